"""What the spike detector is fed each step, from the loop's host values or from a finished run's records.

Contents:
    step_signals(loss, grad_norm, records, skipped)   -- a step's signals, online (the loop's host values)
    tap_signals(taps, norm, has_grad, update_ratio)   -- THE rule turning a step's tap rows into tap signals
    rank_mean(losses)                                 -- THE loss signal under DDP: the mean of the ranks' losses
    run_signals(grads, steps)                         -- every step's signals, offline, from a run's records
    detect_run(run_dir, detector)                     -- a finished run fed through a detector, as the loop feeds it
    save_anomalies(run_dir, detector, run_id)         -- `anomalies.parquet` from a detector
    finish_anomalies(run_dir, detector, run_id)       -- at a run's close: the file (the last word says its spikes)
    read_anomalies(run_dir)                           -- `anomalies.parquet` as a DataFrame, refused if not this run's

Example::

    det = Detector()
    det.observe(step, step_signals(loss, grad_norm, [records]))      # in the loop, after the step's one transfer
    detect_run(run_dir).anomalies                                    # the same, afterwards, from the records

Online and offline go through `tap_signals`, so a run's `anomalies.parquet` is what `detect_run` rebuilds
from its records. Imports no torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from gradrunner.analysis.anomalies import GRAD_NORM, LOSS, Detector
from gradrunner.analysis.anomaly_summary import anomaly_rows
from gradrunner.analysis.reading import load
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.anomalies import ANOMALIES_FILE, read_anomalies_table, write_anomalies
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, StepRecords

#: The grads columns `run_signals` reads.
TAP_COLUMNS = ["step", "tap", "norm", "has_grad", "update_ratio", "rank"]


def tap_signals(
    taps: Sequence[str], norm: np.ndarray, has_grad: np.ndarray, update_ratio: np.ndarray | None
) -> dict[str, float]:
    """One step's tap rows (every call and micro-batch) as signals, taps in order of first row.

    Example::

        tap_signals(["fc1:output", ":h", ":h"], np.array([2.0, 3.0, 4.0]), np.ones(3, bool), None)
        # {'fc1:output:norm': 2.0, ':h:norm': 5.0}

    - `<tap>:norm`: the norm of all the tap's gradients of the step together (the root of the sum of
      its rows' squared norms: calls and micro-batches), over the rows that have a gradient; absent
      when none has one (a tap not called). A NaN or Inf norm stays one (and is flagged).
    - `<tap>:update_ratio`: parameter taps, the largest finite ratio of its rows; absent where none
      is finite (NaN means "unknown" in the records: activation taps, a parameter of norm 0).
    """
    norms, grad = norm.tolist(), has_grad.tolist()
    ratios = [math.nan] * len(norms) if update_ratio is None else update_ratio.tolist()
    out: dict[str, float] = {}
    if len(set(taps)) == len(taps):  # one row per tap (the usual case): no grouping
        for tap, n, g, r in zip(taps, norms, grad, ratios, strict=True):
            if g:
                out[tap + ":norm"] = n
            if r == r and r not in (math.inf, -math.inf):
                out[tap + ":update_ratio"] = r
        return out
    rows: dict[str, list[int]] = {}
    for i, tap in enumerate(taps):
        rows.setdefault(tap, []).append(i)
    for tap, at in rows.items():
        got = [norms[i] for i in at if grad[i]]
        if got:
            out[tap + ":norm"] = got[0] if len(got) == 1 else _root_sum_square(got)
        finite = [ratios[i] for i in at if math.isfinite(ratios[i])]
        if finite:
            out[tap + ":update_ratio"] = max(finite)
    return out


def _root_sum_square(values: list[float]) -> float:
    """sqrt(sum(v^2)), scaled so that no square overflows; NaN/Inf when one is."""
    big = max(abs(v) for v in values)
    if not math.isfinite(big) or any(v != v for v in values):
        return math.nan if any(v != v for v in values) else math.inf
    if big == 0:
        return 0.0
    return big * math.sqrt(math.fsum((v / big) ** 2 for v in values))


def step_signals(
    loss: float | None, grad_norm: float | None, records: Iterable[StepRecords] = (), skipped: bool = False
) -> dict[str, float]:
    """The signals of one step, from what the loop has on the host after the step's one transfer.

    Example::

        step_signals(0.41, 2.3, [recs])          # {'loss': 0.41, 'grad_norm': 2.3, 'fc1:output:norm': ..., ...}
        step_signals(0.41, 2.3)                  # a step that is not captured: no tap signal

    `records`: the step's `StepRecords`, one per backward of a captured step (one per micro-batch
    under accumulation), none on other steps. `loss` / `grad_norm` None: absent. On a step the
    GradScaler skipped (fp16 overflow: `skipped`), only the loss is a signal: the infinite gradients
    are the scaler's business, and the update ratios of a step not taken are 0.
    """
    out: dict[str, float] = {} if loss is None else {LOSS: float(loss)}
    if skipped:
        return out
    if grad_norm is not None:
        out[GRAD_NORM] = float(grad_norm)
    recs = [r for r in records if len(r)]
    if not recs:
        return out
    taps = [k.tap for r in recs for k in r.keys]
    norm = np.concatenate([np.asarray(r.stats["norm"], np.float64) for r in recs])
    has_grad = np.concatenate([np.asarray(r.has_grad, bool) for r in recs])
    ratios = [
        np.full(len(r), np.nan) if r.update_ratio is None else np.asarray(r.update_ratio, np.float64) for r in recs
    ]
    out.update(tap_signals(taps, norm, has_grad, np.concatenate(ratios)))
    return out


def rank_mean(losses: Sequence[float | None]) -> float | None:
    """THE loss signal of a step under DDP: the mean of the ranks' losses (in rank order), online and offline.

    Example::

        rank_mean([0.25, 714.0])      # 357.125: a spike on rank 1 is the step's spike
        rank_mean([0.5])              # 0.5: one process, its loss as it is

    Ranks without a loss (None) are left out; None when no rank has one. A NaN or Inf loss stays one.
    """
    present = [float(v) for v in losses if v is not None]
    return sum(present) / len(present) if present else None


def run_signals(grads: pd.DataFrame | None, steps: pa.Table) -> Iterator[tuple[int, dict[str, float]]]:
    """Every step's signals from a run's records, as `step_signals` gives them online; steps in order.

    Example::

        for step, values in run_signals(load(run_dir, columns=TAP_COLUMNS), steps_table):
            det.observe(step, values)

    `grads`: the grads rows (`TAP_COLUMNS`; None for a run without captured steps); `steps`: the steps
    table as Arrow (a null loss or grad_norm is absent, a NaN one is NaN: pandas would tell neither
    apart). The loss is the mean of the ranks' losses of the step (`rank_mean`, as the loop feeds it under
    DDP); everything else is rank 0's rows (the rows of the rank that runs the detector).
    """
    n = steps.num_rows
    col = {c: steps.column(c).to_pylist() if c in steps.column_names else [None] * n
           for c in ("step", "loss", "grad_norm", "skipped", "rank")}  # fmt: skip
    if grads is not None and "rank" in grads.columns:
        grads = grads[grads["rank"].fillna(0) == 0]
    by_step = {} if grads is None or grads.empty else dict(iter(grads.groupby("step", sort=False)))
    ranks_loss: dict[object, list[tuple[int, float | None]]] = {}
    for step, loss, rank in zip(col["step"], col["loss"], col["rank"], strict=True):
        ranks_loss.setdefault(step, []).append((rank or 0, loss))
    for step, _, grad_norm, skipped, rank in zip(*col.values(), strict=True):
        if rank not in (0, None):
            continue
        loss = rank_mean([v for _, v in sorted(ranks_loss[step], key=lambda rv: rv[0])])
        values = step_signals(loss, grad_norm, skipped=skipped is True)
        rows = by_step.get(step)
        if rows is not None and skipped is not True:
            ratio = rows["update_ratio"].to_numpy(np.float64) if "update_ratio" in rows.columns else None
            values.update(tap_signals(rows["tap"].tolist(), rows["norm"].to_numpy(np.float64),
                                      rows["has_grad"].to_numpy(bool), ratio))  # fmt: skip
        yield int(step), values


def detect_run(run_dir: str | os.PathLike[str], detector: Detector | None = None) -> Detector:
    """A finished run's records fed through `detector` (default: `Detector()`), step by step; the detector.

    Example::

        det = detect_run("outputs/2026-11-23/10-00-00-000000")
        det.anomalies, summary_lines(det.anomalies, det.window, det.taps())

    Reads verified records (`load`, and `rundir.read_verified` for the steps table, whose nulls
    matter); a file that does not verify is one paragraph (`GradrunnerError`).
    """
    directory = Path(run_dir)
    det = detector if detector is not None else Detector()
    path = directory / STEPS_FILE
    if not path.is_file():
        raise GradrunnerError(f"{directory} is not a run dir (no {STEPS_FILE}); pass the dir of one run")
    try:
        steps = rundir.read_verified(path, rundir.job_state(directory).marker)
    except rundir.Damaged as e:
        raise GradrunnerError(f"cannot read the steps of {directory}: {str(e).rstrip('.')}. Re-run it with "
                              "resume=true, or move it away") from e  # fmt: skip
    # The run's own file (a dir below it, e.g. a replay, is not this run's records).
    grads = load(directory / GRADS_FILE, columns=TAP_COLUMNS) if (directory / GRADS_FILE).is_file() else None
    for step, values in run_signals(grads, steps):
        det.observe(step, values)
    return det


def save_anomalies(
    run_dir: str | os.PathLike[str], detector: Detector, run_id: str, order: Sequence[str] | None = None
) -> Path:
    """Write the detector's anomalies to `<run_dir>/anomalies.parquet` (with first movers and the settings).

    Example::

        save_anomalies(run_dir, det, run_id)      # at the end of the run, before done.json

    `order`: the taps' tie-break order for `first_mover` (default: the order the detector first saw them).
    """
    order = detector.taps() if order is None else order
    return write_anomalies(
        run_dir, anomaly_rows(detector.anomalies, detector.window, order), run_id, detector.settings()
    )


def finish_anomalies(run_dir: str | os.PathLike[str], detector: Detector, run_id: str, rebuild: bool = False) -> None:
    """At a run's close (every path): the detector's `anomalies.parquet`, which the run's last word
    (`health.last_word`) then reads to say each spike (`spike_lines`), once.

    Example::

        finish_anomalies(run_dir, det, run_id)     # then health.last_word(run_dir): '... loss spike at step 40 ...'

    `rebuild`: the detector did not see every step (a resumed run): a fresh one with its settings is fed
    the run's closed records first (`detect_run`: the same rule, the same values).
    """
    if rebuild:
        detector = detect_run(run_dir, Detector(**detector.settings()))
    order = detector.taps()
    rows = anomaly_rows(detector.anomalies, detector.window, order)
    write_anomalies(run_dir, rows, run_id, detector.settings())


def read_anomalies(run_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """`<run_dir>/anomalies.parquet` as a DataFrame (one row per flagged value), verified as `load` verifies records.

    Example::

        read_anomalies(run_dir).query("signal == 'loss'")[["step", "z", "first_tap", "lead"]]

    A missing file, or one that does not verify (damaged, or of another run: its `run_id` column or
    metadata is not the run's), is one paragraph (`GradrunnerError`) naming it and the fix; its rows
    are never returned.
    """
    directory = Path(run_dir)
    path = directory / ANOMALIES_FILE
    rebuild = (f"rebuild it from the run's records with gradrunner.analysis.anomaly_signals.detect_run('{directory}') "
               "and save_anomalies")  # fmt: skip
    try:
        table = read_anomalies_table(directory)
    except FileNotFoundError as e:
        raise GradrunnerError(f"no {ANOMALIES_FILE} in {directory}: the run was made without spike detection "
                              f"(or is not a run dir); {rebuild}") from e  # fmt: skip
    except Exception as e:  # rundir.Damaged, or what pyarrow raises on a damaged footer
        why = str(e) if isinstance(e, rundir.Damaged) else f"{type(e).__name__}: {one_paragraph(e)}"
        raise GradrunnerError(
            f"cannot read {path} (the run {directory}): {why.rstrip('.')}. Its rows are not returned "
            f"(damaged: truncated, overwritten or flipped bytes; or swapped in from another run); move it away and {rebuild}."
        ) from e
    return table.to_pandas()
