"""The TensorBoard target: event files per job (`to_tensorboard`), and live logging from `record()` (`LiveTensorBoard`).

Needs the `tensorboard` package only (`gradrunner[tensorboard]`), imported when a function runs.

Example::

    to_tensorboard(jobs("runs/mine"), Path("runs/mine/tensorboard"))
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.errors import GradrunnerError
from gradrunner.export.jobs import MARKER, Job, exclusive, grad_scalars, source_of, tag_prefix
from gradrunner.records.atomic import write_atomically
from gradrunner.records.columns import COUNT_COLUMNS, EXTRA_FLOAT_COLUMNS, STAT_COLUMNS, is_temp_of, temp_name

#: The names TensorBoard's event files start with.
_EVENTS = "events.out.tfevents."
#: Where `record(..., log_to="tensorboard")` logs live, in the run dir.
LIVE_DIR = "tensorboard"
#: The event file an export writes, under its temp name (`columns.temp_name`: hidden, and without "tfevents",
#: so TensorBoard, which reads only files named so, never reads it half-written).
_STAGING = "gradrunner-export.events"


def to_tensorboard(all_jobs: Sequence[Job], out: Path) -> list[Path]:
    """One event file per job under `out/<job>`; scalars, histograms and the hparams plugin's records.

    Example::

        to_tensorboard(jobs("runs/mine"), Path("runs/mine/tensorboard"))   # [Path('runs/mine/tensorboard/run')]

    A re-export replaces a job's event files: TensorBoard reads every event file of a dir, so appending
    would draw every point twice. The new file is written in full beside them under a hidden name without
    "tfevents" (`_STAGING`), which TensorBoard does not read, then swapped in (`_swap_in`): an export
    killed partway leaves the previous one as it was and nothing TensorBoard shows (the next export removes
    it). Each job's dir holds a marker naming the job dir it was exported from: another job's export there
    is kept, and this job is written to `out/<job>-<8 hex of its dir>` instead (`target_dirs`).

    One export at a time writes `out` (`jobs.exclusive`): a second one is a GradrunnerError naming the first.
    """
    with exclusive(out, "TensorBoard"):  # one export at a time: another one's temp file is not a killed export's
        targets = target_dirs(all_jobs, out)  # before anything is written
        for job, target in zip(all_jobs, targets, strict=True):
            _write_job(job, target)
    return targets


def _write_job(job: Job, target: Path) -> None:
    """Write `job`'s event file in full under its temp name in `target`, then swap it in."""
    shutil.rmtree(target.parent / f".{target.name}.gradrunner-export", ignore_errors=True)  # an older gradrunner's
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():  # a killed export's (the lock is held: no live export's)
        if is_temp_of(old.name, _STAGING):
            old.unlink(missing_ok=True)
    staged = target / temp_name(_STAGING, str(os.getpid()))
    try:
        _write_events(job, staged)
        _swap_in(staged, target, json.dumps({"source": source_of(job), "run_id": job.run_id}))
    finally:
        staged.unlink(missing_ok=True)


