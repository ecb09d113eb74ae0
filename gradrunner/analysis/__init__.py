"""The analysis layer: records read back into pandas, summaries, aggregates over a sweep.

Imports no torch (a test checks it in a fresh interpreter). The figures and the HTML page are `gradrunner.report`.

| module | what it holds |
| --- | --- |
| `reading` | `load(run or sweep dir)`: records into one DataFrame |
| `labels` | a sweep's `job` column and its swept overrides as typed columns (`RESERVED_COLUMNS`) |
| `health` | what a finished job's records say: the summary that ends every run (`last_word`), a sweep's |
| `summaries` | the helpers: tap summary, gradient flow, the columns that tell runs apart |
| `strategies` | do the capture strategies agree (`compare_strategies`, `strategy_groups`), what each costs |
| `micro` | `combine_micro_steps(df)`: under gradient accumulation, one record per step (the whole batch's gradient) |
| `optional` | helpers over the optional columns: histograms over steps, update ratios, per-example spread |
| `aggregate` | a large sweep across its runs: the layout (`sweep_layout`), medians and bands (`over_runs`) |
| `live` | `load(dir, live=True)`: the closed segments of a running or killed `record()` job |
| `compare` | two runs' records side by side (`compare_runs`; `python -m gradrunner.compare`) |
| `noise` | the gradient noise scale per step and parameter tap (`noise_scale`, McCandlish et al. 2018) |
| `anomalies`, `anomaly_names`, `anomaly_signals`, `anomaly_summary`, `anomaly_context` | the spike detector (its rule, signal names, what the loop feeds it), `anomalies.parquet` (read with `read_anomalies`), first movers and the last word, the z around each spike (the report) |

Example::

    from gradrunner.analysis import load, tap_summary
    df = load("multirun/2026-11-23/10-00-00")
    tap_summary(df)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradrunner.analysis.compare import compare_runs
    from gradrunner.analysis.micro import combine_micro_steps
    from gradrunner.analysis.noise import noise_scale
    from gradrunner.analysis.optional import (
        UPDATE_RATIO_GUIDE,
        hist_bin_labels,
        histograms_over_steps,
        per_example_spread,
        update_ratios,
    )
    from gradrunner.analysis.reading import TABLES, DamagedRecordsWarning, IncompleteSweepWarning, load
    from gradrunner.analysis.strategies import compare_strategies, strategy_costs, strategy_groups
    from gradrunner.analysis.summaries import (
        FLOW_MEASURES,
        flow_steps,
        forward_order,
        grad_flow,
        measure,
        pick_steps,
        run_columns,
        tap_summary,
    )

#: Where each public name lives: imported on first use, so that `gradrunner.analysis.health` (which the
#: runner's every process imports) does not pay for pandas and the readers it never uses.
_HOME: dict[str, str] = {
    "compare_runs": "compare",
    "combine_micro_steps": "micro",
    "noise_scale": "noise",
    "UPDATE_RATIO_GUIDE": "optional",
    "hist_bin_labels": "optional",
    "histograms_over_steps": "optional",
    "per_example_spread": "optional",
    "update_ratios": "optional",
    "TABLES": "reading",
    "DamagedRecordsWarning": "reading",
    "IncompleteSweepWarning": "reading",
    "load": "reading",
    "FLOW_MEASURES": "summaries",
    "flow_steps": "summaries",
    "forward_order": "summaries",
    "grad_flow": "summaries",
    "measure": "summaries",
    "pick_steps": "summaries",
    "run_columns": "summaries",
    "tap_summary": "summaries",
    "compare_strategies": "strategies",
    "strategy_costs": "strategies",
    "strategy_groups": "strategies",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])

__all__ = [
    "FLOW_MEASURES",
    "TABLES",
    "UPDATE_RATIO_GUIDE",
    "DamagedRecordsWarning",
    "IncompleteSweepWarning",
    "combine_micro_steps",
    "compare_runs",
    "compare_strategies",
    "flow_steps",
    "forward_order",
    "grad_flow",
    "hist_bin_labels",
    "histograms_over_steps",
    "load",
    "measure",
    "noise_scale",
    "per_example_spread",
    "pick_steps",
    "run_columns",
    "strategy_costs",
    "strategy_groups",
    "tap_summary",
    "update_ratios",
]
