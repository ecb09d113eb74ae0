"""Closed segments of a job's records while it runs: readable before the record files have their footer.

A Parquet file is readable only once its footer is written, at the end of the job. `Segments`
copies every batch a job's writers take and, every `every` steps, writes the steps completed since
the last segment as small closed files in a hidden dir of the run dir:
`.live/<run id>/<table>-<n>.parquet.seg` (a hidden dir and a name not ending in `.parquet`: `load`,
pyarrow datasets and DuckDB globs never read it as records). When the writers have closed, the record files hold everything and the
segments are removed; a job killed outright keeps them. `gradrunner.analysis.live` reads them.
Nothing about the record files themselves changes (docs/what-survives.md).

Reading side (`read_segments`): only the segments of the run that holds (or last held) the run dir
(`live_run_id`: its lock file's run id) are read, never a dead run's left in the same dir; they must be
numbered 0, 1, ... without a gap, and hold that run id only. A segment that disappears while it is read
(the job closing its files) is `SegmentsGone`, which the reader answers by looking again.

Example::

    read_segments(run_dir, live_run_id(run_dir), "grads")   # the rows of the completed steps so far
    seg = Segments(run_dir, run_id, {"grads": grads_writer, "steps": steps_writer}, every=10)
    ...; seg.step_done()          # after each step's rows are written
    seg.close()                   # after the writers closed
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gradrunner.records.columns import LOCK_FILE, TEMP_SUFFIX

#: The hidden dir of a run dir holding running jobs' segments, one subdir per run id.
LIVE_DIR = ".live"


#: Segment files end so: a `*.parquet` glob (DuckDB's, polars') never takes them for records.
SEGMENT_SUFFIX = ".parquet.seg"


def segment_name(table: str, n: int) -> str:
    """The file name of segment `n` of `table` (zero-padded: names sort in order).

    Example::

        segment_name("grads", 3)      # 'grads-000003.parquet.seg'
    """
    return f"{table}-{n:06d}{SEGMENT_SUFFIX}"


def segment_number(filename: str, table: str) -> int | None:
    """The `n` of a segment file name of `table` (`segment_name`'s inverse); None for any other name.

    Example::

        segment_number("grads-000003.parquet.seg", "grads")     # 3
    """
    found = re.fullmatch(rf"{re.escape(table)}-(\d+){re.escape(SEGMENT_SUFFIX)}", filename)
    return int(found.group(1)) if found else None


class SegmentsGone(Exception):
    """A segment disappeared while the segments were read: the job removed them (its record files are closed)."""


class SegmentDamaged(Exception):
    """A segment that does not verify (unreadable, another run's rows, a gap in the numbering); `str(e)` says why."""


def live_run_id(directory: str | os.PathLike[str]) -> str | None:
    """The run id of the run that holds, or last held, the run dir: the one whose segments are live.

    Example::

        live_run_id("runs/mine")      # '9f2c...' (its lock file's run id); None: no run took this dir

    The run dir's lock file (`run.books.RunLock`) names the run that took the dir last, alive or killed;
    without one, the run whose temp record files are there (`.<file>.<run id>.tmp`), if only one is.
    A new job started in a killed job's dir takes the lock first: the dead run's segments are then
    never the live ones.
    """
    d = Path(directory)
    owner = lock_owner(d)
    if isinstance(owner.get("run_id"), str) and owner["run_id"]:
        return str(owner["run_id"])
    try:
        names = [e.name for e in os.scandir(d)]
    except OSError:
        return None
    ids = {m.group(1) for n in names if (m := re.fullmatch(rf"\.\w+\.parquet\.([\w-]+){re.escape(TEMP_SUFFIX)}", n))}
    return ids.pop() if len(ids) == 1 else None


def lock_owner(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The record in the run dir's lock file of the run that holds, or last held, it ({} if none reads).

    Example::

        lock_owner("runs/mine").get("pid")      # 4242 (host, pid, started, run_id: `run.books.RunLock`)
    """
    try:
        owner = json.loads((Path(directory) / LOCK_FILE).read_bytes() or b"{}")
    except (OSError, ValueError, RecursionError):
        return {}
    return owner if isinstance(owner, dict) else {}


def read_segments(directory: str | os.PathLike[str], run_id: str, table: str) -> pa.Table | None:
    """Every segment of `table` that run `run_id` wrote in `directory`, verified, as one table; None if it wrote none.

    Example::

        read_segments("runs/mine", live_run_id("runs/mine"), "steps").num_rows   # the steps completed so far

    Raises `SegmentsGone` when a segment disappears while being read (the job closed its files: read
    its record files instead), `SegmentDamaged` when one does not read, holds rows of another run, or
    the numbering has a gap (each checked page's CRC is verified where the writer wrote one).
    """
    where = Path(directory) / LIVE_DIR / run_id
    try:
        numbered = sorted((n, e.name) for e in os.scandir(where) if (n := segment_number(e.name, table)) is not None)
    except FileNotFoundError:
        return None
    if not numbered:
        return None
    if [n for n, _ in numbered] != list(range(len(numbered))):
        missing = sorted(set(range(numbered[-1][0] + 1)) - {n for n, _ in numbered})
        raise SegmentsGone(f"segment(s) {', '.join(map(str, missing[:5]))} of {table} in {where} are gone")
    parts = []
    for _, name in numbered:
        path = where / name
        try:
            part = pq.ParquetFile(path, page_checksum_verification=True).read()
        except FileNotFoundError:
            raise SegmentsGone(f"{path} is gone") from None
        except Exception as e:  # ArrowInvalid, OSError: a damaged segment
            if not path.exists():
                raise SegmentsGone(f"{path} is gone") from None
            raise SegmentDamaged(f"{path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})") from e
        if "run_id" in part.column_names:
            ids = {str(v) for v in pc.unique(part.column("run_id")).to_pylist()} - {run_id}
            if ids:
                raise SegmentDamaged(f"{path} holds rows of run(s) {', '.join(sorted(ids))}, not of run {run_id}")
        parts.append(part)
    return pa.concat_tables(parts, promote_options="permissive")


class Segments:
    """Tees the batches of a job's writers into closed segment files, every `every` completed steps."""

    def __init__(self, directory: str | os.PathLike[str], run_id: str, writers: dict[str, Any], every: int = 10) -> None:  # fmt: skip
        self.path = Path(directory) / LIVE_DIR / run_id
        self.every, self.steps, self.count = max(1, int(every)), 0, 0
        self._buffers: dict[str, list[pa.RecordBatch]] = {}
        self._schemas: dict[str, pa.Schema] = {}
        for table, writer in writers.items():
            self._tee(table, writer)

    def _tee(self, table: str, writer: Any) -> None:
        write_batch = writer.write_batch
        buffer: list[pa.RecordBatch] = self._buffers.setdefault(table, [])
        self._schemas[table] = writer.schema

        def tee(batch: pa.RecordBatch) -> None:
            write_batch(batch)
            buffer.append(batch)

        writer.write_batch = tee  # the instance's own: the writer's rows are written exactly as before

    def step_done(self) -> None:
        """Count a completed step; every `every` steps, write the steps since the last segment."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows of every table as segment files (each complete, then renamed)."""
        if not any(self._buffers.values()):
            return
        self.path.mkdir(parents=True, exist_ok=True)
        for table, buffer in self._buffers.items():
            rows = pa.Table.from_batches(buffer, schema=self._schemas[table])
            final = self.path / segment_name(table, self.count)
            temp = final.with_name(f".{final.name}.tmp")
            pq.write_table(rows, temp)
            os.replace(temp, final)
            buffer.clear()
        self.count += 1

    def close(self) -> None:
        """Remove the segments: the record files hold every row now."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()  # the .live dir, when no other run left segments there
        except OSError:
            pass
