"""Records on disk: the writers that stream a job's rows (the schemas: `records.schema`).

Contents (the schemas themselves live in `records.schema`; GRADS_SCHEMA and STEPS_SCHEMA are re-exported):
    RecordWriter                 -- one row per step x tap x call, into `<job dir>/grads.parquet`
    StepsWriter                  -- one row per step (loss, timings, memory), `<job dir>/steps.parquet`
    run_metadata()               -- the file's key-value metadata: config YAML, versions, seed, commit
    closing_together(*writers)   -- close (or abort) a job's writers as one, signals deferred
    write_whole(table, path)     -- a table written in one go, as the writers write a file of those rows
    deferred_signals()           -- SIGINT/SIGTERM/SIGHUP held back while a critical section runs

Both writers stream complete row groups through one `pq.ParquetWriter` into a hidden temp file that
carries the run id (`.grads.parquet.<run id>.tmp`, see `columns.temp_name`: ignored by pyarrow
dataset discovery and by DuckDB's `*.parquet` globs) and link it to the final name on `close()`, so
a `grads.parquet` always has its footer. Pages carry CRC checksums (`write_page_checksum`), which
`rundir.verify_job` checks before a resume trusts a file. Writing a row group and dropping it from
the buffer, and closing, run with signals deferred: an interrupt cannot split them.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import importlib.metadata
import json
import os
import platform
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import (
    CONSTANT_COLUMNS,
    COUNT_COLUMNS,
    EXTRA_FLOAT_COLUMNS,
    GRADS_FILE,
    HIST_COLUMN,
    HIST_EDGES,
    HIST_EDGES_KEY,
    OVERRIDES_KEY,
    PER_EXAMPLE_COLUMN,
    STAT_COLUMNS,
    STEPS_FILE,
    StepRecords,
    temp_name,
)

# Defined in records/critical.py; re-exported for the modules that import it from the writer.
from gradrunner.records.critical import deferred_signals as deferred_signals

# The schemas are defined in records/schema.py; re-exported here for the modules that import them from the writer.
from gradrunner.records.schema import GRADS_SCHEMA as GRADS_SCHEMA
from gradrunner.records.schema import STEPS_SCHEMA as STEPS_SCHEMA
from gradrunner.records.schema import grads_schema as grads_schema
from gradrunner.records.schema import write_options

_W = TypeVar("_W", bound="ParquetTableWriter")


def run_metadata(
    config_yaml: str,
    seed: int,
    start_time: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] | None = None,
) -> dict[str, str]:
    """Key-value metadata for a job's Parquet files: what ran, with which versions, from which commit.

    Example::

        meta = run_metadata(OmegaConf.to_yaml(cfg), seed=cfg.seed)
        RecordWriter(job_dir / "grads.parquet", constants=consts, metadata=meta)
        pq.read_schema(job_dir / "grads.parquet").metadata[b"gradrunner.config"]

    `git.commit` is the HEAD of the repository holding `cwd` (default: the current directory), or
    "" outside a repository; `gradrunner.start_time` defaults to now, ISO 8601 in UTC. `overrides` (the
    job's own command-line overrides, `gradrunner.overrides`, a JSON list) are what `analysis.load`
    labels a sweep's jobs by: they travel with the records, whatever later happens to `.hydra/`.
    """
    if start_time is None:
        start_time = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "gradrunner.config": config_yaml,
        "gradrunner.version": _distribution_version("gradrunner", unknown="0+unknown"),
        "torch.version": _distribution_version("torch"),
        "python.version": platform.python_version(),
        "git.commit": _git_commit(cwd),
        "gradrunner.seed": str(seed),
        "gradrunner.start_time": start_time,
        **({OVERRIDES_KEY: json.dumps([str(o) for o in overrides])} if overrides is not None else {}),
    }


def _distribution_version(name: str, unknown: str = "unknown") -> str:
    """An installed distribution's version, read from its metadata (no import: records need no torch)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return unknown


def _git_commit(cwd: str | os.PathLike[str] | None) -> str:
    # Metadata must never fail a run: no git, no repository, no commit yet or a hung git all give "".
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


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
    block normally or by KeyboardInterrupt closes (what was written stays readable); any other
    exception closes if at least one step was written, else aborts (deletes the temp file); a
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

    Kept (closed) when `error` is None or a KeyboardInterrupt, or when a step was written; else aborted.
    All temp files are finished before any is renamed, and if one cannot be finished or renamed
    (a full disk), every writer is aborted: the tables a job leaves always agree.
    """
    with deferred_signals():
        keep = error is None or isinstance(error, KeyboardInterrupt) or any(w.steps_written for w in writers)
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


class _RunTableWriter(ParquetTableWriter):
    """A table of one job: the constant columns (run_id, ..., rank) are repeated on every row.

    `path` not ending in `.parquet` is the job dir: the file is `<path>/<default_name>`.
    `constants` must hold exactly run_id, experiment, strategy, device and dtype.
    """

    #: Schema of the table, and the file name used when the writer is given a directory.
    table_schema: pa.Schema
    default_name: str

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        constants: dict[str, str],
        metadata: dict[str, str],
        rows_per_group: int = ROWS_PER_GROUP,
        rank: int = 0,
        schema: pa.Schema | None = None,
    ) -> None:
        path = Path(path)
        if path.suffix != ".parquet":  # a job dir, existing or not
            path = path / self.default_name
        if set(constants) != set(CONSTANT_COLUMNS):
            raise GradrunnerError(
                f"constants has keys {sorted(constants)}; expected exactly {list(CONSTANT_COLUMNS)}"
            )
        self.constants = {k: str(v) for k, v in constants.items()}
        self._rank = rank
        self._constant_cache: dict[int, dict[str, pa.Array]] = {}
        super().__init__(path, self.table_schema if schema is None else schema, metadata=metadata, rows_per_group=rows_per_group,
                         run_id=self.constants["run_id"])  # fmt: skip

    @property
    def rank(self) -> int:
        """The `rank` column of the rows written from now on (a gatherer writes each rank's rows in turn)."""
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        if rank != self._rank:
            self._rank = rank
            self._constant_cache.clear()  # the cached constant columns carry the rank

    def _constant_columns(self, n: int) -> dict[str, pa.Array]:
        # One repeated value per column: Parquet's dictionary encoding stores it once per page.
        # Arrow arrays are immutable, and steps mostly have the same length: build them once.
        if n not in self._constant_cache:
            if len(self._constant_cache) > 8:
                self._constant_cache.clear()
            cols = {c: pa.repeat(pa.scalar(v, pa.string()), n) for c, v in self.constants.items()}
            cols["rank"] = pa.repeat(pa.scalar(self.rank, pa.int64()), n)
            self._constant_cache[n] = cols
        return dict(self._constant_cache[n])


class RecordWriter(_RunTableWriter):
    """Streams the gradient records of one job to `grads.parquet` (schema `GRADS_SCHEMA`).

    Example::

        with RecordWriter(job_dir / "grads.parquet", constants=consts, metadata=run_metadata(yaml, 0)) as w:
            w.write_step(step, collector.finish(loss))
        df = pd.read_parquet(job_dir / "grads.parquet")

    `path` not ending in `.parquet` is the job dir (`<path>/grads.parquet`); `constants` holds
    run_id, experiment, strategy, device and dtype. Guarantees: see `ParquetTableWriter`.
    """

    table_schema = GRADS_SCHEMA
    default_name = GRADS_FILE

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        constants: dict[str, str],
        metadata: dict[str, str],
        rows_per_group: int = ROWS_PER_GROUP,
        rank: int = 0,
        per_example: bool = False,
        histogram: bool = False,
    ) -> None:
        """`per_example` / `histogram` add the optional columns (the bin edges go into the metadata)."""
        if histogram:
            metadata = {**metadata, HIST_EDGES_KEY: json.dumps(list(HIST_EDGES))}
        super().__init__(path, constants=constants, metadata=metadata, rows_per_group=rows_per_group, rank=rank,
                         schema=grads_schema(per_example, histogram))  # fmt: skip

    def write_step(self, step: int, records: StepRecords, micro_step: list[int | None] | None = None) -> None:
        """Append one row per record of `step` (the loss comes from `records.loss`); `micro_step` per record."""
        if len(records):
            batch = self._grads_batch(step, records)
            if micro_step is not None:
                i = batch.schema.get_field_index("micro_step")
                batch = batch.set_column(i, "micro_step", pa.array(micro_step, pa.int64()))
            self.write_batch(batch)
        self.steps_written += 1

    def _grads_batch(self, step: int, recs: StepRecords) -> pa.RecordBatch:
        n = len(recs)
        no_grad = ~np.asarray(recs.has_grad, dtype=bool)  # statistics of a tap without gradient: null
        cols = self._constant_columns(n)
        cols.update(
            step=pa.repeat(pa.scalar(step, pa.int64()), n),
            tap=pa.array([k.tap for k in recs.keys], pa.string()),
            module=pa.array([k.module for k in recs.keys], pa.string()),
            name=pa.array([k.name for k in recs.keys], pa.string()),
            call=pa.array([k.call for k in recs.keys], pa.int64()),
            shape=_list_array(recs.shape, np.int64),
            numel=pa.array(np.asarray(recs.numel, dtype=np.int64)),
            values=_list_array(recs.values if recs.values is not None else [None] * n, np.float32),
            loss=pa.repeat(pa.scalar(recs.loss, pa.float64()), n),
            has_grad=pa.array(~no_grad),
            reason=pa.array(recs.reason if recs.reason is not None else [None] * n, pa.string()),
        )
        for c in STAT_COLUMNS:
            cols[c] = pa.array(np.asarray(recs.stats[c], dtype=np.float64), mask=no_grad)
        for c in COUNT_COLUMNS:  # 0 (not null) without gradient: keeps the columns int64 in pandas
            cols[c] = pa.array(np.where(no_grad, 0, np.asarray(recs.counts[c], dtype=np.int64)))
        for c in EXTRA_FLOAT_COLUMNS:
            col = getattr(recs, c)
            v = np.full(n, np.nan) if col is None else np.asarray(col, dtype=np.float64)
            cols[c] = pa.array(v, mask=~np.isfinite(v))
        cols["micro_step"] = pa.nulls(n, pa.int64())
        edited = np.zeros(n, dtype=bool) if recs.edited is None else np.asarray(recs.edited, dtype=bool)
        cols["edited"] = pa.array(edited)
        cols["edited_norm"] = pa.array(np.full(n, np.nan) if recs.edited_norm is None else recs.edited_norm, mask=~edited)
        names = self.schema.names
        if PER_EXAMPLE_COLUMN in names:
            cols[PER_EXAMPLE_COLUMN] = _list_array(recs.per_example_norm or [None] * n, np.float64)
        if HIST_COLUMN in names:
            cols[HIST_COLUMN] = _list_array(recs.hist_counts or [None] * n, np.int64)
        return pa.RecordBatch.from_arrays([cols[f.name] for f in self.schema], schema=self.schema)


def _list_array(items: Sequence[Sequence[int] | np.ndarray | None], dtype: type[np.generic]) -> pa.Array:
    """A list array from per-row sequences (None -> null), built from one flat buffer and offsets."""
    lengths = np.fromiter((0 if x is None else len(x) for x in items), dtype=np.int64, count=len(items))
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise GradrunnerError(
            f"one step holds {offsets[-1]} captured values, more than a Parquet list column takes "
            f"({np.iinfo(np.int32).max}); use capture.values=sample or fewer taps"
        )
    kept = [np.asarray(x, dtype=dtype).reshape(-1) for x in items if x is not None]
    # A step's values are consecutive slices of the collector's one host buffer: wrap that buffer
    # (zero-copy) rather than concatenate; anything else is concatenated.
    base = kept[0].base if kept else None
    flat = None
    if isinstance(base, np.ndarray) and base.dtype == dtype and base.flags.c_contiguous:
        start = kept[0].__array_interface__["data"][0]
        at = start
        for k in kept:
            if k.base is not base or k.__array_interface__["data"][0] != at or not k.flags.c_contiguous:
                break
            at += k.nbytes
        else:
            first = (start - base.__array_interface__["data"][0]) // base.itemsize
            flat = base.reshape(-1)[first : first + int(offsets[-1])]
    if flat is None:
        flat = np.concatenate(kept) if kept else np.zeros(0, dtype=dtype)
    nulls = np.fromiter((x is None for x in items), dtype=bool, count=len(items))
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(flat), mask=pa.array(nulls) if nulls.any() else None
    )


