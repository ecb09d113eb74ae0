"""Sweeps on real launchers (joblib, submitit_local), the sweep manifest, and `load` over failed jobs.

End to end: the CLI (`python -m gradrunner -m ...`) from a fresh cwd, on tiny runs (steps=2), inside the
test's process (`conftest.python_m`); the launchers' own worker processes are real.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import check_ok, gradrunner_in_process
from report_tables import tables_after

from gradrunner.analysis import IncompleteSweepWarning, load
from gradrunner.cli.sweep_books import MANIFEST, build_manifest
from gradrunner.records.rundir import DONE, FAILED

STRATEGIES = "hook,retain_grad,autograd_grad"
KEY = ["strategy", "seed", "step", "tap", "call"]
STATS = ["norm", "mean", "std", "min", "max", "abs_max", "zero_frac", "nan_count", "inf_count", "loss"]


def sweep(cwd: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return gradrunner_in_process(cwd, "-m", f"hydra.sweep.dir={name}", *args)


def manifest(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / MANIFEST).read_text())


def by_key(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY).reset_index(drop=True)


@pytest.mark.slow
def test_joblib_with_two_workers_gives_the_records_of_the_basic_launcher(tmp_path: Path) -> None:
    args = ["+experiment=mlp", "steps=2", "capture.values=full", f"capture.strategy={STRATEGIES}", "seed=0,1"]
    check_ok(sweep(tmp_path, "basic", *args))
    try:
        check_ok(sweep(tmp_path, "joblib", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *args))
    finally:  # joblib keeps its two workers for reuse; in the sweep's own process they ended with it
        from joblib.externals.loky import get_reusable_executor

        get_reusable_executor(max_workers=2).shutdown(wait=True)
    basic, joblib = by_key(load(tmp_path / "basic", values=True)), by_key(load(tmp_path / "joblib", values=True))
    assert len(basic) == len(joblib) > 0 and basic.run_id.nunique() == joblib.run_id.nunique() == 6
    assert basic[KEY].equals(joblib[KEY])
    np.testing.assert_allclose(joblib[STATS].to_numpy(float), basic[STATS].to_numpy(float), rtol=1e-6, atol=0)
    for a, b in zip(joblib["values"], basic["values"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    # every job wrote its own files, and the manifest lists them all
    jobs = manifest(tmp_path / "joblib")["jobs"]
    assert [j["status"] for j in jobs] == ["completed"] * 6
    assert len({j["dir"] for j in jobs}) == 6
    assert all(j["files"] == ["grads.parquet", "steps.parquet"] for j in jobs)
    assert sorted(tuple(sorted(j["overrides"])) for j in jobs) == sorted(
        tuple(sorted(j["overrides"])) for j in manifest(tmp_path / "basic")["jobs"]
    )


@pytest.mark.slow
def test_submitit_local_sweep_runs_unchanged(tmp_path: Path) -> None:
    result = sweep(tmp_path, "sub", "hydra/launcher=submitit_local", "+experiment=cosine", "steps=2",
                   "capture.strategy=hook,autograd_grad")  # fmt: skip
    check_ok(result)
    df = load(tmp_path / "sub")
    assert sorted(df.strategy.unique()) == ["autograd_grad", "hook"] and set(df.step) == {0, 1}
    assert manifest(tmp_path / "sub")["counts"] == {"completed": 2, "failed": 0, "missing": 0}


@pytest.fixture(scope="module")
def failed_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A basic-launcher sweep of three jobs whose middle one fails, with report=true."""
    pytest.importorskip("matplotlib")
    cwd = tmp_path_factory.mktemp("failed")
    # the sweep check (which would refuse the sweep before any job) is off: here job 1 must fail as it runs
    result = sweep(cwd, "sw", "+experiment=cosine", "steps=1", "capture.strategy=hook,bogus,retain_grad", "report=true",
                   "~hydra.callbacks.sweep_check")  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr
    return cwd / "sw"


@pytest.mark.slow
def test_the_manifest_lists_every_job_with_its_status(failed_sweep: Path) -> None:
    m = manifest(failed_sweep)
    assert m["counts"] == {"completed": 2, "failed": 1, "missing": 0}
    assert [(j["num"], j["dir"], j["status"]) for j in m["jobs"]] == [
        (0, "0", "completed"), (1, "1", "failed"), (2, "2", "completed"),
    ]  # fmt: skip
    assert m["jobs"][1]["overrides"] == ["+experiment=cosine", "steps=1", "capture.strategy=bogus", "report=True"]
    assert "capture.strategy='bogus'" in m["jobs"][1]["error"] and m["jobs"][0]["error"] is None
    assert m["jobs"][0]["files"] == ["grads.parquet", "steps.parquet"] and m["jobs"][1]["files"] == []


def test_job_status_lives_in_the_job_dirs(failed_sweep: Path) -> None:
    assert (failed_sweep / "0" / DONE).is_file() and not (failed_sweep / "0" / FAILED).exists()
    failed = json.loads((failed_sweep / "1" / FAILED).read_text())
    assert failed["status"] == "failed" and "capture.strategy='bogus'" in failed["error"]
    done = json.loads((failed_sweep / "2" / DONE).read_text())
    assert done["files"] == ["grads.parquet", "steps.parquet"]
    assert done["config"]["capture"]["strategy"] == "retain_grad"


def test_load_reads_the_completed_jobs_and_names_the_failed_one(failed_sweep: Path) -> None:
    with pytest.warns(IncompleteSweepWarning, match=r"1 of 3 jobs .* job 1 failed: capture.strategy='bogus'"):
        df = load(failed_sweep)
    assert sorted(df.job.unique()) == ["0", "2"] and sorted(df.strategy.unique()) == ["hook", "retain_grad"]


