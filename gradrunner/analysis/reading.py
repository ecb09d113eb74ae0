"""Read gradrunner records into pandas: one run dir, a whole sweep, or one Parquet file.

Contents:
    load(path, table="grads", columns=None, values=False, on_damaged="raise")  -- a run, a sweep or one .parquet file
    IncompleteSweepWarning            -- `load` left out failed or unfinished jobs of a sweep
    DamagedRecordsWarning             -- `load(..., on_damaged="skip")` left out files that do not verify
    TABLES                            -- the tables a job writes

Example::

    df = load("multirun/2024-05-01/12-00-00")      # one row per job x step x tap x call
    steps = load("multirun/2024-05-01/12-00-00", table="steps")
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradrunner.analysis.labels import FileRead, concat, job_overrides, natural_key, with_job_columns
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.columns import KEPT_PREFIX, LOCK_FILE, OVERRIDES_KEY, VALUES_COLUMN, wanted_columns
from gradrunner.records.urls import local_path_of

#: Tables a job writes, each as `<job dir>/<table>.parquet`.
TABLES = ("grads", "steps")
#: The captured elements: large (every element of every gradient), so read only when asked for.
VALUES = VALUES_COLUMN
#: What `load` does with a file that does not verify.
ON_DAMAGED = ("raise", "skip")


def load(
    path: str | os.PathLike[str],
    table: str = "grads",
    columns: Sequence[str] | None = None,
    values: bool = False,
    on_damaged: str = "raise",
    live: bool = False,
) -> pd.DataFrame:
    """Every `<table>.parquet` below `path` as one DataFrame, with a column per swept override.

    Example::

        df = load("multirun/2024-05-01/12-00-00")             # a sweep: 0/, 1/, ... job dirs
        df.groupby(["capture.strategy", "tap"])["norm"].mean()
        steps = load("outputs/2024-05-01/12-00-00", table="steps")
        small = load(sweep, columns=["step", "tap", "norm"])   # reads those columns only (plus job, overrides)
        full = load(run_dir, values=True)                       # with the captured elements

    `path` is a run dir, a sweep dir (Hydra multirun) or a `.parquet` file. Only `columns` are
    read when given (a name some files lack is null in their rows; a name no file holds, an option off in
    every run or a misspelling, is not a column of the result); by default every column but `values`
    (every captured element: often most of the bytes), which `values=True` or naming it in
    `columns` adds. Schemas are unified: a column only some files have is kept, null elsewhere.
    When the files live in subdirectories (a sweep), a `job` column holds each job dir relative
    to `path`, and every override of the job (from its records: the files' metadata, else `done.json`,
    else `<job>/.hydra/overrides.yaml` for records written before overrides travelled with them) whose value differs
    between the sweep's jobs (the failed and missing ones too: the column of `data.seq_len=8,80` is there when
    the 80 jobs failed) becomes a column named after its key, or `override.<key>` when the key is one of
    `labels.RESERVED_COLUMNS` (`steps=5,10` gives `override.steps`, never clashing with a record or a
    helper's column), as int or float when every value parses so, else as string. Hidden files and
    directories are skipped.

    In a sweep whose jobs carry completion markers (`done.json`, written by the CLI and `record()`; a job
    dir holding gradrunner's run-dir lock file counts, so a sweep none of whose jobs completed yet too), only completed
    jobs are read: failed jobs (`failed.json`) and jobs without a marker (killed, still running) are
    left out and named in an `IncompleteSweepWarning`; `pd.read_parquet` still reads their partial files.
    Jobs the sweep's `manifest.json` lists that no job dir holds (written as the sweep starts, it lists every job:
    those a killed launcher never started too) are named in that warning too, and counted in the sweep's total. A file
    that cannot be read is a GradrunnerError naming it and its job: never a silently shorter result. A
    completed job whose file is gone (its `done.json` lists it) is such a file too.

    Every file is verified as it is read: each page's CRC checksum, and, for a job with `done.json`,
    its run id (a file swapped in from another run is refused), row count and footer against what
    `done.json` recorded. Files that do not verify are named, each with its job and why, in one
    GradrunnerError (`on_damaged="raise"`, the default), or left out with one `DamagedRecordsWarning`
    (`on_damaged="skip"`); their rows are never returned. Only the pages of the columns read are
    checked: a flip in the `values` pages of a load without `values` changes nothing it returns.

    `path` may be a `file://` URL (read as the local path it names); any other URL (`s3://`, `gs://`,
    `memory://`) is a GradrunnerError saying URLs are not read: download the dir first.

    `live=True` reads a run dir whose job is still running: the steps completed so far (see
    `gradrunner.analysis.live`).
    """
    if on_damaged not in ON_DAMAGED:
        raise GradrunnerError(f"on_damaged={on_damaged!r} is not allowed: allowed: {', '.join(map(repr, ON_DAMAGED))}")
    if isinstance(columns, str):  # a str is a sequence of its letters: it would read a column per letter
        raise GradrunnerError(
            f"columns={columns!r} is one name; pass a list of column names, e.g. columns=[{columns!r}]"
        )
    path = local_path_of(os.fspath(path), "load()")  # a file:// URL is its local path; other URLs are refused
    if live and table in TABLES:  # a running job's closed segments: gradrunner.analysis.live
        from gradrunner.analysis.live import load_live

        running = load_live(path, table, columns, values)
        if running is not None:
            return running
    root = Path(path)
    if table not in TABLES:
        raise GradrunnerError(f"table={table!r} is not a gradrunner table; allowed: {', '.join(TABLES)}")
    files, jobs = _files_to_read(root, table)
    read, joined = _read_all(root, files, columns, values)
    damaged = [r for r in read if isinstance(r, str)]
    if damaged:
        files, read = _without_damaged(root, files, read, damaged, on_damaged)
    if root.is_dir() and any(f.path.parent != root for f in files):
        others = _not_read(jobs, {f.path.parent for f in files}) if jobs is not None else []
        kept = [r for r in read if isinstance(r, FileRead)]
        joined = with_job_columns(root, [f.path.parent for f in files], kept, joined, others)
    return joined.to_pandas()


class IncompleteSweepWarning(UserWarning):
    """`load` left out jobs of a sweep that failed or did not finish; the message names them."""


class DamagedRecordsWarning(UserWarning):
    """`load(..., on_damaged="skip")` left out record files that do not verify; the message names them."""


@dataclass(frozen=True)
class _File:
    """A record file to read, and the `done.json` of its job (None without one) that it is checked against."""

    path: Path
    marker: dict[str, Any] | None


@dataclass(frozen=True)
class _Jobs:
    """What `load` needs to know of a sweep's (or a run's) jobs before reading any record."""

    #: The job dirs below the root (`rundir.job_dirs_below`'s rule), with their state.
    states: list[rundir.JobState]
    #: The state of the root itself (a run dir holding its own records).
    root: rundir.JobState
    #: The record files (final names) in each of those dirs, root included.
    present: dict[Path, list[str]]
    #: Whether any job dir holds a marker (`done.json` or `failed.json`, damaged ones too) or the run-dir lock
    #: file every gradrunner run takes (`run.books.RunLock`): its jobs mark their completion, so a job without
    #: `done.json` did not complete, also when no job of the sweep has yet.
    marked: bool
    #: The dirs found (root included): a manifest's job dir is looked up here before on disk.
    dirs: frozenset[Path]
    #: The jobs the sweep's `manifest.json` lists that no job dir holds (`_dirless`), as it lists them.
    dirless: list[dict[str, Any]]


#: Files read before their rows are joined into one table (their many small arrays then freed).
_BATCH = 1024
#: The keys of `done.json` that reading uses; the rest (the resolved config) is not kept per job.
_MARKER_KEYS = ("status", "run_id", "files", "rows", "footers", "overrides")


def _jobs_of(root: Path) -> _Jobs:
    """THE one place `load` learns a sweep's jobs: their dirs, status and `done.json`, from one walk of the tree."""
    tree = rundir.list_tree(root)

    def state(d: Path) -> rundir.JobState:
        s = rundir.job_state(d, tree.dirs[d])
        if s.marker is not None:  # a smaller copy: ten thousand resolved configs are not kept
            s.marker = {k: s.marker[k] for k in _MARKER_KEYS if k in s.marker}
        return s

    dirs = tree.job_dirs()
    present = {d: [n for n in rundir.RECORD_NAMES if tree.has(d, n, file=True)] for d in [root, *dirs]}
    marked = any(tree.has(d, rundir.DONE) or tree.has(d, rundir.FAILED) or tree.has(d, LOCK_FILE) for d in dirs)
    found = frozenset(tree.dirs)
    states = [state(d) for d in dirs]
    return _Jobs(states, state(root), present, marked, found, _dirless(root, found, states))


