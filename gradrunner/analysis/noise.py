"""The gradient noise scale per step and parameter tap, from the recorded norms and per-example norms.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", Appendix A: with per-example
gradients g_i of mean G and covariance Sigma, the gradient of a batch of B examples, G_B = (1/B) sum g_i,
has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Two batch sizes give unbiased estimates of |G|^2 and tr(Sigma);
here B_small = 1 (one example) and B_big = B (the step's batch):

    |G_B|^2  = norm^2                                 (the recorded `norm`: the batch gradient, `.grad`)
    |G_1|^2  = (1/B) sum_i |g_i|^2 = B sum_i s_i^2     (g_i = B s_i; s_i: `per_example_norm`, row i's share)
    g2          = (B |G_B|^2 - |G_1|^2) / (B - 1)      estimates |G|^2
    trace_sigma = (|G_1|^2 - |G_B|^2) / (1 - 1/B)      estimates tr(Sigma)
    b_simple    = trace_sigma / g2                     the simple noise scale B_simple = tr(Sigma) / |G|^2

`per_example_norm` is each row's *share* of `.grad` (the shares sum to `.grad`). For a mean-reduced
loss the share is g_i / B, so g_i = B s_i as above. For a sum-reduced loss the share is g_i itself
and `.grad` = B G_B: read with the formulas above, |G_B|^2 and |G_1|^2 are then both B^2 times
larger, and so are g2 and trace_sigma (in units of the sum's gradient), while b_simple, their ratio,
is the same: any constant factor c on the loss (the reduction, a loss scale, 1/N of accumulation)
multiplies both by c^2. b_simple never depends on it; g2 and trace_sigma are those of a mean loss
exactly when the loss is one. (In closed form: b_simple = (B S - N) / (N - S), S = sum_i s_i^2, N = norm^2.)

Rows: per (run, step, tap), the per-example norms of every rank (DDP: each rank's rows, shares of
the all-reduced `.grad`) make the batch of B rows; `norm` is the lowest rank's. The whole model's row,
tap `"*"`, pools the parameter taps of that step (the squared norms of disjoint parameters add: N and
S are sums over taps): it is the noise scale of the concatenation of the taps recorded, which is the
whole model when every parameter is tapped; a step where one tap's N or S is NaN (a NaN gradient) has NaN there. Two paths of one tied `Parameter` (GPT-2's `lm_head:weight`
and `transformer.wte:weight`) hold the same gradient, value and rows: a tap whose N, S, B, size and own
norm (`value_norm`) equal another's in the step counts once there. Distinct parameters can share N, S and
B (two biases whose outputs are added get equal gradients) but not, as a rule, their values; ones equal in
both at every step (two zero-initialised such biases) cannot be told apart from the records and count once:
tap one of them. `b_simple_ema` (with `ema=beta`) is
EMA(trace_sigma) / EMA(g2) over the steps of each run and tap, each EMA m_t = beta m_(t-1) + (1 - beta) x_t
from m = 0 (the bias correction cancels in the ratio): McCandlish et al. smooth the numerator and
denominator separately, since the ratio of two noisy unbiased estimates is biased.

Parameter taps are those with an `update_norm` (what records hold for parameters), or those named in `taps`; a
named tap that records show is not a parameter's is refused: a module's output or input, a `local.` variable
(told by the name: `records.columns.activation_kind`), or a tap without an `update_norm` in records whose
parameter taps have one. (An activation's row norms add up to its own norm: g2 would be 0, b_simple meaningless.)

Example::

    from gradrunner.analysis import load
    from gradrunner.analysis.noise import noise_scale
    ns = noise_scale(load("outputs/2026-11-25/10-00-00"), ema=0.9)
    ns[ns.tap == "*"][["step", "b_simple", "b_simple_ema"]]    # the critical batch size's estimate over steps
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd

from gradrunner.analysis.summaries import need_columns
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import activation_kind

#: The tap of the whole-model rows.
WHOLE_MODEL = "*"


class NoiseScaleWarning(UserWarning):
    """Parameter taps left out of `noise_scale` (chosen by default) because their records hold no per-example norms."""


_ENABLE = "capture.per_example=true (Python: capture(..., per_example=True))"


def noise_scale(df: pd.DataFrame, ema: float | None = None, taps: Sequence[str] | None = None) -> pd.DataFrame:
    """Per run, step and parameter tap (and `"*"`, the taps pooled): `rows`, `g2`, `trace_sigma`, `b_simple`.

    Example::

        ns = noise_scale(df, ema=0.95)
        ns.pivot(index="step", columns="tap", values="b_simple_ema")    # per layer over steps

    `ema` (0 <= ema < 1) adds `b_simple_ema`; `taps` picks the parameter taps (default: those with an
    `update_norm`; a named tap that is not a parameter's, a module's output for one, raises GradrunnerError).
    `run_id` is a column when the records hold it. With one row (B = 1) nothing can
    be estimated: NaN. Taps chosen by default whose records carry no per-example norms (a layer type
    without them) are left out with a `NoiseScaleWarning` naming them; a tap named in `taps` without
    them, or no tap with them, raises GradrunnerError. A tap whose norms are null at some steps only (rows whose
    squared norms overflowed float32, in a diverging run) has those steps left out, with a `NoiseScaleWarning`
    naming them; the whole-model row of such a step is NaN.
    """
    if ema is not None and not 0 <= ema < 1:
        raise GradrunnerError(f"ema={ema!r} must be a number in [0, 1) (the weight of the previous steps, e.g. 0.9)")
    rows, partial = _parameter_rows(df, taps)
    per_tap = _per_tap(rows)
    whole = _whole_model(per_tap, partial)
    out = pd.concat([per_tap, whole], ignore_index=True) if len(whole) else per_tap
    out = _estimates(out)
    if ema is not None:
        out["b_simple_ema"] = _ema_ratio(out, ema)
    keys = [c for c in ("run_id", "step", "tap") if c in out.columns]
    order = out["tap"].eq(WHOLE_MODEL).astype(int)  # "*" after the taps of its step
    out = (
        out.assign(_star=order).sort_values([*keys[:-1], "_star", "tap"]).drop(columns=["_star", "sq_norm", "sq_rows"])
    )
    return out.reset_index(drop=True)


def _parameter_rows(df: pd.DataFrame, taps: Sequence[str] | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The records of the parameter taps that got a gradient, each with its per-example norms (else an error), and
    the (run, step) keys of the steps some of whose taps' rows were left out (their whole-model row is NaN)."""
    need_columns(df, ["step", "tap", "norm"], "noise_scale")
    if taps is not None:
        unknown = sorted(set(taps) - set(df["tap"]))
        if unknown:
            raise GradrunnerError(f"taps {unknown} are not in these records; taps there: {sorted(set(df['tap']))}")
        chosen = list(taps)
        _refuse_non_parameters(df, chosen)
    elif "update_norm" in df.columns and df["update_norm"].notna().any():
        chosen = sorted(set(df.loc[df["update_norm"].notna(), "tap"]))
    else:
        raise GradrunnerError(
            "noise_scale found no parameter taps (records with an update_norm: a runner job's, or "
            "record(..., update_norms=True)); tap parameters (e.g. "
            "taps=['*:weight', '*:bias']) and run with " + _ENABLE + ", or name them: noise_scale(df, taps=[...])"
        )
    rows = df[df["tap"].isin(chosen)]
    if "has_grad" in rows.columns:
        rows = rows[rows["has_grad"].fillna(True).astype(bool)]
    pen = rows["per_example_norm"] if "per_example_norm" in rows.columns else pd.Series(None, index=rows.index)
    # a step's rows of a tap are one batch over its ranks: one rank's null leaves the tap's step unknown
    lacking = pen.isna().groupby([rows[c] for c in ("run_id", "step", "tap") if c in rows.columns]).transform("any")
    # a tap with norms at no step (the option off, a layer type without them) against one whose norms are null at
    # some steps only (rows whose squared norms overflowed float32 in a diverging run): those steps are left out
    never = set(rows.loc[lacking, "tap"]) - set(rows.loc[~lacking, "tap"])
    named = rows.loc[lacking & rows["tap"].isin(never), ["tap", "step"]]
    if len(named):
        names = _steps_of(named)
        if taps is None and len(never) < len(set(rows["tap"])):
            # Taps chosen for the user: leave out those without norms (GPT-2's wpe without position_ids), saying so.
            warnings.warn(f"noise_scale leaves out {names}: no per_example_norm there (the PerExampleWarning of the "
                          f"run said why); the whole-model row {WHOLE_MODEL!r} pools the other taps only",
                          NoiseScaleWarning, stacklevel=3)  # fmt: skip
            rows, lacking = rows[~rows["tap"].isin(never)], lacking[~rows["tap"].isin(never)]
        else:
            raise GradrunnerError(
                f"noise_scale needs per_example_norm on every parameter tap it uses; these records have none for "
                f"{names}. Turn them on with {_ENABLE}, or leave those taps out: noise_scale(df, taps=[...])."
            )
    keys = [c for c in ("run_id", "step") if c in rows.columns]
    partial = rows.loc[lacking, keys].drop_duplicates()
    if len(partial):
        warnings.warn(f"noise_scale leaves out the steps of {_steps_of(rows.loc[lacking, ['tap', 'step']])} that have "
                      f"no per_example_norm (the PerExampleWarning of the run said why: e.g. rows whose squared norms "
                      f"overflow float32); the whole-model row {WHOLE_MODEL!r} of those steps is NaN",
                      NoiseScaleWarning, stacklevel=3)  # fmt: skip
    return rows[~lacking], partial


