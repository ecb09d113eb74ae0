"""A large sweep summarised across its runs: which swept values to keep apart, and quantiles over the rest.

Contents:
    AGGREGATE_ABOVE              -- the report draws a panel per run up to this many runs, aggregates above
    SweepLayout, sweep_layout(df) -- the run column that colours the lines, the one that splits facets, the rest
    over_runs(df, value, layout, by)  -- per swept value and `by` (step, tap): runs, median and quantile band
    pick_taps(df, n)             -- at most n taps spread over the forward order (first and last included)
    per_run(grads, steps, summary, layout)   -- a row per run: its swept values, first and last loss, its trouble
    runs_by_value(runs, layout)  -- a row per swept value: runs, the last loss's median and band, runs in trouble
    taps_by_value(summary, layout)  -- `tap_summary` per swept value and tap: medians over the runs, runs in trouble

A sweep of 1,000 jobs over `optimizer.lr` (4 values) x `seed` (250) is read as 4 lines, each the
median over its 250 seeds with a 10-90% band: `seed`, and any run column with more than
`MAX_LEVELS` values, is aggregated over, never drawn one panel per run.

Example::

    df = load("multirun/2026-11-24/10-00-00")
    layout = sweep_layout(df)           # SweepLayout(hue='optimizer.lr', facet=None, over=['seed'], runs=1000)
    over_runs(df, "norm", layout, ["tap", "call", "step"])   # columns optimizer.lr, tap, call, step, runs, median, lo, hi
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from gradrunner.analysis.summaries import forward_order, pick_steps, run_columns

#: The report draws a panel per run for up to this many runs; above, it aggregates over runs.
AGGREGATE_ABOVE = 8
#: A run column with more distinct values than this is aggregated over (a line or facet per value would not be read).
MAX_LEVELS = 6
#: The band drawn around the median: these quantiles over the runs.
BAND = (0.1, 0.9)


def _is_seed(column: str) -> bool:
    return column == "seed" or column.endswith((".seed", "_seed"))


@dataclass(frozen=True)
class SweepLayout:
    """How a sweep's runs are drawn: `hue` (a line per value), `facet` (a column of panels per value), `over`
    (aggregated over: the median and band of the runs sharing hue and facet); `runs` in all."""

    hue: str | None
    facet: str | None
    over: tuple[str, ...]
    runs: int

    @property
    def keys(self) -> list[str]:
        """The run columns kept apart: [hue, facet] (those that are set)."""
        return [c for c in (self.hue, self.facet) if c is not None]

    def short(self) -> str:
        """For a figure's title, e.g. 'median and 10-90% band of 1,000 runs'."""
        return f"median and {BAND[0]:.0%}-{BAND[1]:.0%} band of {self.runs:,} runs"

    def describe(self) -> str:
        """The sentence the report shows, e.g. '1,000 runs aggregated over seed: median and 10-90% band, a line per optimizer.lr.'"""
        over = f" over {', '.join(self.over)}" if self.over else ""
        text = f"{self.runs:,} runs aggregated{over}: median and {BAND[0]:.0%}-{BAND[1]:.0%} band"
        if self.hue is not None:
            text += f", a line per {self.hue}"
        if self.facet is not None:
            text += f", a column of panels per {self.facet}"
        return text + "."


def sweep_layout(df: pd.DataFrame) -> SweepLayout:
    """The layout of a sweep's figures: the swept run column with fewest values colours, the next splits facets.

    Example::

        sweep_layout(load(sweep))   # lr (4 values) x batch (2) x seed (250): hue='train.batch', facet='lr', over=('seed',)

    Seeds (`seed`, `*.seed`) and run columns with more than `MAX_LEVELS` values are aggregated over, as is a
    third swept column; `run_id` is never a line or a facet.
    """
    columns = [c for c in run_columns(df) if c != "run_id"]
    runs = df.drop_duplicates("run_id")
    levels = {c: int(runs[c].nunique(dropna=False)) for c in columns}
    swept = sorted((c for c in columns if not _is_seed(c) and levels[c] <= MAX_LEVELS), key=lambda c: levels[c])
    hue = swept[0] if swept else None
    facet = swept[1] if len(swept) > 1 else None
    over = tuple(c for c in columns if c not in (hue, facet))
    return SweepLayout(hue=hue, facet=facet, over=over, runs=len(runs))


def over_runs(df: pd.DataFrame, value: str, layout: SweepLayout, by: list[str]) -> pd.DataFrame:
    """Per value of the layout's keys and of `by`: `runs` with a finite `value`, its `median`, `lo` and `hi` (`BAND`).

    Example::

        t = over_runs(df, "norm", sweep_layout(df), ["tap", "call", "step"])
        t[t.tap == "fc1:output"].pivot(index="step", columns="optimizer.lr", values="median")

    NaN values (a tap without gradient) are left out of the quantiles; a key whose every value is NaN
    gets runs=0 and NaN quantiles. Rows are sorted by the keys.
    """
    keys = [*layout.keys, *by]
    g = df.groupby(keys, sort=True, dropna=False, observed=True)[value]
    out = g.agg(runs="count", median="median")
    quantiles = g.quantile(np.array(BAND)).unstack(-1)
    out["lo"], out["hi"] = quantiles[BAND[0]], quantiles[BAND[1]]
    return out.reset_index()


def pick_taps(df: pd.DataFrame, n: int) -> pd.DataFrame:
    """At most `n` rows of `forward_order(df)`, spread evenly over it, the first and last tap included.

    Example::

        pick_taps(df, 8).label.tolist()     # 8 of the model's 40 taps, input side to output side
    """
    order = forward_order(df)
    return order.iloc[pick_steps(range(len(order)), n)].reset_index(drop=True)


