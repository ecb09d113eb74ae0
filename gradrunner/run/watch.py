"""Warnings a user would want while a run goes on: records that will be huge, a run that learns nothing.

| check | warns (once, through logging) when |
| --- | --- |
| `warn_values_size` | `capture.values=full` will write more than `VALUES_WARN_BYTES` over the run (estimated at step 0) |
| `ZeroWatch` | the loss, or every captured gradient, is exactly zero for each of the first `ZERO_STEPS` steps |
| `warn_without_grad` | a tap has a record without gradient, the first time for each tap (the `reason` column says why) |
| `warn_nothing_captured` | `taps=[]` or `steps=0`: nothing will be captured (at the start) |
| `last_word` | always, at the end of a run: loss first/last, NaN/Inf, vanishing/exploding taps, taps never with a gradient, where the records are (`health`) |

Example::

    watch = ZeroWatch()
    for step in range(steps):
        ...
        watch.step(step, loss_value, recs)   # logs one warning at step ZERO_STEPS - 1 if nothing moves
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, StepRecords

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


def warn_nothing_captured(taps: list[object], steps: int) -> bool:
    """Log a warning (and return True) when the run will capture nothing: `taps=[]` or `steps=0`.

    Example::

        warn_nothing_captured([], steps=50)   # "taps=[]: this run captures no gradient ..."
    """
    if steps <= 0:
        log.warning("steps=%d: this run takes no step, so nothing will be captured and the records stay empty. "
                    "Set steps=N (N >= 1).", steps)  # fmt: skip
        return True
    if not taps:
        log.warning("taps=[]: this run captures no gradient (grads.parquet will have no rows; steps.parquet still "
                    "gets the loss). Name what to capture, e.g. taps='[\"*:output\"]'; list the model's taps with "
                    "python -m gradrunner.taps <your overrides>.")  # fmt: skip
        return True
    return False


#: Names listed in one line of the last word before "... and N more".
_LIST_AT_MOST = 6


@dataclass
class Health:
    """What a finished job's records say about it: `health(job_dir)`, and `str()` of it for the log.

    Example::

        h = health(Path("outputs/2026-11-23/10-00-00-000000"))
        h.first_nonfinite      # (5, 'fc2:output') or None
        print(h)               # the summary that ends every run
    """

    directory: Path
    steps: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    loss_nonfinite_step: int | None = None
    #: (step, tap label) of the first record holding a NaN or Inf, in record order.
    first_nonfinite: tuple[int, str] | None = None
    taps: int = 0
    #: tap label -> the first step its norm fell below the threshold (its last norm is below it).
    vanishing: dict[str, int] = field(default_factory=dict)
    #: tap label -> the first step its norm went above the threshold.
    exploding: dict[str, int] = field(default_factory=dict)
    #: tap label -> the reason of its first record (it never had a gradient).
    without_grad: dict[str, str] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        nonfinite = self.first_nonfinite is not None or self.loss_nonfinite_step is not None
        return not (nonfinite or self.vanishing or self.exploding or self.without_grad or self.taps == 0)

    def lines(self) -> list[str]:
        """The summary, one claim a line (the first says where the records are)."""
        from gradrunner.analysis.summaries import EXPLODE_ABOVE, VANISH_BELOW

        out = [f"records: {self.directory} ({GRADS_FILE}, {STEPS_FILE}; read the dir with gradrunner.analysis.load, "
               "a file with pandas.read_parquet)"]
        if self.loss_first is None:
            out.append("loss: no step completed")
        else:
            out.append(f"loss: {self.loss_first:.6g} at the first step, {self.loss_last:.6g} at the last "
                       f"({self.steps} steps)")  # fmt: skip
        if self.loss_nonfinite_step is not None or self.first_nonfinite is not None:
            parts = []
            if self.loss_nonfinite_step is not None:
                parts.append(f"the loss from step {self.loss_nonfinite_step}")
            if self.first_nonfinite is not None:
                parts.append(f"gradients from step {self.first_nonfinite[0]}, first in {self.first_nonfinite[1]}")
            out.append("NaN/Inf: " + "; ".join(parts))
        if self.taps == 0:
            out.append("no tap was captured (taps=[], or no captured step)")
            return out
        if self.vanishing:
            out.append(f"vanishing (norm below {VANISH_BELOW:g} at the last captured step): "
                       f"{_count(self.vanishing, self.taps)}: {_listed(self.vanishing, 'from step')}")  # fmt: skip
        if self.exploding:
            out.append(f"exploding (norm above {EXPLODE_ABOVE:g}): "
                       f"{_count(self.exploding, self.taps)}: {_listed(self.exploding, 'from step')}")  # fmt: skip
        if self.without_grad:
            out.append(f"never had a gradient: {_count(self.without_grad, self.taps)}: "
                       f"{_listed(self.without_grad, '')}")  # fmt: skip
        if self.healthy:
            out.append(f"healthy: no NaN/Inf; none of the {self.taps} taps vanishing, exploding or without gradient")
        return out

    def __str__(self) -> str:
        return "\n  ".join(["run summary:", *self.lines()])


def _count(taps: dict[str, Any], total: int) -> str:
    return f"{len(taps)} of {total} tap{'s' if total != 1 else ''}"


def _listed(taps: dict[str, Any], prefix: str) -> str:
    shown = [f"{t} ({prefix} {v})" if prefix else f"{t} ({v})" for t, v in list(taps.items())[:_LIST_AT_MOST]]
    more = len(taps) - _LIST_AT_MOST
    return ", ".join(shown) + (f", and {more} more" if more > 0 else "")


_HEALTH_COLUMNS = ["step", "tap", "call", "norm", "has_grad", "nan_count", "inf_count", "reason"]


def health(directory: Path) -> Health:
    """Read the few columns a summary needs from `directory`'s records and judge them (as `tap_summary` does).

    Example::

        health(Path("outputs/2026-11-23/10-00-00-000000")).healthy    # False: see str() for why
    """
    import pyarrow.parquet as pq

    from gradrunner.analysis.summaries import forward_order, tap_summary  # the one rule for vanishing/exploding

    h = Health(directory=directory)
    steps_file, grads_file = directory / STEPS_FILE, directory / GRADS_FILE
    if steps_file.is_file():
        steps = pq.read_table(steps_file, columns=["step", "loss"]).to_pandas().sort_values("step", kind="stable")
        h.steps = len(steps)
        if len(steps):
            h.loss_first, h.loss_last = float(steps["loss"].iloc[0]), float(steps["loss"].iloc[-1])
            bad = steps.loc[~np.isfinite(steps["loss"].to_numpy(dtype=np.float64)), "step"]
            h.loss_nonfinite_step = int(bad.iloc[0]) if len(bad) else None
    if not grads_file.is_file():
        return h
    names = set(pq.read_schema(grads_file).names)
    df = pq.read_table(grads_file, columns=[c for c in _HEALTH_COLUMNS if c in names]).to_pandas()
    if df.empty:
        return h
    order = forward_order(df)
    labels = {(str(t), int(c)): str(label) for t, c, label in zip(order.tap, order.call, order.label, strict=True)}
    summary = tap_summary(df)
    h.taps = len(summary)
    for row in summary.to_dict("records"):
        label = labels[(str(row["tap"]), int(row["call"]))]
        if row["vanishing"]:
            h.vanishing[label] = int(row["first_vanishing_step"])
        if row["exploding"]:
            h.exploding[label] = int(row["first_exploding_step"])
        if row["steps"] == 0:
            reasons = df.loc[(df["tap"] == row["tap"]) & (df["call"] == row["call"]), "reason"].dropna()
            h.without_grad[label] = str(reasons.iloc[0]) if len(reasons) else "no reason recorded"
    bad_rows = df[(df["nan_count"].fillna(0) > 0) | (df["inf_count"].fillna(0) > 0)]
    if len(bad_rows):
        first = bad_rows[bad_rows["step"] == bad_rows["step"].min()].iloc[0]  # record order within the step
        h.first_nonfinite = (int(first["step"]), labels[(str(first["tap"]), int(first["call"]))])
    return h


def last_word(directory: Path) -> Health:
    """Log the run's health summary (a warning when something is wrong) and return it.

    Example::

        last_word(Path("outputs/2026-11-23/10-00-00-000000"))   # at the end of every run
    """
    h = health(directory)
    (log.info if h.healthy else log.warning)("%s", h)
    return h


def brief(h: Health) -> str:
    """One line for a job of a sweep: its loss, then its trouble (or "healthy").

    Example::

        brief(health(job_dir))   # 'loss 1.95 -> nan; NaN/Inf from step 5 (fc1:output)'
    """
    loss = "no step" if h.loss_first is None else f"loss {h.loss_first:.4g} -> {h.loss_last:.4g}"
    trouble = []
    nonfinite = [s for s in (h.loss_nonfinite_step, h.first_nonfinite and h.first_nonfinite[0]) if s is not None]
    if nonfinite:
        where = f" ({h.first_nonfinite[1]})" if h.first_nonfinite else ""
        trouble.append(f"NaN/Inf from step {min(nonfinite)}{where}")
    for what, taps in (("vanishing", h.vanishing), ("exploding", h.exploding), ("without gradient", h.without_grad)):
        if taps:
            trouble.append(f"{_count(taps, h.taps)} {what}")
    if h.taps == 0:
        trouble.append("no tap captured")
    return f"{loss}; " + (", ".join(trouble) if trouble else "healthy")


def sweep_word(sweep_dir: Path, jobs: list[tuple[str, list[str]]]) -> bool:
    """Log one line per completed job of a sweep (`brief`); a warning when a job is not healthy. True if all are.

    Example::

        sweep_word(Path("multirun/2026-11-23/10-00-00-000000"), [("0", ["capture.strategy=hook"])])
    """
    lines, healthy = [], True
    for job, overrides in jobs:
        h = health(sweep_dir / job)
        healthy &= h.healthy
        lines.append(f"job {job} ({' '.join(overrides) or 'no overrides'}): {brief(h)}")
    if lines:
        (log.info if healthy else log.warning)("%s", "\n  ".join([f"sweep summary ({sweep_dir}):", *lines]))
    return healthy
