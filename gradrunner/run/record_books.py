"""What `record()` and the callbacks do with a run dir that already holds records: refuse, overwrite or resume.

The runner's rule (`books.prepare`) speaks of `hydra.run.dir` and `resume=true`; `record()` and the
Lightning/HF callbacks have their own two options, `resume=True` and `overwrite=True`, and this module
is their rule:

- an empty dir (or one that never got records) is used as it is;
- `overwrite=True`: the records, markers and report there are deleted and the session starts again;
- `resume=True`: the records of a session that did not complete (an exception, Ctrl-C, a train()
  that raised; the files were closed) are continued: the new session keeps their rows of the steps
  before the one training resumes at (`rec.start_at(step)`; the callbacks pass the framework's
  restored step, Lightning `ckpt_path=`, HF `resume_from_checkpoint`; by default the step after the
  last one recorded) and writes the rest, so the run dir ends as an uninterrupted run's. A killed
  session's files have no footer, but the steps it closed into live segments (`.live/<run id>/`, every
  `live_every` steps) are continued the same way once they verify. A completed run (`done.json`) is not
  resumed, nor records of other options or of another model (the taps resolved to other names or parameter
  shapes), each named; a resume at a step after the last one kept is refused
  (those steps' records would be missing);
- neither: one paragraph naming these two options.

Example::

    kept = prepare(run_dir, config, resume=True, overwrite=False, who="record()")   # with the dir's lock held
    ...   # open the writers, then carry(kept, start, grads_writer, steps_writer, run_id)
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records.columns import GRADS_FILE, KEPT_PREFIX, RECORD_FILES, STEPS_FILE
from gradrunner.records.critical import deferred_signals
from gradrunner.records.rundir import DONE, _present, read_marker
from gradrunner.records.segments import LIVE_DIR, SegmentDamaged, SegmentsGone, read_segments, segment_number
from gradrunner.records.table_writer import write_whole
from gradrunner.run import books
from gradrunner.run.config_compare import config_dict, config_diff
from gradrunner.run.session_log import LOG_FILE

log = logging.getLogger(__name__)


@dataclass
class Kept:
    """The records of an interrupted session that this one continues (in their kept files until carried)."""

    directory: Path
    next_step: int
    carried: bool = False

    def path(self, name: str) -> Path:
        return self.directory / f"{KEPT_PREFIX}{name}"

    def drop(self) -> None:
        """The new session's files are closed: the kept copies are no longer needed."""
        for name in RECORD_FILES:
            self.path(name).unlink(missing_ok=True)

    def settle(self) -> bool:
        """The new session's files are closed: drop the kept copies if they were carried into them, else put them
        back as they were (a session that ended before its first step wrote none of their rows). True if put back."""
        if self.carried:
            if all((self.directory / n).is_file() for n in RECORD_FILES):
                self.drop()
            return False
        for name in RECORD_FILES:
            if self.path(name).is_file():
                os.replace(self.path(name), self.directory / name)
        return True


def _options(who: str) -> str:
    return f"{who} with resume=True (continue the records of the run that did not complete) or overwrite=True"


def _table(name: str) -> str:
    """The segments' name of a record file's table (`grads.parquet` -> `grads`)."""
    return name.removesuffix(".parquet")


def killed_segments(directory: Path, last_run: str | None) -> Path | None:
    """The live segments (`.live/<run id>/`) the session that last held `directory` left, or None.

    Example::

        killed_segments(run_dir, lock.previous.get("run_id"))     # run_dir/.live/9f2c...  (a killed session's)

    A session that ended, however, removed its own; with the dir's lock held, segments still there are
    a killed session's: the steps it closed (its record files have no footer).
    """
    if not last_run:
        return None
    where = directory / LIVE_DIR / str(last_run)
    try:
        names = [e.name for e in os.scandir(where)]
    except OSError:
        return None
    # a flush writes steps' segment last: one there means the steps it closed have their grads rows too
    return where if any(segment_number(n, _table(STEPS_FILE)) is not None for n in names) else None


