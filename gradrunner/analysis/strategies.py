"""Do the capture strategies of a sweep agree, and what does each cost: helpers over `load`'s DataFrame.

Contents:
    compare_strategies(df)      -- per record and statistic, how far the strategies disagree
    strategy_groups(df)         -- the groups of runs that differ in the strategy alone, and the strategies each lacks
    strategy_costs(steps_df)    -- per strategy: step time, capture time, peak memory

Runs are compared only with runs that differ from them in the strategy alone: every other run column
(`summaries.run_columns`: a seed, a learning rate) is a key. A group of runs that lacks a strategy's
run (its job failed, or the sweep did not have it) is not compared: `strategy_groups` names it.

Example::

    df = load("multirun/2024-05-01/12-00-00")     # capture.strategy=hook,autograd_grad seed=0,1
    compare_strategies(df).groupby("stat")["rel_diff"].max()
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gradrunner.analysis.summaries import forward_order, need_columns, repeats, run_columns
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import STAT_COLUMNS


def _other_run_columns(df: pd.DataFrame, by: str) -> list[str]:
    """Run columns besides `by` and those repeating it (a seed, a learning rate): runs are compared only within them."""
    runs = [c for c in run_columns(df) if c not in ("run_id", by)]
    if not runs:
        return []
    per_run = df.groupby("run_id", sort=False, dropna=False)[[*runs, by]].first()
    return [c for c in runs if not repeats(per_run[c], per_run[by]) and not repeats(per_run[by], per_run[c])]


def strategy_groups(df: pd.DataFrame, by: str = "strategy", keys: list[str] | None = None) -> pd.DataFrame:
    """Per group of runs that differ in `by` alone: how many strategies it has, and which it lacks.

    Example::

        g = strategy_groups(load("multirun/2024-05-01/12-00-00"))   # strategy x seed; (autograd_grad, 1) failed
        g[g.missing != ""]                                           # seed 1: strategies 1, missing 'autograd_grad'

    Columns: the other run columns (none in a sweep over `by` alone: one group), `strategies` (how
    many of `df`'s values of `by` the group's runs have) and `missing` (those it lacks, in order of
    appearance, comma-separated; "" when none). `compare_strategies` compares the groups missing none.
    `keys` names the group columns of a frame without `run_id` (a `tap_summary`'s run columns).
    """
    need_columns(df, [by], "strategy_groups")
    return _grouped(df, by, _other_run_columns(df, by) if keys is None else keys)[0]


def _grouped(df: pd.DataFrame, by: str, runs: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """`strategy_groups` over the run columns `runs`, and the number of each row's group (an index into it)."""
    every = list(dict.fromkeys(df[by].tolist()))
    if not runs:
        return pd.DataFrame({"strategies": [len(every)], "missing": [""]}), np.zeros(len(df), dtype=np.int64)
    g = df.groupby(runs, sort=False, dropna=False)
    have = g[by].unique()  # groups in order of appearance, as `ngroup` numbers them with sort=False
    out = have.index.to_frame(index=False)
    out["strategies"] = [len(h) for h in have]
    out["missing"] = [", ".join(str(s) for s in every if s not in set(h)) for h in have]
    return out, g.ngroup().to_numpy()


def _spread(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest absolute and relative difference along axis 1 of `x` (the strategies), per row.

    abs = max - min; rel = abs / max |x| (0 when abs is 0). Equal values (infinities included) and
    all-NaN rows differ by 0; a NaN in only some strategies (or a missing record) differs by inf.
    """
    nan = np.isnan(x)
    hi, lo = np.fmax.reduce(x, axis=1), np.fmin.reduce(x, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        abs_diff = np.where(hi == lo, 0.0, hi - lo)
        rel_diff = np.where(abs_diff == 0, 0.0, abs_diff / np.maximum(np.abs(hi), np.abs(lo)))
    all_nan, some_nan = nan.all(axis=1), nan.any(axis=1) & ~nan.all(axis=1)
    abs_diff = np.where(all_nan, 0.0, np.where(some_nan, math.inf, abs_diff))
    rel_diff = np.where(all_nan, 0.0, np.where(some_nan | np.isinf(abs_diff), math.inf, rel_diff))
    return abs_diff, rel_diff


def _values_spread(wide: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """`_spread` of the captured values, element by element, then the largest over elements."""
    abs_out, rel_out = np.zeros(len(wide)), np.zeros(len(wide))
    for i, row in enumerate(wide.itertuples(index=False, name=None)):
        # a cell is an array, None (values not captured) or NaN (the strategy lacks the record)
        arrays = [np.asarray(v, dtype=np.float64) for v in row if isinstance(v, (np.ndarray, list))]
        if (arrays and len(arrays) < len(row)) or len({a.size for a in arrays}) > 1:
            abs_out[i] = rel_out[i] = math.inf  # captured by some strategies only, or of different lengths
        elif arrays and arrays[0].size:
            a, r = _spread(np.stack(arrays, axis=1))
            abs_out[i], rel_out[i] = a.max(), r.max()
    return abs_out, rel_out


def compare_strategies(df: pd.DataFrame, by: str = "strategy") -> pd.DataFrame:
    """Per (step, tap, call) and statistic: the largest absolute and relative difference between strategies.

    Example::

        cmp = compare_strategies(load("multirun/2024-05-01/12-00-00"))
        cmp.groupby("stat")[["abs_diff", "rel_diff"]].max()     # the worst case per statistic
        cmp[cmp.rel_diff > 1e-6]                                 # the records that disagree

    For every statistic column and for `values` (when captured), with x the strategies' values:
    `abs_diff` = max(x) - min(x), `rel_diff` = abs_diff / max |x| (0 when abs_diff is 0). A
    statistic NaN in some strategies only, or a record some strategies lack, differs by inf.
    Other run columns (a seed, a learning rate; one that splits the runs as `by` does but holds other
    values too) are kept as keys, so only runs that differ in `by` alone are compared; a group of
    runs that lacks a strategy's run (a failed job) is left out (`strategy_groups` names it: no rows
    when no group has every strategy). `strategies` counts the strategies that have the record.
    Under gradient accumulation each micro-batch's records are compared (`micro_step` is a key).
    """
    need_columns(df, [by, "step", "tap", "call"], "compare_strategies")
    runs = _other_run_columns(df, by)
    groups, number = _grouped(df, by, runs)
    complete = (groups["missing"] == "").to_numpy()
    if not complete.all():
        df = df[complete[number]]
    micro = ["micro_step"] if "micro_step" in df.columns and df["micro_step"].notna().any() else []
    keys = [*runs, "step", *micro, "tap", "call"]
    if df.empty:
        return pd.DataFrame(columns=[*keys, "stat", "abs_diff", "rel_diff", "strategies"])
    indexed = df.set_index([*keys, by])
    if not indexed.index.is_unique:
        raise GradrunnerError(
            f"several runs share {by} and {runs or 'no other run column'}; "
            f"compare one group at a time, e.g. df[df.job.isin([...])]"
        )
    stats = [c for c in STAT_COLUMNS if c in df.columns]
    wide = indexed[stats].unstack(by)
    counts = df.groupby(keys, sort=False, dropna=False)[by].nunique().reindex(wide.index)
    frames = []
    for stat in stats:
        abs_diff, rel_diff = _spread(wide[stat].to_numpy(dtype=np.float64))
        frames.append(pd.DataFrame({"stat": stat, "abs_diff": abs_diff, "rel_diff": rel_diff}, index=wide.index))
    if "values" in df.columns and df["values"].notna().any():
        abs_diff, rel_diff = _values_spread(indexed["values"].unstack(by).reindex(wide.index))
        frames.append(pd.DataFrame({"stat": "values", "abs_diff": abs_diff, "rel_diff": rel_diff}, index=wide.index))
    out = pd.concat([f.assign(strategies=counts.to_numpy()) for f in frames]).reset_index()
    out = out.merge(forward_order(df)[["tap", "call", "position"]], on=["tap", "call"], how="left")
    out = out.sort_values([*keys[:-2], "position"], kind="stable")  # forward order within a step (micro-batch)
    return out.drop(columns="position").reset_index(drop=True)


def strategy_costs(steps: pd.DataFrame, by: str = "strategy") -> pd.DataFrame:
    """Per strategy: median step time and capture time over the captured steps, and peak memory.

    Example::

        costs = strategy_costs(load("multirun/2024-05-01/12-00-00", table="steps"))
        costs[["step_time_s", "capture_time_s"]] * 1e3            # milliseconds
        costs.peak_memory_bytes / 2**20                            # MiB

    Medians leave out the first step's warm-up and other outliers; `capture_share` is
    capture_time_s / step_time_s. `peak_memory_bytes` is the largest of the run. On CPU it is the
    process's peak RSS, which never goes down: Hydra's basic launcher runs every job of a sweep in
    one process, so a later job's peak includes the earlier jobs'; compare memory on a GPU, or
    with each job in its own process.
    """
    need_columns(
        steps, [by, "step", "captured", "step_time_s", "capture_time_s", "peak_memory_bytes"], "strategy_costs"
    )
    keys = [by, *_other_run_columns(steps, by)]
    captured = steps[steps["captured"].fillna(False).astype(bool)]
    out = captured.groupby(keys, sort=False, dropna=False).agg(
        captured_steps=("step", "size"),
        step_time_s=("step_time_s", "median"),
        capture_time_s=("capture_time_s", "median"),
        peak_memory_bytes=("peak_memory_bytes", "max"),
    )
    out["capture_share"] = out["capture_time_s"] / out["step_time_s"]
    return out.reset_index()
