"""Helpers over the optional columns: histograms over steps, update ratios, per-example norm spread.

Each returns the DataFrame behind one of the report's panels; each needs the column it reads
(`hist_counts` with `capture.histogram=true`, `per_example_norm` with `capture.per_example=true`,
`update_ratio` on parameter taps) and raises a one-paragraph error naming the option otherwise.

Example::

    df = load("outputs/2026-11-23/10-00-00")
    update_ratios(df).pivot(index="step", columns="tap", values="update_ratio")
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.analysis.summaries import need_columns, rank_columns
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import HIST_EDGES

#: The usual guide for `update_ratio`: about 1e-3 per step is a healthy learning rate (Karpathy's rule of thumb).
UPDATE_RATIO_GUIDE = 1e-3


def _need(df: pd.DataFrame, column: str, option: str) -> None:
    if column not in df.columns or df[column].isna().all():
        raise GradrunnerError(
            f"these records have no {column!r} values; run with {option} to record them "
            f"(columns present: {', '.join(map(str, df.columns))})."
        )


def hist_bin_labels() -> list[str]:
    """Labels of the `hist_counts` bins, in order: '0', '<1e-30', '[1e-30,1.8e-30)', ..., '>=1e+10', 'nan/inf'.

    Example::

        hist_bin_labels()[0]     # '0'
    """
    inner = [f"[{a:.2g},{b:.2g})" for a, b in itertools.pairwise(HIST_EDGES)]
    return ["0", f"<{HIST_EDGES[0]:.0e}", *inner, f">={HIST_EDGES[-1]:.0e}", "nan/inf"]


def histograms_over_steps(df: pd.DataFrame, tap: str, call: int = 0, rank: int | None = None) -> pd.DataFrame:
    """Counts of |g| per bin (columns, labelled by `hist_bin_labels`) per step (rows) for one tap's call.

    Example::

        h = histograms_over_steps(df, "fc1:output")    # h.loc[3] is step 3's histogram
        h.div(h.sum(axis=1), axis=0)                    # as fractions

    With several runs in `df` (a sweep), pass the rows of one run; with several ranks (torchrun), name
    one: `rank=0`. Under gradient accumulation a step's micro-batch counts are added (`combine_micro_steps`).
    """
    _need(df, "hist_counts", "capture.histogram=true")
    need_columns(df, ["run_id", "step", "tap", "call"], "histograms_over_steps")
    df = combine_micro_steps(df)
    rows = df[(df["tap"] == tap) & (df["call"] == call) & df["hist_counts"].notna()]
    if rank is not None and "rank" in rows.columns:
        rows = rows[rows["rank"] == rank]
    elif rank_columns(rows):
        ranks = ", ".join(str(r) for r in sorted(rows["rank"].unique()))
        raise GradrunnerError(f"the records of {tap!r} hold the rows of ranks {ranks}; name one, e.g. rank=0.")
    if rows.empty:
        taps = ", ".join(sorted(df["tap"].unique()))
        raise GradrunnerError(f"no histogram rows for tap {tap!r} call {call}; taps in these records: {taps}.")
    if rows["run_id"].nunique() > 1:
        raise GradrunnerError(
            f"the records hold {rows['run_id'].nunique()} runs; pass the rows of one, e.g. df[df.run_id == ...]."
        )
    counts = np.stack([np.asarray(c, dtype=np.int64) for c in rows["hist_counts"]])
    return pd.DataFrame(counts, index=pd.Index(rows["step"].to_numpy(), name="step"), columns=hist_bin_labels())


def update_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Per parameter tap and step (and rank, under torchrun): `update_norm`, `value_norm`, `update_ratio`, and whether
    it is above the guide.

    Example::

        r = update_ratios(df)
        r[r.step == r.step.max()].sort_values("update_ratio")   # which layers move fastest now
    """
    _need(df, "update_ratio", "parameter taps (e.g. taps=['*:weight'])")
    keep = [c for c in ("run_id", "step", "tap", *rank_columns(df), "update_norm", "value_norm", "update_ratio") if c in df.columns]
    out = df.loc[df["update_ratio"].notna(), keep].reset_index(drop=True)
    out["log10_ratio"] = np.log10(out["update_ratio"].where(out["update_ratio"] > 0))
    out["above_guide"] = out["update_ratio"] > UPDATE_RATIO_GUIDE
    return out


def per_example_spread(df: pd.DataFrame) -> pd.DataFrame:
    """Per record with per-example norms: how unevenly the examples contribute.

    Columns: `run_id`, `step`, `tap`, `call` (`rank` under torchrun: `top_example` is a row of that rank's
    batch), `n_examples`, `max_norm`, `median_norm`, `dominance` (max over median), `top_example`
    (the batch row with the largest norm), `top_share` (its share of the summed squared norms). A record
    holding a NaN norm (a NaN gradient), or only zeros (a dead layer: no row contributes), says neither which row
    is largest nor by how much: `dominance` and `top_share` NaN, `top_example` null (`Int64`). Under gradient accumulation a step's micro-batch records
    are combined first (`combine_micro_steps`: the rows of the micro-batches that reached the tap, concatenated in
    micro-batch order), so a step counts once and `top_example` is a row of the step's whole batch (as in a parameter
    tap's record) when every micro-batch reached the tap.

    Example::

        s = per_example_spread(df)
        s.sort_values("dominance", ascending=False).head()    # where one example dominates
    """
    _need(df, "per_example_norm", "capture.per_example=true")
    need_columns(df, ["run_id", "step", "tap", "call"], "per_example_spread")
    df = combine_micro_steps(df)
    rows = df[df["per_example_norm"].notna()]
    ranked = bool(rank_columns(rows))
    out = []
    for r in rows.itertuples(index=False):
        norms = np.asarray(r.per_example_norm, dtype=np.float64)
        if norms.size == 0:
            continue
        median = float(np.median(norms))
        sq = norms * norms
        # argmax would name the NaN row, and max/median read inf; all rows 0 (a dead layer): no row is largest
        unknown = bool(np.isnan(norms).any()) or not norms.any()
        with np.errstate(invalid="ignore"):  # inf / inf (norms that overflowed): NaN, not a warning
            dominance = float(norms.max() / median) if median > 0 else float("inf")
            share = float(sq.max() / sq.sum()) if sq.sum() > 0 else 0.0
        out.append({
            "run_id": r.run_id, "step": r.step, "tap": r.tap, "call": r.call, **({"rank": r.rank} if ranked else {}),
            "n_examples": norms.size,
            "max_norm": float(norms.max()), "median_norm": median,
            "dominance": np.nan if unknown else dominance,
            "top_example": pd.NA if unknown else int(norms.argmax()), "top_share": np.nan if unknown else share,
        })  # fmt: skip
    frame = pd.DataFrame(out)
    return frame.astype({"top_example": "Int64"}) if len(frame) else frame
