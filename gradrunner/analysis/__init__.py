"""The analysis layer: records read back into pandas, summaries, plots and the HTML report.

Imports no torch (a test checks it in a fresh interpreter).

| module | what it holds |
| --- | --- |
| `reading` | `load(run or sweep dir)`: records into one DataFrame |
| `summaries` | the helpers: tap summary, gradient flow, strategy agreement and cost |
| `optional` | helpers over the optional columns: histograms over steps, update ratios, per-example spread |
| `plots`, `plots_optional` | matplotlib figures drawn from those helpers' DataFrames |
| `plots_edits` | a sweep over an edit's strength: its table (`edit_sweep`) and panel (`plot_edit_sweep`) |
| `aggregate`, `plots_sweep` | a large sweep across its runs: the layout (`sweep_layout`), medians and bands (`over_runs`), their figures |
| `report` | `python -m gradrunner.report <dir>`: PNGs and one HTML page; a run's sections |
| `report_sweep`, `report_sections` | a large sweep's sections; the sections a run and a sweep share |
| `report_records`, `report_page` | what the report reads beyond `load`; the page's HTML, embedded PNGs, atomic write |

Example::

    from gradrunner.analysis import load, tap_summary
    df = load("multirun/2026-11-23/10-00-00")
    tap_summary(df)
"""

from gradrunner.analysis.optional import (
    UPDATE_RATIO_GUIDE,
    hist_bin_labels,
    histograms_over_steps,
    per_example_spread,
    update_ratios,
)
from gradrunner.analysis.reading import TABLES, DamagedRecordsWarning, IncompleteSweepWarning, load
from gradrunner.analysis.summaries import (
    FLOW_MEASURES,
    compare_strategies,
    flow_steps,
    forward_order,
    grad_flow,
    measure,
    pick_steps,
    run_columns,
    strategy_costs,
    tap_summary,
)

__all__ = [
    "FLOW_MEASURES",
    "TABLES",
    "UPDATE_RATIO_GUIDE",
    "DamagedRecordsWarning",
    "IncompleteSweepWarning",
    "compare_strategies",
    "flow_steps",
    "forward_order",
    "grad_flow",
    "hist_bin_labels",
    "histograms_over_steps",
    "load",
    "measure",
    "per_example_spread",
    "pick_steps",
    "run_columns",
    "strategy_costs",
    "tap_summary",
    "update_ratios",
]
