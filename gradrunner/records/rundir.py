"""A job dir's state, read-only: its completion marker, its failure record, which folders are jobs, and verified reading.

Contents:
    DONE, FAILED, RECORD_NAMES   -- `done.json` (written last), `failed.json`, the record files
    MANIFEST                     -- `manifest.json`, a sweep dir's list of its jobs (`cli.sweep_books` writes it)
    JobState, job_state(dir)     -- "completed", "failed" or "missing", read from the dir's files alone
    read_marker(dir)             -- `done.json` if gradrunner wrote it, and why one that is there is not
    footer_digest(path)          -- size and footer hash of a record file, pinned by `done.json`
    verify_job(dir, marker)      -- why a "completed" job's files cannot be trusted, or None
    read_verified(path, marker)  -- a record file read with every page, its run id and footer checked
    foreign_rows(ids, expected)  -- the rows of many files whose run id is not their job's, in one comparison
    job_dirs_below(root)         -- THE rule for which folders below a sweep dir are jobs
    Tree, list_tree(root)        -- one walk of a sweep dir: its dirs and their entries, the rule over them
    unfinished_jobs(dirs)        -- the jobs of a sweep that did not complete

Status comes from files in the job dir, so it is the same whichever launcher ran the job and
in whichever process or machine: `done.json` is written by the runner after every record file is
closed (with their run id, row counts and footer digests, which a resume and `analysis.load` check),
`failed.json` when the job raised. Neither means the job never ran, was killed, or is still running:
"missing". Writing these files, the run dir's lock and what a rerun may do: `gradrunner.run.books`.

Example::

    job_state("multirun/2024-05-01/12-00-00-123456/3").status     # 'completed'
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gradrunner.records.atomic import write_atomically
from gradrunner.records.columns import RECORD_FILES, is_temp_of

#: Completion marker: the last file a job writes, after its records are closed.
DONE = "done.json"
#: Failure record of a job that raised (its error message), written by the sweep callback.
FAILED = "failed.json"
#: A sweep dir's list of its jobs: written as the sweep starts (every job, status "pending" unless the sweep
#: catalogue shows it complete) and again as it ends (`cli.sweep_books`); `analysis.load` names the jobs it lists
#: that no job dir holds.
MANIFEST = "manifest.json"
#: Record files a job writes; each is first written under a hidden temp name (`columns.temp_name`).
RECORD_NAMES = RECORD_FILES

Status = Literal["completed", "failed", "missing"]
@dataclass
class JobState:
    """What a job dir says about its job.

    Example::

        state = job_state(job_dir)
        state.status, state.error, state.files     # 'failed', "capture.strategy='bogus' ...", []
    """

    directory: Path
    status: Status
    #: Record files present under their final names (partial ones too, for a job that did not complete).
    files: list[str] = field(default_factory=list)
    #: The error message of a failed job.
    error: str | None = None
    #: The content of `done.json` of a completed job.
    marker: dict[str, Any] | None = None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return None
    return data if isinstance(data, dict) else None


def read_marker(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The job's `done.json` if gradrunner wrote it, else None; and why a `done.json` that is there is not one.

    Example::

        marker, damage = read_marker(job_dir)     # (None, "done.json is not a completion marker ...") for '{}'

    A marker gradrunner wrote is an object with `status: completed`, a string `run_id` and a non-empty
    list of file names. Anything else (`{}`, garbage, a directory) is damage: the job did not complete.
    """
    path = directory / DONE
    if not os.path.lexists(path):
        return None, None
    data = read_json(path)
    ok = (isinstance(data, dict) and data.get("status") == "completed" and isinstance(data.get("run_id"), str)
          and isinstance(data.get("files"), list) and bool(data["files"])
          and all(isinstance(f, str) for f in data["files"]))  # fmt: skip
    if ok:
        return data, None
    what = "a directory" if path.is_dir() else "not a JSON object" if data is None else "an object without its fields"
    return None, f"{DONE} is not a completion marker gradrunner wrote ({what}): treated as damage"


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically: a reader sees the whole file or none.

    Example::

        write_json(sweep_dir / "manifest.json", {"jobs": []})
    """
    return write_atomically(path, json.dumps(data, indent=1, default=str) + "\n")


def _temps(directory: Path, name: str) -> list[str]:
    """Temp files of `name` in `directory`, of any run."""
    try:
        return sorted(e.name for e in os.scandir(directory) if is_temp_of(e.name, name))
    except OSError:
        return []


def _present(directory: Path) -> list[str]:
    """Record files of `directory`, final and hidden temp names (of any run), that exist."""
    return [n for name in RECORD_NAMES for n in ([name] if (directory / name).exists() else []) + _temps(directory, name)]


def job_state(directory: str | os.PathLike[str], entries: Mapping[str, os.DirEntry[str]] | None = None) -> JobState:
    """The job's status from its dir alone: failed (`failed.json`), completed (`done.json`), or missing.

    Example::

        job_state("outputs/2024-05-01/12-00-00-123456").status   # 'completed'

    `entries` (the dir's `os.scandir` entries by name, from `list_tree`) spares a stat per name.
    """
    d = Path(directory)
    if entries is None:
        files = [n for n in RECORD_NAMES if (d / n).is_file()]
        failed_there = (d / FAILED).exists()
    else:
        files = [n for n in RECORD_NAMES if n in entries and entries[n].is_file()]
        failed_there = FAILED in entries and _exists(entries[FAILED])
    failed = read_json(d / FAILED) if failed_there else None
    if failed is not None or failed_there:
        return JobState(d, "failed", files, error=str((failed or {}).get("error", "unknown error")))
    marker, _ = read_marker(d) if entries is None or DONE in entries else (None, None)
    if marker is not None:
        return JobState(d, "completed", [str(f) for f in marker.get("files", files)], marker=marker)
    return JobState(d, "missing", files)


def _exists(entry: os.DirEntry[str]) -> bool:
    """`Path.exists` of a scanned entry: a dangling symlink does not exist."""
    return not entry.is_symlink() or os.path.exists(entry.path)


def footer_digest(path: Path) -> str:
    """`<size>:<sha256 of the footer>` of a Parquet file: what `done.json` pins for each record file.

    Example::

        footer_digest(job_dir / "grads.parquet")     # '20731:9f86d081...'

    The footer (schema, key-value metadata, row groups, page offsets, statistics) carries no checksum
    of its own, and page checksums cover page data only: this digest is what catches a change there,
    reading only the file's last bytes.
    """
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            return f"{size}:"
        f.seek(size - 8)
        length = int.from_bytes(f.read(4), "little")
        f.seek(max(0, size - 8 - length))
        return f"{size}:{hashlib.sha256(f.read()).hexdigest()}"


def verify_job(directory: Path, marker: dict[str, Any]) -> str | None:
    """Why the completed job in `directory` (its `done.json` is `marker`) cannot be trusted, or None.

    Example::

        verify_job(job_dir, json.loads((job_dir / "done.json").read_text()))  # 'grads.parquet is missing'

    Each record file `marker` names must open, its footer and every page (CRC checksums) must read,
    its `run_id` column must hold only the marker's run id, and its row count and `footer_digest` must
    match the marker's (markers written before they were recorded skip those checks).
    """
    recorded = marker.get("rows")
    rows: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    run_id = marker.get("run_id")
    names = marker.get("files")
    if not isinstance(names, list) or not names:
        return f"{DONE} names no record files"
    for name in names:
        path = directory / str(name)
        if not path.is_file():
            return f"{name} is missing"
        try:
            f = pq.ParquetFile(path, page_checksum_verification=True)
            ids: set[str] = set()
            for i in range(f.num_row_groups):  # one row group at a time: memory stays bounded
                group = f.read_row_group(i)
                if "run_id" in group.column_names:
                    ids.update(str(v) for v in pc.unique(group.column("run_id")).to_pylist())
            n = f.metadata.num_rows
        except Exception as e:  # ArrowInvalid, OSError, UnicodeDecodeError: a damaged footer or page
            return f"{name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
        if run_id is not None and ids - {run_id}:
            return f"{name} holds rows of run(s) {', '.join(sorted(ids - {run_id}))}, not of run {run_id} ({DONE})"
        if str(name) in rows and rows[str(name)] != n:
            return f"{name} has {n} rows where {DONE} recorded {rows[name]}"
        footers = marker.get("footers")
        if isinstance(footers, dict) and str(name) in footers and footers[str(name)] != footer_digest(path):
            return f"{name} is not the file {DONE} recorded (its size or footer changed since the job completed)"
    return None


class Damaged(Exception):
    """A record file that does not verify; `str(e)` says why, starting with the file's name."""


def read_verified(
    path: Path,
    marker: dict[str, Any] | None,
    columns: list[str] | None = None,
    digest: str | None = None,
    opened: pq.ParquetFile | None = None,
    check_run_id: bool = True,
    use_threads: bool = True,
    source: str = DONE,
) -> pa.Table:
    """`columns` of the record file `path` (all when None), every page read checked; `Damaged` if it does not verify.

    Example::

        read_verified(job_dir / "grads.parquet", job_state(job_dir).marker, ["step", "norm"])

    Every page read has its CRC checked (`page_checksum_verification`; pages of columns not read are
    not). With the job's `done.json` (`marker`), the file must also hold only the marker's run id (a
    file of another run is refused), its row count and its footer (`footer_digest`: schema, metadata,
    page offsets) must be those recorded when the job completed.

    A caller that has read the file's footer already passes its `digest`, and `opened`: the file
    opened with `page_checksum_verification=True` once that digest matched the marker's (a footer is
    parsed only then); neither is read again. A caller that checks the run id itself, over many files
    at once (`foreign_rows`), passes `check_run_id=False`: the table then holds `run_id` (when the
    file does) even if `columns` does not name it. `use_threads=False` reads the columns one after the
    other (cheaper for a small file, when the caller reads many files in parallel). `source`: the file the
    marker's run id comes from, as a refusal names it (a run without `done.json` has its id from its records).
    """
    name = path.name
    run_id = marker.get("run_id") if marker is not None else None
    footers = marker.get("footers") if marker is not None else None
    if isinstance(footers, dict) and name in footers and footers[name] != (digest or footer_digest(path)):
        # Checked first: a damaged footer is never parsed (a flipped length could ask for any allocation).
        other = _foreign_run(path, run_id)
        raise Damaged(f"{name} holds rows of run(s) {other}, not of run {run_id} ({source}): a file of another run"
                      if other else f"{name} is not the file {DONE} recorded (its size or footer changed since "
                      "the job completed)")  # fmt: skip
    extra = ["run_id"] if run_id is not None and columns is not None and "run_id" not in columns else []
    try:
        table = (opened or pq.ParquetFile(path, page_checksum_verification=True)).read(
            columns=None if columns is None else [*columns, *extra], use_threads=use_threads
        )
    except Exception as e:  # ArrowInvalid, OSError, UnicodeDecodeError (a flipped name), ...: a damaged file
        raise Damaged(f"{name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})") from e
    if marker is None:
        return table
    if check_run_id and run_id is not None and "run_id" in table.column_names:
        ids = {str(v) for v in pc.unique(table.column("run_id")).to_pylist()}
        if ids - {run_id}:
            raise Damaged(f"{name} holds rows of run(s) {', '.join(sorted(ids - {run_id}))}, not of run {run_id} "
                          f"({source}): a file of another run")  # fmt: skip
    rows = marker.get("rows")
    if isinstance(rows, dict) and name in rows and rows[name] != table.num_rows:
        raise Damaged(f"{name} has {table.num_rows} rows where {DONE} recorded {rows[name]}")
    return table.drop_columns(extra) if check_run_id else table


def foreign_rows(run_ids: pa.ChunkedArray | pa.Array, expected: pa.Array) -> np.ndarray:
    """The positions of the rows whose `run_id` is not the one `expected` for them (null: not checked).

    Example::

        foreign_rows(table.column("run_id"), pa.array(["run-a"] * table.num_rows))   # array([], dtype=int64)

    One vectorised comparison over the rows of many files (each file's rows expecting its marker's
    run id): what `read_verified` checks per file. A null `run_id` where one is expected is foreign.
    """
    same = pc.fill_null(pc.equal(run_ids, expected), False)
    wrong = pc.and_(pc.invert(same), pc.is_valid(expected))
    return np.flatnonzero(np.asarray(wrong.to_numpy(zero_copy_only=False), dtype=bool))


def _foreign_run(path: Path, run_id: Any) -> str | None:
    """The other run ids a (verifying) file holds, for the message; None if it does not read or holds `run_id`."""
    try:
        column = pq.ParquetFile(path, page_checksum_verification=True).read(columns=["run_id"]).column("run_id")
        ids = {str(v) for v in pc.unique(column).to_pylist()} - {run_id}
    except Exception:
        return None
    return ", ".join(sorted(ids)) or None


def unfinished_jobs(job_dirs: list[Path]) -> list[JobState] | None:
    """The jobs among `job_dirs` that did not complete, or None when none of them carries a marker.

    Example::

        unfinished_jobs([sweep / "0", sweep / "1"])   # [JobState(.../1, 'failed', error=...)]

    None means the records predate completion markers (or were written outside the CLI): every
    job is then taken as it is.
    """
    states = [job_state(d) for d in job_dirs]
    if not any((d / DONE).exists() or (d / FAILED).exists() for d in job_dirs):
        return None
    return [s for s in states if s.status != "completed"]


def describe_unfinished(
    root: Path, unfinished: list[JobState], total: int, dirless: Sequence[Mapping[str, Any]] = (),
    overrides: Mapping[Path, Sequence[str]] | None = None,
) -> str:  # fmt: skip
    """One paragraph naming the jobs of the sweep at `root` that did not complete, and what to do.

    Example::

        describe_unfinished(sweep, unfinished_jobs(dirs), len(dirs))  # '1 of 6 jobs in ... job 3 failed: ...'

    `unfinished`: the job dirs that did not complete; `dirless`: the jobs the sweep's `MANIFEST` lists that
    no job dir holds (its entries: `num`, `overrides`, `dir`, `error`); `total`: every job of the sweep;
    `overrides`: a job dir's own, named where it has no `done.json` (which config was cut off)."""
    parts = []
    for s in unfinished[:10]:
        name = s.directory.relative_to(root).as_posix()
        own = " ".join((overrides or {}).get(s.directory) or [])
        parts.append(f"job {name} failed: {(s.error or '').rstrip('.')}" if s.status == "failed"
                     else f"job {name} has no {DONE} (killed, or still running{f'; its overrides: {own}' if own else ''})")  # fmt: skip
    parts += [_dirless(j) for j in dirless[: max(0, 10 - len(parts))]]
    left = len(unfinished) + len(dirless)
    more = f"; and {left - len(parts)} more" if left > len(parts) else ""
    partial = [s.directory / f for s in unfinished for f in s.files]
    example = f", or read a job's partial records directly, e.g. pd.read_parquet('{partial[0]}')" if partial else ""
    others = f" The other {total - left} job(s) completed and are read." if total > left else ""
    return (
        f"{left} of {total} jobs in {root} did not complete and are left out: {'; '.join(parts)}{more}.{others} "
        f"Re-run the sweep into the same dir (hydra.sweep.dir={root}) to complete them{example}."
    )


def _dirless(entry: Mapping[str, Any]) -> str:
    """A job the sweep's manifest lists that no job dir holds, in a few words."""
    label = f"job {entry.get('num', '?')} ({' '.join(map(str, entry.get('overrides') or [])) or 'no overrides'})"
    if entry.get("dir"):
        return f"{label}: its dir {entry['dir']} is gone"
    if entry.get("error"):
        return f"{label}: {str(entry['error']).rstrip('.')}"
    return f"{label} did not start (no job dir)"


def job_dirs_below(root: Path) -> list[Path]:
    """THE rule for which folders are jobs: dirs below `root`, none of their parts hidden (`.`, `_`),
    that hold Hydra's `.hydra/overrides.yaml`, a marker (`done.json`, `failed.json`) or a record file,
    final or temp, and are not below a dir (`root` included) that holds records (a run's replays). The sweep manifest, `run.books` and `analysis.load` all use it.

    Example::

        job_dirs_below(Path("multirun/2024-05-01/12-00-00-123456"))   # [.../0, .../1, ...]
    """
    return list_tree(root).job_dirs()


@dataclass(frozen=True)
class Tree:
    """The dirs below a root, none of their parts hidden, each with its entries: one walk of the tree.

    Example::

        tree = list_tree(sweep_dir)
        tree.job_dirs()                                  # [.../0, .../1, ...]: `job_dirs_below`'s rule
        job_state(d, tree.dirs[d])                       # no stat per file name
    """

    root: Path
    #: Every dir below `root` (`root` included) whose parts below `root` are not hidden, by path, with
    #: its `os.scandir` entries by name; symlinked dirs are not entered (as `Path.rglob` does not).
    dirs: dict[Path, dict[str, os.DirEntry[str]]]

    def has(self, directory: Path, name: str, file: bool = False) -> bool:
        """Whether `directory` holds `name` (`Path.exists`; a regular file or a link to one when `file`)."""
        entry = self.dirs[directory].get(name)
        return entry is not None and (entry.is_file() if file else _exists(entry))

    def job_dirs(self) -> list[Path]:
        """The job dirs among `dirs`, sorted: `job_dirs_below`'s rule.

        A run's own dirs below it (`replay/step<S>/`, `autopsy/step<S>/<job>/`: `run.replay`, `run.autopsy`)
        are runs of their own, not jobs of the dir above: below a dir holding records, nothing is a job.
        """
        found = sorted(d for d, entries in self.dirs.items() if d != self.root and _is_job(d, entries))
        runs = {d for d in [self.root, *found] if any(self.has(d, n, file=True) for n in RECORD_NAMES)}
        return [d for d in found if not any(p in runs for p in d.parents)]


def _is_job(directory: Path, entries: dict[str, os.DirEntry[str]]) -> bool:
    """Whether a dir with these entries is a job's (`job_dirs_below`'s rule)."""
    for name in (DONE, FAILED, *RECORD_NAMES):
        if name in entries and _exists(entries[name]):
            return True
    if ".hydra" in entries and os.path.exists(os.path.join(entries[".hydra"].path, "overrides.yaml")):
        return True
    # The glob `.<name>.*.tmp` and `is_temp_of` both: `.grads.parquet.tmp` (no run id) is not taken.
    return any(
        is_temp_of(n, name) and n.startswith(f".{name}.") and len(n) >= len(name) + 6
        for n in entries
        if n.startswith(".") and n.endswith(".tmp")
        for name in RECORD_NAMES
    )


def list_tree(root: Path) -> Tree:
    """`root` and every dir below it whose parts below `root` are not hidden, with their entries (one `os.scandir` each)."""
    dirs: dict[Path, dict[str, os.DirEntry[str]]] = {}
    pending = [root]
    while pending:
        d = pending.pop()
        try:
            with os.scandir(d) as it:
                entries = {e.name: e for e in it}
        except OSError:  # gone, or not readable: as Path.rglob, a dir it cannot list has nothing below it
            continue
        dirs[d] = entries
        for name, e in entries.items():
            if not name.startswith((".", "_")) and _is_real_dir(e):
                pending.append(d / name)
    return Tree(root, dirs)


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
