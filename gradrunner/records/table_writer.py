"""One Parquet table streamed to disk: row groups to a hidden temp file, committed atomically, or dropped.

Contents:
    ParquetTableWriter           -- record batches of one schema to a file, committed on `close()`
    finish_all(writers, error)   -- close (or abort) a job's writers as one, signals deferred
    closing_together(*writers)   -- a block left with `finish_all`: a job's tables kept or dropped as one
    write_whole(table, path)     -- a table written in one go, as the writers write a file of those rows
    ROWS_PER_GROUP               -- rows per row group

The temp file carries the run id (`.grads.parquet.<run id>.tmp`, `columns.temp_name`: ignored by
pyarrow dataset discovery and by DuckDB's `*.parquet` globs) and is linked to the final name on
`close()`, so a final file always has its footer. Pages carry CRC checksums. Writing a row group and
dropping it from the buffer, and closing, run with signals deferred: an interrupt cannot split them.
The job's tables (`grads.parquet`, `steps.parquet`) are `records.writer`.

Example::

    with ParquetTableWriter(job_dir / "t.parquet", schema, metadata={}) as w:
        w.write_batch(batch)
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import temp_name
from gradrunner.records.critical import deferred_signals
from gradrunner.records.schema import write_options

_W = TypeVar("_W", bound="ParquetTableWriter")

#: Rows per row group (the writers' default `rows_per_group`).
ROWS_PER_GROUP = 8192

#: Buffered batches are merged into one when this many have piled up.
_COALESCE_BATCHES = 64

class ParquetTableWriter:
    """Streams record batches of one schema to a Parquet file, committed atomically on `close()`.

    Example::

        with ParquetTableWriter(job_dir / "t.parquet", schema, metadata={}) as w:
            w.write_batch(batch)      # buffered; full row groups go to `.t.parquet.tmp`
        # here t.parquet exists, with its footer, and the temp file is gone

    Rows are buffered until `rows_per_group` rows (or `max_buffer_bytes` bytes) are waiting, then
    written as row groups, so memory does not grow with the length of a run. Leaving the `with`
    block normally, or by KeyboardInterrupt once a row was written, closes (what was written stays readable);
    any other exception closes if at least one step was written, else aborts (deletes the temp file); a
    close or a write that fails (a full disk) aborts too and re-raises. An existing final file is
    never overwritten, and the writer only ever deletes its own temp file (named with `run_id`).
    """

    #: CRC checksums on every page (measured cost: BENCHMARKS.md, benchmarks/parquet_throughput.py).
    page_checksums = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: pa.Schema,
        *,
        metadata: dict[str, str],
        rows_per_group: int = ROWS_PER_GROUP,
        max_buffer_bytes: int = 64 << 20,
        run_id: str | None = None,
    ) -> None:
        assert rows_per_group > 0, rows_per_group
        self.path = Path(path)
        self.temp_path = self.path.with_name(temp_name(self.path.name, run_id or uuid.uuid4().hex))
        self.schema = schema.with_metadata({str(k): str(v) for k, v in metadata.items()})
        self.rows_per_group = rows_per_group
        self.max_buffer_bytes = max_buffer_bytes
        self.steps_written = 0
        self.rows_written = 0
        self._buffer: list[pa.RecordBatch] = []
        self._buffered_rows = 0
        self._buffered_bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._state = "open"
        self._refuse_existing()

    @property
    def rows_buffered(self) -> int:
        """Rows waiting in memory for the next row group (fewer than `rows_per_group`)."""
        return self._buffered_rows

    def write_batch(self, batch: pa.RecordBatch) -> None:
        """Buffer `batch` (of this writer's schema); write every complete row group."""
        assert self._state == "open", f"{self.path}: write after {self._state}"
        if batch.num_rows:
            self._buffer.append(batch)
            self._buffered_rows += batch.num_rows
            self._buffered_bytes += batch.nbytes
            if len(self._buffer) >= _COALESCE_BATCHES:
                # Thousands of one-step batches cost far more memory than their rows: merge them.
                self._buffer = pa.Table.from_batches(self._buffer, schema=self.schema).combine_chunks().to_batches()
        if self._buffered_rows >= self.rows_per_group or self._buffered_bytes >= self.max_buffer_bytes:
            self._flush(everything=self._buffered_bytes >= self.max_buffer_bytes)

    def close(self) -> Path:
        """Write what is buffered and the footer, then move the file to its final name."""
        if self._state == "closed":
            return self.path
        with deferred_signals():
            self.finish_temp()
            self.commit()
        return self.path

    def finish_temp(self) -> None:
        """Write what is buffered and the footer into the temp file (first half of `close`)."""
        assert self._state == "open", f"{self.path}: close after {self._state}"
        self._flush(everything=True, last=True)
        try:
            self._open(rows=0).close()  # opening here too, so a run without rows still leaves a valid file
        except BaseException:
            self._state = "broken"
            raise
        self._state = "finished"

    def commit(self) -> None:
        """Give the finished temp file its final name, never replacing an existing file (second half)."""
        assert self._state == "finished", f"{self.path}: commit after {self._state}"
        self._refuse_existing()
        try:
            os.link(self.temp_path, self.path)  # fails if the name exists: no other run's file is replaced
        except FileExistsError:
            self._refuse_existing()
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            os.replace(self.temp_path, self.path)  # a filesystem without hard links
        self.temp_path.unlink(missing_ok=True)
        self._state = "closed"

    def abort(self) -> None:
        """Drop everything: close the temp file and delete it. No final file is created."""
        if self._state in ("closed", "aborted"):
            return
        self._state = "aborted"
        self._buffer = []
        try:
            if self._writer is not None:
                with contextlib.suppress(Exception):  # a broken writer (full disk) cannot close
                    self._writer.close()
        finally:
            self.temp_path.unlink(missing_ok=True)

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        finish_all([self], exc)

    def _refuse_existing(self) -> None:
        if os.path.lexists(self.path):
            raise GradrunnerError(
                f"{self.path} already exists; gradrunner never overwrites records. "
                "Write to a new output directory (e.g. hydra.run.dir=...) or move the old file away."
            )

    def _open(self, rows: int | None = None) -> pq.ParquetWriter:
        """The Parquet writer, opened on first use; `rows`: the whole file's row count, when it is known."""
        if self._writer is None:
            self.temp_path.parent.mkdir(parents=True, exist_ok=True)
            options = write_options(self.schema, rows=rows)
            checksums = self.page_checksums
            self._writer = pq.ParquetWriter(self.temp_path, self.schema, write_page_checksum=checksums, **options)
        return self._writer

    def _flush(self, everything: bool, last: bool = False) -> None:
        """Write full row groups (and, if `everything`, the partial last one) from the buffer.

        `last`: no rows come after these (the file is being finished), so a file opened here holds
        exactly these rows, and a small one is written with the codec for small files (`write_options`).

        Writing the rows and dropping them from the buffer happen with signals deferred, so a row
        group is never written twice; a write that fails leaves the writer "broken" (only `abort`).
        """
        if not self._buffer:
            return
        table = pa.Table.from_batches(self._buffer, schema=self.schema)
        cut = table.num_rows if everything else table.num_rows - table.num_rows % self.rows_per_group
        rest = table.slice(cut).combine_chunks()
        with deferred_signals():
            if cut:
                try:
                    writer = self._open(rows=table.num_rows if last else None)
                    writer.write_table(table.slice(0, cut), row_group_size=self.rows_per_group)
                except BaseException:
                    self._state = "broken"
                    raise
                self.rows_written += cut
            self._buffer = rest.to_batches()
            self._buffered_rows = rest.num_rows
            self._buffered_bytes = rest.nbytes


def finish_all(writers: Sequence[ParquetTableWriter], error: BaseException | None) -> None:
    """Close every writer of a job, or abort every one, as one step, with signals deferred.

    Example::

        finish_all([grads, steps], None)      # both files final, or (on a failure) neither

    Kept (closed) when `error` is None, or when a step was written (on a KeyboardInterrupt: or any row, for a
    writer that counts no steps); else aborted: Ctrl-C before the first step leaves no empty files.
    All temp files are finished before any is renamed, and if one cannot be finished or renamed
    (a full disk), every writer is aborted: the tables a job leaves always agree.
    """
    with deferred_signals():
        wrote = any(w.steps_written for w in writers)
        rows = any(w.rows_written or w.rows_buffered for w in writers)
        keep = error is None or wrote or (isinstance(error, KeyboardInterrupt) and rows)
        if not keep:
            for w in writers:
                w.abort()
            return
        try:
            for w in writers:
                if w._state == "open":
                    w.finish_temp()
            for w in writers:
                if w._state == "finished":
                    w.commit()
        except BaseException:
            for w in writers:  # a file that cannot be finished (the disk is full) is removed, with its siblings
                with contextlib.suppress(OSError):
                    if w._state == "closed":
                        w.path.unlink(missing_ok=True)
                    w.abort()
            raise


@contextlib.contextmanager
def closing_together(*writers: ParquetTableWriter) -> Iterator[None]:
    """Leave the block with `finish_all(writers, error)`: a job's tables are kept or dropped as one.

    Example::

        with closing_together(grads, steps):
            ...   # Ctrl-C here: both files closed, with the same steps
    """
    try:
        yield
    except BaseException as e:
        finish_all(writers, e)
        raise
    finish_all(writers, None)


def write_whole(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """`table` written to `path` in one go, as `ParquetTableWriter` writes a file of exactly these rows.

    Example::

        write_whole(pq.read_table(job / "grads.parquet"), copy / "grads.parquet")   # a copied job's file

    The same encodings, codec (chosen by the row count: `write_options`), row groups and page
    checksums; no temp file, no atomic rename (for copies and rewrites made by benchmarks and tests).
    """
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP, write_page_checksum=ParquetTableWriter.page_checksums,
                   **write_options(table.schema, rows=table.num_rows))  # fmt: skip
