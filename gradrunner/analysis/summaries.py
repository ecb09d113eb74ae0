"""The usual questions about loaded records, each answered by a short pandas helper.

Contents:
    need_columns(df, columns, who)    -- a one-paragraph error naming the columns a helper uses that `df` lacks
    run_columns(df)                   -- the columns that tell the runs of a sweep apart
    rank_columns(df) / lowest_rank(df) -- ["rank"] under DDP (several ranks), else []; each run's lowest rank's rows
    forward_order(df)                 -- (tap, call) in the order they fire in the forward pass
    pick_steps(steps, n)              -- a few steps spread over a run, first and last included
    flow_steps(df, n)                 -- the steps worth a look: first, around the first NaN/Inf, largest change, last finite
    measure(df, name)                 -- how large each gradient is: norm, rms, abs_max, mean_abs
    tap_summary(df)                   -- per tap: a statistic over steps, first NaN/Inf, vanishing/exploding
    vanishing_boundary(summary)       -- the tap below which every gradient vanishes, if the flow stops at one
    grad_flow(df, steps)              -- a measure per tap in forward order, for a few steps
    FLOW_MEASURES, VANISH_BELOW, EXPLODE_ABOVE

Whether the capture strategies agree, and what they cost, is `gradrunner.analysis.strategies`.

Every helper takes the DataFrame `gradrunner.analysis.load` returns, rows in record order (the order
they were written: step by step, taps in firing order), and groups by `run_columns(df)` so a sweep
works as well as one run; records of several ranks (torchrun) are kept apart by `rank_columns(df)`.
Each is short on purpose: read it, copy it, adapt it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import CONSTANT_COLUMNS
from gradrunner.records.writer import STEPS_SCHEMA, grads_schema

#: Measures `measure()` knows besides the record's own columns.
FLOW_MEASURES = ("norm", "rms", "abs_max", "mean_abs")
#: `tap_summary`'s default thresholds on the norm: rough heuristics for float32 models of moderate size.
VANISH_BELOW, EXPLODE_ABOVE = 1e-6, 1e3

# Columns a job writes itself; any other column of a loaded DataFrame came from `load` (a swept override).
_RECORD_COLUMNS = frozenset(grads_schema(per_example=True, histogram=True).names) | frozenset(STEPS_SCHEMA.names) | {"job"}
_RUN_CONSTANTS = tuple(c for c in CONSTANT_COLUMNS if c != "run_id")


def need_columns(df: pd.DataFrame, columns: Iterable[str], who: str) -> None:
    """Raise a one-paragraph GradrunnerError naming the `columns` helper `who` uses that `df` lacks (a frame read
    with `load(dir, columns=[...])`), rather than the KeyError pandas would give half-way.

    Example::

        need_columns(df, ["step", "tap", "has_grad"], "tap_summary")
    """
    missing = [c for c in dict.fromkeys(columns) if c not in df.columns]
    if missing:
        raise GradrunnerError(
            f"{who} needs the column(s) {', '.join(map(repr, missing))}, which this frame lacks (columns there: "
            f"{', '.join(map(str, df.columns)) or 'none'}); pass the frame gradrunner.analysis.load(dir) returns, or "
            f"name them in load(dir, columns=[...])"
        )


def run_columns(df: pd.DataFrame) -> list[str]:
    """The columns that tell the runs in `df` apart, most readable first; [] for a single run.

    Example::

        df = load("multirun/2024-05-01/12-00-00")   # capture.strategy=retain_grad,hook,autograd_grad
        run_columns(df)                              # ['strategy']
        df.groupby(run_columns(df) + ["tap"])["norm"].max()

    Candidates are experiment, strategy, device and dtype, then the swept-override columns `load`
    adds. One is kept when it is constant within each run (`run_id`), differs between runs, and does
    not repeat a column kept before it (`repeats`: `capture.strategy` repeats `strategy`). A column
    that only happens to split the runs as a kept one does (the seed of a strategy x seed sweep
    whose (hook, 1) and (autograd_grad, 0) jobs failed) is kept: it is not the same setting.
    `run_id` is appended when the kept columns do not tell every run apart.
    """
    if "run_id" not in df.columns or df["run_id"].nunique(dropna=False) < 2:
        return []
    candidates = [c for c in _RUN_CONSTANTS if c in df.columns]
    candidates += [c for c in df.columns if c not in _RECORD_COLUMNS]
    per_run = df.groupby("run_id", sort=False, dropna=False)[candidates]
    constant = per_run.nunique(dropna=False).max() <= 1
    runs = per_run.first()
    kept: list[str] = []
    for column in candidates:
        varies = runs[column].nunique(dropna=False) > 1
        if constant[column] and varies and not any(repeats(runs[column], runs[k]) for k in kept):
            kept.append(column)
    if not kept or len(runs[kept].drop_duplicates()) < len(runs):
        kept.append("run_id")
    return kept


def repeats(column: pd.Series, other: pd.Series) -> bool:
    """Whether `column` repeats `other`: the same value (as text) on every row where `column` is set.

    Example::

        runs = df.groupby("run_id").first()
        repeats(runs["capture.strategy"], runs["strategy"])     # True: the override is the strategy
        repeats(runs["seed"], runs["strategy"])                 # False, even where they split the runs alike

    A row without `column` (a run that did not set the override) repeats anything; a column set nowhere
    repeats nothing.
    """
    set_ = column.notna().to_numpy()
    same = column.astype(str).to_numpy() == other.astype(str).to_numpy()
    return bool(set_.any() and (same | ~set_).all())


def rank_columns(df: pd.DataFrame) -> list[str]:
    """`["rank"]` when `df` holds the rows of several ranks (a run under torchrun), else `[]`: the key to add.

    Example::

        df.groupby(["tap", *rank_columns(df)])["norm"].max()     # per rank under DDP, per tap otherwise
    """
    return ["rank"] if "rank" in df.columns and df["rank"].nunique() > 1 else []


def lowest_rank(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of each run's lowest rank (rank 0's under torchrun): a step's loss is rank 0's, as the last word's.

    Example::

        lowest_rank(load(run_dir, table="steps"))["loss"]      # one loss per step, not one per step and rank
    """
    if not rank_columns(df):
        return df
    runs = df["run_id"] if "run_id" in df.columns else pd.Series(0, index=df.index)
    return df[df["rank"] == df["rank"].groupby(runs).transform("min")]


