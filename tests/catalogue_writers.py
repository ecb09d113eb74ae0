"""The catalogue writers test_catalogue starts in processes of their own (`multiprocessing`'s spawn).

A spawned child imports the module that holds its target. Here that is this module, which imports only
`gradrunner.records.catalogue` (sqlite3 and the run dir's names): about 0.3 s of CPU per child. The test
module itself imports pandas, Hydra and torch through conftest, about 3 s per child, and eight children
are started.
"""

from __future__ import annotations

import os
import random
import sqlite3
from multiprocessing.synchronize import Event
from pathlib import Path

from gradrunner.records.catalogue import CATALOGUE, JobRow, record_job


def writer(sweep_dir: str, who: int, count: int, seed: int) -> None:
    """Record `count` completed jobs named `{who}-{i}`, each run id derived from its name."""
    rng = random.Random(seed)
    for i in range(count):
        row = JobRow(dir=f"{who}-{i}", num=who * 1000 + i, overrides=[f"w={who}", f"i={i}"], status="completed",
                     run_id=f"{who:02d}{i:04d}", rows=rng.randrange(1, 100), files=["grads.parquet"])  # fmt: skip
        record_job(sweep_dir, row)


def killed_inside_a_transaction(sweep_dir: str) -> None:
    """Record one job, then exit with status 9 while holding the write lock with an uncommitted insert."""
    record_job(sweep_dir, JobRow(dir="before", num=0, overrides=["a=0"], status="completed", run_id="r0"))
    con = sqlite3.connect(Path(sweep_dir) / CATALOGUE, isolation_level=None)
    con.execute("begin immediate")
    con.execute("insert or replace into jobs (dir, num, overrides, status, files) values ('torn', 1, '[]', "
                "'completed', '[]')")  # fmt: skip
    os._exit(9)  # killed holding the write lock, uncommitted: the journal rolls it back


def damaged_then_written(sweep_dir: str, who: int, start: Event) -> None:
    """Wait for `start`, then record job `w{who}` (into a catalogue the test damaged)."""
    start.wait()
    record_job(sweep_dir, JobRow(dir=f"w{who}", num=100 + who, overrides=[f"w={who}"], status="completed"))
