"""gradrunner.analysis.load: runs, sweeps, single files, schema unification, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from written_jobs import write_job

from gradrunner.analysis import IncompleteSweepWarning, load
from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import RECORD_FILES, TapKey
from gradrunner.records.rundir import DONE, FAILED, write_json
from gradrunner.records.writer import RecordWriter


def make_sweep(root: Path) -> None:
    for i, (strategy, seed) in enumerate([("retain_grad", 0), ("hook", 1), ("autograd_grad", 2)]):
        write_job(
            root / str(i), strategy, overrides=["+experiment=mlp", f"capture.strategy={strategy}", f"seed={seed}"]
        )


def test_single_run_dir_equals_read_parquet(tmp_path: Path) -> None:
    write_job(tmp_path)
    df = load(tmp_path, values=True)
    pd.testing.assert_frame_equal(df, pd.read_parquet(tmp_path / "grads.parquet"))
    assert "job" not in df.columns and len(df) == 4
    pd.testing.assert_frame_equal(load(tmp_path), df.drop(columns="values"))
    assert df.run_id.unique().tolist() == [tmp_path.name]


def test_columns_reads_only_those_and_values_only_when_asked(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    df = load(tmp_path, columns=["step", "tap", "norm", "no_such_column"])
    assert df.columns.tolist() == ["step", "tap", "norm", "job", "capture.strategy", "seed"]
    reference = pd.read_parquet(tmp_path / "0" / "grads.parquet").norm.fillna(-1.0).tolist()
    assert df.norm.fillna(-1.0).tolist() == reference * 3
    assert "values" not in load(tmp_path).columns
    full = load(tmp_path, columns=["step"], values=True)
    assert full["values"].map(lambda v: v is None or len(v)).tolist()[:2] == [4, True]


def test_columns_that_no_file_holds_keep_every_row(tmp_path: Path) -> None:
    """Only `load`'s own columns asked for (`job`, a swept override), or a column no file has: a sweep raised pyarrow's
    ArrowInvalid and a run came back with 0 rows (found 2026-11-27: pyarrow joins tables without columns into 0 rows)."""
    make_sweep(tmp_path)
    rows = [len(pd.read_parquet(tmp_path / str(i) / "grads.parquet")) for i in range(3)]
    df = load(tmp_path, columns=["job", "seed"])
    assert df.columns.tolist() == ["job", "capture.strategy", "seed"]
    assert df.job.tolist() == [str(i) for i, n in enumerate(rows) for _ in range(n)]
    assert df.seed.tolist() == [i for i, n in enumerate(rows) for _ in range(n)]
    one = load(tmp_path / "0", columns=["no_such_column"])
    assert one.shape == (rows[0], 0)


def test_parquet_file_path(tmp_path: Path) -> None:
    write_job(tmp_path)
    df = load(tmp_path / "steps.parquet")
    assert df.step.tolist() == [0, 1] and df.captured.all()


def test_steps_table(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    df = load(tmp_path, table="steps")
    assert len(df) == 6 and df.job.tolist() == ["0", "0", "1", "1", "2", "2"]
    assert df["capture.strategy"].tolist() == df.strategy.tolist()


def test_sweep_adds_job_and_varying_override_columns(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    df = load(tmp_path)
    assert len(df) == 12
    assert df.job.tolist() == ["0"] * 4 + ["1"] * 4 + ["2"] * 4
    assert df["capture.strategy"].tolist() == ["retain_grad"] * 4 + ["hook"] * 4 + ["autograd_grad"] * 4
    assert df["capture.strategy"].tolist() == df.strategy.tolist()
    assert df.seed.dtype == "int64" and df.seed.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # the same in every job: not a column
    assert "experiment" in df.columns and df.experiment.unique().tolist() == ["mlp"]
    assert not {"+experiment", "override.experiment"} & set(df.columns)


def test_sweep_jobs_in_natural_order_and_typed_values(tmp_path: Path) -> None:
    for i, lr in [(10, "1"), (2, "0.5"), (1, "1e-3")]:
        write_job(tmp_path / str(i), steps=1, overrides=[f"optimizer.lr={lr}", "tag=a" if i != 2 else "tag=b"])
    df = load(tmp_path)
    assert df.job.unique().tolist() == ["1", "2", "10"]
    assert df["optimizer.lr"].dtype == "float64"
    assert df.groupby("job", sort=False)["optimizer.lr"].first().tolist() == [1e-3, 0.5, 1.0]
    assert df.groupby("job", sort=False)["tag"].first().tolist() == ["a", "b", "a"]


def test_override_missing_in_some_jobs_is_null(tmp_path: Path) -> None:
    write_job(tmp_path / "0", steps=1, overrides=["seed=1"])
    write_job(tmp_path / "1", steps=1, overrides=[])
    df = load(tmp_path)
    assert df.groupby("job")["seed"].first(skipna=False).isna().tolist() == [False, True]


def _seq_len_sweep(root: Path, failed: bool) -> Path:
    """data.seq_len=8,80 with the 80 job not completed: failed (a dir with failed.json), or without a dir (the
    manifest lists it, as when its dir was removed); the 8 job completed (done.json)."""
    overrides = [["+experiment=gpt2", "data.seq_len=8"], ["+experiment=gpt2", "data.seq_len=80"]]
    write_job(root / "0", steps=1, overrides=overrides[0])
    write_json(root / "0" / DONE, {"status": "completed", "run_id": "0", "files": list(RECORD_FILES)})
    if failed:
        (root / "1" / ".hydra").mkdir(parents=True)
        (root / "1" / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides[1]))
        write_json(root / "1" / FAILED, {"status": "failed", "error": "seq_len 80 > n_positions 16"})
    jobs = [{"num": i, "dir": str(i) if i == 0 or failed else None, "overrides": o} for i, o in enumerate(overrides)]
    write_json(root / "manifest.json", {"jobs": jobs})
    return root


@pytest.mark.parametrize("failed", [True, False], ids=["failed", "without_a_dir"])
def test_a_key_swept_only_by_jobs_left_out_is_still_a_column(tmp_path: Path, failed: bool) -> None:
    """data.seq_len=8,80 whose 80 job failed: load gave no data.seq_len column, so code written for the whole
    sweep (df[df["data.seq_len"] == 8]) raised KeyError on it (found 2026-11-27)."""
    with pytest.warns(IncompleteSweepWarning, match="job 1"):
        df = load(_seq_len_sweep(tmp_path, failed))
    assert df["data.seq_len"].dtype == "int64" and df["data.seq_len"].tolist() == [8] * len(df)
    pd.testing.assert_frame_equal(df[df["data.seq_len"] == 8], df)
    assert len(df) == len(pd.read_parquet(tmp_path / "0" / "grads.parquet"))
    assert "experiment" in df.columns and "override.experiment" not in df.columns  # the same in every job
    with pytest.warns(IncompleteSweepWarning):
        assert load(tmp_path, table="steps")["data.seq_len"].tolist() == [8]


def test_override_named_like_a_column_is_prefixed(tmp_path: Path) -> None:
    write_job(tmp_path / "0", steps=1, overrides=["device=auto"])
    write_job(tmp_path / "1", steps=1, overrides=["device=cpu"])
    df = load(tmp_path)
    assert df.device.unique().tolist() == ["cpu"]
    assert df["override.device"].tolist() == ["auto", "auto", "cpu", "cpu"]


@pytest.mark.parametrize("key", ["steps", "step", "norm", "first", "label", "position", "stat", "job"])
def test_a_swept_key_named_like_a_record_or_helper_column_is_prefixed(tmp_path: Path, key: str) -> None:
    write_job(tmp_path / "0", steps=1, overrides=[f"{key}=5", "seed=1"])
    write_job(tmp_path / "1", steps=1, overrides=[f"{key}=10", "seed=2"])
    df = load(tmp_path)
    assert df[f"override.{key}"].tolist() == [5, 5, 10, 10]
    assert df.seed.tolist() == [1, 1, 2, 2]  # not a record or helper column: its own name


def test_schema_unification_keeps_columns_some_files_lack(tmp_path: Path) -> None:
    write_job(tmp_path / "0", steps=1)
    write_job(tmp_path / "1", steps=1)
    extra = tmp_path / "1" / "grads.parquet"
    t = pq.read_table(extra)
    extra.unlink()
    pq.write_table(t.append_column("grad_scale", pa.array([2.0] * t.num_rows)), extra)
    df = load(tmp_path)
    assert df.grad_scale.isna().tolist() == [True, True, False, False]
    assert df.grad_scale.iloc[2:].tolist() == [2.0, 2.0]
    assert df.norm.notna().sum() == 2  # every other column intact


def test_run_dir_ignores_hidden_temp_of_running_job(tmp_path: Path) -> None:
    write_job(tmp_path / "0", steps=1)
    live = RecordWriter(tmp_path / "1", constants=dict(run_id="r", experiment="e", strategy="hook",
                        device="cpu", dtype="float32"), metadata={}, rows_per_group=1)  # fmt: skip
    col = Collector()
    col.add(TapKey("fc1", "output", 0), torch.ones(2))
    live.write_step(0, col.finish())
    assert load(tmp_path).job.unique().tolist() == ["0"]
    live.abort()


def test_empty_dir_error_names_path_and_file(tmp_path: Path) -> None:
    (tmp_path / ".grads.parquet.tmp").write_bytes(b"partial")
    with pytest.raises(GradrunnerError, match=rf"no grads\.parquet found in {tmp_path}"):
        load(tmp_path)


def test_missing_path_and_bad_table(tmp_path: Path) -> None:
    with pytest.raises(GradrunnerError, match="does not exist"):
        load(tmp_path / "nope")
    with pytest.raises(GradrunnerError, match="table='grad'.*allowed: grads, steps"):
        load(tmp_path, table="grad")


# The README's one-liners, verbatim (tests/test_analysis_load.py checks that the README has them).
DUCKDB_LINE = """duckdb.sql("select strategy, tap, count(*) as n, avg(norm) as norm from 'multirun/**/grads.parquet' group by all order by all").df()"""
POLARS_LINE = """pl.read_parquet("multirun/**/grads.parquet").group_by("strategy", "tap").agg(pl.len(), pl.col("norm").mean())"""


DUCKDB_OWN_RUNS = """duckdb.sql("select count(*) from read_parquet('multirun/**/grads.parquet', filename=true) where not regexp_matches(filename, '/(replay|autopsy)/')").fetchall()[0][0]"""


def test_the_readme_says_how_a_glob_leaves_out_a_runs_replays_as_load_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's replay (`anomaly.replay`) or autopsy dirs hold runs of their own below it: `load` leaves them out, the
    README's `**` glob read them too, with nothing said (found 2026-11-27); the README says so, and how to filter."""
    duckdb = pytest.importorskip("duckdb")
    sweep = tmp_path / "multirun" / "2026-11-23" / "10-00-00"
    make_sweep(sweep)
    (sweep / "0" / "replay" / "step1").mkdir(parents=True)
    (sweep / "0" / "replay" / "step1" / "grads.parquet").write_bytes((sweep / "1" / "grads.parquet").read_bytes())
    monkeypatch.chdir(tmp_path)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert DUCKDB_OWN_RUNS in readme
    rows = len(load("multirun"))
    assert duckdb.sql("select count(*) from 'multirun/**/grads.parquet'").fetchall()[0][0] > rows  # the plain glob
    assert eval(DUCKDB_OWN_RUNS, {"duckdb": duckdb}) == rows