def forward_order(df: pd.DataFrame) -> pd.DataFrame:
    """Every (tap, call) in forward order, with its `position` and a plot `label`.

    Example::

        order = forward_order(df)                 # columns tap, call, position, label
        order.label.tolist()                       # ['fc1:output', ..., ':h [0]', ':h [1]', ...]
        df.merge(order, on=["tap", "call"]).sort_values(["step", "position"])

    Forward order is the order of first appearance in the records, which are written step by step
    in firing order. `label` is the tap, followed by ` [call]` for a tap that fires more than once.
    """
    order = df[["tap", "call"]].drop_duplicates().reset_index(drop=True)
    order["call"] = order["call"].astype("int64")
    order["position"] = np.arange(len(order), dtype=np.int64)
    repeated = order.groupby("tap")["call"].transform("size") > 1
    order["label"] = [f"{t} [{c}]" if r else t for t, c, r in zip(order.tap, order.call, repeated, strict=True)]
    return order


def pick_steps(steps: Iterable[int], n: int = 4) -> list[int]:
    """Up to `n` steps spread evenly over `steps`, the first and the last included.

    Example::

        pick_steps(range(100))            # [0, 33, 66, 99]
        pick_steps(df["step"], n=2)       # first and last captured step
    """
    unique = sorted({int(s) for s in steps})
    if len(unique) <= n:
        return unique
    picks = np.linspace(0, len(unique) - 1, max(n, 1)).round().astype(int)
    return [unique[i] for i in sorted(set(picks.tolist()))]