def _with_run_id(summary: pd.DataFrame, grads: pd.DataFrame) -> pd.DataFrame:
    """`tap_summary`'s rows with their run's `run_id` (its run columns may name runs by override values instead)."""
    if "run_id" in summary.columns:
        return summary
    run_cols = list(summary.columns[: summary.columns.get_loc("tap")])
    if not run_cols:
        return summary.assign(run_id=grads["run_id"].iloc[0])
    return summary.merge(grads.drop_duplicates("run_id")[[*run_cols, "run_id"]], on=run_cols, how="left")


def per_run(
    grads: pd.DataFrame, steps: pd.DataFrame | None, summary: pd.DataFrame, layout: SweepLayout
) -> pd.DataFrame:
    """A row per run (indexed by run_id): its layout keys and job, captured steps, steps run, first and last loss
    (NaN stays NaN), and whether any of its taps had NaN/Inf (`nan/inf`), vanished or exploded.

    Example::

        runs = per_run(df, load(sweep, table="steps"), tap_summary(df), sweep_layout(df))
        runs[runs["nan/inf"]].job          # the jobs whose gradients went NaN/Inf
    """
    g = grads.groupby("run_id", sort=False)
    runs = g[[*layout.keys, *(["job"] if "job" in grads.columns else [])]].first()
    runs["captured steps"] = g["step"].nunique()
    source = steps if steps is not None and len(steps) else grads
    ordered = source[["run_id", "step", "loss"]].sort_values("step", kind="stable")
    runs["first loss"] = ordered.drop_duplicates("run_id", keep="first").set_index("run_id")["loss"]
    runs["last loss"] = ordered.drop_duplicates("run_id", keep="last").set_index("run_id")["loss"]
    if steps is not None and len(steps):
        runs["steps run"] = steps.groupby("run_id", sort=False)["step"].size()
    s = _with_run_id(summary, grads).groupby("run_id", sort=False)
    runs["nan/inf"] = s["first_nonfinite_step"].count().reindex(runs.index, fill_value=0) > 0
    runs["vanishing"] = s["vanishing"].any().reindex(runs.index, fill_value=False).astype(bool)
    runs["exploding"] = s["exploding"].any().reindex(runs.index, fill_value=False).astype(bool)
    return runs


def _keyed(frame: pd.DataFrame, layout: SweepLayout) -> tuple[pd.DataFrame, list[str]]:
    """`frame` and the keys to group it by: the layout's, or one constant column `runs of` = 'all runs'."""
    return (frame, layout.keys) if layout.keys else (frame.assign(**{"runs of": "all runs"}), ["runs of"])


def runs_by_value(runs: pd.DataFrame, layout: SweepLayout) -> pd.DataFrame:
    """`per_run`'s rows grouped by swept value: runs, median captured steps, the last loss's median and band, and
    how many runs had a NaN/Inf loss (of those whose `loss recorded` is true, where `runs` has that column),
    NaN/Inf, vanishing or exploding taps.

    Example::

        runs_by_value(per_run(df, steps, tap_summary(df), layout), layout)
    """
    frame, keys = _keyed(runs, layout)
    g = frame.groupby(keys, sort=True, dropna=False)
    last = g["last loss"]
    table = g.agg(runs=("captured steps", "size"), captured=("captured steps", "median"))
    table = table.rename(columns={"captured": "captured steps (median)"})
    table["last loss (median)"] = last.median()
    table[f"last loss ({BAND[0]:.0%})"] = last.quantile(BAND[0])
    table[f"last loss ({BAND[1]:.0%})"] = last.quantile(BAND[1])
    finite = np.isfinite(frame["last loss"].to_numpy(dtype=np.float64))
    # a run whose loss was not recorded (null: `rec.step()` without one; the report's `loss recorded`) is no NaN one
    recorded = frame["loss recorded"].to_numpy(dtype=bool) if "loss recorded" in frame.columns else True
    table["runs with NaN/Inf loss"] = (
        frame.assign(_bad=~finite & recorded).groupby(keys, sort=True, dropna=False)["_bad"].sum()
    )
    for column, label in (("nan/inf", "NaN/Inf"), ("vanishing", "vanishing"), ("exploding", "exploding")):
        table[f"runs with {label} taps"] = g[column].sum().astype("int64")
    return table.reset_index()


def taps_by_value(summary: pd.DataFrame, layout: SweepLayout, grads: pd.DataFrame) -> pd.DataFrame:
    """`tap_summary` per swept value and (tap, call), in forward order: runs, the median over runs of each run's
    first, last and largest value, and how many runs had the tap NaN/Inf, vanishing or exploding.

    Example::

        taps_by_value(tap_summary(df), sweep_layout(df), df)
    """
    frame, keys = _keyed(_with_run_id(summary, grads), layout)
    frame = frame.assign(_nonfinite=frame["first_nonfinite_step"].notna())
    g = frame.groupby([*keys, "tap", "call"], sort=False, dropna=False)
    table = g.agg(runs=("steps", "size"), first=("first", "median"), last=("last", "median"), max=("max", "median"),
                  nan_inf=("_nonfinite", "sum"), vanishing=("vanishing", "sum"), exploding=("exploding", "sum"))  # fmt: skip
    table = table.reset_index().sort_values(keys, kind="stable")  # forward order within a swept value
    return table.rename(columns={"first": "first (median)", "last": "last (median)", "max": "max (median)",
                                 "nan_inf": "runs NaN/Inf", "vanishing": "runs vanishing",
                                 "exploding": "runs exploding"}).reset_index(drop=True)  # fmt: skip