def _write_events(job: Job, path: Path) -> None:
    """Write `job`'s event file (what `EventFileWriter` writes: a version record, then one event per value) to `path`."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    now = time.time()
    with path.open("wb") as f:
        writer = RecordWriter(f)
        writer.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        for s in _hparams_summaries(job.params):
            writer.write(Event(wall_time=now, step=0, summary=s).SerializeToString())
        for tag, step, value in job.scalars:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            writer.write(Event(wall_time=now, step=step, summary=summary).SerializeToString())
        for tag, step, limits, counts in job.histograms:
            nz = [(lim, c) for lim, c in zip(limits, counts, strict=True) if c]
            histo = HistogramProto(min=0.0, max=max((lim for lim, _ in nz), default=0.0), num=float(sum(counts)),
                                   bucket_limit=limits, bucket=[float(c) for c in counts])  # fmt: skip
            summary = Summary(value=[Summary.Value(tag=tag, histo=histo)])
            writer.write(Event(wall_time=now, step=step, summary=summary).SerializeToString())
        f.flush()
        os.fsync(f.fileno())


def target_dirs(all_jobs: Sequence[Job], out: Path) -> list[Path]:
    """Each job's dir under `out`: `out/<job>`, unless that holds another job dir's export (its marker says
    whose); then `out/<job>-<8 hex of the job dir>`. A dir this job's export already holds is reused.

    Example::

        target_dirs(jobs("runs/b"), Path("tb"))     # [Path('tb/run-3f2a9c0d')] when tb/run holds runs/a's export

    A dir with event files and no marker (an export by an older gradrunner) is replaced as before.
    """
    taken: set[Path] = set()
    targets = []
    for job in all_jobs:
        source = source_of(job)
        plain, own = out / job.name, out / f"{job.name}-{hashlib.sha256(source.encode()).hexdigest()[:8]}"
        holders = {d: _holder(d) for d in (plain, own)}
        mine = [d for d in (plain, own) if holders[d] == source and d not in taken]
        free = [d for d in (plain, own) if holders[d] is None and d not in taken]
        if not mine and not free:
            raise GradrunnerError(f"cannot export {job.directory} to TensorBoard: {plain} and {own} hold other jobs' "
                                  "exports (or are not directories); pass another --out.")  # fmt: skip
        targets.append((mine or free)[0])
        taken.add(targets[-1])
    return targets


def _holder(target: Path) -> str | None:
    """Whose export `target` holds: the job dir its marker names; None when free (no dir, or no marker: empty or
    an older gradrunner's export); "" when it cannot be told (not a dir, a marker that does not read)."""
    if not target.exists():
        return None
    if not target.is_dir():
        return ""
    try:
        marker = json.loads((target / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""
    return str(marker.get("source", "")) if isinstance(marker, dict) else ""


def _swap_in(staged: Path, target: Path, marker: str) -> None:
    """Replace `target`'s event files with `staged` (written in full) and its marker with `marker` (other files left).

    The marker goes first: a target never holds this job's events under another job's marker, or none. The old
    event files go before the new one comes in: a kill between the two leaves no events, never two exports' points.
    """
    write_atomically(target / MARKER, marker)
    for old in target.glob(f"{_EVENTS}*"):
        old.unlink()
    os.replace(staged, target / f"{_EVENTS}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.gradrunner")


def _hparams_summaries(params: dict[str, str]) -> Iterator[Any]:
    """The hparams plugin's experiment and session-start records (what `SummaryWriter.add_hparams` writes)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    for k, v in params.items():
        start.hparams[k].string_value = v
    experiment = api_pb2.Experiment(hparam_infos=[api_pb2.HParamInfo(name=k, type=api_pb2.DATA_TYPE_STRING) for k in params])
    for tag, content in (("_hparams_/experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment, version=0)),
                         ("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start, version=0))):  # fmt: skip
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString()))
        yield Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def _read_first(logdir: Path, now: int) -> None:
    """Rename the event files in `logdir` started in second `now` or later (a session killed and resumed within one
    second, a clock set back) to the second before it: TensorBoard reads a dir's files in name order, the second
    each was started in first, so a file the resumed session starts now is read after them (its purge too)."""
    for old in sorted(logdir.glob(f"{_EVENTS}*")):
        stamp, _, rest = old.name[len(_EVENTS):].partition(".")
        if stamp.isdigit() and int(stamp) >= now:
            os.replace(old, old.with_name(f"{_EVENTS}{now - 1:010d}.{rest}"))


def drop_live_log(run_dir: Path) -> list[str]:
    """Remove the live log's event files of `run_dir` (records deleted with `overwrite=True`); what was removed.

    Exports written below it (`<run_dir>/tensorboard/<job>/`) are the user's and are left.
    """
    found = sorted((run_dir / LIVE_DIR).glob(f"{_EVENTS}*"))
    for old in found:
        old.unlink()
    return [f"{LIVE_DIR}/{old.name}" for old in found]


class LiveTensorBoard:
    """Live logging from `record(..., log_to="tensorboard")`: each captured step's statistics as it is written.

    Example::

        live = LiveTensorBoard(run_dir / "tensorboard")
        live.write(step, records)      # the host-side StepRecords the writer just took: no device sync
        live.write_step(step, [micro_0, micro_1], loss)   # separate micro-batch records: one value per tap and step
        live.close()

    Tags are the export's (`grads/<tap>/<stat>`, `steps/loss`), so a live log and a later export agree. The
    event file is opened at the first step written: at step 0 (a run from the start, an overwritten run's
    dir too) the event files already in `logdir` are removed first; at a later step (a resumed run) a
    `SessionLog(START)` event at that step makes TensorBoard drop the earlier session's points from it on.
    Either way each step is drawn once.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        self._writer: Any = None

    def _open(self, step: int) -> Any:
        """The writer, opened for a first step `step`: the event files of an earlier session reconciled first."""
        if self._writer is not None:
            return self._writer
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if step == 0:  # the whole run is written again: an earlier session's points are not this run's
            for old in self.logdir.glob(f"{_EVENTS}*"):
                old.unlink()
        else:
            _read_first(self.logdir, int(time.time()))
        self._writer = EventFileWriter(str(self.logdir))
        if step > 0:  # resumed: TensorBoard purges the points at steps >= `step` it read before this event (the
            # earlier files: it reads a dir's event files in name order, the second each was started in first)
            self._writer.add_event(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        return self._writer

    def write(self, step: int, recs: Any, loss: float | None) -> None:
        if any(m is not None for m in (getattr(recs, "micro_step", None) or ())):  # a step of several micro-batches
            self._write_combined(step, [{**recs.row(i), "step": step, "rank": 0} for i in range(len(recs))], loss)
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for i, key in enumerate(recs.keys):
            prefix = tag_prefix(key.tap, key.call, 0)
            for c in STAT_COLUMNS:
                if recs.has_grad[i]:
                    values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(recs.stats[c][i])))
            for c in COUNT_COLUMNS:
                values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(recs.counts[c][i])))
            for c in EXTRA_FLOAT_COLUMNS:
                col = getattr(recs, c)
                if col is not None and math.isfinite(float(col[i])):
                    values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(col[i])))
        if loss is not None:  # NaN kept, as the export keeps it
            values.append(Summary.Value(tag="steps/loss", simple_value=float(loss)))
        self._open(step).add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def write_step(self, step: int, micro: Sequence[Any], loss: float | None) -> None:
        """One event for a step whose records came in several micro-batches (`micro`, in order), combined.

        Example::

            live.write_step(step, [recs_micro_0, recs_micro_1], loss)   # one value per tap, as the export writes

        The micro-batches are combined as `analysis.micro.combine_micro_steps` combines them (the whole
        batch's gradient); one part is `write` itself.
        """
        if len(micro) == 1:
            self.write(step, micro[0], loss)
            return
        rows = [{**r.row(i), "step": step, "rank": 0, "micro_step": m} for m, r in enumerate(micro) for i in range(len(r))]
        self._write_combined(step, rows, loss)

    def _write_combined(self, step: int, rows: list[dict[str, Any]], loss: float | None) -> None:
        """One event from a step's record rows over its micro-batches (`micro_step` set), combined per tap."""
        import pandas as pd
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        per_step = combine_micro_steps(pd.DataFrame(rows).drop(columns=["values", "shape"], errors="ignore"))
        values = [Summary.Value(tag=t, simple_value=v) for t, _, v in grad_scalars(per_step)]
        if loss is not None:
            values.append(Summary.Value(tag="steps/loss", simple_value=float(loss)))
        self._open(step).add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