def flow_steps(df: pd.DataFrame, n: int = 4) -> list[int]:
    """Up to `n` steps worth drawing: the first, the largest change, the last finite one and the first non-finite one.

    Example::

        flow_steps(df)                        # e.g. [0, 3, 4, 5]: the explosion at 3-4, NaN from 5
        plot_grad_flow(df, steps=flow_steps(df))

    A step is non-finite when a record of it holds a NaN or Inf; "largest change" is the step
    whose mean |log10 norm| change from the step before, over the taps, is largest (among the
    finite steps). Steps after the first non-finite one are all NaN, so none of them is picked.
    Without anything remarkable it is `pick_steps` (spread evenly, first and last included).
    """
    need_columns(df, ["run_id", "step", "tap", "call", "norm", "has_grad", "nan_count", "inf_count"], "flow_steps")
    steps = sorted({int(s) for s in df["step"]})
    bad = df.loc[(df["nan_count"].fillna(0) > 0) | (df["inf_count"].fillna(0) > 0), "step"]
    first_bad = int(bad.min()) if len(bad) else None
    finite = [s for s in steps if first_bad is None or s < first_bad]
    # in order of priority: first, first non-finite, the largest change (and the step before it), last finite
    picks: list[int] = [*finite[:1], *([first_bad] if first_bad is not None else [])]
    if len(finite) > 1:
        d = df[df["step"].isin(finite) & df["has_grad"].fillna(False).astype(bool)]
        table = d.pivot_table(index="step", columns=["run_id", "tap", "call", *rank_columns(d)], values="norm",
                              aggfunc="first")
        with np.errstate(divide="ignore", invalid="ignore"):
            change = table.where(table > 0).apply(np.log10).diff().abs().mean(axis=1, skipna=True)
        if change.notna().any() and change.max() > 0:
            jump = int(change.index[int(np.nanargmax(change.to_numpy(dtype=np.float64)))])
            picks += [jump, finite[finite.index(jump) - 1]]
        picks.append(finite[-1])
    picks = list(dict.fromkeys(picks))[:n]
    spread = [s for s in pick_steps(finite, n) if s not in picks]
    return sorted(picks + spread[: n - len(picks)])


def measure(df: pd.DataFrame, name: str = "norm") -> pd.Series:
    """One number per record saying how large its gradient is (NaN where a tap got no gradient).

    Example::

        df["rms"] = measure(df, "rms")
        df.groupby("tap")["rms"].median()
        measure(df, "std")              # any record column works too

    - `norm`: the L2 norm ||g|| (recorded); grows with the tensor's size.
    - `rms`: ||g|| / sqrt(numel) = sqrt(mean(g**2)), exact, comparable across tensor sizes. It is
      an upper bound on mean |g| (equal when every |g_i| is the same).
    - `abs_max`: max |g_i| (recorded).
    - `mean_abs`: mean |g_i|, what the usual `plot_grad_flow` snippet draws. The statistics cannot
      give it, so it needs captured values: exact with `capture.values=full`, an estimate from the
      sampled elements with `capture.values=sample`.
    """
    if name == "rms":
        need_columns(df, ["norm", "numel"], "measure 'rms'")
        return (df["norm"] / np.sqrt(df["numel"].where(df["numel"] > 0))).rename("rms")
    if name == "mean_abs":
        if "values" not in df.columns or df["values"].isna().all():
            raise GradrunnerError(
                "measure 'mean_abs' needs captured values (capture.values=full or sample, read with "
                "load(..., values=True)); without them use 'rms', its upper bound"
            )
        return df["values"].map(lambda v: np.nan if v is None else float(np.abs(v).mean())).rename("mean_abs")
    if name not in df.columns:
        raise GradrunnerError(f"measure {name!r} is neither {', '.join(FLOW_MEASURES)} nor a column of the records")
    return df[name].astype("float64")