def _not_read(jobs: _Jobs, read: set[Path]) -> list[list[str]]:
    """The overrides of the sweep's jobs whose records are not read (failed, unfinished, damaged, without a dir)."""
    left = [job_overrides(s.directory, None, s.marker) for s in jobs.states if s.directory not in read]
    return left + [[str(o) for o in j.get("overrides") or []] for j in jobs.dirless]


def _files_to_read(root: Path, table: str) -> tuple[list[_File], _Jobs | None]:
    """The `<table>.parquet` files to read below `root` (or `root` itself), in natural job order, each with
    its job's `done.json`: only completed jobs' when the sweep's jobs carry markers (a warning names the others);
    and the jobs below `root` (None for a file).
    """
    name = f"{table}.parquet"
    if root.is_file():
        if root.suffix != ".parquet":
            raise GradrunnerError(f"{root} is not a .parquet file; pass a run dir, a sweep dir or a .parquet file")
        return [_File(root, rundir.job_state(root.parent).marker)], None
    if not root.is_dir():
        raise GradrunnerError(f"{root} does not exist; pass a run dir, a sweep dir or a .parquet file")
    jobs = _jobs_of(root)
    # A completed job whose `done.json` lists the file is read even when the file is gone: it is then named as
    # damaged (refused, or left out with a warning), never silently missing from the result.
    holding = [s for s in [jobs.root, *jobs.states] if name in jobs.present[s.directory] or _listed(s, name)]
    aside = root / f"{KEPT_PREFIX}{name}"
    if not holding and aside.is_file() and jobs.root.marker is None:
        warnings.warn(f"{root} has no {name}: read {aside.name}, the records of an earlier session that a resumed "
                      "record() session keeps aside until it closes its own files (it is running, or was killed "
                      "before; record(..., resume=True) into the dir then continues them)", UserWarning, stacklevel=3)  # fmt: skip
        return [_File(aside, None)], jobs
    if not holding:
        raise GradrunnerError(
            f"no {name} found in {root} or its subdirectories; pass a run dir (holding {name}), "
            "a sweep dir (holding job dirs 0/, 1/, ...) or a .parquet file"
        )
    kept = _completed_only(root, jobs, holding)
    files = [_File(s.directory / name, s.marker) for s in kept]
    return sorted(files, key=lambda f: natural_key(f.path.relative_to(root))), jobs


