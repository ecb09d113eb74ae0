"""torchrun of a rank script over cases, for the tests of sharded capture (`test_sharded_stats` and the tests that
run their own rank scripts): nothing left behind on a time-out or a failure, and a failure's log says why.

`gradrunner_torchrun` is `torchrun -m gradrunner ARGS` for the tests of sharded runs (`test_sharded_run` and
`test_sharded_run_checkpoint`), with the same guarantee.

Example::

    torchrun(2, tmp_path, ["fsdp2:mlp:float32"])   # sharded_ranks.py on 2 ranks; each writes its results to tmp_path
    gradrunner_torchrun(tmp_path, "+experiment=mlp", "train.parallel=fsdp2")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import procs
import pytest
from conftest import cli_env, torchrun_command
from warm import descendants

HERE = Path(__file__).parent


def torchrun(world: int, out: Path, cases: list[str], timeout: float = 300, script: str = "sharded_ranks.py") -> None:
    """torchrun in a session of its own; on a time-out or failure torchrun and every rank are killed.

    torchrun starts each rank in a session of its own (`start_new_session`), so killing torchrun's group
    does not reach them: SIGTERM lets torchrun stop its ranks, then every rank still running (found by
    the pid and start time each wrote: `procs`) is killed with its group.
    """
    cmd = torchrun_command(world, str(HERE / script), str(out), *cases)
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    log = ""
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        for pid in procs.alive(out):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while procs.alive(out) and time.monotonic() < deadline:  # killed: gone as soon as they are reaped
            time.sleep(0.1)
        assert not procs.alive(out), "ranks outlived the test"
    lines = log.splitlines()
    errors = [line for line in lines if line.startswith("[rank") and "Error" in line]
    # a rank that aborted: what C++ said and every thread's Python stack (PYTHONFAULTHANDLER), not only the tail
    fatal = next((i for i, line in enumerate(lines) if "terminate called" in line or "Fatal Python error" in line), None)
    aborted = "\n".join(lines[max(0, fatal - 2) : fatal + 60]) if fatal is not None else ""
    assert proc.returncode == 0, "\n".join(errors[:8]) + "\n" + aborted + "\n" + log[-3000:]


def gradrunner_torchrun(cwd: Path, *args: str, world: int = 2, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`torchrun -m gradrunner ARGS`; on a time-out torchrun and every rank are killed (none is left behind)."""
    cmd = torchrun_command(world, "-m", "gradrunner", *args)
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = descendants(proc.pid)  # ranks lead sessions of their own: killing torchrun's group misses them
        for pid in [*ranks, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s; it and its ranks were killed\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
