"""A sweep's catalogue: one SQLite file in the sweep dir listing every job that ended, written as jobs end.

Contents:
    CATALOGUE                    -- `catalogue.sqlite`, in the sweep dir
    JobRow                       -- one job: dir, number, overrides, status, run id, rows, files, error, fingerprint
    record_job(sweep_dir, row)   -- insert or replace the row of `row.dir`, in one transaction
    record_jobs(sweep_dir, rows) -- the same for several rows, in one transaction
    read_jobs(sweep_dir)         -- every row, or None when there is no catalogue (or it is damaged, or held)
    stamps(dir, files)           -- size and modification time of a completed job's record files, for its row
    still_complete(sweep, row)   -- THE rule for when a catalogue row may stand for its job dir (None: it may)

Each job writes its own row when it ends (`cli.sweep_books.SweepBookkeeping.on_job_end`, in the job's
process, whichever launcher), so the catalogue is safe under concurrent writers: every write is one
SQLite transaction (`BEGIN IMMEDIATE`, rollback journal), and the file is never rewritten whole. An
access waits at most `LOCK_WAIT_S` for another process's transaction; one that gives up names the
process holding the lock (`/proc/locks`), and later accesses of the same process do not wait again
until one succeeds: a stuck holder costs a sweep one wait, not one per job. SQLite's locks are the filesystem's POSIX locks: on a local disk and on NFS with a
working lock manager they hold; where they do not, the catalogue is only a shortcut. Everything it
says can be rebuilt from the job dirs (`done.json`, `failed.json`): the sweep manifest falls back to
scanning them, and a job that is not listed, or listed with another config fingerprint, is
composed and checked the slow way. A damaged file (not SQLite, another layout, a missing column,
rows that do not parse) is moved aside (`catalogue.sqlite.damaged-<pid>`) once, with a warning, never
trusted; the jobs of the next run write their rows anew, so the run after it gets the shortcut back.

The catalogue is a cache of the job dirs: a row stands for its job only while `still_complete`
says so (the dir still completed by the same run, no `failed.json`, each record file of the same
size and modification time as when the row was written and with the footer `done.json` pinned).
Anything else sends the job the slow way, where the job verifies its files itself and re-runs
when they do not verify.

Read it with Python's `sqlite3` or pandas::

    import sqlite3, pandas as pd
    pd.read_sql("select * from jobs", sqlite3.connect("multirun/2026-11-24/12-00-00-000000/catalogue.sqlite"))

Example::

    record_job(sweep_dir, JobRow(dir="3", num=3, overrides=["seed=3"], status="completed", run_id="ab12", rows=22))
    {r.dir: r.status for r in read_jobs(sweep_dir) or []}     # {'3': 'completed'}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradrunner.records import rundir

log = logging.getLogger(__name__)

#: The catalogue's file name, in the sweep dir.
CATALOGUE = "catalogue.sqlite"
#: The layout of the `jobs` table (`PRAGMA user_version`); version 1 (no `stamps`) is read and upgraded in
#: place by the next write; any other version is treated as damage.
VERSION = 2
#: How long an access waits for another process's transaction before giving up, in seconds. A healthy
#: transaction holds the lock for milliseconds; the catalogue is a shortcut, never worth a long wait.
LOCK_WAIT_S = 10.0

_COLUMNS = ("dir", "num", "overrides", "status", "run_id", "rows", "files", "error", "fingerprint", "finished",
            "stamps")  # fmt: skip
_CREATE = """
create table if not exists jobs (
    dir text primary key,   -- the job dir, relative to the sweep dir (posix)
    num integer,            -- hydra.job.num
    overrides text not null,-- JSON list: the job's task overrides, as given
    status text not null,   -- completed | failed
    run_id text,
    rows integer,           -- record rows in all files of a completed job
    files text not null,    -- JSON list of its record files
    error text,             -- a failed job's error, one paragraph
    fingerprint text,       -- the config sources the job was composed from (run.sweep_plan); null: unknown
    finished text,          -- when the row was written, ISO 8601 UTC
    stamps text             -- JSON {file: "<size>:<mtime_ns>"} of a completed job's record files (`stamps`)
)
"""


@dataclass(frozen=True)
class JobRow:
    """One job of the catalogue.

    Example::

        JobRow(dir="0", num=0, overrides=["+experiment=mlp", "seed=0"], status="completed", run_id="9f2c", rows=22)
    """

    dir: str
    num: int | None
    overrides: list[str]
    status: str
    run_id: str | None = None
    rows: int | None = None
    files: list[str] = field(default_factory=list)
    error: str | None = None
    fingerprint: str | None = None
    finished: str | None = None
    #: `stamps(dir, files)` when the row was written: how `still_complete` sees a file changed since.
    stamps: dict[str, str] | None = None

    def key(self) -> tuple[str, ...]:
        """The overrides, order-free: how a job of a re-run finds its row."""
        return tuple(sorted(self.overrides))


class _Damaged(Exception):
    """The catalogue file is not a catalogue this version can read."""


class CatalogueBusy(sqlite3.OperationalError):
    """Another process held the catalogue's lock for longer than `LOCK_WAIT_S`; the message names it."""


