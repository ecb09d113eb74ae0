"""Every use of Hydra's internals, in one place: what gradrunner needs from Hydra beyond its public API.

Contents:
    task_overrides()             -- this job's own command-line overrides ([] outside a Hydra app)
    job_error(job_return)        -- the exception a failed job raised, without re-raising it
    expand_sweep(overrides)      -- the basic sweeper's job list for parsed overrides
    config_loader()              -- the running app's config loader (to compose a sweep's jobs up front)

Hydra 1.3 offers no public way to read a failed job's exception (`JobReturn.return_value` re-raises
it), to expand a sweep the way its basic sweeper does, or to reach the config loader from a callback:
those reach into `hydra._internal` / private attributes here, and nowhere else.

Example::

    meta = run_metadata(yaml, seed, overrides=task_overrides())
"""

from __future__ import annotations

from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn


def task_overrides() -> list[str]:
    """This job's overrides (`hydra.overrides.task`), as given; [] when no Hydra app runs.

    Example::

        task_overrides()     # ['+experiment=mlp', 'seed=0'] in job 0 of `-m +experiment=mlp seed=0,1`
    """
    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def job_error(job_return: JobReturn) -> BaseException | None:
    """The exception a failed job raised (`return_value` would re-raise it), or None.

    Example::

        error = job_error(job_return)      # in a Callback's on_job_end
    """
    error = getattr(job_return, "_return_value", None)
    return error if isinstance(error, BaseException) else None


def expand_sweep(overrides: list[Override]) -> list[list[str]]:
    """Every job's override list, in job order, by the basic sweeper's own expansion rules."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def config_loader() -> Any:
    """The running Hydra app's config loader (`load_sweep_config` composes one job of a sweep)."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().config_loader()
