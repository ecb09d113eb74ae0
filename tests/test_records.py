"""gradrunner.records.writer: schema, round trips, row groups, atomic close, metadata, other readers."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import COUNT_COLUMNS, STAT_COLUMNS, StepRecords, TapKey, temp_name
from gradrunner.records.schema import SMALL_FILE_ROWS, write_options
from gradrunner.records.table_writer import write_whole
from gradrunner.records.writer import GRADS_SCHEMA, STEPS_SCHEMA, RecordWriter, StepsWriter, run_metadata

CONSTANTS = {"run_id": "run-1", "experiment": "mlp", "strategy": "hook", "device": "cpu", "dtype": "float32"}
CONTRACT_COLUMNS = [
    "run_id", "experiment", "strategy", "device", "dtype", "step", "tap", "module", "name", "call",
    "shape", "numel", "norm", "mean", "std", "min", "max", "abs_max", "zero_frac",
    "nan_count", "inf_count", "values", "loss",
]  # fmt: skip


def make_step(step: int, values: str = "none") -> StepRecords:
    """Four records: a 3x4 output, a scalar, the second call of fc1, and a tap without gradient."""
    g = torch.Generator().manual_seed(step)
    col = Collector(values=values, sample_size=5, seed=0)
    col.add(TapKey("fc1", "output", 0), torch.randn(3, 4, generator=g))
    col.add(TapKey("", "output", 0), torch.tensor(2.0 + step))
    col.add(TapKey("fc1", "output", 1), torch.tensor([0.0, float("nan"), float("inf"), 1.0]))
    col.add(TapKey("fc2", "weight", 0), None)
    return col.finish(torch.tensor(0.5 * step))


def write(path: Path, steps: list[StepRecords], **kw: object) -> Path:
    with RecordWriter(path, constants=CONSTANTS, metadata={"k": "v"}, **kw) as w:
        for i, recs in enumerate(steps):
            w.write_step(i, recs)
    return w.path


def test_schema_has_contract_columns_in_order_then_has_grad_reason_and_rank() -> None:
    assert GRADS_SCHEMA.names == [*CONTRACT_COLUMNS, "has_grad", "reason", "rank", "value_norm", "update_norm", "update_ratio",
                                  "micro_step", "edited", "edited_norm"]
    types = {f.name: f.type for f in GRADS_SCHEMA}
    assert types["shape"] == pa.list_(pa.int64()) and types["values"] == pa.list_(pa.float32())
    assert all(types[c] == pa.float64() for c in [*STAT_COLUMNS, "loss"])
    assert all(types[c] == pa.int64() for c in ["step", "call", "numel", *COUNT_COLUMNS, "rank"])
    assert all(types[c] == pa.string() for c in CONSTANTS) and types["has_grad"] == pa.bool_()


@pytest.mark.parametrize("values", ["none", "full", "sample"])
def test_round_trip_matches_step_records(tmp_path: Path, values: str) -> None:
    steps = [make_step(i, values) for i in range(3)]
    table = pq.read_table(write(tmp_path / "grads.parquet", steps))
    assert table.schema.remove_metadata() == GRADS_SCHEMA
    rows = table.to_pylist()
    assert len(rows) == 12
    for step, recs in enumerate(steps):
        for i in range(len(recs)):
            row, want = rows[4 * step + i], recs.row(i)
            assert {k: row[k] for k in CONSTANTS} == CONSTANTS
            assert (row["step"], row["loss"], row["rank"]) == (step, recs.loss, 0)
            for k in ("tap", "module", "name", "call", "shape", "numel", "has_grad", *COUNT_COLUMNS):
                assert row[k] == want[k], k
            if want["has_grad"]:
                np.testing.assert_array_equal([row[c] for c in STAT_COLUMNS], [want[c] for c in STAT_COLUMNS])
            if values == "none" or not want["has_grad"]:
                assert row["values"] is None
            else:
                np.testing.assert_array_equal(np.array(row["values"], np.float32), want["values"])


def test_sample_and_full_values_have_expected_lengths(tmp_path: Path) -> None:
    full = pq.read_table(write(tmp_path / "a.parquet", [make_step(0, "full")])).column("values").to_pylist()
    sample = pq.read_table(write(tmp_path / "b.parquet", [make_step(0, "sample")])).column("values").to_pylist()
    assert [None if v is None else len(v) for v in full] == [12, 1, 4, None]
    assert [None if v is None else len(v) for v in sample] == [5, 1, 4, None]


def test_no_grad_row_has_null_statistics_and_empty_shape(tmp_path: Path) -> None:
    table = pq.read_table(write(tmp_path / "grads.parquet", [make_step(0)]))
    row = table.to_pylist()[3]
    assert row["tap"] == "fc2:weight" and row["has_grad"] is False
    assert [row[c] for c in STAT_COLUMNS] == [None] * len(STAT_COLUMNS)
    assert (row["shape"], row["numel"], row["nan_count"], row["inf_count"]) == ([], 0, 0, 0)
    assert all(table.column(c).null_count == 1 for c in STAT_COLUMNS)
    # NaN statistics of a real gradient stay NaN, not null: the scalar's std (one element)
    assert np.isnan(table.column("std")[1].as_py())


def test_non_finite_counts_and_loss_written(tmp_path: Path) -> None:
    df = pd.read_parquet(write(tmp_path / "grads.parquet", [make_step(0), make_step(1)]))
    odd = df[(df.tap == "fc1:output") & (df.call == 1)]
    assert odd.nan_count.tolist() == [1, 1] and odd.inf_count.tolist() == [1, 1]
    assert df.loss.tolist() == [0.0] * 4 + [0.5] * 4
    assert df.nan_count.dtype == np.int64


def test_loss_none_is_null(tmp_path: Path) -> None:
    col = Collector()
    col.add(TapKey("fc1", "output", 0), torch.ones(2))
    table = pq.read_table(write(tmp_path / "grads.parquet", [col.finish()]))
    assert table.column("loss").to_pylist() == [None]


def test_empty_step_and_empty_run_give_valid_file(tmp_path: Path) -> None:
    f = write(tmp_path / "grads.parquet", [Collector().finish(), StepRecords()])
    table = pq.read_table(f)
    assert table.num_rows == 0 and table.schema.remove_metadata() == GRADS_SCHEMA


def test_metadata_round_trips(tmp_path: Path) -> None:
    meta = run_metadata("model:\n  hidden: 8\n", seed=7, start_time="2024-01-02T03:04:05+00:00")
    with RecordWriter(tmp_path, constants=CONSTANTS, metadata=meta) as w:
        w.write_step(0, make_step(0))
    got = {k.decode(): v.decode() for k, v in pq.read_schema(tmp_path / "grads.parquet").metadata.items()}
    assert got == meta
    assert got["gradrunner.config"] == "model:\n  hidden: 8\n" and got["gradrunner.seed"] == "7"
    assert got["torch.version"] == torch.__version__
    assert got["python.version"] == ".".join(map(str, sys.version_info[:3]))


def test_run_metadata_defaults(tmp_path: Path) -> None:
    meta = run_metadata("a: 1\n", seed=0, cwd=tmp_path)  # tmp_path: not inside a git repository
    assert meta["git.commit"] == ""
    assert meta["gradrunner.version"]
    start = datetime.datetime.fromisoformat(meta["gradrunner.start_time"])
    assert start.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - start) < datetime.timedelta(minutes=1)


def test_run_metadata_git_commit(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert run_metadata("", seed=0, cwd=tmp_path)["git.commit"] == head


def test_row_groups_are_full_and_buffer_is_bounded(tmp_path: Path) -> None:
    with RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=6) as w:
        for step in range(10):  # 4 rows per step, 40 rows
            w.write_step(step, make_step(step))
            assert w.rows_buffered < 6
            assert w.rows_written + w.rows_buffered == 4 * (step + 1)
    meta = pq.ParquetFile(tmp_path / "grads.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [6] * 6 + [4]


def test_step_larger_than_a_row_group_is_split(tmp_path: Path) -> None:
    write(tmp_path / "grads.parquet", [make_step(0), make_step(1)], rows_per_group=3)
    meta = pq.ParquetFile(tmp_path / "grads.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3, 3, 2]


def test_byte_cap_flushes_before_rows_per_group(tmp_path: Path) -> None:
    w = RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=1000)
    w.max_buffer_bytes = 1  # every step is over the cap: written at once
    w.write_step(0, make_step(0, "full"))
    assert (w.rows_buffered, w.rows_written) == (0, 4)
    w.close()


def test_encodings_follow_field_notes(tmp_path: Path) -> None:
    meta = pq.ParquetFile(write(tmp_path / "grads.parquet", [make_step(0, "full")])).metadata.row_group(0)
    enc = {meta.column(i).path_in_schema: meta.column(i).encodings for i in range(meta.num_columns)}
    codec = {meta.column(i).path_in_schema: meta.column(i).compression for i in range(meta.num_columns)}
    assert codec.pop("values.list.element") == "UNCOMPRESSED"  # gradients barely compress: kept plain, fast
    assert set(codec.values()) == {"SNAPPY"}  # 4 rows, all known when the file is opened: a small file
    assert "BYTE_STREAM_SPLIT" not in enc["values.list.element"] and "RLE_DICTIONARY" not in enc["values.list.element"]
    for c in [*STAT_COLUMNS, "loss"]:
        assert "BYTE_STREAM_SPLIT" in enc[c] and "RLE_DICTIONARY" not in enc[c], c
    for c in [*CONSTANTS, "tap", "module", "name"]:
        assert "RLE_DICTIONARY" in enc[c], c


def codecs(path: Path) -> set[str]:
    meta = pq.ParquetFile(path).metadata
    return {meta.row_group(g).column(i).compression for g in range(meta.num_row_groups) for i in range(meta.num_columns)}


def test_small_files_are_snappy_and_the_rest_zstd(tmp_path: Path) -> None:
    # A file whose rows are all buffered until close, and fewer than SMALL_FILE_ROWS: snappy (no zstd context per page).
    small = write(tmp_path / "a" / "grads.parquet", [make_step(i) for i in range(3)])
    assert pq.ParquetFile(small).metadata.num_rows == 12
    assert codecs(small) == {"SNAPPY", "UNCOMPRESSED"}
    # A row group written before the end: the file's size is unknown when it is opened, so zstd throughout.
    early = write(tmp_path / "b" / "grads.parquet", [make_step(i) for i in range(3)], rows_per_group=4)
    meta = pq.ParquetFile(early).metadata
    assert meta.num_row_groups == 3 and codecs(early) == {"ZSTD", "UNCOMPRESSED"}
    # The threshold, and the same rows read back from both.
    assert {write_options(GRADS_SCHEMA, rows=n)["compression"]["norm"] for n in (0, SMALL_FILE_ROWS - 1)} == {"SNAPPY"}
    assert {write_options(GRADS_SCHEMA, rows=n)["compression"]["norm"] for n in (SMALL_FILE_ROWS, None)} == {"ZSTD"}
    pd.testing.assert_frame_equal(pq.read_table(small).to_pandas(), pq.read_table(early).to_pandas())


def test_write_whole_writes_a_file_as_the_writer_does(tmp_path: Path) -> None:
    for n in (3, 600):  # 12 rows (snappy) and 2,400 rows (zstd), all written at close as one row group
        streamed = write(tmp_path / str(n) / "grads.parquet", [make_step(i) for i in range(n)])
        table = pq.read_table(streamed)
        write_whole(table, tmp_path / f"{n}.parquet")
        a, b = pq.ParquetFile(streamed).metadata, pq.ParquetFile(tmp_path / f"{n}.parquet").metadata
        assert a.num_row_groups == b.num_row_groups == 1
        layout = [[(m.row_group(0).column(i).path_in_schema, m.row_group(0).column(i).compression,
                    sorted(m.row_group(0).column(i).encodings)) for i in range(m.num_columns)] for m in (a, b)]  # fmt: skip
        assert layout[0] == layout[1]
        assert {c for _, c, _ in layout[0]} == ({"SNAPPY", "UNCOMPRESSED"} if n == 3 else {"ZSTD", "UNCOMPRESSED"})
        reread = pq.ParquetFile(tmp_path / f"{n}.parquet", page_checksum_verification=True).read()
        pd.testing.assert_frame_equal(reread.to_pandas(), table.to_pandas())


def test_a_file_without_rows_is_valid(tmp_path: Path) -> None:
    empty = write(tmp_path / "grads.parquet", [])
    assert pq.ParquetFile(empty).metadata.num_rows == 0 and pq.read_table(empty).schema.names == GRADS_SCHEMA.names


def test_temp_file_is_hidden_until_close(tmp_path: Path) -> None:
    w = RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=2)
    w.write_step(0, make_step(0))
    assert [p.name for p in tmp_path.iterdir()] == [temp_name("grads.parquet", "run-1")] == [".grads.parquet.run-1.tmp"]
    assert pa.dataset.dataset(tmp_path, format="parquet").files == []  # discovery ignores it
    assert w.close() == tmp_path / "grads.parquet"
    assert [p.name for p in tmp_path.iterdir()] == ["grads.parquet"]
    assert w.close() == tmp_path / "grads.parquet"  # idempotent


def test_exception_after_steps_keeps_them(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with RecordWriter(tmp_path, constants=CONSTANTS, metadata={}) as w:
            w.write_step(0, make_step(0))
            raise RuntimeError("boom")
    assert pq.read_table(tmp_path / "grads.parquet").column("step").to_pylist() == [0] * 4
    assert [p.name for p in tmp_path.iterdir()] == ["grads.parquet"]


def test_exception_before_any_step_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with RecordWriter(tmp_path, constants=CONSTANTS, metadata={}):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_keyboard_interrupt_keeps_completed_steps(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        with RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=3) as w:
            for step in range(5):
                w.write_step(step, make_step(step))
            raise KeyboardInterrupt
    df = pd.read_parquet(tmp_path / "grads.parquet")
    assert sorted(set(df.step)) == [0, 1, 2, 3, 4] and len(df) == 20


def test_abort_deletes_temp(tmp_path: Path) -> None:
    w = RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=1)
    w.write_step(0, make_step(0))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "grads.parquet").write_bytes(b"old")
    with pytest.raises(GradrunnerError, match="grads.parquet already exists"):
        RecordWriter(tmp_path, constants=CONSTANTS, metadata={})
    assert (tmp_path / "grads.parquet").read_bytes() == b"old"


def test_constants_must_be_complete(tmp_path: Path) -> None:
    with pytest.raises(GradrunnerError, match="expected exactly.*dtype"):
        RecordWriter(tmp_path, constants={"run_id": "x"}, metadata={})


def test_steps_writer_round_trip(tmp_path: Path) -> None:
    with StepsWriter(tmp_path, constants=CONSTANTS, metadata={"a": "b"}, rows_per_group=2) as w:
        w.write(0, True, 0.5, 0.03, 0.01, None)
        w.write(1, False, 0.25, 0.02, 0.0, 1024)
        w.write(2, False, None, 0.02, 0.0, 2048)
        assert [p.name for p in tmp_path.iterdir()] == [".steps.parquet.run-1.tmp"]
    table = pq.read_table(tmp_path / "steps.parquet")
    assert table.schema.remove_metadata() == STEPS_SCHEMA and table.schema.metadata == {b"a": b"b"}
    rows = table.to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["captured"] for r in rows] == [True, False, False]
    assert [r["loss"] for r in rows] == [0.5, 0.25, None]
    assert [r["peak_memory_bytes"] for r in rows] == [None, 1024, 2048]
    assert all({k: r[k] for k in CONSTANTS} == CONSTANTS and r["rank"] == 0 for r in rows)


def test_duckdb_reads_sweep_glob_ignoring_temp_files(tmp_path: Path) -> None:
    for job in ("0", "1"):
        write(tmp_path / job / "grads.parquet", [make_step(0, "full"), make_step(1, "full")])
    live = RecordWriter(tmp_path / "2", constants=CONSTANTS, metadata={}, rows_per_group=1)
    live.write_step(0, make_step(0))  # a running job: only its hidden temp exists
    rel = duckdb.sql(
        f"select step, tap, call, shape, values, norm, has_grad from '{tmp_path}/**/*.parquet' "
        "where tap = 'fc1:output' and call = 0 and step = 1"
    )
    assert dict(zip(rel.columns, map(str, rel.types), strict=True))["values"] == "FLOAT[]"
    rows = rel.fetchall()
    want = make_step(1, "full")
    assert len(rows) == 2 and rows[0][3] == [3, 4]
    np.testing.assert_allclose(rows[0][4], want.values[0])
    assert rows[0][5] == want.stats["norm"][0]
    n = duckdb.sql(f"select count(*) from '{tmp_path}/**/*.parquet' where norm is null").fetchall()
    assert n == [(4,)]  # the no-grad tap, 2 steps x 2 jobs, null rather than NaN
    live.abort()


def test_polars_reads_file(tmp_path: Path) -> None:
    df = pl.read_parquet(write(tmp_path / "grads.parquet", [make_step(0, "sample")]))
    assert df.schema["values"] == pl.List(pl.Float32) and df.schema["shape"] == pl.List(pl.Int64)
    assert df.schema["tap"] == pl.String and df.schema["step"] == pl.Int64
    assert df["tap"].to_list() == ["fc1:output", ":output", "fc1:output", "fc2:weight"]
    assert df["norm"].null_count() == 1


def test_sigkill_mid_write_leaves_no_final_file(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from gradrunner.records.writer import RecordWriter
        from gradrunner.capturing.stats import Collector
        from gradrunner.records.columns import TapKey
        w = RecordWriter({str(tmp_path)!r}, constants={CONSTANTS!r}, metadata={{}}, rows_per_group=2)
        for step in range(5):
            col = Collector()
            col.add(TapKey("fc1", "output", 0), torch.ones(3))
            w.write_step(step, col.finish())
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=os.getcwd())
    assert proc.returncode == -9, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == [temp_name("grads.parquet", "run-1")] == [".grads.parquet.run-1.tmp"]
    assert (tmp_path / ".grads.parquet.run-1.tmp").stat().st_size > 0  # row groups were flushed, no footer


def test_two_writers_of_different_runs_never_touch_each_others_files(tmp_path: Path) -> None:
    mine = RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=1)
    theirs = RecordWriter(tmp_path, constants={**CONSTANTS, "run_id": "run-2"}, metadata={}, rows_per_group=1)
    mine.write_step(0, make_step(0))
    theirs.write_step(0, make_step(1))
    theirs.abort()  # deletes its own temp file only
    assert sorted(p.name for p in tmp_path.iterdir()) == [".grads.parquet.run-1.tmp"]
    mine.close()
    assert set(pq.read_table(tmp_path / "grads.parquet").column("run_id").to_pylist()) == {"run-1"}


def test_close_never_replaces_a_file_that_appeared_meanwhile(tmp_path: Path) -> None:
    w = RecordWriter(tmp_path, constants=CONSTANTS, metadata={}, rows_per_group=1)
    w.write_step(0, make_step(0))
    (tmp_path / "grads.parquet").write_bytes(b"another run's")
    with pytest.raises(GradrunnerError, match="already exists"):
        w.close()
    assert (tmp_path / "grads.parquet").read_bytes() == b"another run's"


def test_pages_carry_checksums_that_catch_a_flipped_byte(tmp_path: Path) -> None:
    with RecordWriter(tmp_path, constants=CONSTANTS, metadata={}) as w:
        w.write_step(0, make_step(0, values="full"))
    path = tmp_path / "grads.parquet"
    col = pq.read_metadata(path).row_group(0).column(GRADS_SCHEMA.get_field_index("norm"))
    data = bytearray(path.read_bytes())
    data[col.data_page_offset + col.total_compressed_size - 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.ParquetFile(path, page_checksum_verification=True).read()
