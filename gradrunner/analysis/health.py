"""What a finished job's records say about it: the health summary that ends every run, and a sweep's.

Reads back only the few columns it needs (pyarrow; no torch) and judges them by the one rule of
`analysis.summaries` (vanishing / exploding taps), so the summary and `tap_summary` never disagree.

| function | what it does |
| --- | --- |
| `health(job_dir)` | `Health`: loss first/last, NaN/Inf, vanishing/exploding taps, taps never with a gradient |
| `last_word(job_dir)` | logs that summary at the end of every run (a warning when something is wrong) |
| `brief(h)`, `sweep_word(sweep_dir, jobs)` | one line per job of a sweep, logged at the end of the sweep |

Example::

    h = health(Path("outputs/2026-11-23/10-00-00-000000"))
    print(h)               # the summary that ends every run
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradrunner.records.columns import GRADS_FILE, STEPS_FILE

log = logging.getLogger(__name__)

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
