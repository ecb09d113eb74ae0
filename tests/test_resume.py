"""Resume: an existing run dir is refused or resumed; a killed sweep re-run completes only what was missing."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
from conftest import INTERRUPT_AT_STEP_3, check_ok, cli_env, compose_cfg, gradrunner

from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import LOCK_FILE
from gradrunner.records.rundir import DONE, FAILED, job_state
from gradrunner.run.job import run

RECORDS = ("grads.parquet", "steps.parquet", DONE)
STRATEGIES = "hook,retain_grad,autograd_grad"


def stamps(directory: Path, names: tuple[str, ...] = RECORDS) -> dict[str, tuple[int, int]]:
    """inode and mtime of each file: both unchanged means the file was not touched."""
    return {n: ((directory / n).stat().st_ino, (directory / n).stat().st_mtime_ns) for n in names}


# -- a single run into an existing dir ------------------------------------------------------------


def test_a_completed_run_writes_done_json_last(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path)
    done = json.loads((tmp_path / DONE).read_text())
    assert done["status"] == "completed" and done["files"] == ["grads.parquet", "steps.parquet"]
    assert done["run_id"] == pd.read_parquet(tmp_path / "grads.parquet").run_id.iloc[0]
    assert (tmp_path / DONE).stat().st_mtime_ns >= (tmp_path / "grads.parquet").stat().st_mtime_ns
    assert job_state(tmp_path).status == "completed"


def test_a_second_run_into_the_same_dir_is_refused(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    named = rf"run dir {re.escape(str(tmp_path))} already holds records .*resume=true"
    with pytest.raises(GradrunnerError, match=named):
        run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    assert stamps(tmp_path) == before


def test_resume_skips_a_completed_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    with caplog.at_level(logging.INFO, logger="gradrunner.records.rundir"):
        path = run(compose_cfg("+experiment=cosine", "steps=1", "resume=true"), out_dir=tmp_path)
    assert path == tmp_path / "grads.parquet"
    assert "already completed (done.json): skipped" in caplog.text
    assert stamps(tmp_path) == before


def test_resume_refuses_a_completed_run_of_another_config(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    with pytest.raises(GradrunnerError, match=r"completed run of a different config \(steps: 1 -> 2\)"):
        run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert stamps(tmp_path) == before


def test_resume_reruns_an_incomplete_run_from_step_0(tmp_path: Path) -> None:
    (tmp_path / "grads.parquet").write_bytes(b"partial")  # as a Ctrl-C'd run leaves it, minus the footer
    (tmp_path / ".steps.parquet.tmp").write_bytes(b"partial")
    (tmp_path / FAILED).write_text('{"error": "earlier"}')
    with pytest.raises(GradrunnerError, match="did not complete"):
        run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path)
    run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*RECORDS, LOCK_FILE])
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1]


def test_an_interrupted_run_has_no_marker_and_resumes(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        run(compose_cfg("+experiment=cosine", "steps=5", *INTERRUPT_AT_STEP_3), out_dir=tmp_path)
    assert (tmp_path / "grads.parquet").exists() and not (tmp_path / DONE).exists()
    assert job_state(tmp_path).status == "missing"
    run(compose_cfg("+experiment=cosine", "steps=5", "resume=true"), out_dir=tmp_path)
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_cli_refuses_an_existing_run_dir_then_resumes_it(tmp_path: Path) -> None:
    args = ("+experiment=cosine", "steps=1", "hydra.run.dir=run")
    check_ok(gradrunner(tmp_path, *args))
    refused = gradrunner(tmp_path, *args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = [s for s in refused.stderr.splitlines() if s.strip()]
    assert line.startswith(f"gradrunner: error: the run dir {tmp_path / 'run'} already holds records")
    assert "resume=true" in line
    resumed = gradrunner(tmp_path, *args, "resume=true")
    check_ok(resumed)
    assert "already completed (done.json): skipped" in resumed.stdout + resumed.stderr


# -- a sweep killed part-way ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_sweep_rerun_completes_only_what_was_missing(tmp_path: Path) -> None:
    args = ["-m", "hydra.sweep.dir=sw", "+experiment=cosine", "steps=400", f"capture.strategy={STRATEGIES}"]
    sw = tmp_path / "sw"
    proc = subprocess.Popen([sys.executable, "-m", "gradrunner", *args], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (sw / "0" / DONE).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before job 0 completed"
            time.sleep(0.01)
        proc.kill()  # SIGKILL: no handler runs, no manifest, job 1 is cut off wherever it was
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert job_state(sw / "1").status == "missing" and not (sw / "2" / DONE).exists()
    before = stamps(sw / "0")

    result = gradrunner(tmp_path, *args)
    check_ok(result)
    assert stamps(sw / "0") == before
    assert "already completed (done.json): skipped" in result.stdout
    assert all(job_state(sw / str(i)).status == "completed" for i in range(3))
    assert json.loads((sw / "manifest.json").read_text())["counts"] == {"completed": 3, "failed": 0, "missing": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load(sw, table="steps")
    assert df.groupby("strategy").step.apply(list).map(lambda s: s == list(range(400))).all()
    assert sorted(df.strategy.unique()) == ["autograd_grad", "hook", "retain_grad"]
