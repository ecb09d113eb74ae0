"""Closed segments of a job's records while it runs: readable before the record files have their footer.

A Parquet file is readable only once its footer is written, at the end of the job. `Segments`
copies every batch a job's writers take and, every `every` steps, writes the steps completed since
the last segment as small closed files in a hidden dir of the run dir:
`.live/<run id>/<table>-<n>.parquet.seg` (a hidden dir and a name not ending in `.parquet`: `load`,
pyarrow datasets and DuckDB globs never read it as records). When the writers have closed, the record files hold everything and the
segments are removed; a job killed outright keeps them. `gradrunner.analysis.live` reads them.
Nothing about the record files themselves changes (docs/what-survives.md).

Example::

    seg = Segments(run_dir, run_id, {"grads": grads_writer, "steps": steps_writer}, every=10)
    ...; seg.step_done()          # after each step's rows are written
    seg.close()                   # after the writers closed
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

#: The hidden dir of a run dir holding running jobs' segments, one subdir per run id.
LIVE_DIR = ".live"


#: Segment files end so: a `*.parquet` glob (DuckDB's, polars') never takes them for records.
SEGMENT_SUFFIX = ".parquet.seg"


def segment_name(table: str, n: int) -> str:
    """The file name of segment `n` of `table` (zero-padded: names sort in order)."""
    return f"{table}-{n:06d}{SEGMENT_SUFFIX}"


class Segments:
    """Tees the batches of a job's writers into closed segment files, every `every` completed steps."""

    def __init__(self, directory: str | os.PathLike[str], run_id: str, writers: dict[str, Any], every: int = 10) -> None:
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