def _listed(state: rundir.JobState, name: str) -> bool:
    """Whether the job's `done.json` lists the record file `name`."""
    files = state.marker.get("files") if state.marker is not None else None
    return isinstance(files, list) and name in files


def _read_all(
    root: Path, files: list[_File], columns: Sequence[str] | None, values: bool
) -> tuple[list[FileRead | str], pa.Table]:
    """Every file read and verified, and the rows of those that verified as one table.

    A file that does not verify is a sentence naming it, its job and why (`_read`'s). Files are read
    `_BATCH` at a time (a few threads: pyarrow reads outside the GIL), the run ids of a batch checked
    in one comparison, and each batch's rows joined into one table at once: memory follows the rows
    read, not the number of files.
    """
    read: list[FileRead | str] = []
    joined: list[pa.Table] = []
    for start in range(0, len(files), _BATCH):
        batch = files[start : start + _BATCH]
        tables = _read_batch(root, batch, columns, values)
        extra = columns is not None and "run_id" not in columns  # read for the run id check only
        kept = [t.drop_columns(["run_id"]) if extra and "run_id" in t.column_names else t
                for t in tables if isinstance(t, pa.Table)]  # fmt: skip
        it = iter(kept)
        for t in tables:
            if isinstance(t, str):
                read.append(t)
            else:
                own = next(it)
                read.append(FileRead(own.num_rows, tuple(own.column_names), (own.schema.metadata or {}).get(OVERRIDES_KEY.encode())))  # fmt: skip
        if kept:
            joined.append(concat(kept).combine_chunks())
    return read, concat(joined) if joined else pa.table({})


