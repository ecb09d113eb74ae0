"""The autopsy's HTML page: the interventions ranked, and their loss curves overlaid on the run's (an inline SVG).

Example::

    write_page(sweep_dir / "autopsy.html", spike, table, notes)
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from gradrunner.records.atomic import write_atomically

if TYPE_CHECKING:
    from gradrunner.run.autopsy import Spike

_COLOURS = ("#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_W, _H, _PAD = 720, 360, 48


def _curves(spike: Spike, table: pd.DataFrame, sweep_dir: Path) -> dict[str, pd.Series]:
    end = spike.step + spike.horizon
    curves = {"the run": spike.losses.loc[spike.start:end]}
    for r in table.itertuples():
        path = sweep_dir / str(r.job) / "steps.parquet"
        if path.is_file():
            curves[str(r.intervention)] = pd.read_parquet(path, columns=["step", "loss"]).set_index("step")["loss"]
    return curves


def _svg(curves: dict[str, pd.Series], spike: Spike) -> str:
    """log10(loss) against step; NaN/Inf points left out (the curve stops there)."""
    finite = [v for c in curves.values() for v in c if math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(finite)), math.log10(max(finite))) if finite else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1
    x0, x1 = spike.start, spike.step + spike.horizon

    def xy(step: int, value: float) -> str:
        x = _PAD + (step - x0) / max(x1 - x0, 1) * (_W - 2 * _PAD)
        y = _H - _PAD - (math.log10(value) - lo) / (hi - lo) * (_H - 2 * _PAD)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-size="11">',
             f'<rect width="{_W}" height="{_H}" fill="white" stroke="#ccc"/>',
             f'<text x="{_PAD}" y="16">log10 loss, steps {x0}-{x1}; spike at step {spike.step}</text>']  # fmt: skip
    sx = xy(spike.step, 10**lo).split(",")[0]
    parts.append(f'<line x1="{sx}" x2="{sx}" y1="{_PAD}" y2="{_H - _PAD}" stroke="#999" stroke-dasharray="4"/>')
    for i, (name, c) in enumerate(curves.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        points = " ".join(xy(int(str(s)), float(v)) for s, v in c.items() if math.isfinite(v) and v > 0)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{_W - _PAD - 100}" y="{_PAD + 14 * i}" fill="{colour}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_page(path: Path, spike: Spike, table: pd.DataFrame, notes: list[str]) -> Path:
    """`autopsy.html` next to `autopsy.parquet`: the ranking table and the overlaid loss curves."""
    rows = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(str(r.intervention))}</td><td>{'yes' if r.avoided else 'no'}</td>"
        f"<td>{r.max_loss:.6g}</td><td>{r.final_loss:.6g}</td><td>{html.escape(str(r.job))}</td></tr>"
        for i, r in enumerate(table.itertuples())
    )
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>autopsy of step {spike.step}</title></head><body>"
            f"<h1>Autopsy of the loss spike at step {spike.step}</h1><p>{html.escape(str(spike.run_dir))}: branches from "
            f"the checkpoint before step {spike.start} to step {spike.step + spike.horizon}; avoided: the loss stayed "
            f"below {spike.threshold:.6g} (the spike rule's threshold) over steps {spike.step}-{spike.step + spike.horizon}."
            f"</p><table border='1'><tr><th>rank</th><th>intervention</th><th>avoided</th><th>max loss</th>"
            f"<th>final loss</th><th>job</th></tr>{rows}</table><ul>{items}</ul>"
            f"{_svg(_curves(spike, table, path.parent), spike)}</body></html>\n")  # fmt: skip
    return write_atomically(path, page)