def _segment_tables(directory: Path, where: Path, who: str) -> dict[str, pa.Table]:
    """A killed session's closed steps from its segments, verified: the steps of `steps.parquet`'s segments and
    the grads rows of those steps (a kill between two tables' segments leaves grads rows of a step not closed)."""
    tables: dict[str, pa.Table] = {}
    for name in RECORD_FILES:
        try:
            found = read_segments(directory, where.name, _table(name))
        except (SegmentsGone, SegmentDamaged, OSError) as e:
            raise books.Refused(
                f"resume=True: the records in {directory} cannot be continued: the live segments a killed session "
                f"left in {where} do not verify ({one_paragraph(e)}). Pass {who} overwrite=True to record from step 0 "
                "there, or record into a new dir."
            ) from e
        if found is None:
            raise books.Refused(
                f"resume=True: the records in {directory} cannot be continued: the live segments a killed session "
                f"left in {where} hold no {_table(name)} segment. Pass {who} overwrite=True to record from step 0 "
                "there, or record into a new dir."
            )
        tables[name] = found
    closed = tables[STEPS_FILE].column("step")
    grads = tables[GRADS_FILE]
    if grads.num_rows:
        tables[GRADS_FILE] = grads.filter(pc.is_in(grads.column("step"), value_set=closed))
    return tables


def _held(directory: Path, present: list[str], kept_copies: list[str], killed: Path | None, done: bool) -> str:
    """What the dir holds, as a refusal names it: the files that are really there."""
    held = list(present) + [f"{KEPT_PREFIX}{n}" for n in kept_copies]
    if kept_copies:
        held[-1] += " (the records a resumed session kept aside before it was killed)"
    if killed is not None:
        held.append(f"{killed.relative_to(directory)}/ (the closed steps of a killed session)")
    return ", ".join(held + ([DONE] if done else []))


def prepare(
    directory: Path, config: DictConfig, *, resume: bool, overwrite: bool, who: str, last_run: str | None = None,
    taps: Mapping[str, tuple[int, ...] | None] | None = None,
) -> Kept | None:  # fmt: skip
    """Before a session writes into `directory` (its lock held): None to start from step 0, or what it resumes.

    Example::

        prepare(run_dir, config, resume=False, overwrite=True, who="record()")   # None: the old records deleted

    `last_run`: the run id of the session that held the dir before this one (its lock record), whose live
    segments a kill left. `taps`: this session's resolved taps and, where known (a parameter's), their shapes:
    a resume of records whose taps differ (another model) is refused. Raises `books.Refused` (one paragraph
    naming `resume=`/`overwrite=` of `who`) where the dir holds records this session may not touch.
    """
    kept_copies = [n for n in RECORD_FILES if (directory / f"{KEPT_PREFIX}{n}").is_file()]
    present = _present(directory)
    # a plain session leaves a killed one's segments where they are (never read: not the live run's)
    killed = killed_segments(directory, last_run) if resume or overwrite else None
    marker, damage = read_marker(directory)
    if (not present and not kept_copies and killed is None and marker is None and damage is None
            and books.checkpoint_held(directory) is None):  # fmt: skip
        books._clean(directory)  # a stale failure record, nothing else
        return None
    if overwrite:
        removed = books._clean(directory) + books._drop_checkpoint(directory)
        for n in kept_copies:
            (directory / f"{KEPT_PREFIX}{n}").unlink()
        if (directory / LIVE_DIR).is_dir():  # killed sessions' segments: their records too
            shutil.rmtree(directory / LIVE_DIR, ignore_errors=True)
            removed.append(f"{LIVE_DIR}/")
        if (directory / LOG_FILE).is_file():  # the log of the records deleted: the new session starts its own
            (directory / LOG_FILE).unlink()
            removed.append(LOG_FILE)
        from gradrunner.export.tensorboard import drop_live_log  # no tensorboard import: file names only

        removed += drop_live_log(directory)  # its points are the deleted records' (a run from a later step kept them)
        log.warning("overwrite=True: deleted the records of the earlier run in %s (%s); recording from step 0",
                    directory, ", ".join(removed + kept_copies) or "none")  # fmt: skip
        return None
    held = _held(directory, present, kept_copies, killed, marker is not None or damage is not None)
    if not resume:
        if marker is not None:
            raise books.Refused(
                f"the run dir {directory} already holds records ({held}) of a completed run; gradrunner never "
                f"overwrites records silently. Pass {who} overwrite=True (delete them and record from step 0), or "
                "record into a new dir (resume=True continues only a run that did not complete)."
            )
        raise books.Refused(
            f"the run dir {directory} already holds records ({held}) of a run that did not complete (interrupted, "
            f"failed or killed); gradrunner never overwrites records silently. Pass {_options(who)} (delete them "
            "and record from step 0), or record into a new dir."
        )
    if marker is not None:
        raise books.Refused(
            f"the run dir {directory} holds a completed run ({DONE}); resume=True continues only a run that did not "
            f"complete. Pass {who} overwrite=True instead of resume=True to record it again, or record into a new dir."
        )
    return _kept(directory, config, who, killed, taps)


