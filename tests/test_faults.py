"""Faults from outside: SIGTERM (a preempted job) is handled like Ctrl-C, and a disk that fills up
(a real write limit, `RLIMIT_FSIZE`) ends the run with one paragraph and no half-written records.

Ctrl-C, SIGTERM and SIGKILL through the real CLI are in test_cli.py
(`test_ctrl_c_and_sigterm_close_cleanly_...`, `test_sigkill_leaves_no_unreadable_grads_file`);
simulated ENOSPC is a case in test_errors.py.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import child_python, cli_env, compose_cfg, job_dirs, python_m
from records_check import check_records

from gradrunner.errors import GradrunnerError
from gradrunner.run.guards import Terminated, sigterm_as_interrupt
from gradrunner.run.loop import train


def test_sigterm_raises_terminated_only_while_open_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary for the handler to run at
    assert signal.getsignal(signal.SIGTERM) == before
    assert issubclass(Terminated, KeyboardInterrupt)  # everything that keeps records on Ctrl-C does so here


def test_sigterm_in_train_keeps_the_completed_steps(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    cfg = compose_cfg("+experiment=cosine", "steps=100", "data=faulty", "data.at_batch=3", "data.fault=sigterm")
    with pytest.raises(Terminated):
        train(cfg, out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anomalies.parquet", "grads.parquet", "steps.parquet"]
    assert check_records(tmp_path) == [0, 1, 2]  # steps 0-2 in both tables: step 3 never completed
    assert signal.getsignal(signal.SIGTERM) == before


def _file_size_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail with EFBIG


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_full_disk_ends_the_run_with_one_paragraph_and_nothing_half_written(tmp_path: Path, seed: int) -> None:
    limit = random.Random(seed).randint(2 << 10, 512 << 10)  # a file size the grads file reaches at a random point
    result = subprocess.run(
        [child_python(), "-m", "gradrunner", "+experiment=mlp", "steps=40", "capture.values=full"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: _file_size_limit(limit),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    (line,) = [s for s in result.stderr.splitlines() if s.strip()]
    (job,) = job_dirs(tmp_path)
    assert line.startswith(f"gradrunner: error: could not write the records in {job}: ") and "File too large" in line
    assert "No records were kept. No half-written file is left." in line and "free some disk space" in line
    assert check_records(job) == []  # both tables dropped together, no temp file left
    assert json.loads((job / "failed.json").read_text())["error"] == line.removeprefix("gradrunner: error: ")


@pytest.mark.slow
def test_an_optimizer_step_that_overflows_float16_is_one_paragraph_naming_the_step(tmp_path: Path) -> None:
    # On the CPU torch refuses the update's scalar for float16; on CUDA it is applied, and the run ends with
    # its loss diverged (the last word says so; seen on an H100): the CPU is this test's subject.
    result = python_m(tmp_path, "gradrunner", "+experiment=mlp", "device=cpu", "dtype=float16", "optimizer.lr=1e6",
                      "hydra.run.dir=run")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    (line,) = [s for s in result.stderr.splitlines() if s.strip()]
    assert line.startswith("gradrunner: error: step 0 failed in the optimizer step (SGD): value cannot be converted "
                           "to type c10::Half without overflow.")  # fmt: skip
    assert "lower optimizer.lr" in line and "no step completed, so no records are kept" in line
    run = tmp_path / "run"
    # A failed single run: failed.json and the error in its log, no records, nothing half-written.
    assert json.loads((run / "failed.json").read_text())["error"] == line.removeprefix("gradrunner: error: ")
    assert line.removeprefix("gradrunner: error: ") in (run / "gradrunner.log").read_text()
    assert sorted(p.name for p in run.iterdir()) == [".gradrunner.lock", ".hydra", "failed.json", "gradrunner.log"]


def test_an_optimizer_step_that_fails_later_keeps_the_steps_before(tmp_path: Path) -> None:
    # On CPU an overflowing float16 SGD step raises; on CUDA it writes inf silently (then on_nonfinite applies).
    cfg = compose_cfg("+experiment=cosine", "steps=10", "dtype=float16", "optimizer.lr=1e6", "device=cpu")
    with pytest.raises(GradrunnerError, match=r"^step (\d+) failed in the optimizer step \(SGD\)") as info:
        train(cfg, out_dir=tmp_path)
    step = int(str(info.value).split()[1])
    assert check_records(tmp_path) == list(range(step))
    if step:
        assert f"the records of steps 0-{step - 1} are kept" in str(info.value)
