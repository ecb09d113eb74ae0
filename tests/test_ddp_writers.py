"""Under DDP, rank 0's two tables close together and hold the same steps, also when a rank dies between
the gathers of a step's grads rows and its steps row (a stand-in for the process group: no torchrun)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from records_check import check_records

from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import TapKey
from gradrunner.run.engine import RunFiles, open_writers


class DyingGroup:
    """Rank 0 of a process group whose other rank dies at the `dies_at`-th gather (the collective then raises)."""

    is_main = True

    def __init__(self, dies_at: int) -> None:
        self.calls, self.dies_at = 0, dies_at

    def gather(self, obj: Any) -> list[Any]:
        self.calls += 1
        if self.calls == self.dies_at:
            raise RuntimeError("Connection closed by peer (rank 1 died)")
        return [obj]  # only rank 0's rows: records_check keys rows by (step, tap, call)


def records(step: int) -> Any:
    col = Collector(values="none")
    col.add(TapKey("fc1", "output", 0), torch.full((2, 2), float(step)))
    return col.finish(torch.tensor(1.0))


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_dying_between_a_steps_two_gathers_leaves_both_tables_with_the_same_steps(
    tmp_path: Path, seed: int
) -> None:
    dies_at = random.Random(seed).randint(2, 12)  # any gather: grads (odd calls) or steps (even calls)
    consts = {"run_id": "r", "experiment": "mlp", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    with pytest.raises(RuntimeError, match="rank 1 died"), contextlib.ExitStack() as stack:
        grads, steps = open_writers(stack, RunFiles(tmp_path, consts, {}), DyingGroup(dies_at))  # type: ignore[arg-type]
        for step in range(10):
            grads.write_step(step, records(step))
            steps.write(step, True, 1.0, 0.1, 0.01, None)
    kept = check_records(tmp_path)  # both tables, the same steps, each once, no temp file
    assert kept == list(range((dies_at - 1) // 2))
