"""Records under gradient accumulation, one per step: the micro-batches' records of a tap combined.

With `train.accumulate=N` (and `record()`/the callbacks under accumulation) an activation, input or
local tap has one record per micro-batch (`micro_step` 0..N-1): the gradient of that micro-batch's
loss / N. Side by side, those gradients are the gradient of the step's loss (the mean of the
micro-batches' losses) with respect to the whole batch's activations: `combine_micro_steps` gives
that gradient's statistics, exactly, from the per-micro-batch ones. It is what a run without
accumulation, on the same batch, records. Parameter taps (`micro_step` null: one record per step,
the accumulated `.grad`) are kept as they are.

| column | combined over the micro-batches with a gradient |
| --- | --- |
| `numel`, `nan_count`, `inf_count`, `hist_counts` | summed |
| `norm`, `value_norm`, `edited_norm` | sqrt of the summed squares (`edited_norm`: the unedited norm where a micro-batch was not edited) |
| `mean`, `zero_frac` | weighted by `numel` (a micro-batch of `numel` 0, an expert given no tokens, adds nothing) |
| `std` | Bessel-corrected, from the summed sums and squares (as the record's own) |
| `min`, `max`, `abs_max` | min, max, max (NaN where any is NaN; a micro-batch of `numel` 0 has none to add) |
| `loss` | the mean of the micro-batches' losses (`steps.parquet`'s `loss`) |
| `per_example_norm` | concatenated (the whole batch's rows) |
| `shape` | the micro-batches' shapes side by side along dim 0 |
| `has_grad`, `edited` | any; `reason` of the first where none has a gradient |
| `values`, `micro_step` | null |

Example::

    df = combine_micro_steps(load("outputs/accumulated"))    # one row per step x tap x call x rank
    df.groupby("tap")["norm"].max()
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from gradrunner.records.columns import HIST_COLUMN, PER_EXAMPLE_COLUMN

#: A record's identity within a run once micro-batches are combined (those present of them).
_KEYS = ("run_id", "job", "step", "tap", "call", "rank")


def has_micro_steps(df: pd.DataFrame) -> bool:
    """Whether `df` holds records of separate micro-batches (a `micro_step` that is not null).

    Example::

        has_micro_steps(load("outputs/accumulated"))    # True with train.accumulate=2
    """
    return "micro_step" in df.columns and bool(df["micro_step"].notna().any())


def combine_micro_steps(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with each (step, tap, call, rank)'s micro-batch records combined into one (the table above).

    Example::

        per_step = combine_micro_steps(df)
        assert not per_step.duplicated(["run_id", "step", "tap", "call", "rank"]).any()

    Rows stay in record order (a combined row where its micro-batch 0 was); `df` without micro-batch
    records is returned as it is.
    """
    if not has_micro_steps(df):
        return df
    df = df.reset_index(drop=True)
    micro = df["micro_step"].notna().to_numpy()
    parts = df[micro]
    keys = [k for k in _KEYS if k in df.columns]
    group = parts.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()
    first = parts.index.to_numpy()[np.unique(group, return_index=True)[1]]
    original = df.loc[first].reset_index(drop=True)
    combined = original.copy()
    _combine_into(combined, parts, group)
    alone = np.bincount(group) == 1  # a tap that fired in one micro-batch only: its record as it is
    combined.loc[alone] = original.loc[alone]
    combined.index = first
    out = pd.concat([df[~micro], combined]).sort_index(kind="stable")
    out.loc[first, "micro_step"] = None
    return out.reset_index(drop=True)


