"""Faults from outside: SIGTERM (a preempted job) is handled like Ctrl-C, and a disk that fills up
(a real write limit, `RLIMIT_FSIZE`) ends the run with one paragraph and no half-written records.

Ctrl-C, SIGTERM and SIGKILL through the real CLI are in test_cli.py
(`test_ctrl_c_and_sigterm_close_cleanly_...`, `test_sigkill_leaves_no_unreadable_grads_file`);
simulated ENOSPC is a case in test_errors.py.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import cli_env, compose_cfg, job_dirs

from gradrunner.run import loop as runner
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


def test_sigterm_in_train_keeps_the_completed_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}

    def sigterm_at_step_3(device: torch.device) -> int:
        calls["n"] += 1
        if calls["n"] == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return 1

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(runner, "peak_memory_bytes", sigterm_at_step_3)
    with pytest.raises(Terminated):
        train(compose_cfg("+experiment=cosine", "steps=100"), out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.parquet", "steps.parquet"]
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1, 2]
    assert sorted(pd.read_parquet(tmp_path / "grads.parquet").step.unique()) == [0, 1, 2, 3]
    assert signal.getsignal(signal.SIGTERM) == before


def _file_size_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail with EFBIG


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_one_paragraph_and_nothing_half_written(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradrunner", "+experiment=mlp", "steps=40", "capture.values=full"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=180,
        preexec_fn=lambda: _file_size_limit(256 * 1024),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    (line,) = [s for s in result.stderr.splitlines() if s.strip()]
    assert line.startswith("gradrunner: error: could not write the records in ") and "File too large" in line
    assert "free some disk space" in line
    (job,) = job_dirs(tmp_path)
    assert not (job / "grads.parquet").exists() and list(job.glob(".*.tmp")) == []
    for path in job.glob("*.parquet"):  # what was kept (the small steps.parquet) is complete
        pq.read_metadata(path)
        assert f"kept: {path.name}" in line
