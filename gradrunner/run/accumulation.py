"""What a record is under gradient accumulation (`train.accumulate=N`).

Activation, input and local taps are recorded per micro-batch (`micro_step` 0..N-1): the gradient of
that micro-batch's loss / N. Parameter taps are recorded once per optimisation step, on the last
micro-batch's rows: the accumulated `.grad` the optimiser uses (unscaled, before clipping).

Example::

    recs = drop_param_rows(cap.records(loss), cap)       # micro-batches 0..N-2
    acc = param_grad_records(cap)                        # after scaler.unscale_, before clipping
    recs = replace_param_rows(cap.records(loss, before), acc)   # the last micro-batch's records
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from gradrunner.capturing.session import Capture, unscaled
from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import StepRecords, TapKey

#: StepRecords fields that describe the gradient (recomputed from `.grad`); the rest (the tapped
#: value's norm, the update norms, the loss) stay as the capture recorded them.
_GRADIENT_FIELDS = ("shape", "numel", "has_grad", "stats", "counts", "values", "positions", "hist_counts")


def _param_keys(cap: Capture) -> set[TapKey]:
    return {TapKey(t.module, t.name, 0) for t in cap.taps if t.kind == "param"}


def micro_steps(recs: StepRecords, micro_step: int, cap: Capture) -> list[int | None]:
    """The `micro_step` column of `recs`: `micro_step` for each record, null for parameter taps (one per step)."""
    params = _param_keys(cap)
    return [None if k in params else micro_step for k in recs.keys]


def drop_param_rows(recs: StepRecords, cap: Capture) -> StepRecords:
    """`recs` without its parameter-tap rows (a micro-batch before the last)."""
    params = _param_keys(cap)
    keep = [i for i, k in enumerate(recs.keys) if k not in params]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(recs):
        v = getattr(recs, f.name)
        if isinstance(v, list):
            v = [v[i] for i in keep]
        elif isinstance(v, np.ndarray):
            v = v[keep]
        elif isinstance(v, dict):
            v = {c: np.asarray(a)[keep] for c, a in v.items()}
        out[f.name] = v
    return StepRecords(**out)


def param_grad_records(cap: Capture) -> StepRecords:
    """Records of every parameter tap's accumulated `.grad` as it is now.

    Call it after `scaler.unscale_` and before clipping (the records' meaning: true gradients, before clipping).
    """
    return param_grad_collector(cap).finish()


def param_grad_collector(cap: Capture, scale: torch.Tensor | None = None) -> Collector:
    """Every parameter tap's `.grad` as it is now, reduced on its device (no host sync until `finish()`).

    `scale` (0-d, e.g. 1/loss scale where `.grad` is not yet unscaled) multiplies each gradient first.
    What is kept is a copy: a later in-place change of `.grad` (clipping, `zero_grad`) does not reach it.

    Example::

        acc = param_grad_collector(cap, cap.grad_scale)   # after each backward; keep the latest
        recs = replace_param_rows(recs, acc.finish())
    """
    col = Collector(cap.values, cap.sample_size, cap.seed, histogram=cap.histogram)
    for t in cap.taps:
        if t.kind == "param":
            grad = getattr(cap.model.get_submodule(t.module), t.name).grad
            if grad is not None:
                grad = grad.detach() if scale is None else unscaled(grad.detach(), scale)
            col.add(TapKey(t.module, t.name, 0), grad, batched=False)
    return col


def replace_param_rows(recs: StepRecords, acc: StepRecords) -> StepRecords:
    """`recs` with the gradient columns of the parameter taps in `acc` taken from `acc` (in place)."""
    row = {k: j for j, k in enumerate(acc.keys)}
    for i, k in enumerate(recs.keys):
        j = row.get(k)
        if j is None:
            continue
        for name in _GRADIENT_FIELDS:
            mine, theirs = getattr(recs, name), getattr(acc, name)
            if mine is None or theirs is None:
                continue
            if isinstance(mine, dict):
                for c in mine:
                    mine[c][i] = theirs[c][j]
            else:
                mine[i] = theirs[j]
    return recs
