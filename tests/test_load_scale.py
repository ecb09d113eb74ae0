"""`load()` of a sweep (issue 25): the same rows, labels and refusals as reading every file on its own.

A copied sweep of 20 jobs (`benchmarks/sweep_scale.copy_job`: each job its own run id, seed and
`done.json`) is read by `load()` and, independently, file by file with `pq.read_table` and the
labels of each `done.json`; a file tampered with (a row of another run, a file of another job) is
refused naming it, as it was before `load()` read a sweep in one pass. The one walk of the tree
that finds the job dirs gives what the rule's globs gave.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradrunner.analysis import DamagedRecordsWarning, load
from gradrunner.errors import GradrunnerError
from gradrunner.records import rundir
from gradrunner.records.columns import GRADS_FILE, RECORD_FILES, is_temp_of
from gradrunner.records.table_writer import write_whole

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sweep_scale import copy_job, run_real_jobs

JOBS = 20


@pytest.fixture(scope="module")
def copied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep of JOBS copied jobs (seed=i, run copy-i) made from one real job, read-only for the tests."""
    base = tmp_path_factory.mktemp("copied")
    (source,) = run_real_jobs(base / "real", 1)
    for i in range(JOBS):
        copy_job(source, base / "sweep" / str(i), i, f"copy-{i:06d}")
    return base / "sweep"


@pytest.fixture
def sweep(copied: Path, tmp_path: Path) -> Path:
    """A copy of the copied sweep that a test may tamper with."""
    shutil.copytree(copied, tmp_path / "sweep")
    return tmp_path / "sweep"


def read_independently(root: Path, table: str, columns: list[str] | None = None) -> pd.DataFrame:
    """Each job's file with pq.read_table, in job order, with `job` and the seed from its done.json."""
    frames = []
    for i in range(JOBS):
        job = root / str(i)
        t = pq.read_table(job / f"{table}.parquet")
        t = t.select(columns) if columns is not None else t.drop_columns(["values"] if "values" in t.column_names else [])
        df = t.replace_schema_metadata(None).to_pandas()
        df["job"] = pd.array([str(i)] * len(df), dtype=pd.StringDtype(na_value=float("nan")))
        overrides = dict(o.split("=", 1) for o in json.loads((job / rundir.DONE).read_text())["overrides"])
        df["seed"] = int(overrides["seed"])
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


@pytest.mark.slow
@pytest.mark.parametrize("table", ["grads", "steps"])
def test_load_of_a_copied_sweep_is_each_file_read_on_its_own_with_its_labels(copied: Path, table: str) -> None:
    df = load(copied, table=table)
    expected = read_independently(copied, table)
    assert df.columns.tolist() == expected.columns.tolist()
    pd.testing.assert_frame_equal(df, expected, check_dtype=False)
    assert df.dtypes.astype(str).tolist() == expected.dtypes.astype(str).tolist()
    assert df.groupby("job", sort=False)["run_id"].unique().map(list).tolist() == [[f"copy-{i:06d}"] for i in range(JOBS)]
    assert df.job.unique().tolist() == [str(i) for i in range(JOBS)]  # natural order: 2 before 10


@pytest.mark.slow
def test_load_of_some_columns_reads_those_with_the_labels(copied: Path) -> None:
    df = load(copied, columns=["step", "tap", "norm"])
    expected = read_independently(copied, "grads", ["step", "tap", "norm"])
    assert df.columns.tolist() == ["step", "tap", "norm", "job", "seed"]
    pd.testing.assert_frame_equal(df, expected, check_dtype=False)


def rewrite(path: Path, table: pa.Table) -> None:
    """`table` written over the record file `path` as the writer writes it (page checksums included)."""
    write_whole(table, path)


def repin(job: Path) -> None:
    """The job's done.json made to match its files again (rows, footers): only the rows themselves can tell."""
    marker = json.loads((job / rundir.DONE).read_text())
    for name in RECORD_FILES:
        marker["rows"][name] = pq.read_metadata(job / name).num_rows
        marker["footers"][name] = rundir.footer_digest(job / name)
    (job / rundir.DONE).write_text(json.dumps(marker))


@pytest.mark.slow
def test_one_row_of_another_run_is_refused_naming_the_file_and_both_runs(sweep: Path) -> None:
    path = sweep / "13" / GRADS_FILE
    t = pq.read_table(path)
    ids = t.column("run_id").to_pylist()
    ids[5] = "copy-999999"
    rewrite(path, t.set_column(t.schema.get_field_index("run_id"), "run_id", pa.array(ids, pa.string())))
    repin(sweep / "13")  # its footer and row count are those done.json pins: the run id alone is wrong
    why = f"{path} (job 13 of {sweep}): grads.parquet holds rows of run(s) copy-999999, not of run copy-000013 (done.json): a file of another run"
    for columns in (None, ["step", "norm"]):  # run_id is checked whether or not it is asked for
        with pytest.raises(GradrunnerError) as info:
            load(sweep, columns=columns)
        assert str(info.value).startswith(f"cannot read 1 record file(s) that do not verify (damaged: truncated, overwritten or flipped bytes; or swapped in from another run): {why}. ")
        assert len(str(info.value).splitlines()) == 1
    with pytest.warns(DamagedRecordsWarning, match="job 13 of"):
        df = load(sweep, on_damaged="skip")
    assert "13" not in set(df.job) and df.job.nunique() == JOBS - 1 and "copy-999999" not in set(df.run_id)
    assert load(sweep, table="steps").job.nunique() == JOBS  # its steps.parquet verifies