def _combine_into(out: pd.DataFrame, parts: pd.DataFrame, group: np.ndarray) -> None:
    """Fill `out` (one row per group, in group order) with the combined statistics of `parts`' rows."""
    n = len(out)
    # a frame read without `has_grad`: a record has a gradient where its norm is there
    grad = (parts["has_grad"].fillna(False) if "has_grad" in parts.columns else parts["norm"].notna()).to_numpy(dtype=bool)

    def total(values: np.ndarray, mask: np.ndarray = grad) -> np.ndarray:
        return np.bincount(group[mask], weights=values[mask], minlength=n)

    def col(name: str) -> np.ndarray:  # a column not read (health reads a few): NaN, and not written back
        if name not in parts.columns:
            return np.full(len(parts), np.nan)
        return parts[name].to_numpy(dtype=np.float64, na_value=np.nan)

    def put(name: str, values: np.ndarray | pd.Series) -> None:
        if name in out.columns:
            out[name] = values

    has_grad = total(np.ones(len(parts))) > 0
    # a micro-batch whose gradient has no elements (an expert given no tokens) has no mean, extremes or zeros to add
    elements = grad & ~(col("numel") == 0)
    numel = total(col("numel"))
    sq = total(col("norm") ** 2)
    s = total(col("mean") * col("numel"), elements)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s / numel
        var = (sq - s * mean) / (numel - 1)
        stats = {
            "norm": np.sqrt(sq),
            "mean": mean,
            "std": np.where(numel > 1, np.sqrt(np.maximum(var, 0.0)), np.nan),
            "min": _extreme(col("min"), group, elements, n, "min"),
            "max": _extreme(col("max"), group, elements, n, "max"),
            "abs_max": _extreme(col("abs_max"), group, elements, n, "max"),
            "zero_frac": total(col("zero_frac") * col("numel"), elements) / numel,
        }
    for name, values in stats.items():
        put(name, np.where(has_grad, values, np.nan))
    if "numel" in out.columns:
        out["numel"] = np.where(has_grad, numel, out["numel"]).astype(np.int64)
    everywhere = np.ones(len(parts), dtype=bool)
    for name in ("nan_count", "inf_count"):
        put(name, total(np.nan_to_num(col(name)), everywhere).astype(np.int64))
    out["has_grad"] = has_grad
    if "reason" in out.columns:
        out.loc[has_grad, "reason"] = None
    put("loss", total(col("loss"), everywhere) / np.bincount(group, minlength=n))
    put("value_norm", np.sqrt(total(col("value_norm") ** 2, everywhere)))
    if "edited" in parts.columns:
        edited = parts["edited"].fillna(False).to_numpy(dtype=bool)
        out["edited"] = total(edited.astype(np.float64), everywhere) > 0
        after = np.where(edited, col("edited_norm"), col("norm"))
        put("edited_norm", np.where(out["edited"], np.sqrt(total(after**2)), np.nan))
    _combine_lists(out, parts, group, grad)


def _extreme(values: np.ndarray, group: np.ndarray, mask: np.ndarray, n: int, op: str) -> np.ndarray:
    """`op` ("min", "max") over each group's `values` where `mask`; NaN propagates, as in a record."""
    v = pd.Series(values[mask])
    by = v.groupby(group[mask])
    picked = (by.min() if op == "min" else by.max()).where(~v.isna().groupby(group[mask]).any())
    return picked.reindex(range(n)).to_numpy(dtype=np.float64)


def _combine_lists(out: pd.DataFrame, parts: pd.DataFrame, group: np.ndarray, grad: np.ndarray) -> None:
    """The list columns: `shape` side by side along dim 0, `per_example_norm` concatenated (over the micro-batches
    with a gradient, `grad`, as the statistics: one the tap did not reach has no rows), `hist_counts` summed."""
    indices = pd.Series(np.arange(len(group))).groupby(group).indices
    rows = [indices[g] for g in range(len(out))]
    if "shape" in parts.columns:
        shapes = parts["shape"].to_numpy()
        out["shape"] = pd.Series([_side_by_side([shapes[i] for i in r]) for r in rows], index=out.index, dtype=object)
    if PER_EXAMPLE_COLUMN in parts.columns:
        pe = parts[PER_EXAMPLE_COLUMN].to_numpy()
        with_grad = [[i for i in r if grad[i]] or list(r) for r in rows]
        joined = [None if any(pe[i] is None for i in r) else np.concatenate([pe[i] for i in r]) for r in with_grad]
        out[PER_EXAMPLE_COLUMN] = pd.Series(joined, index=out.index, dtype=object)
    if HIST_COLUMN in parts.columns:
        hist = parts[HIST_COLUMN].to_numpy()
        out[HIST_COLUMN] = pd.Series([_summed([hist[i] for i in r]) for r in rows], index=out.index, dtype=object)
    if "values" in parts.columns:
        out["values"] = None


def _side_by_side(shapes: list[Any]) -> Any:
    dims = [list(s) for s in shapes if s is not None and len(s)]
    if not dims or any(d[1:] != dims[0][1:] for d in dims):
        return shapes[0]
    return np.array([sum(d[0] for d in dims), *dims[0][1:]], dtype=np.int64)


def _summed(counts: list[Any]) -> np.ndarray | None:
    arrays = [np.asarray(c, dtype=np.int64) for c in counts if c is not None]
    if not arrays or len({a.size for a in arrays}) > 1:
        return None
    return np.sum(arrays, axis=0)
