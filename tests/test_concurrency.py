"""Two runs into one dir at once: one live run per run dir (its lock), the other refused or, in a
sweep, its job skipped; every job ends with the records of exactly one run, without duplicates.

The order of events is set by files, never by sleeps: the test data option `data=faulty`
(tests/faulty_data.py) writes `<ready>.<pid>` when a job reaches batch 2 and then waits for the gate
file the test creates.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SEARCHPATH, cli_env, gradrunner
from procs import stat_fields
from records_check import check_records

from gradrunner.records.rundir import DONE, FAILED

TIMEOUT = 150.0
STRATEGIES = "hook,retain_grad,autograd_grad"


def held_args(tmp_path: Path) -> list[str]:
    """Overrides of a run whose jobs signal `ready.<pid>` at batch 2 and wait there for `gate`."""
    return [SEARCHPATH, "+experiment=cosine", "steps=4", "data=faulty", "data.at_batch=2",
            f"data.ready_file={tmp_path / 'ready'}", f"data.wait_for={tmp_path / 'gate'}"]  # fmt: skip


#: Where each started run's output goes (a file: joblib workers outlive a killed launcher and would
#: hold a pipe open).
OUTPUT: dict[int, Path] = {}


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """The CLI in the background, its output in a file."""
    path = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.txt"
    with open(path, "w") as out:
        # A session (and process group) of its own: joblib workers stay in it, so the test can end them all.
        proc = subprocess.Popen([sys.executable, "-m", "gradrunner", *args], cwd=tmp_path, env=cli_env(),
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    OUTPUT[proc.pid] = path
    return proc


def finish(proc: subprocess.Popen[str]) -> str:
    """Wait for `proc`; its output."""
    proc.wait(timeout=TIMEOUT)
    return OUTPUT[proc.pid].read_text()


def ready_of(tmp_path: Path, proc: subprocess.Popen[str]) -> list[dict[str, int]]:
    """The ready signals written by `proc` itself or by its workers (joblib)."""
    found = [json.loads(f.read_text()) for f in tmp_path.glob("ready.*")]
    return [r for r in found if proc.pid in (r["pid"], r["ppid"])]


def wait_until(what: str, done: Callable[[], bool], *procs: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not done():
        for p in procs:
            assert p.poll() is None, f"waiting for {what}, the run ended: {OUTPUT[p.pid].read_text()}"
        assert time.monotonic() < deadline, f"{what} did not happen in {TIMEOUT} s"
        time.sleep(0.02)  # polling a file, not waiting out a race


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, dead and waiting to be reaped, do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_fields(stat.parent.name)
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def end_group(proc: subprocess.Popen[str]) -> None:
    """Kill `proc` and every process of its group (a killed launcher's joblib workers), and reap `proc`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        end_group(p)
    for p in started:  # no test leaves a process behind (the workers are reaped by init once killed)
        wait_until(f"the processes of group {p.pid} to end", lambda p=p: not group_alive(p.pid))


@pytest.mark.slow
def test_a_second_run_into_a_live_run_dir_is_refused_naming_it_and_changes_nothing(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    first = start(tmp_path, *held_args(tmp_path), "hydra.run.dir=run")
    procs.append(first)
    wait_until("the first run to hold its dir", lambda: bool(ready_of(tmp_path, first)), first)
    hydra_before = {f.name: f.read_bytes() for f in (tmp_path / "run" / ".hydra").iterdir()}

    second = gradrunner(tmp_path, "+experiment=cosine", "steps=3", "hydra.run.dir=run")
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    (line,) = [s for s in second.stderr.splitlines() if s.strip()]
    assert line.startswith(f"gradrunner: error: the run dir {tmp_path / 'run'} is in use by a live run (host ")
    assert f"pid {first.pid}, started " in line and "changed nothing there" in line
    assert {f.name: f.read_bytes() for f in (tmp_path / "run" / ".hydra").iterdir()} == hydra_before
    assert not (tmp_path / "run" / FAILED).exists()

    (tmp_path / "gate").touch()
    out = finish(first)
    assert first.returncode == 0, out
    assert check_records(tmp_path / "run") == [0, 1, 2, 3] and (tmp_path / "run" / DONE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_two_sweeps_into_one_dir_at_once_complete_every_job_once(
    tmp_path: Path, procs: list[subprocess.Popen[str]], launcher: str
) -> None:
    # Jobs the first sweep holds when the second one starts, and one more job for the second to run.
    live = 1 if launcher == "basic" else 2
    strategies = ",".join(STRATEGIES.split(",")[: live + 1])
    args = ["-m", "hydra.sweep.dir=sw", *held_args(tmp_path), f"capture.strategy={strategies}"]
    if launcher == "joblib":
        args += ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    first = start(tmp_path, *args)
    procs.append(first)
    wait_until(f"{live} job(s) of the first sweep to start", lambda: len(ready_of(tmp_path, first)) == live, first)
    if launcher == "joblib":
        first.send_signal(signal.SIGKILL)  # the launcher dies; its joblib workers keep their jobs going
        first.wait(timeout=TIMEOUT)

    second = start(tmp_path, *args)  # a re-run into the same sweep dir while those jobs are alive
    procs.append(second)
    wait_until("the second sweep to run a job of its own", lambda: bool(ready_of(tmp_path, second)), second)
    (tmp_path / "gate").touch()
    out = finish(second)
    assert second.returncode == 0, out
    if launcher == "basic":
        out_first = finish(first)
        assert first.returncode == 0, out_first
    sw = tmp_path / "sw"
    jobs = live + 1
    wait_until("every job to complete", lambda: all((sw / str(i) / DONE).exists() for i in range(jobs)))
    for i in range(live):  # the first sweep's live jobs were skipped by the second, saying so
        assert "skipped: the run dir" in (sw / str(i) / "gradrunner.log").read_text()
    for i in range(jobs):
        assert check_records(sw / str(i)) == [0, 1, 2, 3]  # one run's rows, each once, both tables alike
        assert not (sw / str(i) / FAILED).exists()


@pytest.mark.slow
def test_two_sweeps_of_other_configs_into_one_dir_at_once_name_the_jobs_neither_ran(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # A holds job dir 0 (seed=0) while B (seed=2,3) starts: B's job 0 finds it held by a run of another
    # config, which will never do B's job; B's job 1 (seed=3) runs in dir 1.
    args = ["-m", "hydra.sweep.dir=sw", *held_args(tmp_path)]
    first = start(tmp_path, *args, "seed=0,1")
    procs.append(first)
    wait_until("the first sweep's job 0 to start", lambda: bool(ready_of(tmp_path, first)), first)
    second = start(tmp_path, *args, "seed=2,3")
    procs.append(second)
    wait_until("the second sweep to run a job of its own", lambda: bool(ready_of(tmp_path, second)), second)
    (tmp_path / "gate").touch()
    out_first, out_second = finish(first), finish(second)
    assert first.returncode == 1 and second.returncode == 1, (out_first, out_second)  # each left a job not run

    sw = tmp_path / "sw"
    assert check_records(sw / "0") == [0, 1, 2, 3] and check_records(sw / "1") == [0, 1, 2, 3]
    seeds = {d: json.loads((sw / d / DONE).read_text())["overrides"][-1] for d in ("0", "1")}
    assert seeds == {"0": "seed=0", "1": "seed=3"}  # the runs that held the dirs: seed=1 and seed=2 never ran
    refusal = f"the run dir {sw / '0'} is in use by a live run"
    assert refusal in out_second and "That run is of another config (" in out_second
    assert "this job did not run, and counts as failed" in out_second

    # B's last word: its own job 1 ran, its job 0 failed; A's seed=0 job is not B's.
    (word,) = [line for line in out_second.splitlines() if "sweep summary" in line]
    said = out_second[out_second.index(word) :]
    assert "seed=3): " in said and "job 0 (+experiment=cosine" in said and "seed=2): failed (did not run" in said
    assert "seed=0): " not in said  # no line of B's summary says A's job ran as B's
    # The manifest of whichever sweep ended last names the job of its own that did not run.
    manifest = json.loads((sw / "manifest.json").read_text())
    not_run = [j for j in manifest["jobs"] if j["dir"] is None]
    assert [(j["status"], j["overrides"][-1]) for j in not_run] in ([("failed", "seed=1")], [("failed", "seed=2")])
    assert manifest["counts"]["failed"] == 1