#: The catalogues (resolved paths) whose lock an access of this process gave up on, with who held it: later
#: accesses try once without waiting, until one succeeds.
_GAVE_UP: dict[str, str] = {}
#: SQLite's words for a lock another connection holds.
_BUSY = ("database is locked", "database table is locked", "database schema is locked", "database is busy")
#: SQLite's words for a failure of the disk or the process, not of the file's content: never moved aside.
_NOT_DAMAGE = ("disk i/o error", "database or disk is full", "unable to open", "readonly database", "out of memory",
               "interrupted")  # fmt: skip


@contextlib.contextmanager
def _connect(path: Path) -> Iterator[sqlite3.Connection]:
    wait = 0.0 if str(path.resolve()) in _GAVE_UP else LOCK_WAIT_S
    con = sqlite3.connect(path, timeout=wait, isolation_level=None)
    try:
        yield con
    finally:
        con.close()


def _busy(error: BaseException) -> bool:
    return isinstance(error, sqlite3.OperationalError) and any(w in str(error).lower() for w in _BUSY)


def _not_damage(error: BaseException) -> bool:
    """A lock, a full or failing disk: the file may be fine, so it is never moved aside for this."""
    return _busy(error) or (isinstance(error, sqlite3.OperationalError)
                            and any(w in str(error).lower() for w in _NOT_DAMAGE))  # fmt: skip


def holder(path: Path) -> str:
    """Who holds the SQLite lock on `path`: `pid N (command line)` from `/proc/locks`, or why that is unknown.

    Example::

        holder(sweep_dir / CATALOGUE)     # 'pid 4242 (python -m gradrunner -m ...) on this machine'
    """
    try:
        st = os.stat(path)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = [line.replace("->", " ").split() for line in f]
    except OSError:
        return "another process (this system does not list its file locks)"
    pids = sorted({int(p[4]) for p in lines if len(p) > 5 and p[1] == "POSIX" and p[5] == key
                   and p[4].lstrip("-").isdigit() and int(p[4]) not in (-1, os.getpid())})  # fmt: skip
    if not pids:
        return "a process this machine does not list (on another machine sharing the file system, or in a container)"
    described = []
    for pid in pids[:3]:
        try:
            command = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split())
        except OSError:
            command = ""
        described.append(f"pid {pid}" + (f" ({command[:160]})" if command else ""))
    return ", ".join(described) + " on this machine"


def _gave_up(path: Path) -> str:
    """Remember that this process gave up waiting for `path`'s lock, and say who holds it."""
    who = holder(path)
    key = str(path.resolve())
    waited = "again (not waiting: an earlier access waited already)" if key in _GAVE_UP else f"for {LOCK_WAIT_S:g} s"
    _GAVE_UP[key] = who
    return (f"the sweep catalogue {path} is locked by {who}; gave up waiting {waited}. The catalogue is only a "
            "shortcut: the job dirs are read instead. If that process is stuck, end it; its lock goes with it")


def _succeeded(path: Path) -> None:
    _GAVE_UP.pop(str(path.resolve()), None)