def test_the_readme_duckdb_and_polars_lines_read_a_sweep_with_steps_tables_beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    duckdb = pytest.importorskip("duckdb")
    pl = pytest.importorskip("polars")
    make_sweep(tmp_path / "multirun" / "2026-11-23" / "10-00-00")  # grads.parquet and steps.parquet per job
    monkeypatch.chdir(tmp_path)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert DUCKDB_LINE in readme and POLARS_LINE in readme
    by_duckdb = eval(DUCKDB_LINE, {"duckdb": duckdb})
    by_polars = eval(POLARS_LINE, {"pl": pl}).to_pandas().sort_values(["strategy", "tap"]).reset_index(drop=True)
    reference = load("multirun").groupby(["strategy", "tap"]).agg(n=("norm", "size"), norm=("norm", "mean")).reset_index()
    assert by_duckdb.n.tolist() == by_polars["len"].tolist() == reference.n.tolist() == [2] * 6
    np.testing.assert_allclose(by_duckdb.norm.to_numpy(float), reference.norm.to_numpy(float))
    np.testing.assert_allclose(by_polars.norm.to_numpy(float), reference.norm.to_numpy(float))


def test_a_gradient_of_no_elements_is_written_with_norm_0_and_no_other_statistics(tmp_path: Path) -> None:
    """An expert given no tokens has a (0, d) gradient: its mean, std, min, max, abs_max and zero_frac were written as
    NaN (found 2026-11-27), a value a NaN gradient also gives. They are null (no value), its norm 0 (torch's), has_grad
    true; the other tap's statistics are torch's."""
    g, none = torch.tensor([[1.0, -2.0], [0.0, 3.0]]), torch.zeros(0, 2)
    col = Collector()
    col.add(TapKey("experts.0", "output", 0), g)
    col.add(TapKey("experts.2", "output", 0), none)
    with RecordWriter(tmp_path, constants=dict(run_id="r", experiment="e", strategy="hook", device="cpu",
                                               dtype="float32"), metadata={}) as w:  # fmt: skip
        w.write_step(0, col.finish(torch.tensor(1.0)))
    table = pq.read_table(tmp_path / RECORD_FILES[0]).to_pylist()
    full, empty = (next(r for r in table if r["tap"] == t) for t in ("experts.0:output", "experts.2:output"))
    assert empty["has_grad"] and empty["numel"] == 0 and empty["norm"] == float(none.norm()) == 0.0
    assert all(empty[c] is None for c in ("mean", "std", "min", "max", "abs_max", "zero_frac"))
    want = {"norm": g.norm(), "mean": g.mean(), "std": g.std(), "min": g.min(), "max": g.max(), "zero_frac": 0.25}
    for name, value in want.items():
        assert full[name] == pytest.approx(float(value), rel=1e-6), name
