"""Records with planted properties, written without a model: the analysis helpers must report exactly those.

The planted sweep (`planted_sweep`) has three jobs, one per strategy, four steps each. Taps in firing order:

    fc1:output     norm 0.1, 1e-4, 1e-7, 1e-10: vanishes (below 1e-6 from step 2)
    :h             fires twice per step (calls 0 and 1), norm 1
    fc2:output     norm 1; in `hook` only, step 1 is scaled by 1 + 1e-3: the planted disagreement
    head:output    norm 1, a NaN from step 2 on
    fc2:weight     norm 1, then 1e4 at step 3: explodes
    unused:output  never gets a gradient
"""

from __future__ import annotations

from pathlib import Path

import torch

from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import RECORD_FILES, TapKey
from gradrunner.records.rundir import DONE, FAILED, write_json
from gradrunner.records.writer import RecordWriter, StepsWriter

STRATEGIES = ("retain_grad", "hook", "autograd_grad")
STEPS = 4
#: Planted median step time (s) and peak memory (bytes) per strategy; step 0 takes 1 s (warm-up).
STEP_TIME = {"retain_grad": 0.010, "hook": 0.020, "autograd_grad": 0.030}
CAPTURE_TIME = {"retain_grad": 0.001, "hook": 0.002, "autograd_grad": 0.003}
PEAK = {"retain_grad": 100 << 20, "hook": 200 << 20, "autograd_grad": 300 << 20}
TAPS = ["fc1:output", ":h", "fc2:output", "head:output", "fc2:weight", "unused:output"]


def grad_with_norm(norm: float, n: int = 4) -> torch.Tensor:
    """A float32 gradient proportional to 1, 2, ..., n whose L2 norm is `norm`."""
    ramp = torch.arange(1, n + 1, dtype=torch.float64)
    grad: torch.Tensor = (ramp * norm / ramp.norm()).float()
    return grad


def planted_step(strategy: str, step: int) -> list[tuple[TapKey, torch.Tensor | None]]:
    fc1 = grad_with_norm(0.1 * 1e-3**step)
    fc2 = grad_with_norm(1.0) * (1 + 1e-3 if strategy == "hook" and step == 1 else 1.0)
    head = grad_with_norm(1.0)
    if step >= 2:
        head[1] = float("nan")
    weight = grad_with_norm(1e4 if step == 3 else 1.0, n=6)
    return [
        (TapKey("fc1", "output", 0), fc1),
        (TapKey("", "h", 0), grad_with_norm(1.0)),
        (TapKey("fc2", "output", 0), fc2),
        (TapKey("", "h", 1), grad_with_norm(1.0)),
        (TapKey("head", "output", 0), head),
        (TapKey("fc2", "weight", 0), weight),
        (TapKey("unused", "output", 0), None),
    ]


def write_planted_job(job_dir: Path, strategy: str, values: str = "full", overrides: list[str] | None = None) -> None:
    consts = {"run_id": f"run-{job_dir.name}", "experiment": "planted", "strategy": strategy,
              "device": "cpu", "dtype": "float32"}  # fmt: skip
    with RecordWriter(job_dir, constants=consts, metadata={}) as grads, StepsWriter(
        job_dir, constants=consts, metadata={}
    ) as steps:
        for step in range(STEPS):
            col = Collector(values=values)
            for key, grad in planted_step(strategy, step):
                col.add(key, grad)
            grads.write_step(step, col.finish(torch.tensor(1.0 / (step + 1))))
            step_time = 1.0 if step == 0 else STEP_TIME[strategy]
            steps.write(step, True, 1.0 / (step + 1), step_time, CAPTURE_TIME[strategy], PEAK[strategy])
    if overrides is not None:
        (job_dir / ".hydra").mkdir()
        (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def planted_sweep_with_failures(root: Path, jobs: list[tuple[str, int, bool]], values: str = "none") -> Path:
    """A strategy x seed sweep with completion markers, as the CLI leaves it: `jobs` is (strategy, seed, completed)
    per job dir 0/, 1/, ...; a completed job gets `done.json`, a failed one only `failed.json` (no records)."""
    for i, (strategy, seed, completed) in enumerate(jobs):
        job, overrides = root / str(i), [f"capture.strategy={strategy}", f"seed={seed}"]
        if completed:
            write_planted_job(job, strategy, values, overrides)
            marker = {"status": "completed", "run_id": f"run-{i}", "files": list(RECORD_FILES), "overrides": overrides}
            write_json(job / DONE, marker)
        else:
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
            write_json(job / FAILED, {"status": "failed", "error": "simulated CUDA out of memory"})
    return root


def planted_sweep(root: Path, values: str = "full") -> Path:
    """Three jobs 0/, 1/, 2/, one per strategy, as a Hydra multirun lays them out."""
    for i, strategy in enumerate(STRATEGIES):
        write_planted_job(root / str(i), strategy, values, ["+experiment=planted", f"capture.strategy={strategy}"])
    return root