def _read_batch(root: Path, files: list[_File], columns: Sequence[str] | None, values: bool) -> list[pa.Table | str]:
    """`files` read and verified, the run ids of all their rows checked against their `done.json` in one comparison."""

    def one(f: _File) -> pa.Table | str:  # several files: one thread each, not one per column of a small file
        return _read(root, f, columns, values, check_run_id=False, threads=len(files) == 1)

    read: list[pa.Table | str] | None = None
    if len(files) > 1:
        try:
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                read = list(pool.map(one, files))
        except RuntimeError:  # no new threads at interpreter shutdown (a sweep's report=true, written at exit)
            read = None
    read = read if read is not None else [one(f) for f in files]
    checked = [i for i, (f, t) in enumerate(zip(files, read, strict=True))
               if isinstance(t, pa.Table) and f.marker is not None and f.marker.get("run_id") is not None
               and "run_id" in t.column_names]  # fmt: skip
    suspect = set()
    if checked:
        try:
            ids = pa.chunked_array([_as_string(read[i].column("run_id")) for i in checked], pa.string())  # type: ignore[union-attr]
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a run_id column of another type: file by file
            suspect = set(checked)
        else:
            rows = np.array([read[i].num_rows for i in checked])  # type: ignore[union-attr]
            expected = pa.array([files[i].marker["run_id"] for i in checked], pa.string())  # type: ignore[index]
            foreign = rundir.foreign_rows(ids, expected.take(np.repeat(np.arange(len(checked)), rows)))
            suspect = {checked[int(k)] for k in np.searchsorted(np.cumsum(rows), foreign, side="right")}
    for i in sorted(suspect):
        read[i] = _read(root, files[i], columns, values)  # read again and checked alone: its own message
    return read


def _as_string(column: pa.ChunkedArray) -> pa.ChunkedArray:
    return column if column.type == pa.string() else column.cast(pa.string())


def _read(
    root: Path, f: _File, columns: Sequence[str] | None, values: bool, check_run_id: bool = True, threads: bool = True
) -> pa.Table | str:
    """One record file, verified: the columns asked for (those it has), or all but `values` unless `values`.

    A file that does not verify is returned as a sentence naming it, its job and why. A footer that
    `done.json` pins is parsed once, after its digest matched: the schema and the read both use it.
    `check_run_id=False` leaves the run id to the caller (`_read_all`): `run_id` is then read too.
    `threads=False` decodes the file's columns one after the other (the caller reads files in parallel).
    """
    path, marker = f.path, f.marker
    try:
        if marker is not None and not path.is_file():
            raise rundir.Damaged(f"{path.name} is missing, though {rundir.DONE} lists it (deleted or moved away)")
        digest = rundir.footer_digest(path) if _pinned(f) else None
        opened = None
        if digest is not None and marker is not None and marker["footers"][path.name] == digest:
            # The footer is what the job wrote: parsed once, here, and read from by read_verified (an OSFile:
            # no filesystem lookup per file).
            opened = pq.ParquetFile(pa.OSFile(os.fspath(path)), page_checksum_verification=True)
        # A footer whose digest does not match is read as before: read_verified then says why it is refused.
        names = opened.schema_arrow.names if opened is not None else pq.read_schema(path).names
        wanted = wanted_columns(names, columns, values)
        return rundir.read_verified(path, marker, wanted, digest, opened, check_run_id, use_threads=threads)
    except Exception as e:  # rundir.Damaged, or what pyarrow raises on a damaged footer (UnicodeDecodeError too)
        job = path.parent.relative_to(root).as_posix() if root.is_dir() and path.parent != root else None
        where = f"job {job} of {root}" if job else f"the run {path.parent}"
        why = str(e) if isinstance(e, rundir.Damaged) else f"{type(e).__name__}: {one_paragraph(e)}"
        return f"{path} ({where}): {why.rstrip('.')}"


