"""Signals wherever they land: SIGHUP like SIGTERM (completed steps kept), Ctrl-C while Python imports
or after the run ended is one line and exit 130, never a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SEARCHPATH, check_ok, cli_env, compose_cfg, gradrunner_in_process
from records_check import check_records
from torch import nn

import gradrunner
from gradrunner.run.loop import train
from gradrunner.run.signals import Terminated, exit_status


def test_sighup_in_train_keeps_the_completed_steps(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGHUP)
    cfg = compose_cfg("+experiment=cosine", "steps=100", "data=faulty", "data.at_batch=3", "data.fault=sighup")
    with pytest.raises(Terminated) as info:
        train(cfg, out_dir=tmp_path)
    assert info.value.signal_name == "SIGHUP" and exit_status(info.value) == 129
    assert check_records(tmp_path) == [0, 1, 2]  # steps 0-2 in both tables: step 3 never completed
    assert signal.getsignal(signal.SIGHUP) == before


def python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_ctrl_c_while_python_imports_the_app_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # The Ctrl-C lands while gradrunner.run.job is being imported (set by patching import: no timing).
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def importing(name, *a, **k):\n"
        "    if name == 'gradrunner.run.job': raise KeyboardInterrupt\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = importing\n"
        "sys.argv = ['gradrunner', '+experiment=cosine', 'steps=1']\n"
        "import runpy; runpy.run_module('gradrunner', run_name='__main__')\n"
    )
    result = python(code, tmp_path)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "gradrunner: interrupted while starting; nothing ran"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_after_the_run_ended_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # The Ctrl-C lands in an atexit callback, as it would while the sweep manifest is written.
    code = (
        "import atexit, os, signal, sys\n"
        "atexit.register(lambda: [os.kill(os.getpid(), signal.SIGINT), sum(range(10000))])\n"
        "sys.argv = ['gradrunner', '+experiment=cosine', 'steps=1', 'device=cpu', 'hydra.run.dir=run']\n"
        "import runpy; runpy.run_module('gradrunner', run_name='__main__')\n"
    )
    result = python(code, tmp_path)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "gradrunner: interrupted while finishing; the records written are complete"
    )
    assert check_records(tmp_path / "run") == [0]


def test_handlers_are_installed_once_per_run_not_swapped_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = signal.signal

    def counting(signum: int, handler: object) -> object:
        calls.append(signum)
        return real(signum, handler)  # type: ignore[arg-type]

    monkeypatch.setattr(signal, "signal", counting)
    train(compose_cfg("+experiment=cosine", "steps=40"), out_dir=tmp_path)
    assert check_records(tmp_path) == list(range(40))
    assert len(calls) <= 6  # SIGINT, SIGTERM, SIGHUP installed once and restored once: not per step


@pytest.mark.parametrize(("fault", "status", "said"), [("sigint", 130, "interrupted"),
                                                       ("sigterm", 143, "terminated (SIGTERM)")])  # fmt: skip
def test_a_signal_before_step_0_completes_keeps_no_files_says_none_were_and_a_rerun_works(
    tmp_path: Path, fault: str, status: int, said: str
) -> None:
    """The signal lands while the batch of step 0 is made: two 0-row files were kept, the last line said "the
    records of completed steps are kept in ... (grads.parquet, steps.parquet)" and a re-run was refused."""
    run = ["+experiment=cosine", "steps=2", "hydra.run.dir=run"]
    cut = gradrunner_in_process(tmp_path, SEARCHPATH, *run, "data=faulty", "data.at_batch=0", f"data.fault={fault}")
    assert cut.returncode == status, cut.stderr
    assert cut.stderr.strip().splitlines()[-1] == f"gradrunner: {said}; no step completed, so no records were kept"
    assert [p.name for p in (tmp_path / "run").iterdir() if "parquet" in p.name] == []  # no final or temp file
    check_ok(gradrunner_in_process(tmp_path, SEARCHPATH, *run))  # not "already holds records"
    assert check_records(tmp_path / "run") == [0, 1]


def test_record_interrupted_before_its_first_step_keeps_no_files_and_the_next_session_runs(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 1))
    with pytest.raises(KeyboardInterrupt), gradrunner.record(model, ["0:output"], tmp_path / "r"):
        raise KeyboardInterrupt  # Ctrl-C before the first rec.step()
    assert [p.name for p in (tmp_path / "r").iterdir() if "parquet" in p.name] == []
    with gradrunner.record(model, ["0:output"], tmp_path / "r") as rec:  # was refused: "already holds records"
        model(torch.ones(2, 3)).sum().backward()
        rec.step()
    assert check_records(tmp_path / "r") == [0]