def _refuse_non_parameters(df: pd.DataFrame, taps: Sequence[str]) -> None:
    """Raise GradrunnerError naming the taps of `taps` that the records show are not parameter taps, and why."""
    updated = set(df.loc[df["update_norm"].notna(), "tap"]) if "update_norm" in df.columns else set()
    why = {t: activation_kind(t) or ("no update_norm in these records, which hold one for each parameter tap"
                                     if updated and t not in updated else None) for t in taps}  # fmt: skip
    bad = {t: w for t, w in why.items() if w is not None}
    if bad:
        if updated:
            allowed = f"the parameter taps of these records, {sorted(updated)}, or leave `taps` out to take them all"
        else:
            others = sorted({str(t) for t in df["tap"]} - {t for t in df["tap"] if activation_kind(str(t))})
            allowed = f"parameter taps ('<module>:<parameter>'; the other taps of these records: {others})"
        raise GradrunnerError(
            "noise_scale estimates the noise of parameter gradients only (McCandlish et al.); "
            + ", ".join(f"{t!r} ({w})" for t, w in bad.items())
            + f" {'is not a parameter tap' if len(bad) == 1 else 'are not parameter taps'}. Name {allowed}."
        )


def _steps_of(rows: pd.DataFrame) -> str:
    """`'fc1:weight' (steps 2-3), ...`: each tap of `rows` (columns tap, step) with the span of its steps."""
    return ", ".join(f"{t!r} (steps {_span(s)})" for t, s in rows.groupby("tap")["step"])