def _kept(
    directory: Path, config: DictConfig, who: str, killed: Path | None = None,
    taps: Mapping[str, tuple[int, ...] | None] | None = None,
) -> Kept:  # fmt: skip
    """Move the interrupted session's closed files aside (hidden) after checking they read and match `config`.

    `killed`: a killed session's live segments, which hold its closed steps (a resumed one's carried rows
    first): they are the records continued, written as the kept copies."""
    tables: dict[str, pa.Table] = {} if killed is None else _segment_tables(directory, killed, who)
    for name in RECORD_FILES if killed is None else ():
        source = directory / name if (directory / name).is_file() else directory / f"{KEPT_PREFIX}{name}"
        try:
            tables[name] = pq.ParquetFile(source, page_checksum_verification=True).read()  # every page's CRC
        except (OSError, pa.ArrowException) as e:
            raise books.Refused(
                f"resume=True: the records in {directory} cannot be continued: {name} does not read "
                f"({one_paragraph(e)}); a process that was killed leaves its files without their footer, a damaged "
                f"one fails its pages' checksums. Pass {who} overwrite=True to record from step 0 there, or record "
                "into a new dir."
            ) from e
    problem = _not_one_run(tables)
    if problem:
        raise books.Refused(
            f"resume=True: the records in {directory} cannot be continued: {problem}; they are kept and nothing was "
            f"written. Pass {who} overwrite=True to record from step 0 there, or record into a new dir."
        )
    raw = (tables[GRADS_FILE].schema.metadata or {}).get(b"gradrunner.config")
    old = OmegaConf.to_container(OmegaConf.create(raw.decode())) if raw else {}
    assert isinstance(old, dict), old
    diff = config_diff({str(k): v for k, v in old.items()}, config_dict(config)) if old else []
    if diff:
        raise books.Refused(
            f"resume=True: {directory} holds records of other options ({'; '.join(diff)}); they are kept and nothing "
            f"was written. Resume with the same options, pass {who} overwrite=True, or record into a new dir."
        )
    changed = _other_taps(tables[GRADS_FILE], taps)
    if changed:
        raise books.Refused(
            f"resume=True: {directory} holds records of other taps ({'; '.join(changed)}): the same tap specs resolve "
            f"to other tensors in this model, so it is not the model those records were made of; they are kept and "
            f"nothing was written. Resume with that model, pass {who} overwrite=True, or record into a new dir."
        )
    steps = tables[STEPS_FILE].column("step").to_pylist()
    for name in RECORD_FILES:
        kept = directory / f"{KEPT_PREFIX}{name}"
        if killed is not None:  # whole, then renamed: a kill here leaves the segments or the copies
            write_whole(tables[name], kept.with_name(f"{kept.name}.tmp"))
            os.replace(kept.with_name(f"{kept.name}.tmp"), kept)
        elif (directory / name).is_file():
            os.replace(directory / name, kept)
    if killed is not None:
        shutil.rmtree(killed, ignore_errors=True)
    books._clean(directory)  # markers of the interrupted run, temp files of a killed one
    log.warning("resume=True: continuing the %d recorded step(s) of the run that did not complete in %s",
                len(steps), directory)  # fmt: skip
    return Kept(directory, next_step=max(steps) + 1 if steps else 0)


def _other_taps(grads: pa.Table, taps: Mapping[str, tuple[int, ...] | None] | None) -> list[str]:
    """How the kept records' taps differ from this session's resolved `taps` (names; shapes where given)."""
    if taps is None or not grads.num_rows:
        return []
    kept = {str(t) for t in pc.unique(grads.column("tap")).to_pylist()}
    out = []
    for which, names in (("only the records have", kept - set(taps)), ("only this session has", set(taps) - kept)):
        if names:
            listed = sorted(names)
            out.append(f"{which} {', '.join(listed[:6])}{f' and {len(listed) - 6} more' if len(listed) > 6 else ''}")
    for tap, shape in sorted(taps.items()):
        if shape is None or tap not in kept:
            continue
        rows = grads.filter(pc.equal(grads.column("tap"), tap)).column("shape").to_pylist()
        shapes = {tuple(r) for r in rows if r is not None}
        if shapes and tuple(shape) not in shapes:
            out.append(f"{tap} has the shape {list(min(shapes))} there, {list(shape)} here")
    return out


