"""Which process a tests' torchrun rank is: its pid and start time, written by the rank into the test's out dir
(`mark`), read back by `rank_launch.torchrun` to find the ranks left running (`alive`). Standard library only: each
rank imports it.

A pid alone can name another process once the rank is gone, and a warm rank's command line is its server's, so that
cannot tell either; a pid with its start time (`/proc/PID/stat`, field 22: clock ticks since boot) names one process.

Example::

    mark(out)      # in the rank, first thing: out/pid.rank<RANK>
    alive(out)     # in the test: the pids of this run's ranks still running
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, ...]; field 22 (start time) is [19]."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def mark(out: str | os.PathLike[str]) -> None:
    (Path(out) / f"pid.rank{os.environ['RANK']}").write_text(f"{os.getpid()} {_stat('self')[19]}")


def alive(out: str | os.PathLike[str]) -> list[int]:
    """The pids of the ranks that marked `out` and still run (not a later process with a reused pid, not a zombie)."""
    found = []
    for f in Path(out).glob("pid.rank*"):
        pid, start = f.read_text().split()
        try:
            fields = _stat(pid)
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            found.append(int(pid))
    return found
