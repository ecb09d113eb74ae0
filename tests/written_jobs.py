"""A job dir written with gradrunner's own writers, no run: `write_job` (test_analysis_load, test_load_scale);
one written by `record()` on a tiny model: `recorded_run` (the export tests).

Example::

    write_job(tmp_path / "0", steps=1, overrides=["seed=1"])   # grads.parquet and steps.parquet, two taps a step
    recorded_run(tmp_path / "run", steps=3)                    # a completed record() run dir
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradrunner
from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import TapKey
from gradrunner.records.writer import RecordWriter, StepsWriter


def write_job(job_dir: Path, strategy: str = "hook", steps: int = 2, overrides: list[str] | None = None) -> None:
    consts = {"run_id": job_dir.name, "experiment": "mlp", "strategy": strategy, "device": "cpu", "dtype": "float32"}
    with RecordWriter(job_dir, constants=consts, metadata={}) as w, StepsWriter(
        job_dir, constants=consts, metadata={}
    ) as s:
        for step in range(steps):
            col = Collector(values="full")
            col.add(TapKey("fc1", "output", 0), torch.full((2, 2), float(step)))
            col.add(TapKey("fc2", "output", 0), None)
            w.write_step(step, col.finish(torch.tensor(1.0)))
            s.write(step, True, 1.0, 0.1, 0.01, None)
    if overrides is not None:
        (job_dir / ".hydra").mkdir()
        (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def recorded_run(directory: Path, steps: int = 2, seed: int = 0, taps: Sequence[str] = ("0:output", "2:weight"),
                 model: nn.Module | None = None, **options: Any) -> Path:  # fmt: skip
    """A run dir written by `record`: `steps` steps of a tiny model (0 steps: a completed run with no rows)."""
    torch.manual_seed(seed)
    model = model if model is not None else nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, list(taps), directory, **options) as rec:
        for _ in range(steps):
            loss = model(torch.randn(5, 3)).pow(2).mean()
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    return directory
