"""A sweep's catalogue: one SQLite file in the sweep dir listing every job that ended, written as jobs end.

Contents:
    CATALOGUE                    -- `catalogue.sqlite`, in the sweep dir
    JobRow                       -- one job: dir, number, overrides, status, run id, rows, files, error, fingerprint
    record_job(sweep_dir, row)   -- insert or replace the row of `row.dir`, in one transaction
    record_jobs(sweep_dir, rows) -- the same for several rows, in one transaction
    read_jobs(sweep_dir)         -- every row, or None when there is no catalogue (or it is damaged)

Each job writes its own row when it ends (`cli.sweep_books.SweepBookkeeping.on_job_end`, in the job's
process, whichever launcher), so the catalogue is safe under concurrent writers: every write is one
SQLite transaction (`BEGIN IMMEDIATE`, rollback journal, a 60 s busy timeout), and the file is never
rewritten whole. SQLite's locks are the filesystem's POSIX locks: on a local disk and on NFS with a
working lock manager they hold; where they do not, the catalogue is only a shortcut. Everything it
says can be rebuilt from the job dirs (`done.json`, `failed.json`): the sweep manifest falls back to
scanning them, and a job that is not listed, or listed with another config fingerprint, is
composed and checked the slow way. A damaged file is moved aside (`catalogue.sqlite.damaged-<pid>`)
with a warning, never trusted.

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

log = logging.getLogger(__name__)

#: The catalogue's file name, in the sweep dir.
CATALOGUE = "catalogue.sqlite"
#: The layout of the `jobs` table (`PRAGMA user_version`); another version is treated as damage.
VERSION = 1
#: How long a writer waits for another one's transaction before giving up, in seconds.
BUSY_TIMEOUT_S = 60.0

_COLUMNS = ("dir", "num", "overrides", "status", "run_id", "rows", "files", "error", "fingerprint", "finished")
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
    finished text           -- when the row was written, ISO 8601 UTC
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

    def key(self) -> tuple[str, ...]:
        """The overrides, order-free: how a job of a re-run finds its row."""
        return tuple(sorted(self.overrides))


class _Damaged(Exception):
    """The catalogue file is not a catalogue this version can read."""


@contextlib.contextmanager
def _connect(path: Path) -> Iterator[sqlite3.Connection]:
    con = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        yield con
    finally:
        con.close()


def _check_version(con: sqlite3.Connection, *, create: bool) -> None:
    version = con.execute("pragma user_version").fetchone()[0]
    if version == 0 and create:
        con.execute(_CREATE)
        con.execute(f"pragma user_version = {VERSION}")
        return
    if version != VERSION:
        raise _Damaged(f"its layout version is {version}, this gradrunner reads version {VERSION}")
    tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
    if "jobs" not in tables:
        raise _Damaged("it has no jobs table")


def record_job(sweep_dir: str | os.PathLike[str], row: JobRow) -> None:
    """Insert or replace the row of `row.dir` in `<sweep_dir>/catalogue.sqlite`, in one transaction.

    Example::

        record_job(sweep_dir, JobRow(dir="1", num=1, overrides=["seed=1"], status="failed", error="..."))

    Raises `OSError` or `sqlite3.Error` when the file cannot be written (the caller logs it: a job's
    records never depend on its catalogue row). A damaged catalogue is moved aside and started anew.
    """
    record_jobs(sweep_dir, [row])


def record_jobs(sweep_dir: str | os.PathLike[str], rows: Sequence[JobRow]) -> None:
    """`record_job` for several rows, in one transaction (a catalogue rebuilt from the job dirs).

    Example::

        record_jobs(sweep_dir, [JobRow(dir=str(n), num=n, overrides=[f"seed={n}"], status="completed") for n in range(3)])
    """
    path = Path(sweep_dir) / CATALOGUE
    values = [(r.dir, r.num, json.dumps(r.overrides), r.status, r.run_id, r.rows, json.dumps(r.files), r.error,
               r.fingerprint, r.finished) for r in rows]  # fmt: skip
    if not values:
        return
    for attempt in (1, 2):
        try:
            with _connect(path) as con:
                con.execute("begin immediate")
                try:
                    _check_version(con, create=True)
                    con.executemany(f"insert or replace into jobs ({', '.join(_COLUMNS)}) "
                                    f"values ({', '.join('?' * len(_COLUMNS))})", values)  # fmt: skip
                    con.execute("commit")
                except BaseException:
                    con.execute("rollback")
                    raise
            return
        except (_Damaged, sqlite3.DatabaseError) as e:
            if isinstance(e, sqlite3.OperationalError) or attempt == 2:  # locked, disk full: not damage
                raise
            _move_aside(path, str(e))


def read_jobs(sweep_dir: str | os.PathLike[str]) -> list[JobRow] | None:
    """Every row of `<sweep_dir>/catalogue.sqlite`, ordered by job number; None without a (readable) catalogue.

    Example::

        rows = read_jobs("multirun/2026-11-24/12-00-00-000000")
        sum(r.status == "completed" for r in rows or [])      # 10000

    A damaged file (not SQLite, another layout, rows that do not parse) is moved aside with a warning
    and None is returned: callers then read the job dirs themselves.
    """
    path = Path(sweep_dir) / CATALOGUE
    if not path.is_file():
        return None
    try:
        with _connect(path) as con:
            _check_version(con, create=False)
            raw = con.execute(f"select {', '.join(_COLUMNS)} from jobs order by num, dir").fetchall()
        return [_row(r) for r in raw]
    except sqlite3.OperationalError as e:  # locked for longer than the timeout, unreadable: not damage
        log.warning("could not read the sweep catalogue %s (%s); reading the job dirs instead", path, e)
        return None
    except (_Damaged, sqlite3.DatabaseError, ValueError, TypeError) as e:
        _move_aside(path, str(e))
        return None


def _row(raw: tuple[Any, ...]) -> JobRow:
    data = dict(zip(_COLUMNS, raw, strict=True))
    overrides, files = json.loads(data.pop("overrides")), json.loads(data.pop("files"))
    if not (isinstance(overrides, list) and isinstance(files, list) and isinstance(data["dir"], str)):
        raise ValueError(f"a row that is not a job: {raw!r}")
    return JobRow(overrides=[str(o) for o in overrides], files=[str(f) for f in files], **data)


def _move_aside(path: Path, why: str) -> None:
    aside = path.with_name(f"{path.name}.damaged-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # another process moved it first
        return
    log.warning("the sweep catalogue %s is damaged (%s): moved to %s; the job dirs are read instead, and the "
                "catalogue is written anew as jobs end", path, why, aside.name)  # fmt: skip
