"""The W&B target: one offline W&B run per job (`wandb sync` uploads them).

Needs the `wandb` package only (`gradrunner[wandb]`), imported when `to_wandb` runs.

Example::

    to_wandb(jobs("runs/gpt2"), Path("runs/gpt2"))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradrunner.export.jobs import Job


def to_wandb(all_jobs: Sequence[Job], out: Path, project: str = "gradrunner") -> list[Path]:
    """One offline W&B run per job under `out/wandb` (upload later with `wandb sync`)."""
    import wandb

    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for job in all_jobs:
        run = wandb.init(project=project, name=job.name, config=job.params, dir=str(out), mode="offline", reinit="create_new")
        try:
            by_step: dict[int, dict[str, Any]] = {}
            for tag, step, value in job.scalars:
                by_step.setdefault(step, {})[tag] = value
            for tag, step, limits, counts in job.histograms:
                edges = [limits[0] - 1e-30, *limits]  # wandb takes edges: one more than counts
                by_step.setdefault(step, {})[tag] = wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))
            for step in sorted(by_step):
                run.log(by_step[step], step=step)
        finally:
            run.finish()
        dirs.append(Path(run.dir).parent)
    return dirs
