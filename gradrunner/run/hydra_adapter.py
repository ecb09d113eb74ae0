"""Every use of Hydra's internals, in one place: what gradrunner needs from Hydra beyond its public API.

Contents:
    JobFailed, JobRefused        -- a sweep job's mistake, or refusal, as Hydra reports it at the end of the sweep
    task_overrides()             -- this job's own command-line overrides ([] outside a Hydra app)
    job_error(job_return)        -- the exception a failed job raised, without re-raising it
    expand_sweep(overrides)      -- the basic sweeper's job list for parsed overrides
    sweep_jobs(config)           -- every job's overrides of a sweep the basic sweeper (or gradrunner's) runs
    config_loader()              -- the running app's config loader (to compose a sweep's jobs up front)
    mistakes_as_one_paragraph()  -- errors Hydra meets before the job (composing, saving .hydra/) as one paragraph

Hydra 1.3 offers no public way to read a failed job's exception (`JobReturn.return_value` re-raises
it), to expand a sweep the way its basic sweeper does, or to reach the config loader from a callback:
those reach into `hydra._internal` / private attributes here, and nowhere else.

Example::

    meta = run_metadata(yaml, seed, overrides=task_overrides())
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf


class JobFailed(CompactHydraException):
    """A sweep job's user mistake, reported by Hydra at the end of the sweep without a traceback."""


class JobRefused(JobFailed):
    """A sweep job refused because of its dir (`books.Refused`): no `failed.json` is written for it."""


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


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's override list, in job order, for a sweep run by Hydra's basic sweeper (or gradrunner's); else None.

    Example::

        sweep_jobs(cfg)   # [['capture.strategy=hook', 'seed=0'], ['capture.strategy=hook', 'seed=1'], ...]

    Other sweepers (Optuna, Ax, ...) choose their jobs as they go: None.
    """
    sweeper = OmegaConf.select(config, "hydra.sweeper._target_", default="")
    if not str(sweeper).endswith(("BasicSweeper", "GradrunnerSweeper")):  # gradrunner's: the basic one, skipping
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    return expand_sweep(OverridesParser.create().parse_overrides(arguments))


def config_loader() -> Any:
    """The running Hydra app's config loader (`load_sweep_config` composes one job of a sweep)."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().config_loader()


#: Whether the task function has started (`mark_task_started`): errors before it are the command line's.
_TASK_STARTED = False
#: The run or sweep dir of this app (`remember_output_dir`), for a message when Hydra cannot write it.
_OUTPUT_DIR: str | None = None


def remember_output_dir(directory: str) -> None:
    """The run (or sweep) dir, told by the callback that checks it before Hydra writes there."""
    global _OUTPUT_DIR
    _OUTPUT_DIR = directory


def mark_task_started() -> None:
    """Called first thing in the task function: from here on, Hydra reports errors its own way."""
    global _TASK_STARTED
    _TASK_STARTED = True


@contextlib.contextmanager
def mistakes_as_one_paragraph(report: Callable[[str], NoReturn]) -> Iterator[None]:
    """While open, an error Hydra meets before the task function runs goes to `report` as one paragraph.

    Example::

        with mistakes_as_one_paragraph(lambda m: fail(m)):     # fail prints and exits 2
            app()

    Hydra turns a composition error (`steps=many`, an unknown option) into a dozen lines and status 1,
    and an `OSError` while it saves `.hydra/` (a full disk) into a traceback. Its reporting function
    (`hydra._internal.utils.run_and_report`, the private part) is wrapped: a `HydraException`, an
    OmegaConf error or an `OSError` raised before the task starts is handed to `report`; everything
    else, and everything with `HYDRA_FULL_ERROR=1`, is reported by Hydra as before.
    """
    import hydra._internal.utils as hydra_utils
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    global _TASK_STARTED
    _TASK_STARTED = False
    original = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except Exception as e:
            mistake = isinstance(e, (HydraException, OmegaConfBaseException, OSError))
            if _TASK_STARTED or not mistake or os.environ.get("HYDRA_FULL_ERROR") == "1":
                return original(_raise(e))
            report(_describe(e))

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original


def _raise(error: Exception) -> Callable[[], Any]:
    def again() -> Any:
        raise error

    return again


def _describe(error: Exception) -> str:
    """One paragraph for an error Hydra met before the job: its message, its cause's, and the way out."""
    if isinstance(error, OSError):
        run_dir = _OUTPUT_DIR
        where = f" {error.filename or run_dir}" if (error.filename or run_dir) else ""
        return (f"cannot write the run dir{where}: {error.strerror or error}; Hydra could not save the job's "
                ".hydra/ files there, and nothing ran. Free some disk space, make the dir writable, or run into "
                "another dir (hydra.run.dir=... or hydra.sweep.dir=...).")  # fmt: skip
    parts = [" ".join(str(error).split())]
    cause = error.__cause__
    if cause is not None and " ".join(str(cause).split()) not in parts[0]:
        parts.append(" ".join(str(cause).split()))
    text = "; ".join(p.rstrip(".") for p in parts if p)
    text = text.replace(" Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace", "")
    return f"{text}. Fix the override on the command line (python -m gradrunner --help lists the groups and options)."
