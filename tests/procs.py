"""The tests' reads of /proc (standard library only: ranks and the warm server import it).

- `stat_fields(pid)`, `running(pid)`: a process's `/proc/PID/stat` fields; whether it runs (not gone, not a zombie
  waiting to be reaped).
- `mark(out)`, `alive(out)`: a torchrun rank known by its pid and start time, written by the rank into the test's out
  dir and read back by `rank_launch.torchrun` to find the ranks left running. A pid alone can name another process
  once the rank is gone, and a warm rank's command line is its server's, so that cannot tell either; a pid with its
  start time (field 22: clock ticks since boot) names one process.

Example::

    mark(out)      # in the rank, first thing: out/pid.rank<RANK>
    alive(out)     # in the test: the pids of this run's ranks still running
"""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, pgrp, ...]; field 22 (start time) is [19].
    OSError where there is no such process."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def running(pid: int | str) -> bool:
    """Whether `pid` is a process that runs: not gone, not a zombie (dead, waiting to be reaped)."""
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def mark(out: str | os.PathLike[str]) -> None:
    (Path(out) / f"pid.rank{os.environ['RANK']}").write_text(f"{os.getpid()} {stat_fields('self')[19]}")


def alive(out: str | os.PathLike[str]) -> list[int]:
    """The pids of the ranks that marked `out` and still run (not a later process with a reused pid, not a zombie)."""
    found = []
    for f in Path(out).glob("pid.rank*"):
        pid, start = f.read_text().split()
        try:
            fields = stat_fields(pid)
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            found.append(int(pid))
    return found