@pytest.mark.slow
def test_a_file_of_another_job_copied_in_is_refused_and_skipped(sweep: Path) -> None:
    shutil.copy(sweep / "3" / GRADS_FILE, sweep / "5" / GRADS_FILE)
    with pytest.raises(GradrunnerError) as info:
        load(sweep)
    why = f"{sweep / '5' / GRADS_FILE} (job 5 of {sweep}): grads.parquet holds rows of run(s) copy-000003, not of run copy-000005 (done.json): a file of another run"
    assert why in str(info.value) and "on_damaged='skip'" in str(info.value)
    with pytest.warns(DamagedRecordsWarning) as caught:
        df = load(sweep, on_damaged="skip")
    (message,) = [str(w.message) for w in caught if issubclass(w.category, DamagedRecordsWarning)]
    assert message.startswith(f"left out 1 record file(s) that do not verify: {why}. ")
    assert sorted(set(df.job), key=int) == [str(i) for i in range(JOBS) if i != 5]
    assert (df.groupby("job")["run_id"].first() == df.groupby("job")["job"].first().map(lambda j: f"copy-{int(j):06d}")).all()


@pytest.mark.slow
def test_a_job_without_done_json_is_left_out_and_named(sweep: Path) -> None:
    (sweep / "17" / rundir.DONE).unlink()
    with pytest.warns(UserWarning, match=r"1 of 20 jobs .* job 17 has no done.json"):
        df = load(sweep)
    assert df.job.nunique() == JOBS - 1 and "17" not in set(df.job)


def job_dirs_by_globs(root: Path) -> list[Path]:
    """The rule as globs (how `rundir.job_dirs_below` found the job dirs before its one walk)."""
    found = {f.parent.parent for f in root.rglob(".hydra/overrides.yaml")}
    found |= {f.parent for name in (rundir.DONE, rundir.FAILED, *RECORD_FILES) for f in root.rglob(name)}
    found |= {f.parent for name in RECORD_FILES for f in root.rglob(f".{name}.*.tmp") if is_temp_of(f.name, name)}
    found.discard(root)
    return sorted(d for d in found if not any(p.startswith((".", "_")) for p in d.relative_to(root).parts))


def test_the_one_walk_finds_the_job_dirs_the_globs_find(tmp_path: Path) -> None:
    def touch(rel: str) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")

    for rel in ["0/done.json", "1/failed.json", "2/grads.parquet", "3/steps.parquet", "4/.hydra/overrides.yaml",
                "5/.grads.parquet.run1.tmp", "6/.grads.parquet.tmp", "7/.steps.parquet..tmp", "8/notes.txt",
                "a/b/10/done.json", ".hidden/11/done.json", "_private/12/done.json", "13/.hydra/hydra.yaml",
                "14/.live/r/grads-000000.parquet.seg", "done.json", "15/x/16/grads.parquet", "17/done.json/x"]:  # fmt: skip
        touch(rel)
    os.symlink(tmp_path / "nowhere", tmp_path / "8" / "done.json")  # dangling: no job
    os.symlink(tmp_path / "0" / "done.json", tmp_path / "9")  # a link to a file: no dir
    (tmp_path / "18").mkdir()
    os.symlink(tmp_path / "2" / "grads.parquet", tmp_path / "18" / "grads.parquet")  # a link to a record: a job
    os.symlink(tmp_path / "a", tmp_path / "19")  # a linked dir is not entered
    found = rundir.job_dirs_below(tmp_path)
    assert found == job_dirs_by_globs(tmp_path)
    assert [d.relative_to(tmp_path).as_posix() for d in found] == [
        "0", "1", "15/x/16", "17", "18", "2", "3", "4", "5", "7", "a/b/10"]  # fmt: skip


@pytest.mark.slow
def test_job_state_from_scanned_entries_is_job_state_from_the_dir(copied: Path, tmp_path: Path) -> None:
    shutil.copytree(copied / "0", tmp_path / "0")
    shutil.copytree(copied / "1", tmp_path / "1")
    (tmp_path / "1" / rundir.FAILED).write_text('{"status": "failed", "error": "boom"}')
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / rundir.DONE).write_text("{}")
    tree = rundir.list_tree(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for d in tree.job_dirs():
            assert rundir.job_state(d, tree.dirs[d]) == rundir.job_state(d)


def test_a_swept_key_named_like_a_column_only_one_file_has_is_prefixed_in_that_files_rows_only(tmp_path: Path) -> None:
    from written_jobs import write_job

    write_job(tmp_path / "0", steps=1, overrides=["grad_scale=1", "seed=1"])
    write_job(tmp_path / "1", steps=1, overrides=["grad_scale=2", "seed=2"])
    f = tmp_path / "1" / GRADS_FILE
    t = pq.read_table(f)
    f.unlink()
    pq.write_table(t.append_column("grad_scale", pa.array([5.0] * t.num_rows)), f)
    df = load(tmp_path, columns=["step", "grad_scale", "norm"])
    # job 0's rows: the override under its own name; job 1's: its record column, and the override prefixed
    assert df.columns.tolist() == ["step", "norm", "job", "grad_scale", "seed", "override.grad_scale"]
    assert df.grad_scale.tolist() == [1.0, 1.0, 5.0, 5.0] and df.seed.tolist() == [1, 1, 2, 2]
    assert df["override.grad_scale"].isna().tolist() == [True, True, False, False]
    assert df["override.grad_scale"].iloc[2:].tolist() == [2.0, 2.0]
    assert load(tmp_path).columns.tolist()[-4:] == ["job", "grad_scale", "seed", "override.grad_scale"]
