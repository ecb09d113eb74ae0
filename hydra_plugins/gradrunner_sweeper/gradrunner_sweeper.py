"""Hydra's basic sweeper, minus the jobs a sweep dir's catalogue shows complete: they are neither composed nor launched.

Selected by gradrunner's primary config (`override hydra/sweeper: gradrunner`); `hydra/sweeper=basic`
on the command line restores Hydra's own. The decision is `gradrunner.run.sweep_plan.plan`, shared
with the up-front sweep check (`gradrunner.cli.app.SweepCheck`). The remaining jobs keep their numbers:
they are launched in runs of consecutive numbers (`initial_job_idx`), at most `max_batch_size` at a
time, so each runs into the dir it always had. When the up-front check composed and validated every
job already, Hydra's second composition of each batch (`validate_batch_is_legal`) is not repeated.
Before the first job is launched, the sweep dir's `manifest.json` lists every job of the sweep
(`gradrunner.cli.sweep_books.write_planned`), so a reader of a sweep whose launcher was killed knows
the jobs that never started.

This module lives in Hydra's plugin namespace (Hydra instantiates sweepers from `hydra_plugins.*`
only) and stays light: Hydra imports it in every app of this environment; gradrunner is imported
only when a sweep runs.

Example::

    python -m gradrunner -m +experiment=mlp seed=0,1,2 hydra.sweep.dir=multirun/s   # runs 3 jobs
    python -m gradrunner -m +experiment=mlp seed=0,1,2,3 hydra.sweep.dir=multirun/s # runs job 3 only
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.utils import JobReturn
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class GradrunnerSweeper(BasicSweeper):
    """`BasicSweeper` that launches only the jobs `sweep_plan.plan` does not find complete (module doc)."""

    def sweep(self, arguments: list[str]) -> Any:
        from gradrunner.run.sweep_plan import plan

        assert self.config is not None and self.launcher is not None
        decided = plan(self.config)
        if decided is not None:  # the sweep's jobs in its manifest before any runs: a killed launcher leaves them
            from gradrunner.cli.sweep_books import write_planned

            write_planned(decided.sweep_dir, decided.jobs, decided.rows)
        if decided is None or not decided.complete:
            return super().sweep(arguments)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns: list[Sequence[JobReturn]] = []
        for start, batch in _runs(decided.to_run(), decided.jobs, self.max_batch_size):
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=start)
            for r in results:
                _ = r.return_value  # raises for a failed job, as Hydra's own sweeper does
            returns.append(results)
        return returns

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from gradrunner.run.sweep_plan import validated

        assert self.config is not None
        if not validated(self.config):
            super().validate_batch_is_legal(batch)


def _runs(numbers: list[int], jobs: list[list[str]], max_batch: int | None) -> list[tuple[int, list[list[str]]]]:
    """(first job number, its jobs) for each run of consecutive numbers, cut at `max_batch` jobs."""
    size = len(jobs) if max_batch is None or max_batch <= 0 else max_batch
    out: list[tuple[int, list[list[str]]]] = []
    for n in numbers:
        if out and out[-1][0] + len(out[-1][1]) == n and len(out[-1][1]) < size:
            out[-1][1].append(jobs[n])
        else:
            out.append((n, [jobs[n]]))
    return out