class StepsWriter(_RunTableWriter):
    """Streams one row per optimisation step to `steps.parquet` (schema `STEPS_SCHEMA`).

    Example::

        with StepsWriter(job_dir / "steps.parquet", constants=consts, metadata=meta) as w:
            w.write(step=0, captured=True, loss=0.7, step_time_s=0.03, capture_time_s=0.01, peak_memory_bytes=None)
        pd.read_parquet(job_dir / "steps.parquet")

    Same arguments, temp-file, close and abort rules as `RecordWriter`.
    """

    table_schema = STEPS_SCHEMA
    default_name = STEPS_FILE

    def write(
        self,
        step: int,
        captured: bool,
        loss: float | None,
        step_time_s: float | None,
        capture_time_s: float | None,
        peak_memory_bytes: int | None,
        **train: object,
    ) -> None:
        """Append the row of `step` (None where a value is unknown, e.g. peak memory on CPU).

        `train` holds the training step's columns (`lr`, `lrs`, `grad_norm`, `clipped`, `loss_scale`,
        `skipped`, `eval_loss`); those not given are null.
        """
        row: dict[str, object] = dict(self.constants, rank=self.rank, step=step, captured=captured, loss=loss)
        row.update(step_time_s=step_time_s, capture_time_s=capture_time_s, peak_memory_bytes=peak_memory_bytes)
        row.update(train)
        self.write_batch(pa.RecordBatch.from_pylist([row], schema=self.schema))
        self.steps_written += 1
