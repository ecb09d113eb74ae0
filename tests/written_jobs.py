"""A job dir written with gradrunner's own writers, no run: `write_job` (test_analysis_load, test_load_scale).

Example::

    write_job(tmp_path / "0", steps=1, overrides=["seed=1"])   # grads.parquet and steps.parquet, two taps a step
"""

from __future__ import annotations

from pathlib import Path

import torch

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
