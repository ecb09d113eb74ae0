"""`procs`: the tests find their torchrun ranks left running by pid and start time, never another process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest


def test_a_marked_running_process_is_alive_and_a_reused_or_ended_pid_is_not(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    procs.mark(tmp_path)
    assert procs.alive(tmp_path) == [os.getpid()]
    pid, start = (tmp_path / "pid.rank0").read_text().split()
    (tmp_path / "pid.rank0").write_text(f"{pid} {int(start) - 1}")  # our pid, another process's start: a reused pid
    assert procs.alive(tmp_path) == []
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True).stdout.strip()  # fmt: skip
    (tmp_path / "pid.rank0").write_text(f"{ended} {start}")
    assert procs.alive(tmp_path) == []


def test_a_zombie_rank_is_not_alive(tmp_path: Path) -> None:
    """A killed rank not yet reaped still has its /proc entry (state Z): it runs nothing, the wait for it is over."""
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.path.insert(0, sys.argv[1]); import procs; "
                             "os.environ['RANK'] = '1'; procs.mark(sys.argv[2])", str(Path(__file__).parent),
                             str(tmp_path)])  # fmt: skip
    try:
        while True:  # exited, not reaped: a zombie (the test's own wait below reaps it)
            if procs.stat_fields(proc.pid)[0] == "Z":
                break
            time.sleep(0.01)
        assert (tmp_path / "pid.rank1").exists() and procs.alive(tmp_path) == []
    finally:
        proc.wait()
