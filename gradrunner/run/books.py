"""A run's books in its run dir: the lock, what a rerun may do there (refuse, skip, resume), the markers it writes.

Contents:
    RunLock(dir, run_id)         -- the exclusive lock a run holds on its run dir for its whole life
    Refused, LiveRun             -- a run refused because of what its dir holds, or because a live run holds it
    prepare(dir, cfg, resume)    -- before a job writes: "run" (after removing partial records) or "skip"
    mark_complete(dir, ...)      -- write `done.json` (row counts, footer digests) once the records are closed
    mark_failed(dir, error)      -- write `failed.json` (the CLI and the sweep callback do, for a failed job)
    restore_hydra(dir, snapshot) -- THE one way `.hydra/` is put back for a job that did not run

The read-only side (job state, markers read, verification, which folders are jobs) is
`gradrunner.records.rundir`; this side knows the config (OmegaConf) and the process. Whether two configs
give the same records is `run.config_compare`.

Example::

    with RunLock(job_dir, run_id):
        if prepare(job_dir, cfg, resume=True) == "run":
            ...   # train, then mark_complete(job_dir, cfg, files=..., run_id=run_id, world_size=1, overrides=[])
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
import yaml
from omegaconf import DictConfig

from gradrunner.errors import GradrunnerError
from gradrunner.records.atomic import write_atomically
from gradrunner.records.checkpoint_files import CHECKPOINT_DIR, LEGACY_STATE, MANIFEST, read_manifest
from gradrunner.records.columns import LOCK_FILE
from gradrunner.records.locking import Held, read_owner, take, write_owner
from gradrunner.records.rundir import (
    DONE,
    FAILED,
    _present,
    _temps,
    footer_digest,
    read_marker,
    verify_job,
    write_json,
)
from gradrunner.run.config_compare import config_dict, config_diff

log = logging.getLogger(__name__)


def mark_complete(
    directory: Path, cfg: DictConfig, *, files: list[str], run_id: str, world_size: int, overrides: list[str]
) -> Path:
    """Write `done.json`: the job's records (`files`) are closed and whole. Call it last.

    Example::

        mark_complete(job_dir, cfg, files=list(RECORD_FILES), run_id=rid, world_size=1, overrides=[])

    It records each file's row count and `footer_digest`, which `verify_job` (a resume) and
    `analysis.load` check.
    """
    return write_json(
        directory / DONE,
        {
            "status": "completed",
            "run_id": run_id,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "rows": {f: pq.read_metadata(directory / f).num_rows for f in files},
            "footers": {f: footer_digest(directory / f) for f in files},
            "world_size": world_size,
            "overrides": overrides,
            "config": config_dict(cfg),
        },
    )


def mark_failed(directory: Path, error: str) -> Path:
    """Write `failed.json` with the job's error message (one paragraph).

    Example::

        mark_failed(job_dir, "capture.strategy='bogus' is not allowed; ...")
    """
    return write_json(directory / FAILED, {"status": "failed", "error": " ".join(error.split())})


def _clean(directory: Path) -> list[str]:
    """Remove a job's records, markers, temp files and report; return the names removed.

    Only called with the dir's `RunLock` held: any temp file here belongs to a run that is dead.
    """
    names = [DONE, *_present(directory), FAILED, *_temps(directory, DONE), *_temps(directory, FAILED), "report.html"]
    names += sorted(p.name for p in directory.glob("report-*.png"))
    removed = []
    for name in names:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # a done.json that is a directory: damage, removed like a file
            removed.append(name)
        elif os.path.lexists(path):
            path.unlink()
            removed.append(name)
    return removed


def checkpoint_held(directory: Path) -> str | None:
    """The mid-run checkpoint in `directory`, as a message names it; None when there is none.

    Example::

        checkpoint_held(job_dir)     # 'a mid-run checkpoint after step 5 (.checkpoint/)'

    A checkpoint is there once one was written (`checkpoint.json`, or an older gradrunner's
    `state.pt`); a `.checkpoint/` folder without either holds only a killed run's open segment.
    """
    folder = directory / CHECKPOINT_DIR
    if not ((folder / MANIFEST).exists() or (folder / LEGACY_STATE).exists()):
        return None
    manifest, _ = read_manifest(directory)
    if manifest is None:
        return f"a mid-run checkpoint that does not verify ({CHECKPOINT_DIR}/)"
    return f"a mid-run checkpoint after step {int(manifest['step']) - 1} ({CHECKPOINT_DIR}/)"


def _drop_checkpoint(directory: Path) -> list[str]:
    """Remove the checkpoint of a job that completed (it is stale); the names removed."""
    folder = directory / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    shutil.rmtree(folder, ignore_errors=True)
    return [f"{CHECKPOINT_DIR}/"]


def prepare(directory: str | os.PathLike[str], cfg: DictConfig, *, resume: bool) -> Literal["run", "skip"]:
    """Decide what a job does with its dir before writing: "run" (the dir is clean), or "skip" (done).

    Example::

        prepare(job_dir, cfg, resume=True)    # 'skip' when job_dir/done.json holds the same config

    Without records there, "run". With records (or a mid-run checkpoint) and `resume=False`, a
    GradrunnerError (records are never overwritten, a checkpoint never silently resumed). With
    `resume=True`: a completed job of the same config is skipped (a stale checkpoint there removed);
    of a different config, a GradrunnerError naming the differences; anything else (partial records, no
    completion marker, a failure) is removed and the job runs again, from its mid-run checkpoint when
    one is there and verifies (`run.checkpoint`), else from step 0.
    """
    d = Path(directory)
    present = _present(d)
    checkpoint = checkpoint_held(d)
    marker, damage = read_marker(d)
    if damage is not None and resume:
        log.warning("%s: %s; the job runs again (removed: %s)", d, damage, ", ".join(_clean(d)))
        return "run"
    if not present and marker is None and damage is None and checkpoint is None:
        _clean(d)  # a stale failure record of a job that failed before writing anything
        return "run"
    if not resume:
        what = "a completed run" if marker else "a run that did not complete (interrupted, failed or killed)"
        way = "skip it" if marker else (
            "delete its partial records and run it again (from its last mid-run checkpoint if it has one, else "
            "from step 0)"
        )
        held = [*present, *([checkpoint] if checkpoint and not marker else [])] or [DONE]
        raise Refused(
            f"the run dir {d} already holds records ({', '.join(held)}) of {what}; gradrunner never "
            f"overwrites records. Run into a new dir (drop hydra.run.dir=... or choose another), or pass "
            f"resume=true to {way}."
        )
    if marker is not None:
        diff = config_diff(marker.get("config") or {}, config_dict(cfg))
        if diff:
            raise Refused(
                f"{d} holds a completed run of a different config ({'; '.join(diff)}); its records are kept and "
                "this job did not run. Use a new dir for the new config (hydra.sweep.dir=... or hydra.run.dir=...), "
                "or run the original config there to resume."
            )
        problem = verify_job(d, marker)
        if problem is None:
            (d / FAILED).unlink(missing_ok=True)  # a failure record left by an earlier attempt, if any
            if _drop_checkpoint(d):
                log.info("%s: removed the mid-run checkpoint of the completed run (%s/)", d, CHECKPOINT_DIR)
            log.info("%s already completed (%s): skipped; its records are kept", d, DONE)
            return "skip"
        removed = _clean(d) + _drop_checkpoint(d)
        log.warning("%s is marked completed but %s: its records are not trusted (removed: %s); running again",
                    d, problem, ", ".join(removed))  # fmt: skip
        return "run"
    removed = _clean(d)
    if checkpoint is not None:
        log.warning("%s: resuming the run that did not complete there from %s, if it verifies (removed its partial "
                    "records: %s)", d, checkpoint, ", ".join(removed) or "none")  # fmt: skip
        return "run"
    log.warning("%s held partial records of an earlier attempt (%s): removed; running again", d, ", ".join(removed))
    return "run"


#: Hydra's files in a job dir (`hydra.output_subdir`'s default), rewritten by Hydra before a job starts.
HYDRA_DIR = ".hydra"


def hydra_snapshot(directory: Path) -> dict[str, str]:
    """The text of `<directory>/.hydra/*.yaml`, by file name: what `restore_hydra` puts back."""
    found: dict[str, str] = {}
    hydra_dir = directory / HYDRA_DIR
    for f in sorted(hydra_dir.glob("*.yaml")) if hydra_dir.is_dir() else []:
        try:
            found[f.name] = f.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue
    return found


def restore_hydra(directory: Path, snapshot: dict[str, Any]) -> None:
    """THE one way `.hydra/` is put back: each file of `snapshot` whose text differs is rewritten atomically.

    Example::

        restore_hydra(job_dir, owner["hydra"])    # Hydra rewrote .hydra/ for a job that then did not run

    Hydra writes a job's `.hydra/` before the job can look at its dir; a job that then does not run
    (another live run holds the dir, or it holds a completed run) puts back what the dir's owner had.
    Failures are ignored: the files only serve humans, `load()` labels from the records.
    """
    for name, text in snapshot.items():
        path = directory / HYDRA_DIR / str(name)
        if not isinstance(text, str) or "/" in str(name):
            continue
        try:
            if path.read_text(encoding="utf-8") == text:
                continue
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            write_atomically(path, text)


class Refused(GradrunnerError):
    """A run refused because of what its run dir holds; the dir is left as it was."""


class LiveRun(Refused):
    """A run refused because another run, still alive, holds the run dir's lock; `owner` is its lock record."""

    def __init__(self, message: str, owner: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.owner: dict[str, Any] = owner or {}

    def holder_overrides(self) -> list[str] | None:
        """The live run's task overrides, from the `.hydra/overrides.yaml` its lock record keeps; None if unknown."""
        if isinstance(self.owner.get("held_by"), dict):  # a refused run holds it for a moment: whose it is is unknown
            return None
        text = (self.owner.get("hydra") or {}).get("overrides.yaml")
        try:
            found = yaml.safe_load(text) if isinstance(text, str) else None
        except yaml.YAMLError:
            return None
        return [str(o) for o in found] if isinstance(found, list) else None


class RunLock:
    """The exclusive lock a run holds on its run dir, from before it looks at the dir to after `done.json`.

    Example::

        with RunLock(job_dir, run_id):     # LiveRun if another live process holds job_dir
            prepare(job_dir, cfg, resume=True); train(...); mark_complete(...)

    An `fcntl.flock` on `<dir>/.gradrunner.lock`, which holds the owner's host, pid, start time and run
    id for messages, written as soon as the lock is taken, inside `_gate` (a refused run reads it inside the
    gate too, so it names its holder, or says the record does not read). The kernel drops the lock when its process dies (SIGKILL, a preempted node's
    processes), so a dead owner never blocks a resume. It works between processes of one machine;
    on NFS, Linux emulates `flock` with byte-range locks that every client sees (given a working lock
    manager); on a filesystem without locks (Lustre mounted `noflock`) the run goes on unlocked,
    with a warning; Lustre mounted `localflock` locks per node only.
    """

    def __init__(self, directory: str | os.PathLike[str], run_id: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.run_id = run_id
        self._fd: int | None = None
        self._created = False
        self._put_back = False  # leave_no_trace ran: the previous record goes back as the lock is let go
        #: The lock file's record of the run that held the dir before this one ({} if none).
        self.previous: dict[str, Any] = {}

    def __enter__(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        hydra = hydra_snapshot(self.directory)  # before the lock: the owner record is written as soon as it is taken
        with _gate(self.directory):
            self._fd = self._take()
            self.previous = {k: v for k, v in read_owner(self._fd).items() if k != "held_by"}
            # The owner's `.hydra/` goes into the lock file too: a later run refused here puts it back.
            write_owner(self._fd, {**self._me(), "hydra": hydra})
        return self

    def _take(self) -> int:
        """Flock the lock file (`locking.take`); LiveRun, naming the holder, if a live run holds it."""
        try:
            unlocked = "running without the run-dir lock, so nothing stops a second run into this dir"
            fd, self._created = take(self.path, unlocked)
        except Held as held:  # its record is whole and the holder's: it wrote it inside the gate we hold
            restore_hydra(self.directory, held.owner.get("hydra") or {})  # Hydra rewrote the live run's .hydra/
            raise LiveRun(self._refusal(held.owner), held.owner) from None
        return fd

    def _me(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id,
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip

    def leave_no_trace(self) -> None:
        """The run did not run here: put back the previous owner's `.hydra/` and lock record (or remove the lock
        file if this run created it), so that a refused or skipped run leaves the dir as it found it. Until this
        run lets go, the record names it as the holder (`held_by`), so that a refusal meanwhile names it; letting go
        puts the previous record back as it was."""
        if self._fd is None:
            return
        if self._created:
            self.path.unlink(missing_ok=True)  # still locked: a run that opened it meanwhile retries (inode check)
            return
        restore_hydra(self.directory, self.previous.get("hydra") or {})
        with _gate(self.directory):
            write_owner(self._fd, {**self.previous, "held_by": self._me()})
        self._put_back = True  # the previous record as it was, when this run lets go

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            if self._put_back:  # a refused or skipped run: the record byte for byte as it found it
                with _gate(self.directory):
                    write_owner(self._fd, self.previous)
            os.close(self._fd)  # releases the lock; the file stays (removing it would race with a waiting run)
            self._fd = None

    def _refusal(self, owner: dict[str, Any]) -> str:
        by = owner.get("held_by")
        held: dict[str, Any] = by if isinstance(by, dict) else owner
        if all(held.get(k) is not None for k in ("host", "pid", "started", "run_id")):
            who = f"host {held['host']}, pid {held['pid']}, started {held['started']}, run id {held['run_id']}"
            stop = f"stop it (kill {held['pid']} on {held['host']})"
            if held["pid"] == os.getpid() and held["host"] == socket.gethostname():  # not a process to kill: ours
                stop = ("close it (it is this very process's: a `with record(...)` block, a callback's session or a "
                        "job still open in it)")  # fmt: skip
        else:  # a record the disk refused, or one an older gradrunner was writing
            who = f"its owner record in {self.path} could not be read, so it cannot be named"
            stop = "stop it (a process holding that file: `fuser` or `lsof` names it)"
        return (
            f"the run dir {self.directory} is in use by a live run ({who}); gradrunner lets one run at a time "
            f"write a run dir, and this one did not run and changed nothing there. Wait for that run to end, "
            f"{stop}, or run into another dir (hydra.run.dir=... or hydra.sweep.dir=..., record()'s run_dir, a "
            f"callback's dir). The lock ({self.path}) is "
            "held only while that process lives, so a killed run never blocks resume=true."
        )


@contextlib.contextmanager
def _gate(directory: Path) -> Iterator[None]:
    """A short exclusive flock on the run dir itself around taking the lock and writing (or reading) the owner
    record: a run refused by the lock reads the record its holder wrote, whole, never the one before it. Where
    the filesystem has no locks on dirs the gate is skipped (the record is still written in one pwrite)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the gate goes with the fd
