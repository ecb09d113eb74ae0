"""The report's spike section: each loss/grad_norm spike the run's detector flagged, with every signal's z around it.

Example::

    sections += spike_sections(run_dir)     # [] for a run without anomalies.parquet or without a spike

One table per spike step (a loss and a grad_norm spike of one step share it): the signals (loss,
grad_norm, then each tap's norm and update ratio) by the steps from 5 before to 2 after, each cell the
value's z against its signal's window (`analysis.anomaly_context.z_around`), so the tap that moved
first stands out. Imports no torch.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import pandas as pd

from gradrunner.analysis.anomaly_context import z_around
from gradrunner.analysis.anomaly_summary import short, spike_lines
from gradrunner.records.anomalies import ANOMALIES_FILE, read_anomalies_table, settings_of
from gradrunner.report.page import html_section, html_table


def spike_sections(out_dir: Path) -> list[str]:
    """The "Spikes" section of a run's report (its last-word lines, then a z table per spike step); [] without spikes.

    Example::

        spike_sections(Path("outputs/2026-11-26/01-00-00-000000"))    # ['<h2 id="spikes">Spikes</h2>...']
    """

    if not (out_dir / ANOMALIES_FILE).is_file():
        return []
    try:
        table = read_anomalies_table(out_dir)
    except Exception as e:
        return [html_section("Spikes", f"<p>{ANOMALIES_FILE} cannot be read ({html.escape(type(e).__name__)}: "
                                       f"{html.escape(str(e))}); the rest of the report does not use it.</p>")]  # fmt: skip
    settings = settings_of(table.schema)
    lines = spike_lines(table.to_pylist(), int(settings.get("window", 128)))
    around = z_around(out_dir)
    if not around:
        return []
    z = float(settings.get("z", 6.0))
    body = ["<p>" + "<br>\n".join(html.escape(line) for line in lines) + "</p>",
            f"<p>Each cell: the value's z against its signal's last {settings.get('window', 128)} values (norms on a "
            f"log scale); beyond {z:g} is flagged, inf is NaN/Inf, blank: not measured that step.</p>"]  # fmt: skip
    seen: set[int] = set()
    for spike, zs in around:
        if spike.step in seen:
            continue
        seen.add(spike.step)
        cells = zs.map(lambda v: "" if isinstance(v, float) and math.isnan(v) else short(float(v)))
        cells.columns = [f"step {c}" for c in cells.columns]
        title = f"<h3>step {spike.step}: {html.escape(spike.signal)} spike; first to move: {html.escape(spike.first_tap or 'none of the taps')}</h3>"
        body.append(title + html_table(pd.DataFrame(cells).rename_axis("signal").reset_index()))
    return [html_section("Spikes", "\n".join(body))]
