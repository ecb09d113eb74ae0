"""The Parquet schemas of a job's two tables, defined once, and the per-column encodings they are written with.

Contents:
    GRADS_SCHEMA, grads_schema()   -- the columns of `grads.parquet` (plus the optional ones)
    STEPS_SCHEMA                   -- the columns of `steps.parquet`
    write_options(schema, rows)    -- per-column compression, dictionary and byte-stream-split choices

Example::

    from gradrunner.records.schema import GRADS_SCHEMA
    GRADS_SCHEMA.names[:2]      # ['run_id', 'experiment']
"""

from __future__ import annotations

import pyarrow as pa

from gradrunner.records.columns import (
    CONSTANT_COLUMNS,
    COUNT_COLUMNS,
    EXTRA_FLOAT_COLUMNS,
    HIST_COLUMN,
    PER_EXAMPLE_COLUMN,
    STAT_COLUMNS,
)

_CONSTANT_FIELDS = [pa.field(c, pa.string()) for c in CONSTANT_COLUMNS]

#: `grads.parquet`: the contract's columns in the contract's order, then `has_grad`, `reason` and `rank`.
GRADS_SCHEMA = pa.schema(
    [
        *_CONSTANT_FIELDS,
        pa.field("step", pa.int64()),
        pa.field("tap", pa.string()),
        pa.field("module", pa.string()),
        pa.field("name", pa.string()),
        pa.field("call", pa.int64()),
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("numel", pa.int64()),
        *[pa.field(c, pa.float64()) for c in STAT_COLUMNS],
        *[pa.field(c, pa.int64()) for c in COUNT_COLUMNS],
        pa.field("values", pa.list_(pa.float32())),
        pa.field("loss", pa.float64()),
        # False for a tap that took no part in the loss: statistics null, counts 0, shape [], numel 0.
        pa.field("has_grad", pa.bool_()),
        # Why has_grad is false ("module not called in this step", ...); null when it is true.
        pa.field("reason", pa.string()),
        # Reserved for distributed runs; 0 otherwise.
        pa.field("rank", pa.int64()),
        # The tapped tensor's own norm; for parameter taps the optimiser step's change and its ratio
        # to value_norm (null elsewhere, and where not finite).
        *[pa.field(c, pa.float64()) for c in EXTRA_FLOAT_COLUMNS],
        # A step of several backwards (train.accumulate > 1; two losses in a loop of one's own): the backward of the
        # step an activation record comes from (0, 1, ...); parameter taps are recorded once per optimisation step (the
        # accumulated .grad): null there, as everywhere in a step of one backward.
        pa.field("micro_step", pa.int64()),
        # Gradient edits: whether an edit changed this record's gradient (the statistics above are of the
        # gradient before it), and the norm after it (null where not edited).
        pa.field("edited", pa.bool_()),
        pa.field("edited_norm", pa.float64()),
    ]
)


def grads_schema(per_example: bool = False, histogram: bool = False) -> pa.Schema:
    """`GRADS_SCHEMA` plus the optional columns of `capture.per_example` and `capture.histogram`.

    Example::

        grads_schema(histogram=True).names[-1]     # 'hist_counts'
    """
    schema = GRADS_SCHEMA
    if per_example:
        schema = schema.append(pa.field(PER_EXAMPLE_COLUMN, pa.list_(pa.float64())))
    if histogram:
        schema = schema.append(pa.field(HIST_COLUMN, pa.list_(pa.int64())))
    return schema


#: `steps.parquet`: one row per optimisation step, captured or not.
STEPS_SCHEMA = pa.schema(
    [
        *_CONSTANT_FIELDS,
        pa.field("rank", pa.int64()),
        pa.field("step", pa.int64()),
        pa.field("captured", pa.bool_()),
        pa.field("loss", pa.float64()),
        pa.field("step_time_s", pa.float64()),
        pa.field("capture_time_s", pa.float64()),
        pa.field("peak_memory_bytes", pa.int64()),
        # The training step (gradrunner.run.loop.train_step): learning rate of param group 0 used by this step,
        # and of every group (`lrs`); total gradient norm over all parameters before clipping (true, unscaled);
        # whether clipping changed the gradients; the GradScaler's scale (null without fp16) and whether it
        # skipped the optimiser step (inf/NaN gradients); eval loss (null except every train.eval_every steps).
        pa.field("lr", pa.float64()),
        pa.field("lrs", pa.list_(pa.float64())),
        pa.field("grad_norm", pa.float64()),
        pa.field("clipped", pa.bool_()),
        pa.field("loss_scale", pa.float64()),
        pa.field("skipped", pa.bool_()),
        pa.field("eval_loss", pa.float64()),
    ]
)

#: The training step's columns of `steps.parquet` (null where a loop does not give them).
TRAIN_STEP_COLUMNS = tuple(STEPS_SCHEMA.names[STEPS_SCHEMA.get_field_index("lr"):])


def _leaf_paths(field: pa.Field) -> list[str]:
    """Parquet column paths of a field (`values` is stored as `values.list.element`)."""
    if pa.types.is_list(field.type):
        return [f"{field.name}.list.element"]
    return [field.name]


#: A file known to hold fewer rows than this when it is opened is compressed with snappy, not zstd.
SMALL_FILE_ROWS = 1024


def write_options(schema: pa.Schema, rows: int | None = None) -> dict[str, object]:
    """Per-column encodings, measured on gradients (benchmarks/parquet_throughput.py).

    Example::

        pq.ParquetWriter(path, schema, **write_options(schema))            # rows not known yet: zstd
        pq.write_table(table, path, **write_options(schema, rows=22))      # a small file: snappy

    Float statistics: byte stream split and no dictionary (smallest; byte stream split does
    nothing while a dictionary is on). Gradient values (lists of floats): stored plain, since
    random-looking float32 mantissas shrink by about 15% under zstd at a third of the write
    throughput. Everything else: dictionaries. Compressed with zstd, except in a file of fewer
    than `SMALL_FILE_ROWS` rows (`rows`, when the whole file is known before it is written):
    there each page is tiny, zstd sets up a fresh context for every page it decompresses (about
    20 µs, which dominates reading many small files), and snappy, which sets up nothing, leaves
    the file at most about 11% larger, smaller under 100 rows (BENCHMARKS.md, "load() at 10,000 jobs").
    """
    codec = "SNAPPY" if rows is not None and rows < SMALL_FILE_ROWS else "ZSTD"
    split: list[str] = []
    dictionary: list[str] = []
    compression: dict[str, str] = {}
    for field in schema:
        leaf = field.type.value_type if pa.types.is_list(field.type) else field.type
        for path in _leaf_paths(field):
            if pa.types.is_floating(leaf) and pa.types.is_list(field.type):
                compression[path] = "NONE"
            elif pa.types.is_floating(leaf):
                split.append(path)
                compression[path] = codec
            else:
                dictionary.append(path)
                compression[path] = codec
    return {"use_byte_stream_split": split, "use_dictionary": dictionary, "compression": compression}
