"""gradrunner.run.job.run: the report flag, and run dirs that never collide."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_python, cli_env, compose_cfg

import gradrunner.report
from gradrunner.errors import GradrunnerError
from gradrunner.records.rundir import DONE
from gradrunner.run.job import run


def test_report_true_writes_the_report_when_the_run_ends(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run(compose_cfg("+experiment=cosine", "steps=2", "report=true"), out_dir=tmp_path)
    assert (tmp_path / "report.html").is_file() and (tmp_path / DONE).is_file()


def test_a_failing_report_logs_the_command_and_keeps_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    with caplog.at_level(logging.WARNING, logger="gradrunner.run.books"):
        run(compose_cfg("+experiment=cosine", "steps=0", "report=true"), out_dir=tmp_path)  # no rows to report
    assert f"write it with: python -m gradrunner.report {tmp_path}" in caplog.text
    assert (tmp_path / DONE).is_file() and not (tmp_path / "report.html").exists()


def test_report_true_without_matplotlib_fails_before_step_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.delitem(sys.modules, "gradrunner.report.plots", raising=False)
    monkeypatch.delattr(gradrunner.report, "plots", raising=False)
    with pytest.raises(GradrunnerError, match=r"matplotlib, which is not installed: pip install"):
        run(compose_cfg("+experiment=cosine", "steps=2", "report=true"), out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_two_runs_started_together_get_their_own_dirs(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([child_python(), "-m", "gradrunner", "+experiment=cosine", "steps=1"], cwd=tmp_path,
                         env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for _ in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out
    dirs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(dirs) == 2 and all((d / DONE).is_file() for d in dirs)


def test_a_job_after_a_cuda_job_starts_with_the_last_jobs_model_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs of a sweep share a process: a finished job sits in reference cycles (OmegaConf's caught errors keep
    `train`'s frame) until a full garbage-collector pass. Where the process has used CUDA, the next job runs
    that pass before it builds its model, so the last job's tensors are not beside its own (an OOM, a peak
    memory that counts them). CUDA is faked: the path is the same; the cycles are real."""
    import gc
    import weakref

    import torch

    import gradrunner.run.loop as loop

    built: list[weakref.ref[torch.nn.Module]] = []
    alive_at_next_setup: list[bool] = []
    setup = loop.setup

    def watched_setup(cfg: object) -> object:
        alive_at_next_setup.extend(r() is not None for r in built)
        job = setup(cfg)  # type: ignore[arg-type]
        built.append(weakref.ref(job.model))
        return job

    monkeypatch.setattr(loop, "setup", watched_setup)
    cfg = compose_cfg("+experiment=mlp", "steps=2")
    gc.collect()
    gc.disable()  # no pass of its own in between: only the runner's
    try:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # also where this process did use CUDA
        loop.train(cfg, out_dir=tmp_path / "cpu")
        loop.train(cfg, out_dir=tmp_path / "cpu-again")  # a CPU-only process: no pass, and the cycle is there
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        loop.train(cfg, out_dir=tmp_path / "after-cuda")
    finally:
        gc.enable()
    assert alive_at_next_setup == [True, False, False], alive_at_next_setup