def test_load_leaves_out_a_job_without_completion_marker(failed_sweep: Path, tmp_path: Path) -> None:
    copy = tmp_path / "sw"
    shutil.copytree(failed_sweep, copy)
    (copy / "2" / DONE).unlink()  # as if job 2 had been killed after closing its files
    with pytest.warns(IncompleteSweepWarning, match=r"2 of 3 jobs .*job 2 has no done.json .*pd.read_parquet"):
        df = load(copy, table="steps")
    assert df.job.unique().tolist() == ["0"]


def test_report_true_writes_one_report_for_the_sweep_of_its_completed_jobs(failed_sweep: Path) -> None:
    page = (failed_sweep / "report.html").read_text()
    runs = tables_after(page, "Runs")  # the completed jobs are its runs; the failed one is named as left out
    assert runs["strategy"].tolist() == ["hook", "retain_grad"]
    left_out = page[page.index(">Runs</h2>") :].split('<p class="bad">', 1)[1].split("</p>", 1)[0]
    assert left_out.startswith("1 of 3 jobs in ") and "job 1 failed: capture.strategy=" in left_out
    assert list(failed_sweep.glob("*/report*")) == []


def test_an_override_that_interpolates_is_each_jobs_own_in_the_manifest(tmp_path: Path) -> None:
    """`steps=${seed}` with seed=1,2: the sweep's job list resolved the interpolation against the primary config
    (its seed) for every job, so the manifest listed both jobs missing, beside the two dirs the jobs ran in."""
    check_ok(sweep(tmp_path, "sw", "+experiment=mlp", "seed=1,2", "steps=${seed}"))
    m = manifest(tmp_path / "sw")
    assert m["counts"] == {"completed": 2, "failed": 0, "missing": 0} and [j["dir"] for j in m["jobs"]] == ["0", "1"]
    for job in m["jobs"]:  # the overrides each job recorded, the interpolation unresolved
        assert job["overrides"] == json.loads((tmp_path / "sw" / job["dir"] / DONE).read_text())["overrides"]
    steps = load(tmp_path / "sw", table="steps")
    assert steps.groupby("seed").step.max().to_dict() == {1: 0, 2: 1}  # each job its own seed's steps


def test_a_job_that_never_started_is_listed_as_missing(tmp_path: Path) -> None:
    expected = [["capture.strategy=hook"], ["capture.strategy=retain_grad"], ["capture.strategy=autograd_grad"]]
    for num, overrides in [(0, expected[0]), (1, expected[1])]:
        (tmp_path / str(num) / ".hydra").mkdir(parents=True)
        (tmp_path / str(num) / ".hydra" / "overrides.yaml").write_text(f"- {overrides[0]}\n")
    (tmp_path / "0" / DONE).write_text('{"status": "completed", "run_id": "r0", "files": ["grads.parquet", "steps.parquet"]}')
    jobs = build_manifest(tmp_path, expected)["jobs"]
    assert [(j["num"], j["dir"], j["status"]) for j in jobs] == [(0, "0", "completed"), (1, "1", "missing"),
                                                                 (2, None, "missing")]  # fmt: skip
    assert jobs[2]["overrides"] == ["capture.strategy=autograd_grad"]


def test_one_rule_for_job_dirs_so_manifest_and_load_agree_on_a_job_that_never_wrote(tmp_path: Path) -> None:
    from conftest import compose_cfg

    from gradrunner.records.rundir import job_dirs_below
    from gradrunner.run.job import run

    for job in ("0", "1"):
        run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path / job)
        (tmp_path / job / ".hydra").mkdir()
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # Hydra made the dir, the job died before writing
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text("- seed=2\n")
    assert job_dirs_below(tmp_path) == [tmp_path / "0", tmp_path / "1", tmp_path / "2"]
    built = build_manifest(tmp_path, None)
    assert [(j["dir"], j["status"]) for j in built["jobs"]] == [("0", "completed"), ("1", "completed"), ("2", "missing")]
    with pytest.warns(IncompleteSweepWarning, match=r"1 of 3 jobs in .* did not complete .* job 2 has no done.json"):
        df = load(tmp_path)
    assert sorted(df.job.unique()) == ["0", "1"]


def test_load_names_jobs_the_manifest_lists_that_have_no_dir(tmp_path: Path) -> None:
    from conftest import compose_cfg

    from gradrunner.run.job import run

    run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path / "0")
    (tmp_path / MANIFEST).write_text(json.dumps({"jobs": [
        {"num": 0, "dir": "0", "overrides": ["seed=0"]}, {"num": 1, "dir": None, "overrides": ["seed=1"]},
    ]}))  # fmt: skip
    with pytest.warns(IncompleteSweepWarning, match=r"1 of 2 jobs in .* job 1 \(seed=1\) did not start \(no job dir\)"):
        load(tmp_path)


def test_a_manifest_the_disk_refuses_is_one_logged_line_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno
    import logging
    import os

    from omegaconf import OmegaConf

    from gradrunner.cli.sweep_books import SweepBookkeeping

    def no_space(self: Path, *args: object, **kwargs: object) -> int:
        Path.touch(self)  # the temp file exists, as after a partial write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    books = SweepBookkeeping()
    books.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "report": False}))
    monkeypatch.setattr(Path, "write_bytes", no_space)  # records.atomic.write_atomically writes the temp file so
    with caplog.at_level(logging.ERROR, logger="gradrunner.cli.sweep_books"):
        books.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "report": False}))
    (record,) = caplog.records
    assert record.getMessage() == (
        f"could not write the sweep manifest {tmp_path / MANIFEST}: [Errno 28] No space left on device; the jobs' "
        "records and done.json files are not affected"
    )
    assert list(tmp_path.iterdir()) == []
