"""`gradrunner.record(..., resume=True)` under torchrun (DDP and FSDP2 in the user's own loop, 2 ranks, gloo).

A session that raised after the backward of step 2 and a resumed one (its default start: the step after the
last one kept) leave the run dir an uninterrupted run's: every rank's rows, numbered by the step they are of
(rank 1's resumed steps were numbered 0 and 1 again, beside its kept steps 0 and 1: only rank 0 read where
the kept records end). A session into a dir of completed records, without `resume` or `overwrite`, is refused
on every rank with rank 0's paragraph (rank 0 alone refused: the other ranks went on into training and waited in
their first collective, a hang).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from rank_launch import torchrun

pytestmark = pytest.mark.slow

CASES = ["ddp", "fsdp2"]
RUN_COLUMNS = ["run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("record_resume")
    torchrun(2, d, CASES, timeout=300, script="record_resume_ranks.py")
    return d


def _records(run_dir: Path, name: str) -> pd.DataFrame:
    frame = pd.read_parquet(run_dir / name).drop(columns=RUN_COLUMNS, errors="ignore")
    key = [c for c in ("step", "rank", "tap", "call") if c in frame]
    return frame.sort_values(key).reset_index(drop=True)


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_session_ends_as_the_uninterrupted_runs_records_on_every_rank(out: Path, case: str) -> None:
    for name in ("steps.parquet", "grads.parquet"):
        want, got = _records(out / case / "ref", name), _records(out / case / "cut", name)
        assert sorted(set(zip(got["rank"], got["step"], strict=True))) == [(r, s) for r in (0, 1) for s in range(4)]
        pd.testing.assert_frame_equal(got, want)
    assert (out / case / "cut" / "done.json").exists()


@pytest.mark.parametrize("case", CASES)
def test_a_refused_session_is_refused_on_every_rank(out: Path, case: str) -> None:
    said = [json.loads((out / f"{case}.rank{r}.json").read_text())["raised"] for r in (0, 1)]
    assert said[0] is not None and said[0].startswith("Refused: the run dir ") and "already holds records" in said[0]
    assert said[1] == said[0]