def tap_summary(
    df: pd.DataFrame, stat: str = "norm", vanish_below: float = VANISH_BELOW, explode_above: float = EXPLODE_ABOVE
) -> pd.DataFrame:
    """Per run and (tap, call): a measure over the steps, where NaN/Inf start, vanishing and exploding.

    Example::

        s = tap_summary(load("outputs/2024-05-01/12-00-00"))
        s[s.vanishing | s.exploding]                       # the taps in trouble
        s.sort_values("first_vanishing_step").head(1)      # whose gradient collapsed first

    Columns: `steps` with a gradient; `first`, `last`, `min`, `max`, `median` of `measure(df, stat)`
    over those steps (`first`/`last` at the first/last such step; a gradient of no elements, `numel` 0 as
    an expert given no tokens, counts in `steps` but has no value: it is not vanishing); `first_nonfinite_step`, the
    first step whose gradient holds a NaN or Inf; `first_vanishing_step` / `first_exploding_step`,
    the first step where the measure is below `vanish_below` / above `explode_above`;
    `vanishing` (the last value is below `vanish_below`), `exploding` (some value is above
    `explode_above`). The default thresholds (norm below 1e-6, above 1e3) are rough heuristics for
    float32 models of moderate size: set them for yours. Rows come in forward order per run.
    Under gradient accumulation a step's micro-batch records are first combined into one
    (`combine_micro_steps`: the whole batch's gradient), so `steps` counts steps. Records of several
    ranks (torchrun) get a row per rank (a `rank` column after `call`): each rank's own first and last.
    """
    need_columns(df, ["step", "tap", "call", "has_grad", "nan_count", "inf_count"], "tap_summary")
    df = combine_micro_steps(df)
    keys = [*run_columns(df), "tap", "call", *rank_columns(df)]
    d = df.assign(_v=measure(df, stat)).sort_values("step", kind="stable")
    with_grad = d[d["has_grad"].fillna(False).astype(bool)]
    steps = with_grad.groupby(keys, sort=False, dropna=False).size()
    if "numel" in with_grad.columns:  # a gradient of no elements (an expert given no tokens) has no value to judge
        with_grad = with_grad[with_grad["numel"].fillna(1) != 0]
    g = with_grad.groupby(keys, sort=False, dropna=False)["_v"]
    out = g.agg(["min", "max", "median"]).reindex(steps.index)
    out.insert(0, "steps", steps)
    out.insert(1, "first", _by_keys(with_grad, g.head(1), keys))
    out.insert(2, "last", _by_keys(with_grad, g.tail(1), keys))
    nonfinite = d[(d["nan_count"] > 0) | (d["inf_count"] > 0)]
    out["first_nonfinite_step"] = _first_step(nonfinite, keys)
    out["first_vanishing_step"] = _first_step(with_grad[with_grad["_v"] < vanish_below], keys)
    out["first_exploding_step"] = _first_step(with_grad[with_grad["_v"] > explode_above], keys)
    out["vanishing"] = out["last"] < vanish_below
    out["exploding"] = out["first_exploding_step"].notna()
    order = df[keys].drop_duplicates()
    if rank_columns(df):  # a tap's ranks together, in forward order
        order = order.assign(_p=order.groupby(keys[:-1], sort=False, dropna=False).ngroup())
        order = order.sort_values(["_p", "rank"], kind="stable").drop(columns="_p")
    out = out.reindex(pd.MultiIndex.from_frame(order))
    out["steps"] = out["steps"].fillna(0).astype("int64")
    out[["vanishing", "exploding"]] = out[["vanishing", "exploding"]].fillna(False).astype(bool)
    return out.reset_index()


