"""The invariants every fault-injection test asserts on a job dir's records (shared, not a test module).

Example::

    steps = check_records(job_dir)    # every final file reads, no duplicate rows, the two tables agree
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from gradrunner.records.columns import RECORD_FILES, is_temp_of


def read_verified(path: Path) -> pd.DataFrame:
    """A record file read whole, footer and page checksums verified."""
    return pq.ParquetFile(path, page_checksum_verification=True).read().to_pandas()


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if any(is_temp_of(p.name, n) for n in RECORD_FILES))


def check_records(directory: Path) -> list[int]:
    """Assert the invariants on `directory`'s records; return the steps they hold (sorted, [] if none).

    - no temp file is left, and either both tables are there or neither;
    - every final file reads, footer and page checksums included;
    - no (step, tap, call) appears twice in grads.parquet, no step twice in steps.parquet;
    - the two tables hold the same steps (every step is captured in these runs) and one run id;
    - a `done.json` agrees with the files (run id, row counts).
    """
    assert temp_files(directory) == [], temp_files(directory)
    present = [n for n in RECORD_FILES if (directory / n).is_file()]
    assert present in ([], list(RECORD_FILES)), present
    if not present:
        assert not (directory / "done.json").exists()
        return []
    grads, steps = read_verified(directory / "grads.parquet"), read_verified(directory / "steps.parquet")
    assert not grads.duplicated(["step", "tap", "call"]).any(), grads[grads.duplicated(["step", "tap", "call"])]
    assert not steps.step.duplicated().any(), steps.step.tolist()
    assert sorted(grads.step.unique().tolist()) == sorted(steps.step.tolist())
    assert sorted(steps.step.tolist()) == list(range(len(steps)))  # a prefix of the run, without gaps
    ids = set(grads.run_id) | set(steps.run_id)
    assert len(ids) <= 1, ids
    if (directory / "done.json").exists():
        done = json.loads((directory / "done.json").read_text())
        assert ids == {done["run_id"]}
        assert done["rows"] == {"grads.parquet": len(grads), "steps.parquet": len(steps)}
    return sorted(steps.step.tolist())