def _columns_of(con: sqlite3.Connection, *, create: bool) -> tuple[str, ...]:
    """Check (and, writing, create or upgrade) the `jobs` table; the columns it has, in `_COLUMNS` order."""
    version = con.execute("pragma user_version").fetchone()[0]
    if version == 0 and create:
        con.execute(_CREATE)
        con.execute(f"pragma user_version = {VERSION}")
        return _COLUMNS
    if version not in (1, VERSION):
        raise _Damaged(f"its layout version is {version}, this gradrunner reads version {VERSION}")
    tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
    if "jobs" not in tables:
        raise _Damaged("it has no jobs table")
    have = {str(r[1]) for r in con.execute("pragma table_info(jobs)")}
    wanted = _COLUMNS if version == VERSION else _COLUMNS[:-1]
    if set(wanted) - have:
        raise _Damaged(f"its jobs table lacks the column(s) {', '.join(sorted(set(wanted) - have))}")
    if version == 1 and create:  # the layout before `stamps`: upgraded in place, inside the writer's transaction
        con.execute("alter table jobs add column stamps text")
        con.execute(f"pragma user_version = {VERSION}")
        return _COLUMNS
    return wanted


def record_job(sweep_dir: str | os.PathLike[str], row: JobRow) -> None:
    """Insert or replace the row of `row.dir` in `<sweep_dir>/catalogue.sqlite`, in one transaction.

    Example::

        record_job(sweep_dir, JobRow(dir="1", num=1, overrides=["seed=1"], status="failed", error="..."))

    Raises `OSError` or `sqlite3.Error` when the file cannot be written (the caller logs it: a job's
    records never depend on its catalogue row); `CatalogueBusy`, naming the process, when another one
    held the lock for `LOCK_WAIT_S`. A damaged catalogue is moved aside and started anew.
    """
    record_jobs(sweep_dir, [row])


def record_jobs(sweep_dir: str | os.PathLike[str], rows: Sequence[JobRow]) -> None:
    """`record_job` for several rows, in one transaction (a catalogue rebuilt from the job dirs).

    Example::

        record_jobs(sweep_dir, [JobRow(dir=str(n), num=n, overrides=[f"seed={n}"], status="completed") for n in range(3)])
    """
    path = Path(sweep_dir) / CATALOGUE
    values = [(r.dir, r.num, json.dumps(r.overrides), r.status, r.run_id, r.rows, json.dumps(r.files), r.error,
               r.fingerprint, r.finished, None if r.stamps is None else json.dumps(r.stamps)) for r in rows]  # fmt: skip
    if not values:
        return
    for attempt in (1, 2):
        found = _inode(path)
        try:
            with _connect(path) as con:
                con.execute("begin immediate")
                try:
                    _columns_of(con, create=True)
                    con.executemany(f"insert or replace into jobs ({', '.join(_COLUMNS)}) "
                                    f"values ({', '.join('?' * len(_COLUMNS))})", values)  # fmt: skip
                    con.execute("commit")
                except BaseException:
                    if con.in_transaction:
                        con.execute("rollback")
                    raise
            _succeeded(path)
            return
        except (_Damaged, sqlite3.DatabaseError, ValueError) as e:
            if _busy(e):
                raise CatalogueBusy(_gave_up(path)) from None
            if _not_damage(e) or attempt == 2:
                raise
            _move_aside(path, " ".join(str(e).split()), found)


def read_jobs(sweep_dir: str | os.PathLike[str]) -> list[JobRow] | None:
    """Every row of `<sweep_dir>/catalogue.sqlite`, ordered by job number; None without a (readable) catalogue.

    Example::

        rows = read_jobs("multirun/2026-11-24/12-00-00-000000")
        sum(r.status == "completed" for r in rows or [])      # 10000

    A damaged file (not SQLite, another layout, a missing column, rows that do not parse) is moved
    aside with a warning and None is returned: callers then read the job dirs themselves. A lock held
    for longer than `LOCK_WAIT_S`, or a failing disk, is a warning (naming the lock's holder) and None.
    """
    path = Path(sweep_dir) / CATALOGUE
    if not path.is_file():
        return None
    found = _inode(path)
    try:
        with _connect(path) as con:
            columns = _columns_of(con, create=False)
            raw = con.execute(f"select {', '.join(columns)} from jobs order by num, dir").fetchall()
        rows = [_row(r, columns) for r in raw]
    except (_Damaged, sqlite3.DatabaseError, ValueError, TypeError) as e:
        if _busy(e):
            log.warning("%s", _gave_up(path))
        elif _not_damage(e):
            log.warning("could not read the sweep catalogue %s (%s); reading the job dirs instead", path, e)
        else:
            _move_aside(path, " ".join(str(e).split()), found)
        return None
    _succeeded(path)
    return rows


