"""Warnings a user would want while a run goes on: records that will be huge, a run that learns nothing.

What the records say once the run ended (the last word, a sweep's summary) is `gradrunner.analysis.health`.

| check | warns (once, through logging) when |
| --- | --- |
| `warn_values_size` | `capture.values=full` will write more than `VALUES_WARN_BYTES` over the run (estimated at step 0) |
| `ZeroWatch` | the loss, or every captured gradient, is exactly zero for each of the first `ZERO_STEPS` steps |
| `warn_without_grad` | a tap has a record without gradient, the first time for each tap (the `reason` column says why) |
| `warn_nothing_captured` | `taps=[]` without `edits`, or `steps=0`: nothing will be captured (at the start) |

Example::

    watch = ZeroWatch()
    for step in range(steps):
        ...
        watch.step(step, loss_value, recs)   # logs one warning at step ZERO_STEPS - 1 if nothing moves
"""

from __future__ import annotations

import logging
import math

import numpy as np

from gradrunner.records.columns import StepRecords

log = logging.getLogger(__name__)

#: Above this estimate of `capture.values=full` bytes for the whole run, warn (1 GiB).
VALUES_WARN_BYTES = 1 << 30
#: A loss or gradients exactly zero for this many first steps (or every step of a shorter run) warn.
ZERO_STEPS = 5
_FLOAT32_BYTES = 4


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def values_bytes(records: StepRecords, captured_steps: int) -> int:
    """Estimated bytes of `values` over the run: this step's elements (float32) × captured steps.

    Example::

        values_bytes(recs, captured_steps=30)   # e.g. 1_900_000_000
    """
    return int(np.asarray(records.numel, dtype=np.int64).sum()) * _FLOAT32_BYTES * captured_steps


def warn_values_size(records: StepRecords, captured_steps: int, sample_size: int, limit: int | None = None) -> bool:
    """Log a warning (and return True) when `capture.values=full` would write more than `limit` bytes.

    Example::

        warn_values_size(recs, captured_steps=30, sample_size=64)   # at step 0 of a values=full run
    """
    total = values_bytes(records, captured_steps)
    if total <= (VALUES_WARN_BYTES if limit is None else limit):
        return False
    per_step = values_bytes(records, 1)
    sampled = _size(min(int(np.asarray(records.numel).clip(max=sample_size).sum()), per_step) * _FLOAT32_BYTES * captured_steps)
    log.warning(
        "capture.values=full will write about %s of gradient values (%s per captured step x %d captured steps), "
        "and load(..., values=True) will need as much memory. To keep a sample instead: capture.values=sample "
        "capture.sample_size=%d (about %s); or capture fewer steps (capture.every=N) or fewer taps.",
        _size(total), _size(per_step), captured_steps, sample_size, sampled,
    )  # fmt: skip
    return True


class ZeroWatch:
    """Warns once when the loss, or every captured gradient, is exactly zero for the first `ZERO_STEPS` steps.

    Example::

        watch = ZeroWatch(total_steps=50)
        watch.step(0, 0.0, recs)    # ... at step 4 (or the last step of a shorter run): one warning
    """

    def __init__(self, total_steps: int, first: int = ZERO_STEPS) -> None:
        self.last = min(first, total_steps) - 1
        self.zero_loss = self.zero_grads = True
        self.seen_grads = self.warned = False

    def step(self, step: int, loss: float, records: StepRecords | None) -> None:
        if self.warned or step > self.last:
            return
        self.zero_loss &= loss == 0.0
        if records is not None and len(records):
            norms = np.asarray(records.stats["norm"], dtype=np.float64)[np.asarray(records.has_grad, dtype=bool)]
            self.zero_grads &= bool(norms.size) and bool((norms == 0).all())
            self.seen_grads = True
        if step == self.last and (self.zero_loss or (self.zero_grads and self.seen_grads)):
            self.warned = True
            what = "The loss" if self.zero_loss else "Every captured gradient"
            log.warning(
                "%s has been exactly 0 for the first %d step(s): this run learns nothing. Check that the loss "
                "fits the task (e.g. cross_entropy on a model with one output is always 0: use loss=mse for "
                "regression), the targets (data.*), and that the taps take part in the loss.",
                what, self.last + 1,
            )  # fmt: skip


def warn_without_grad(recs: StepRecords, step: int, warned: set[str]) -> None:
    """Log a warning the first time each tap has a record without gradient (its `reason` column says why).

    Example::

        warned: set[str] = set()
        warn_without_grad(cap.records(loss), step=0, warned=warned)
    """
    reasons = recs.reason or [None] * len(recs)
    for key, has_grad, reason in zip(recs.keys, recs.has_grad, reasons, strict=True):
        if not has_grad and key.tap not in warned:
            warned.add(key.tap)
            log.warning("tap %r has no gradient at step %d: %s (warned once per tap; see the reason column)",
                        key.tap, step, reason or "unknown")  # fmt: skip


def captured_steps(steps: int, every: int) -> int:
    """How many steps of a run of `steps` are captured with `capture.every=every` (steps 0, every, ...)."""
    return math.ceil(steps / every) if steps > 0 else 0


def warn_nothing_captured(taps: list[object], steps: int, edits: list[object] | None = None) -> bool:
    """Log a warning (and return True) when the run will capture nothing: `taps=[]` (and no `edits`, whose taps get
    rows) or `steps=0`.

    Example::

        warn_nothing_captured([], steps=50)   # "taps=[]: this run captures no gradient ..."
    """
    if steps <= 0:
        log.warning("steps=%d: this run takes no step, so nothing will be captured and the records stay empty. "
                    "Set steps=N (N >= 1).", steps)  # fmt: skip
        return True
    if not taps and not edits:
        log.warning("taps=[]: this run captures no gradient (grads.parquet will have no rows; steps.parquet still "
                    "gets the loss). Name what to capture, e.g. taps='[\"*:output\"]'; list the model's taps with "
                    "python -m gradrunner.taps <your overrides>.")  # fmt: skip
        return True
    return False