def _by_keys(d: pd.DataFrame, picked: pd.Series, keys: list[str]) -> pd.Series:
    """`picked` (a Series indexed like `d`) re-indexed by the group keys of its rows."""
    return pd.Series(picked.to_numpy(), index=pd.MultiIndex.from_frame(d.loc[picked.index, keys]))


def _first_step(rows: pd.DataFrame, keys: list[str]) -> pd.Series:
    return rows.groupby(keys, sort=False, dropna=False)["step"].min().astype("Int64")


def grad_flow(df: pd.DataFrame, steps: Iterable[int] | None = None, measure_name: str = "norm") -> pd.DataFrame:
    """A measure of every (tap, call) in forward order, for a few steps: the gradient-flow table.

    Example::

        flow = grad_flow(df, steps=[0, 49], measure_name="rms")
        flow.pivot(index="label", columns="step", values="rms")      # one run
        grad_flow(df[df.name == "weight"])                            # parameters only

    `steps` defaults to `pick_steps(df.step)` (four, first and last included); a step the records do not
    hold is a GradrunnerError naming the steps there; `measure_name` is one of `measure`'s names. Columns: `run_id`, the run columns, `step`, `tap`, `call` (`rank` under
    torchrun), the measure, `position` (forward order) and `label`; runs in record order, then step,
    position and rank.
    Under gradient accumulation each step's micro-batch records are combined first (`combine_micro_steps`).
    """
    need_columns(df, ["run_id", "step", "tap", "call"], "grad_flow")
    df = combine_micro_steps(df)
    chosen = pick_steps(df["step"]) if steps is None else [int(s) for s in steps]
    there = sorted({int(s) for s in df["step"]})
    absent = [s for s in chosen if s not in set(there)]
    if absent:
        shown = ", ".join(map(str, there[:20])) + (f", ... ({len(there)} steps)" if len(there) > 20 else "")
        raise GradrunnerError(
            f"grad_flow: step(s) {', '.join(map(str, absent))} are not in these records (steps there: {shown}); "
            "pick among them, e.g. steps=pick_steps(df.step)"
        )
    runs = run_columns(df)
    d = df[df["step"].isin(chosen)]
    ranks = rank_columns(df)
    out = d[["run_id", *[c for c in runs if c != "run_id"], "step", "tap", "call", *ranks]].copy()
    out[measure_name] = measure(d, measure_name)
    out["_run"] = pd.factorize(out["run_id"])[0]  # runs stay in record order
    out = out.merge(forward_order(df), on=["tap", "call"], how="left")
    return out.sort_values(["_run", "step", "position", *ranks], kind="stable").drop(columns="_run").reset_index(drop=True)


#: Tap names that are parameters of the usual layers: left out of the flow's boundary (it is about activations).
_PARAMETER_NAMES = frozenset({"weight", "bias"})


def vanishing_boundary(summary: pd.DataFrame) -> tuple[str, int, int] | None:
    """Where the flow of one run stops: (the first tap still carrying a gradient, taps before it vanishing, from step).

    Example::

        vanishing_boundary(tap_summary(load("outputs/dead-relu")))   # ('relu6:output', 11, 3)

    Over the activation taps (names other than `weight` and `bias`) in forward order: when the
    vanishing ones (`tap_summary`'s rule) are exactly the first k >= 1 of them and the rest are not,
    the gradient vanishes below tap k: "gradients vanish below relu6:output from step 3". None
    otherwise (no vanishing tap, or vanishing taps that are not a prefix). One run only.
    """
    acts = summary[~summary["tap"].str.rsplit(":", n=1).str[-1].isin(_PARAMETER_NAMES)].reset_index(drop=True)
    flags = acts["vanishing"].to_numpy(dtype=bool)
    k = int(np.argmin(flags)) if not flags.all() else len(flags)
    if k == 0 or k == len(flags) or flags[k:].any():
        return None
    return str(acts["tap"].iloc[k]), k, int(acts["first_vanishing_step"].iloc[:k].min())
