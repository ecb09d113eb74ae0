"""What a finished job's records say about it: the health summary that ends every run, and a sweep's.

Reads back only the few columns it needs (pyarrow; no torch) and judges them by the one rule of
`analysis.summaries` (vanishing / exploding taps), so the summary and `tap_summary` never disagree.

| function | what it does |
| --- | --- |
| `health(job_dir)` | `Health`: loss first/last, diverging, NaN/Inf, negative lr, vanishing/exploding taps, taps never with a gradient, taps zeroed by an edit |
| `last_word(job_dir)` | logs that summary at the end of every run (a warning when something is wrong) |
| `brief(h)`, `sweep_word(sweep_dir, jobs, failed)` | one line per job of a sweep (a failed one with its error), logged at the end of the sweep |

Example::

    h = health(Path("outputs/2026-11-23/10-00-00-000000"))
    print(h)               # the summary that ends every run
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gradrunner.records.columns import GRADS_FILE, RECORD_FILES, STEPS_FILE

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
    #: The record files the directory holds (of `grads.parquet`, `steps.parquet`): the summary names only those.
    files: list[str] = field(default_factory=list)
    steps: int = 0
    loss_first: float | None = None
    loss_last: float | None = None
    loss_nonfinite_step: int | None = None
    #: Steps whose loss was recorded (not null: `rec.step()` without a loss, a Trainer's custom `compute_loss`).
    loss_known: int = 0
    #: (step, tap label) of the first record holding a NaN or Inf, in record order.
    first_nonfinite: tuple[int, str] | None = None
    taps: int = 0
    #: tap label -> the first step its norm fell below the threshold (its last norm is below it).
    vanishing: dict[str, int] = field(default_factory=dict)
    #: tap label -> the first step its norm went above the threshold.
    exploding: dict[str, int] = field(default_factory=dict)
    #: tap label -> the reason of its first record (it never had a gradient).
    without_grad: dict[str, str] = field(default_factory=dict)
    #: (the lowest of the first k finite losses, the median of the last k) when the latter is above
    #: `DIVERGE_FACTOR` x the former (k: a tenth of the steps, at least 3; a positive start only).
    loss_diverging: tuple[float, float] | None = None
    loss_level_steps: int = 0  # the steps each end of `loss_diverging` is judged by
    #: (the first step, its rate) when a learning rate of the run was negative (`steps.parquet`'s `lr`).
    negative_lr: tuple[int, float] | None = None
    #: taps whose gradient is exactly 0 at the last captured step because an edit zeroed it (not vanishing):
    #: tap label -> its first step at 0; `zeroing_edits`: the taps whose edit left 0.
    zeroed_by_edit: dict[str, int] = field(default_factory=dict)
    zeroing_edits: list[str] = field(default_factory=list)
    #: The spike detector's last word (`anomaly_summary.spike_lines` of anomalies.parquet): one line per spike.
    spikes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        nonfinite = self.first_nonfinite is not None or self.loss_nonfinite_step is not None
        spiked = any("first to move" in line or "cannot be read" in line for line in self.spikes)  # not lone tap flags
        diverging = self.loss_diverging is not None or self.negative_lr is not None or spiked
        return not (nonfinite or diverging or self.vanishing or self.exploding or self.without_grad or self.taps == 0)

    def lines(self) -> list[str]:
        """The summary, one claim a line (the first says where the records are)."""
        from gradrunner.analysis.summaries import EXPLODE_ABOVE, VANISH_BELOW

        out = [f"records: {self.directory} ({', '.join(self.files)}; read the dir with gradrunner.analysis.load, "
               "a file with pandas.read_parquet)" if self.files else f"records: none in {self.directory}"]  # fmt: skip
        if not self.steps:
            out.append("loss: no step completed")
        elif self.loss_first is None:
            out.append(f"loss: not recorded ({self.steps} steps, each with a null loss): not judged")
        else:
            known = f", the loss recorded at {self.loss_known}" if self.loss_known < self.steps else ""
            out.append(f"loss: {self.loss_first:.6g} at the first step, {self.loss_last:.6g} at the last "
                       f"({self.steps} steps{known})")  # fmt: skip
        if self.loss_diverging is not None:
            start, end = self.loss_diverging
            k = self.loss_level_steps
            out.append(f"loss diverging: {end:.6g} at the end (the median of the last {k} finite steps) against "
                       f"{start:.6g} at the start (the lowest of the first {k}): x{end / start:.3g}")  # fmt: skip
        if self.negative_lr is not None:
            out.append(f"negative learning rate from step {self.negative_lr[0]} (lr {self.negative_lr[1]:.6g}): "
                       "the optimiser climbs the loss")  # fmt: skip
        if self.loss_nonfinite_step is not None or self.first_nonfinite is not None:
            parts = []
            if self.loss_nonfinite_step is not None:
                parts.append(f"the loss from step {self.loss_nonfinite_step}")
            if self.first_nonfinite is not None:
                parts.append(f"gradients from step {self.first_nonfinite[0]}, first in {self.first_nonfinite[1]}")
            out.append("NaN/Inf: " + "; ".join(parts))
        out.extend(self.spikes)
        if self.taps == 0:
            if self.steps:  # else "no step completed" says it all
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
        if self.zeroed_by_edit:
            out.append(f"zero by an edit (the edit on {', '.join(self.zeroing_edits)} leaves a zero gradient; taps "
                       f"upstream get none), not vanishing: {_count(self.zeroed_by_edit, self.taps)}: "
                       f"{_listed(self.zeroed_by_edit, 'from step')}")  # fmt: skip
        if self.healthy:
            out.append(f"healthy: no NaN/Inf, no diverging loss; none of the {self.taps} taps vanishing, exploding "
                       "or without gradient")  # fmt: skip
        return out

    def __str__(self) -> str:
        return "\n  ".join(["run summary:", *self.lines()])


def _count(taps: dict[str, Any], total: int) -> str:
    return f"{len(taps)} of {total} tap{'s' if total != 1 else ''}"


def _listed(taps: dict[str, Any], prefix: str) -> str:
    shown = [f"{t} ({prefix} {v})" if prefix else f"{t} ({v})" for t, v in list(taps.items())[:_LIST_AT_MOST]]
    more = len(taps) - _LIST_AT_MOST
    return ", ".join(shown) + (f", and {more} more" if more > 0 else "")


_HEALTH_COLUMNS = ["step", "tap", "call", "rank", "micro_step", "norm", "has_grad", "nan_count", "inf_count", "reason",
                   "edited", "edited_norm", "numel"]  # fmt: skip
#: The loss is diverging when its level at the end is above this many times its level at the start.
DIVERGE_FACTOR = 2.0


def _level_steps(steps: int) -> int:
    """Steps that set the loss's level at the start (their lowest) and at the end (their median): a tenth of the
    run, at least 3, so one batch's noise is not a trend; 0 (not judged) where the two windows would overlap:
    a falling 2-step run was judged by its own last step as both its start and its end."""
    k = max(3, steps // 10)
    return k if steps >= 2 * k else 0


def _judge_loss(h: Health, steps: Any) -> None:
    """Fill `h`'s loss fields from `steps.parquet`'s rows (step order): first/last, NaN/Inf, diverging, negative lr."""
    h.steps = len(steps)
    if not len(steps):
        return
    if "lr" in steps.columns:
        lr = steps["lr"].to_numpy(dtype=np.float64, na_value=np.nan)
        negative = np.flatnonzero(lr < 0)
        if len(negative):
            h.negative_lr = (int(steps["step"].iloc[negative[0]]), float(lr[negative[0]]))
    known = steps["_loss_known"].to_numpy(dtype=bool) if "_loss_known" in steps.columns else np.ones(len(steps), bool)
    h.loss_known = int(known.sum())
    recorded = steps[known]  # a null loss is not a NaN one: not recorded, so not judged
    if not len(recorded):
        return
    loss = recorded["loss"].to_numpy(dtype=np.float64)
    h.loss_first, h.loss_last = float(loss[0]), float(loss[-1])
    bad = recorded["step"].to_numpy()[~np.isfinite(loss)]
    h.loss_nonfinite_step = int(bad[0]) if len(bad) else None
    finite = loss[np.isfinite(loss)]
    k = _level_steps(len(finite))
    if k:
        start, end = float(finite[:k].min()), float(np.median(finite[-k:]))
        if start > 0 and end > DIVERGE_FACTOR * start:
            h.loss_diverging, h.loss_level_steps = (start, end), k


def health(directory: Path) -> Health:
    """Read the few columns a summary needs from `directory`'s records and judge them (as `tap_summary` does).

    Example::

        health(Path("outputs/2026-11-23/10-00-00-000000")).healthy    # False: see str() for why
    """
    import pyarrow.parquet as pq

    from gradrunner.analysis.summaries import forward_order, tap_summary  # the one rule for vanishing/exploding

    h = Health(directory=directory)
    h.spikes = _spikes(directory)
    steps_file, grads_file = directory / STEPS_FILE, directory / GRADS_FILE
    h.files = [name for name in RECORD_FILES if (directory / name).is_file()]
    if steps_file.is_file():
        wanted = [c for c in ("step", "loss", "lr", "rank") if c in pq.read_schema(steps_file).names]
        table = pq.read_table(steps_file, columns=wanted)
        steps = table.to_pandas()
        if "loss" in table.column_names:  # null (not recorded) and NaN are one value in pandas: told apart here
            steps["_loss_known"] = table.column("loss").is_valid().to_numpy(zero_copy_only=False)
        if "rank" in steps.columns and len(steps):  # under torchrun a row per step and rank: rank 0's loss
            steps = steps[steps["rank"] == steps["rank"].min()]
        _judge_loss(h, steps.sort_values("step", kind="stable"))
    if not grads_file.is_file():
        return h
    names = set(pq.read_schema(grads_file).names)
    df = pq.read_table(grads_file, columns=[c for c in _HEALTH_COLUMNS if c in names]).to_pandas()
    if df.empty:
        return h
    order = forward_order(df)
    labels = {(str(t), int(c)): str(label) for t, c, label in zip(order.tap, order.call, order.label, strict=True)}
    summary = tap_summary(df)  # under torchrun a row per tap and rank: a tap is in trouble when a rank's is
    h.taps = len(summary[["tap", "call"]].drop_duplicates())
    h.zeroing_edits = _zeroing_edits(df)
    steps_with_grad = summary.groupby(["tap", "call"], sort=False)["steps"].transform("sum")
    for row, with_grad in zip(summary.to_dict("records"), steps_with_grad, strict=True):
        label = labels[(str(row["tap"]), int(row["call"]))]
        if row["vanishing"] and h.zeroing_edits and row["last"] == 0.0:
            _earliest(h.zeroed_by_edit, label, row["first_vanishing_step"])
        elif row["vanishing"]:
            _earliest(h.vanishing, label, row["first_vanishing_step"])
        if row["exploding"]:
            _earliest(h.exploding, label, row["first_exploding_step"])
        if with_grad == 0 and label not in h.without_grad:
            reasons = df.loc[(df["tap"] == row["tap"]) & (df["call"] == row["call"]), "reason"].dropna()
            h.without_grad[label] = str(reasons.iloc[0]) if len(reasons) else "no reason recorded"
    bad_rows = df[(df["nan_count"].fillna(0) > 0) | (df["inf_count"].fillna(0) > 0)]
    if len(bad_rows):
        first = bad_rows[bad_rows["step"] == bad_rows["step"].min()].iloc[0]  # record order within the step
        h.first_nonfinite = (int(first["step"]), labels[(str(first["tap"]), int(first["call"]))])
    return h


def _earliest(taps: dict[str, int], label: str, step: Any) -> None:
    """`taps[label]` = `step`, or the earlier of the two (a tap's ranks under torchrun: its first rank in trouble)."""
    taps[label] = min(taps.get(label, int(step)), int(step))


def _spikes(directory: Path) -> list[str]:
    """The spike lines of `directory`'s anomalies.parquet ([] without one; one line when it does not verify)."""

    from gradrunner.analysis.anomaly_summary import spike_lines
    from gradrunner.records.anomalies import ANOMALIES_FILE, read_anomalies_table, settings_of

    if not (directory / ANOMALIES_FILE).is_file():
        return []
    try:
        table = read_anomalies_table(directory)
    except Exception as e:
        return [f"spikes: {ANOMALIES_FILE} cannot be read ({type(e).__name__}: {e})"]
    settings = settings_of(table.schema)
    return spike_lines(table.to_pylist(), int(settings.get("window", 128)))


def _zeroing_edits(df: Any) -> list[str]:
    """The taps whose edit left an exactly zero gradient at the last captured step (`scale: 0`, `dropout: 1`, ...)."""
    if "edited" not in df.columns or "edited_norm" not in df.columns:
        return []
    last = df[df["step"] == df["step"].max()]
    zeroed = last[last["edited"].fillna(False).astype(bool) & (last["edited_norm"] == 0)]
    return list(dict.fromkeys(zeroed["tap"].astype(str)))


def last_word(directory: Path) -> Health:
    """Log the run's health summary (a warning when something is wrong) and return it.

    Example::

        last_word(Path("outputs/2026-11-23/10-00-00-000000"))   # at the end of every run
    """
    h = health(directory)
    (log.info if h.healthy else log.warning)("%s", h)
    return h


def try_last_word(directory: Path) -> Health | None:
    """`last_word` where the run may not have completed (interrupted, failed): the summary of the steps it kept;
    records that cannot be read are a warning saying so, never an error that would hide how the run ended.

    Example::

        except BaseException:
            try_last_word(run_dir)    # 'loss diverging: ...' of the kept steps; then the error propagates
            raise
    """
    try:
        return last_word(directory)
    except Exception as e:  # the summary only reads the records
        log.warning("no run summary: the records in %s could not be read (%s)", directory, " ".join(str(e).split()))
        return None


def brief(h: Health) -> str:
    """One line for a job of a sweep: its loss, then its trouble (or "healthy").

    Example::

        brief(health(job_dir))   # 'loss 1.95 -> nan; NaN/Inf from step 5 (fc1:output)'
    """
    loss = ("no step" if not h.steps else "loss not recorded" if h.loss_first is None
            else f"loss {h.loss_first:.4g} -> {h.loss_last:.4g}")  # fmt: skip
    trouble = []
    nonfinite = [s for s in (h.loss_nonfinite_step, h.first_nonfinite and h.first_nonfinite[0]) if s is not None]
    if nonfinite:
        where = f" ({h.first_nonfinite[1]})" if h.first_nonfinite else ""
        trouble.append(f"NaN/Inf from step {min(nonfinite)}{where}")
    if h.loss_diverging is not None:
        trouble.append(f"loss diverging (x{h.loss_diverging[1] / h.loss_diverging[0]:.3g})")
    if h.negative_lr is not None:
        trouble.append(f"negative lr from step {h.negative_lr[0]}")
    spikes = [line for line in h.spikes if "first to move" in line]
    if spikes:
        trouble.append(f"spikes flagged, the first: {spikes[0].split(' (')[0].split(';')[0]}")
    for what, taps in (("vanishing", h.vanishing), ("exploding", h.exploding), ("without gradient", h.without_grad)):
        if taps:
            trouble.append(f"{_count(taps, h.taps)} {what}")
    if h.taps == 0:
        trouble.append("no tap captured")
    return f"{loss}; " + (", ".join(trouble) if trouble else "healthy")


def sweep_word(
    sweep_dir: Path, jobs: list[tuple[str, list[str]]], failed: Sequence[tuple[str, list[str], str]] = (),
) -> bool:  # fmt: skip
    """Log one line per completed job of a sweep (`brief`) and per failed one (`failed`: dir, overrides, error), in
    job order; a warning when a job is not healthy or failed. True if every job is healthy and none failed.

    Example::

        sweep_word(Path("multirun/2026-11-23/10-00-00-000000"), [("0", ["capture.strategy=hook"])])
    """
    from gradrunner.analysis.labels import natural_key

    lines, healthy = [], not failed
    for job, overrides in jobs:
        h = health(sweep_dir / job)
        healthy &= h.healthy
        lines.append((job, f"job {job} ({' '.join(overrides) or 'no overrides'}): {brief(h)}"))
    for job, overrides, error in failed:
        lines.append((job, f"job {job} ({' '.join(overrides) or 'no overrides'}): failed ({error.rstrip('.')})"))
    if lines:
        ordered = [line for _, line in sorted(lines, key=lambda jl: natural_key(Path(jl[0])))]
        (log.info if healthy else log.warning)("%s", "\n  ".join([f"sweep summary ({sweep_dir}):", *ordered]))
    return healthy
