"""Signals outside a run (issue 38 items 9, 10): between a sweep's jobs, and in a process started with
signals ignored (`nohup`, a background job of a non-interactive shell).

Between jobs (a test-only Hydra callback sends the signal at a seeded job's start or end): Ctrl-C is one
line and exit 130, SIGTERM one line and 143, never a traceback; the jobs that ran keep their records and
running the same command again completes the sweep. A run whose process ignores SIGHUP (`nohup`) or
SIGINT keeps ignoring it, as Python does: the signal, sent at a seeded batch or between jobs, ends nothing.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SEARCHPATH, check_ok, cli_env
from records_check import check_records

from gradrunner.records.rundir import DONE

SWEEP = ["-m", "+experiment=cosine", "steps=1", "seed=0,1,2", "device=cpu", "hydra.sweep.dir=sw"]


def signal_at(when: str, job: int, sig: str) -> list[str]:
    return [f"+hydra.callbacks.signal_at.{k}={v}" for k, v in
            (("_target_", "signalling.SignalAt"), ("when", when), ("job", job), ("sig", sig))]  # fmt: skip


def cli(cwd: Path, *args: str, prefix: tuple[str, ...] = (), ignore: signal.Signals | None = None,
        ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    def ignoring() -> None:
        if ignore is not None:
            signal.signal(ignore, signal.SIG_IGN)  # as `cmd &` in sh leaves SIGINT: inherited through exec

    return subprocess.run([*prefix, sys.executable, "-m", "gradrunner", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          preexec_fn=ignoring)  # fmt: skip


@pytest.mark.slow  # two sweeps of three one-step jobs each: about 25 s on the shared 2-core machine
@pytest.mark.parametrize("seed", range(2))
def test_a_signal_between_sweep_jobs_is_one_line_and_its_exit_status_and_a_rerun_completes(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    sig = ["SIGINT", "SIGTERM"][seed]
    when, job = rng.choice(["on_job_start", "on_job_end"]), rng.randint(0, 1)
    result = cli(tmp_path, *SWEEP, *signal_at(when, job, sig))
    assert result.returncode == 128 + signal.Signals[sig], (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    ran = job + (when == "on_job_end")  # jobs whose task ran before the signal
    what = "interrupted" if sig == "SIGINT" else f"terminated ({sig})"
    if ran:
        assert line.startswith(f"gradrunner: {what} between the jobs of the sweep; the {ran} job(s) that ran"), line
        assert "run the same command again" in line
    else:
        assert line == f"gradrunner: {what} before any job started; nothing ran"
    sw = tmp_path / "sw"
    assert [(sw / str(j) / DONE).is_file() for j in range(3)] == [j < ran for j in range(3)]
    check_ok(cli(tmp_path, *SWEEP))  # the same command again: the rest of the sweep
    assert json.loads((sw / "manifest.json").read_text())["counts"] == {"completed": 3, "failed": 0, "missing": 0}


@pytest.mark.parametrize("seed", range(3))
def test_a_run_started_with_sighup_or_sigint_ignored_is_not_ended_by_it(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sig = [signal.SIGHUP, signal.SIGINT, rng.choice([signal.SIGHUP, signal.SIGINT])][seed]
    at = rng.randint(0, 5)  # the batch whose request sends the signal
    fault = "sighup" if sig == signal.SIGHUP else "sigint"
    prefix = ("nohup",) if sig == signal.SIGHUP else ()  # nohup ignores SIGHUP, then runs the command
    result = cli(tmp_path, SEARCHPATH, "+experiment=cosine", "steps=6", "device=cpu", "data=faulty", f"data.at_batch={at}",
                 f"data.fault={fault}", "hydra.run.dir=run", prefix=prefix,
                 ignore=None if prefix else sig)  # fmt: skip
    check_ok(result)
    assert "Traceback" not in result.stderr and "interrupted" not in result.stderr, result.stderr
    assert check_records(tmp_path / "run") == list(range(6)) and (tmp_path / "run" / DONE).is_file()


@pytest.mark.slow
def test_a_sweep_under_nohup_is_not_ended_by_sighup_between_jobs(tmp_path: Path) -> None:
    result = cli(tmp_path, *SWEEP, *signal_at("on_job_end", 0, "SIGHUP"), prefix=("nohup",))
    check_ok(result)
    assert json.loads((tmp_path / "sw" / "manifest.json").read_text())["counts"]["completed"] == 3