def _pinned(f: _File) -> bool:
    """Whether the file's `done.json` pins its footer (`footer_digest`)."""
    footers = f.marker.get("footers") if f.marker is not None else None
    return isinstance(footers, dict) and f.path.name in footers


def _without_damaged(
    root: Path, files: list[_File], read: list[FileRead | str], damaged: list[str], on_damaged: str
) -> tuple[list[_File], list[FileRead | str]]:
    """Refuse (one paragraph naming every damaged file), or warn and keep the files that verified."""
    named = "; ".join(damaged[:10]) + (f"; and {len(damaged) - 10} more" if len(damaged) > 10 else "")
    fix = ("re-run those jobs with resume=true (it re-runs jobs whose files do not verify), or move their dirs "
           "away to load the others")  # fmt: skip
    kept = [(f, t) for f, t in zip(files, read, strict=True) if isinstance(t, FileRead)]
    if on_damaged == "raise" or not kept:
        raise GradrunnerError(
            f"cannot read {len(damaged)} record file(s) that do not verify (damaged: truncated, overwritten or "
            f"flipped bytes; or swapped in from another run): {named}. Their rows are not returned; {fix}"
            + (", or pass on_damaged='skip' to load the rest with a warning." if on_damaged == "raise" else ".")
        )
    warnings.warn(f"left out {len(damaged)} record file(s) that do not verify: {named}. {fix[0].upper()}{fix[1:]}.",
                  DamagedRecordsWarning, stacklevel=3)  # fmt: skip
    return [f for f, _ in kept], [t for _, t in kept]


def _dirless(root: Path, dirs: frozenset[Path], states: list[rundir.JobState]) -> list[dict[str, Any]]:
    """The jobs the sweep's manifest lists that no job dir holds, as it lists them.

    An entry naming a dir holds it while that dir is there. An entry naming none (a job `pending` when the
    sweep started, `missing` or not run when it ended) is held by a job dir that no entry names and whose
    job has its overrides (`labels.job_overrides`), each dir holding one entry: a job a killed launcher
    started has its dir, one it never started has none.
    """
    data = rundir.read_json(root / rundir.MANIFEST)
    listed = data.get("jobs") if data else None
    if not isinstance(listed, list):
        return []
    entries = [j for j in listed if isinstance(j, dict)]
    named = {root / str(j["dir"]) for j in entries if j.get("dir")}
    unnamed: dict[tuple[str, ...], int] = {}  # the job dirs no entry names, counted by their overrides
    if any(not j.get("dir") for j in entries):
        for s in states:
            if s.directory not in named:
                key = tuple(sorted(job_overrides(s.directory, None, s.marker)))
                unnamed[key] = unnamed.get(key, 0) + 1
    out = []
    for j in entries:
        if j.get("dir"):
            held = root / str(j["dir"]) in dirs or (root / str(j["dir"])).is_dir()
        else:
            key = tuple(sorted(str(o) for o in j.get("overrides") or []))
            held = unnamed.get(key, 0) > 0
            unnamed[key] = unnamed.get(key, 0) - int(held)
        if not held:
            out.append(j)
    return out


def _completed_only(root: Path, jobs: _Jobs, holding: list[rundir.JobState]) -> list[rundir.JobState]:
    """Those of `holding` that completed when the sweep's jobs carry markers; warn naming the jobs left out."""
    if jobs.root.status == "failed":  # a single run asked for by name: read it, but say it failed
        warnings.warn(f"{root} is a failed run ({jobs.root.error}); its records are partial",
                      IncompleteSweepWarning, stacklevel=4)  # fmt: skip
    unfinished = [s for s in jobs.states if s.status != "completed"] if jobs.marked else []
    if not unfinished and not jobs.dirless:
        return holding
    own = {s.directory: job_overrides(s.directory, None, s.marker) for s in unfinished[:10] if s.status != "failed"}
    said = rundir.describe_unfinished(root, unfinished, len(jobs.states) + len(jobs.dirless), jobs.dirless, own)
    warnings.warn(said, IncompleteSweepWarning, stacklevel=4)
    left_out = {s.directory for s in unfinished}
    kept = [s for s in holding if s.directory not in left_out]
    if not kept:
        raise GradrunnerError(f"no job in {root} completed; {said}")
    return kept