def _span(steps: pd.Series) -> str:
    s = sorted(set(int(x) for x in steps))
    return f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0])


def _per_tap(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, step, tap): B, N = norm^2 (the lowest rank's), S = sum of squared per-example norms (all ranks)."""
    keys = [c for c in ("run_id", "step", "tap") if c in rows.columns]
    by = [*keys, "rank"] if "rank" in rows.columns else keys
    dup = rows.duplicated(by, keep=False)
    if dup.any():
        first = rows.loc[dup, by].iloc[0].to_dict()
        raise GradrunnerError(
            f"noise_scale expects one record per step and parameter tap (and rank); {first} has several. "
            "Pass the records of one run, or keep their run_id column."
        )
    sq = [np.square(np.asarray(v, dtype=np.float64)) for v in rows["per_example_norm"]]
    frame = pd.DataFrame({k: rows[k].to_numpy() for k in by})
    frame["n"] = [a.size for a in sq]
    frame["s"] = [float(a.sum()) for a in sq]
    frame["norm2"] = np.square(rows["norm"].to_numpy(dtype=np.float64))
    for c in ("value_norm", "numel"):  # what tells one tied parameter from two with equal gradients
        frame[c] = rows[c].to_numpy(dtype=np.float64) if c in rows.columns else np.nan
    frame = frame.sort_values(by)
    grouped = frame.groupby(keys, sort=True)
    return pd.DataFrame({"rows": grouped["n"].sum(), "sq_rows": grouped["s"].sum(), "sq_norm": grouped["norm2"].first(),
                         "value_norm": grouped["value_norm"].first(), "numel": grouped["numel"].first()}).reset_index()  # fmt: skip


def _whole_model(per_tap: pd.DataFrame, partial: pd.DataFrame) -> pd.DataFrame:
    """The taps of each (run, step) pooled: N and S add over disjoint parameters; B must agree. The steps of `partial`
    (a tap's rows left out there) pool NaN: never the other taps alone."""
    keys = [c for c in ("run_id", "step") if c in per_tap.columns]
    if per_tap.empty:
        return per_tap
    grouped = per_tap.groupby(keys, sort=True)
    rows = grouped["rows"].agg(["min", "max"])
    bad = rows[rows["min"] != rows["max"]]
    if len(bad):
        raise GradrunnerError(
            f"the parameter taps of step {bad.index[0]} have different numbers of per-example norms "
            f"({int(bad['min'].iloc[0])} and {int(bad['max'].iloc[0])}): they are not one batch's rows"
        )
    once = per_tap.drop_duplicates([*keys, "rows", "sq_rows", "sq_norm", "value_norm", "numel"]).groupby(
        keys, sort=True
    )
    # a tap whose sums are NaN (a NaN gradient) leaves the pooled ones unknown: NaN, never the other taps' alone
    # (a groupby sum skips NaN, and gives 0 for a step whose taps are all NaN)
    sums = {c: once[c].agg(lambda s: s.sum(skipna=False)) for c in ("sq_rows", "sq_norm")}
    whole = pd.DataFrame({"rows": rows["min"], **sums})
    if len(partial):
        left = pd.MultiIndex.from_frame(partial[keys]) if len(keys) > 1 else pd.Index(partial[keys[0]])
        whole.loc[whole.index.isin(left), ["sq_rows", "sq_norm"]] = np.nan
    return whole.reset_index().assign(tap=WHOLE_MODEL)


def _estimates(frame: pd.DataFrame) -> pd.DataFrame:
    b = frame["rows"].to_numpy(dtype=np.float64)
    n, s = frame["sq_norm"].to_numpy(), frame["sq_rows"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        g_big, g_one = n, b * s  # |G_B|^2, |G_1|^2 (g_i = B s_i)
        ok = b > 1
        g2 = np.where(ok, (b * g_big - g_one) / (b - 1), np.nan)
        trace = np.where(ok, (g_one - g_big) / (1 - 1 / b), np.nan)
        frame = frame.assign(g2=g2, trace_sigma=trace, b_simple=trace / g2)
    return frame


def _ema_ratio(frame: pd.DataFrame, beta: float) -> pd.Series:
    """EMA(trace_sigma) / EMA(g2) along the steps of each (run, tap); a step with NaN leaves the EMAs as they were."""
    keys = [c for c in ("run_id", "tap") if c in frame.columns]
    out = pd.Series(np.nan, index=frame.index)
    for _, part in frame.sort_values("step").groupby(keys, sort=False):
        num = den = 0.0
        for idx, t, g in zip(part.index, part["trace_sigma"], part["g2"], strict=True):
            if np.isfinite(t) and np.isfinite(g):
                num, den = beta * num + (1 - beta) * t, beta * den + (1 - beta) * g
            out[idx] = num / den if den != 0 else np.nan
    return out
