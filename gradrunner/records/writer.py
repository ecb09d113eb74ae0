"""Records on disk: the writers that stream a job's rows (the schemas: `records.schema`).

Contents (the schemas themselves live in `records.schema`; GRADS_SCHEMA and STEPS_SCHEMA are re-exported):
    RecordWriter                 -- one row per step x tap x call, into `<job dir>/grads.parquet`
    StepsWriter                  -- one row per step (loss, timings, memory), `<job dir>/steps.parquet`
    run_metadata()               -- the file's key-value metadata: config YAML, versions, seed, commit
    recorded_config()            -- the resolved config a records file's metadata holds (however the run ended)
    deferred_signals()           -- SIGINT/SIGTERM/SIGHUP held back while a critical section runs

The file mechanics they share (temp file, row groups, checksums, atomic commit, closing a job's
writers as one, `write_whole`) are `records.table_writer`.

Both writers stream complete row groups through one `pq.ParquetWriter` into a hidden temp file that
carries the run id (`.grads.parquet.<run id>.tmp`, see `columns.temp_name`: ignored by pyarrow
dataset discovery and by DuckDB's `*.parquet` globs) and link it to the final name on `close()`, so
a `grads.parquet` always has its footer. Pages carry CRC checksums (`write_page_checksum`), which
`rundir.verify_job` checks before a resume trusts a file. Writing a row group and dropping it from
the buffer, and closing, run with signals deferred: an interrupt cannot split them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

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
)

# Defined in records/critical.py; re-exported for the modules that import it from the writer.
from gradrunner.records.critical import deferred_signals as deferred_signals

# The schemas are defined in records/schema.py; re-exported here for the modules that import them from the writer.
from gradrunner.records.schema import GRADS_SCHEMA as GRADS_SCHEMA
from gradrunner.records.schema import STEPS_SCHEMA as STEPS_SCHEMA
from gradrunner.records.schema import grads_schema as grads_schema
from gradrunner.records.table_writer import ROWS_PER_GROUP, ParquetTableWriter

#: The key of the records' metadata holding the job's resolved config (YAML).
CONFIG_KEY = "gradrunner.config"


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
        CONFIG_KEY: config_yaml,
        "gradrunner.version": _distribution_version("gradrunner", unknown="0+unknown"),
        "torch.version": _distribution_version("torch"),
        "python.version": platform.python_version(),
        "git.commit": _git_commit(cwd),
        "gradrunner.seed": str(seed),
        "gradrunner.start_time": start_time,
        **({OVERRIDES_KEY: json.dumps([str(o) for o in overrides])} if overrides is not None else {}),
    }


def recorded_config(path: Path) -> dict[str, Any] | None:
    """The config a records file (`grads.parquet`) was written with, from its metadata (`run_metadata`); None where
    the file or the key is missing or unreadable. Unlike `done.json`'s, it is there however the run ended.

    Example::

        recorded_config(job_dir / "grads.parquet")["capture"]["values"]     # 'sample'
    """
    import pyarrow.parquet as pq
    import yaml

    try:
        meta = pq.read_schema(path).metadata or {}
        node = yaml.safe_load(meta.get(CONFIG_KEY.encode(), b"") or "{}")
    except Exception:  # a damaged footer or YAML: whoever reads the records names it
        return None
    return node if isinstance(node, dict) and node else None


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
        """Append one row per record of `step` (the loss and `micro_step` come from `records`; a `micro_step`
        given here, one per record, takes the place of `records.micro_step`)."""
        if micro_step is None:
            micro_step = records.micro_step
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
        # a gradient of no elements (an expert given no tokens): a norm of 0, but no mean, spread, extremes or zeros
        empty = no_grad | (np.asarray(recs.numel, dtype=np.int64) == 0)
        for c in STAT_COLUMNS:
            cols[c] = pa.array(np.asarray(recs.stats[c], dtype=np.float64), mask=no_grad if c == "norm" else empty)
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