def _row(raw: tuple[Any, ...], columns: tuple[str, ...]) -> JobRow:
    data = dict(zip(columns, raw, strict=True))
    overrides, files = json.loads(data.pop("overrides")), json.loads(data.pop("files"))
    raw_stamps = data.pop("stamps", None)
    stamps = json.loads(raw_stamps) if raw_stamps is not None else None
    if not (isinstance(overrides, list) and isinstance(files, list) and isinstance(data["dir"], str)
            and (stamps is None or isinstance(stamps, dict))):  # fmt: skip
        raise ValueError(f"a row that is not a job: {raw!r}")
    return JobRow(overrides=[str(o) for o in overrides], files=[str(f) for f in files],
                  stamps=None if stamps is None else {str(k): str(v) for k, v in stamps.items()}, **data)  # fmt: skip


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _move_aside(path: Path, why: str, found: int | None) -> None:
    """Move the damaged catalogue aside, unless another process did already (the file there is another one)."""
    if found is None or _inode(path) != found:
        return  # moved aside (and perhaps started anew) by another process meanwhile
    aside = path.with_name(f"{path.name}.damaged-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process moved it first
        return
    log.warning("the sweep catalogue %s is damaged (%s): moved to %s; the job dirs are read instead, and the "
                "catalogue is written anew as jobs end", path, why, aside.name)  # fmt: skip


def stamps(directory: Path, files: Sequence[str]) -> dict[str, str]:
    """`<size>:<mtime in ns>` of each record file of a completed job: what its catalogue row remembers.

    Example::

        stamps(job_dir, ["grads.parquet", "steps.parquet"])    # {'grads.parquet': '20731:1764...', ...}
    """
    found = {}
    for name in files:
        with contextlib.suppress(OSError):
            found[name] = _stamp(os.stat(directory / name))
    return found


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}"


def still_complete(sweep_dir: str | os.PathLike[str], row: JobRow, *, files: bool = True) -> str | None:
    """THE rule for when a catalogue row stands for its job: None when it does, else why not (a sentence).

    Example::

        still_complete(sweep_dir, row)     # 'grads.parquet is missing'; None: the job need not run again

    The row must say completed, and its dir must still be a completed job (`rundir.job_state`: a
    `done.json` gradrunner wrote, no `failed.json`) of the row's run id. With `files` (what a re-run
    trusts before skipping the job), each record file `done.json` names must also be there with the
    size and modification time the row recorded and the footer `done.json` pinned (`footer_digest`,
    the file's last bytes): deleted, truncated, overwritten or swapped files are caught without
    reading their pages. A job that fails this goes the slow way, where it verifies every page and
    runs again if they do not verify. The manifest (`files=False`) reports what the markers say.
    """
    if row.status != "completed":
        return f"the catalogue lists it {row.status}"
    directory = Path(sweep_dir) / row.dir
    state = rundir.job_state(directory)
    if state.status != "completed" or state.marker is None:
        return f"its dir holds no completed run ({state.status})"
    if state.marker.get("run_id") != row.run_id:
        return f"its dir holds run {state.marker.get('run_id')}, not run {row.run_id} of the catalogue"
    if not files:
        return None
    footers = state.marker.get("footers")
    for name in [str(f) for f in state.marker["files"]]:
        try:
            st = os.stat(directory / name)
        except OSError:
            return f"{name} is missing"
        if row.stamps is not None and row.stamps.get(name, _stamp(st)) != _stamp(st):
            return f"{name} changed since the job completed (its size or modification time)"
        if isinstance(footers, dict) and name in footers and rundir.footer_digest(directory / name) != footers[name]:
            return f"{name} is not the file {rundir.DONE} recorded (its size or footer changed)"
    return None