def _not_one_run(tables: dict[str, pa.Table]) -> str | None:
    """Why the two tables are not the records of one session (one run id in both; the grads' steps among the
    steps'), or None. A file copied in from another run, or a table a damaged footer shortened, is named."""
    ids = {name: set(pc.unique(t.column("run_id")).to_pylist()) for name, t in tables.items()}
    for name, found in ids.items():
        if len(found) > 1:
            return f"{name} holds the rows of {len(found)} runs ({', '.join(sorted(map(str, found)))})"
    if ids[GRADS_FILE] and ids[STEPS_FILE] and ids[GRADS_FILE] != ids[STEPS_FILE]:
        return (f"{GRADS_FILE} holds the rows of run {next(iter(ids[GRADS_FILE]))} and {STEPS_FILE} those of run "
                f"{next(iter(ids[STEPS_FILE]))}: one of them is another run's")  # fmt: skip
    extra = set(pc.unique(tables[GRADS_FILE].column("step")).to_pylist()) - set(tables[STEPS_FILE].column("step").to_pylist())  # fmt: skip
    if extra:
        return f"{GRADS_FILE} holds steps {sorted(extra)[:5]} that {STEPS_FILE} lacks"
    return None


def check_fresh_start(directory: Path, start: int, *, resume: bool, who: str) -> None:
    """A session with no earlier records to continue begins at step `start` (a training restored from a checkpoint).

    Example::

        check_fresh_start(run_dir, 7, resume=False, who="record()")   # a warning: the records begin at step 7

    Under `resume=True` that is refused: the records of steps 0..start-1 would be missing from a run dir
    meant to hold the whole run (a session killed before it closed a live segment leaves none). Without
    it the records begin at `start`, as asked, and the session's log says so.
    """
    if start <= 0:
        return
    if resume:
        raise books.Refused(
            f"resume=True: {directory} holds no records to continue, but training resumes at step {start}: the "
            f"records of steps 0..{start - 1} would be missing (a session killed before it closed its first live "
            f"segment, every live_every steps, leaves none). Train from step 0 to record them, or pass resume=False "
            f"to {who} to record from step {start} knowingly (the records then begin there)."
        )
    log.warning("the records in %s begin at step %d, where training starts (rec.start_at): steps 0..%d are not "
                "recorded there", directory, start, start - 1)  # fmt: skip


def carry(kept: Kept, start: int, grads: Any, steps: Any, run_id: str) -> None:
    """Write the kept rows of the steps before `start` into this session's writers (as this run's rows).

    Example::

        carry(kept, trainer.global_step, grads_writer, steps_writer, run_id)   # once, before the first step

    A gap (`start` after the step following the last recorded one) is refused: those steps' records
    would be missing without a word.
    """
    if kept.carried:
        return
    if start > kept.next_step:
        raise GradrunnerError(
            f"resume=True: the records in {kept.directory} end at step {kept.next_step - 1} but training resumes at "
            f"step {start}: the records of steps {kept.next_step}..{start - 1} would be missing. Resume training from "
            "a checkpoint at or before the last recorded step, or record into a new dir."
        )
    rows = {}
    for name, writer in ((GRADS_FILE, grads), (STEPS_FILE, steps)):
        table = pq.read_table(kept.path(name))
        table = table.filter(pc.less(table.column("step"), start))
        at = table.schema.get_field_index("run_id")
        table = table.set_column(at, "run_id", pa.array([run_id] * table.num_rows, pa.string()))
        rows[name] = table.select(writer.schema.names).cast(writer.schema)
    with deferred_signals():  # both tables get the same steps, or neither
        for name, writer in ((GRADS_FILE, grads), (STEPS_FILE, steps)):
            for batch in rows[name].to_batches():
                writer.write_batch(batch)
            writer.steps_written += rows[STEPS_FILE].num_rows
    kept.carried = True
    if start < kept.next_step:
        log.info("resume=True: kept the records of steps 0..%d; steps from %d are recorded again", start - 1, start)
