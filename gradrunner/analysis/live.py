"""Records of a job that is still running: `load(run_dir, live=True)`.

A running job's `grads.parquet` has no footer yet (see `gradrunner.records.segments`); what it
has completed so far lies in closed segments under `<run dir>/.live/<run id>/`. `load_live` reads
those of the live run only (`segments.live_run_id`: the run holding, or last holding, the dir's lock),
never a killed run's left in the same dir; once the job's record files exist, `load` reads the record
files themselves; a run that is gone (its lock record's pid no longer runs on this host) and closed no segment
is not waited for (after a resumed `record()` session, `load` reads the records it kept aside). A job closing its files while they are read (its segments removed) is looked at
again, up to `ATTEMPTS` times; what still does not settle is a GradrunnerError, never a raw
`FileNotFoundError` or a shorter result.

Example::

    df = load("runs/mine", live=True)              # the steps completed so far, while it runs
    steps = load("runs/mine", table="steps", live=True)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import KEPT_PREFIX, LOCK_FILE, is_temp_of, wanted_columns
from gradrunner.records.segments import LIVE_DIR, SegmentDamaged, SegmentsGone, live_run_id, lock_owner, read_segments

#: How many times a read that met a job closing its files looks again.
ATTEMPTS = 20


def load_live(
    path: str | os.PathLike[str], table: str = "grads", columns: Sequence[str] | None = None, values: bool = False
) -> pd.DataFrame | None:
    """The running job's `table` from its segments; None when `path` is no running job (then `load` reads it).

    Example::

        load_live("runs/mine").groupby("step").norm.mean()
    """
    d = Path(path)
    gone = ""
    for _ in range(ATTEMPTS):
        if not _running(d, table):
            return None
        run_id = live_run_id(d)
        if run_id is None:
            raise GradrunnerError(_unknown_run(d, table))
        try:
            t = read_segments(d, run_id, table)
        except SegmentsGone as e:  # the job is closing its files: its record files hold every row now
            gone = str(e)
            continue
        except SegmentDamaged as e:
            raise GradrunnerError(f"cannot read the live records of {d}: {e}. Their rows are not returned; wait "
                                  f"for the job to end and load({str(d)!r}) its record files.") from None  # fmt: skip
        if (d / f"{table}.parquet").is_file():
            continue  # closed while the segments were read: read the record file, which holds them all
        if t is None and _gone(d):
            if (d / f"{KEPT_PREFIX}{table}.parquet").is_file():
                return None  # a resumed session killed before a segment: `load` reads the records it kept aside
            raise GradrunnerError(
                f"{d} has no {table}.parquet, and the run that last held it (run {run_id}) is no longer running: it "
                "was killed before it closed a segment of its steps, so there are no live records to read."
            )
        if t is None:
            raise GradrunnerError(
                f"{d} has no {table}.parquet and its running job (run {run_id}) has not completed a segment yet "
                "(one is written every few steps); try again in a moment, or lower the segment length "
                "(record(..., live_every=1))."
            )
        return t.select(wanted_columns(t.column_names, columns, values)).to_pandas()
    raise GradrunnerError(
        f"the live records of {d} kept changing while they were read ({ATTEMPTS} attempts; last: {gone}): the job "
        f"is closing its files. Load {d} again once it has ended (its record files then hold every row)."
    )


def _running(d: Path, table: str) -> bool:
    """A run started here (its lock file, its temp file, its segments) whose record file is not closed yet."""
    if (d / f"{table}.parquet").is_file() or not d.is_dir():
        return False
    try:
        names = [e.name for e in os.scandir(d)]
    except OSError:
        return False
    return any(n == LOCK_FILE or n == LIVE_DIR or is_temp_of(n, f"{table}.parquet") for n in names)


def _gone(d: Path) -> bool:
    """Whether the run that last held `d` is known to be gone: its lock record names this host and a pid that no
    process has (a pid reused since, or another host: not known, so not said)."""
    owner = lock_owner(d)
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _unknown_run(d: Path, table: str) -> str:
    live = d / LIVE_DIR
    runs = sorted(r.name for r in live.iterdir() if r.is_dir()) if live.is_dir() else []
    return (
        f"{d} has no {table}.parquet and no lock file naming its live run, so the live rows cannot be told from "
        f"those a killed run left there (segments of run(s) {', '.join(runs) or 'none'} in {live}). Load the "
        f"run's segments directly (pd.read_parquet on {live}/<run id>/{table}-*.parquet.seg), or wait for the job."
    )
