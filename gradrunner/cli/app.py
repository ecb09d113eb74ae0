"""The Hydra app: `python -m gradrunner +experiment=mlp` (and the `gradrunner` console script).

`main` is a shim over `gradrunner.run.job.run` (`runner.train` plus the run dir's books). A user mistake
(`GradrunnerError`, or an OmegaConf error such as a missing value) prints one paragraph to stderr, no
traceback, and exits with status 2. A sweep (`-m`) is checked before its first job (`SweepCheck`: every
job's config validated, its taps resolved): a bad value is one paragraph, status 2, nothing run; a job
that fails later fails alone, the other jobs still run, and Hydra reports it at the end (status 1).
A misspelled top-level or `capture.*` key on the command line is refused before Hydra runs
(`gradrunner.config.overrides`), in one paragraph with status 2; other mistakes Hydra finds while composing
(an unknown option, a misspelled key inside a YAML file) get Hydra's own short message and status 1. `HYDRA_FULL_ERROR=1` shows the full traceback instead. Ctrl-C and SIGTERM
keep the completed steps' records and exit with 130 and 143. A single run that fails writes `failed.json` and
its error into `gradrunner.log`; one refused because of its run dir (records there, or a live run) changes
nothing there, `.hydra/` included. Every case: docs/errors.md; what survives what: docs/what-survives.md.

Example::

    python -m gradrunner +experiment=mlp capture.strategy=retain_grad steps=10
    python -m gradrunner -m +experiment=mlp capture.strategy=retain_grad,hook,autograd_grad
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gradrunner.config.overrides import group_mistake, misspelled_key
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.records.columns import RECORD_FILES
from gradrunner.records.rundir import DONE, FAILED
from gradrunner.records.urls import url_scheme
from gradrunner.run import signals, sweep_plan
from gradrunner.run.books import Refused, checkpoint_held, mark_failed
from gradrunner.run.guards import check_writable
from gradrunner.run.hydra_adapter import (
    JobFailed,
    JobRefused,
    config_composed_once,
    config_loader,
    keep_job_config,
    keeps_job_configs,
    mark_task_started,
    mistakes_as_one_paragraph,
    remember_output_dir,
    split_options,
)
from gradrunner.run.job import run
from gradrunner.run.session_log import job_log
from gradrunner.run.signals import Terminated

log = logging.getLogger(__name__)


def _fail(error: Exception) -> NoReturn:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    message = one_paragraph(error)
    print(f"gradrunner: error: {message}", file=sys.stderr, flush=True)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        raise (JobRefused if isinstance(error, Refused) else JobFailed)(message) from None
    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        _keep_books(Path(HydraConfig.get().runtime.output_dir), error, message)
    sys.exit(EXIT_USER_ERROR)


def _keep_books(directory: Path, error: Exception, message: str) -> None:
    """A failed single run: its error in `gradrunner.log` and `failed.json`; a refused one: its dir as it was."""
    if isinstance(error, Refused):  # the run layer put back .hydra/ (`RunLock.leave_no_trace`)
        return
    _to_log_files(message)
    if directory.is_dir():
        try:
            mark_failed(directory, message)
        except OSError as e:  # the disk that failed the run may not take failed.json either
            print(f"gradrunner: could not write {directory / FAILED}: {one_paragraph(e)}", file=sys.stderr)


def _to_log_files(message: str) -> None:
    """The error into the job's log file (`gradrunner.log`) only: stderr has it already, once."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _kept(what: str) -> str:
    """The end of the interrupt message, from what is on disk: records are named kept only when they are."""
    if not HydraConfig.initialized():
        return what
    directory = Path(HydraConfig.get().runtime.output_dir)
    kept = [n for n in RECORD_FILES if (directory / n).is_file()]
    checkpoint = checkpoint_held(directory)
    also = f"; {checkpoint} is kept too: resume=true goes on from it" if checkpoint else ""
    if not kept:
        return f"{what}; no step completed, so no records were kept{also}"
    return f"{what}; the records of completed steps are kept in {directory} ({', '.join(kept)}){also}"


class LogFile(logging.FileHandler):
    """`gradrunner.log`: a write that fails (a full disk, a file-size limit) is said once on stderr, not as
    Python's "--- Logging error ---" traceback for every message; the file is then left as it is and the
    run's messages go on to the console."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed = True
        print(f"gradrunner: cannot write the log file {self.baseFilename} ({one_paragraph(error)}); from here on "
              "this run's messages go to the console only", file=sys.stderr, flush=True)  # fmt: skip


def guard_log_files() -> None:
    """Replace the root logger's plain `FileHandler`s (Hydra's `gradrunner.log`) by `LogFile`s, same file and format.

    Example::

        guard_log_files()      # first thing in a job: a full disk then costs the log one line, not tracebacks
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is not logging.FileHandler:
            continue
        guarded = LogFile(handler.baseFilename, mode="a", encoding=handler.encoding, delay=True)
        guarded.setLevel(handler.level)
        guarded.setFormatter(handler.formatter)
        for f in handler.filters:
            guarded.addFilter(f)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(guarded)


class OutputDirCheck(Callback):
    """Checks that the run (or sweep) dir can be written before Hydra creates it and logs into it.

    Registered in `conf/config.yaml` under `hydra.callbacks.output_dir`; without it an unwritable
    `hydra.run.dir` fails inside Hydra with a traceback.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir=<dir>")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir=<dir>")

    @staticmethod
    def _check(directory: str, where: str) -> None:
        _refuse_url(str(directory), where.split("=")[0])
        remember_output_dir(str(Path(directory).absolute()))
        try:
            check_writable(Path(directory).absolute(), where)
        except GradrunnerError as e:
            _fail(e)


def _refuse_url(directory: str, key: str) -> None:
    """A URL run or sweep dir (`s3://...`, `memory://...`): one paragraph, exit 2, before Hydra makes a folder of it."""
    scheme = url_scheme(directory)
    if scheme is None:
        return
    _fail(GradrunnerError(
        f"{key}={directory} is a URL ({scheme}://); gradrunner writes its records to a local path only (Hydra "
        f"would have made a local folder named {str(Path(directory))!r}), so nothing was run or written. Pass a "
        f"local path ({key}=/scratch/runs/...); for object storage, write locally and upload each completed job "
        "dir (the ones holding done.json) yourself, e.g. with `aws s3 sync` or fsspec (docs/scale-out.md)."
    ))  # fmt: skip


class SweepCheck(Callback):
    """Composes and validates every job of a sweep before the first one runs; a bad value is one paragraph, exit 2.

    Registered in `conf/config.yaml` under `hydra.callbacks.sweep_check`. Without it, job 0 runs to
    the end before job 1 fails on `capture.strategy=bogus`. Values are validated and the tap specs
    resolved against each distinct model, built on the meta device (no memory, no weights). Each
    distinct mistake is reported once, with the jobs it affects (`_jobs_named`: the overrides they all have,
    then each one's own; in a large sweep, runs of job numbers, a count and the first few). Jobs the sweep
    catalogue shows complete (`run.sweep_plan`) are not composed: gradrunner's sweeper does not launch them either.
    Hydra's basic launcher runs each job on the config checked here, not composed again
    (`hydra_adapter.config_composed_once`; in sweeps of up to `KEPT_JOBS_AT_MOST` jobs).

    Example::

        python -m gradrunner -m +experiment=mlp capture.strategy=hook,bogus   # exit 2, nothing run
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        decided = sweep_plan.plan(config)  # jobs complete already are neither composed here nor launched
        if decided is None or not decided.jobs or os.environ.get("HYDRA_FULL_ERROR") == "1":
            return
        jobs = decided.jobs
        problems = _job_problems(config, jobs, skip=decided.complete)
        if problems:
            for message, numbers in problems.items():
                print(f"gradrunner: error: {_jobs_named(jobs, numbers)}: {message}", file=sys.stderr, flush=True)
            print("gradrunner: the sweep was checked before any job ran; nothing was run.", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        sweep_plan.mark_validated(config)  # the sweeper need not compose each job a second time


#: How many of the jobs sharing a mistake `_jobs_named` lists with their own overrides (and runs of job numbers).
_JOBS_SHOWN = 5


def _jobs_named(jobs: list[list[str]], numbers: list[int]) -> str:
    """The jobs `numbers` of the sweep `jobs`, each with its own overrides: what they all have, then the rest per job.

    Example::

        _jobs_named([["a=1", "seed=0"], ["a=1", "seed=1"]], [0, 1])  # 'jobs 0, 1 of 2 (all: a=1; job 0: seed=0; job 1: seed=1)'

    More than `_JOBS_SHOWN` jobs are named by runs of numbers and a count, the first `_JOBS_SHOWN` with their own
    overrides: 'jobs 0-6, 8-1999 (1999 of 2000; all: a=1; job 0: seed=0; ...; and 1994 more jobs)'.
    """
    if len(numbers) == 1:
        return f"job {numbers[0]} of {len(jobs)} ({' '.join(jobs[numbers[0]])})"
    shared = [o for o in jobs[numbers[0]] if all(o in jobs[n] for n in numbers)]
    own = [(n, [o for o in jobs[n] if o not in shared]) for n in numbers]
    parts = [f"all: {' '.join(shared)}"] if shared else []
    if any(rest for _, rest in own):
        parts += [f"job {n}: {' '.join(rest) or 'no other override'}" for n, rest in own[:_JOBS_SHOWN]]
        parts += [f"and {len(own) - _JOBS_SHOWN} more jobs"] if len(own) > _JOBS_SHOWN else []
    if len(numbers) <= _JOBS_SHOWN:
        return f"jobs {', '.join(map(str, numbers))} of {len(jobs)} ({'; '.join(parts) or 'no overrides'})"
    return f"jobs {_runs(numbers)} ({'; '.join([f'{len(numbers)} of {len(jobs)}', *parts])})"


def _runs(numbers: list[int]) -> str:
    """Ascending job numbers as runs ('0-6, 8-1999'), the first `_JOBS_SHOWN` runs, then how many jobs more."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    shown = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:_JOBS_SHOWN])
    more = sum(b - a + 1 for a, b in runs[_JOBS_SHOWN:])
    return f"{shown} and {more} more" if more else shown


def _job_problems(config: DictConfig, jobs: list[list[str]], skip: frozenset[int]) -> dict[str, list[int]]:
    """Each distinct config mistake among the jobs not in `skip`, with the numbers of the jobs that have it."""
    from gradrunner.config.schema import validate

    loader = config_loader()
    problems: dict[str, list[int]] = {}
    resolved: dict[str, str | None] = {}
    keep = keeps_job_configs(config, len(jobs) - len(skip))  # for the launcher: each job composed once
    for number, overrides in enumerate(jobs):
        if number in skip:
            continue
        try:
            cfg = loader.load_sweep_config(config, list(overrides))
            validate(cfg)
        except (GradrunnerError, OmegaConfBaseException, CompactHydraException) as e:
            problems.setdefault(one_paragraph(e), []).append(number)
            continue
        if keep:
            keep_job_config(config, list(overrides), cfg)
        key = OmegaConf.to_yaml({"model": cfg.model, "taps": cfg.taps})
        if key not in resolved:
            resolved[key] = _tap_problem(cfg)
        if resolved[key] is not None:
            problems.setdefault(str(resolved[key]), []).append(number)
    return problems


def _tap_problem(cfg: DictConfig) -> str | None:
    """The tap specs resolved against the model built on the meta device (no memory, no init cost), or None.

    A model that cannot be built that way is left to its job, which reports any problem itself.
    """
    import torch
    from hydra.utils import instantiate

    from gradrunner.capturing.taps import resolve_taps

    try:
        with torch.device("meta"):
            model = instantiate(cfg.model, _convert_="all")
    except Exception:
        return None
    if not isinstance(model, torch.nn.Module):
        return None
    try:
        resolve_taps(model, OmegaConf.to_container(cfg.taps, resolve=True))  # type: ignore[arg-type]
    except GradrunnerError as e:
        return one_paragraph(e)
    return None


def _refuse(message: str) -> NoReturn:
    """A mistake found before any job ran (the command line, or the run dir Hydra could not write)."""
    print(f"gradrunner: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def main() -> None:
    """The entry point: a misspelled key on the command line is refused in one paragraph, then the app runs.

    Example::

        gradrunner +experiment=mlp steps=10
    """
    signals.between_runs()  # SIGTERM between a sweep's jobs: a message and 143, not a silent death
    overrides, options = split_options(sys.argv[1:])  # `+experiment=mlp --cfg job steps=2`: argparse takes one run
    sys.argv = [sys.argv[0], *overrides, *options]
    message = misspelled_key(sys.argv[1:]) or group_mistake(sys.argv[1:])
    if message is not None and os.environ.get("HYDRA_FULL_ERROR") != "1":
        print(f"gradrunner: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    try:
        with mistakes_as_one_paragraph(_refuse), config_composed_once():
            app()
    except BrokenPipeError:  # `gradrunner --help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt as e:  # outside any job: a job's own is reported by `app`
        signals.ignore_further_signals()
        print(f"gradrunner: {_outside_jobs(e)}", file=sys.stderr, flush=True)
        sys.exit(signals.exit_status(e))


#: Jobs this process started and ended (`app`), and whether of a sweep: the message of a signal between them.
_JOBS = {"started": 0, "ended": 0, "sweep": 0}


def _outside_jobs(interrupt: KeyboardInterrupt) -> str:
    """What a Ctrl-C (or SIGTERM, SIGHUP) that landed outside any job left: one line."""
    what = f"terminated ({interrupt.signal_name})" if isinstance(interrupt, Terminated) else "interrupted"
    ended = _JOBS["ended"]
    if not _JOBS["started"]:
        return f"{what} before any job started; nothing ran"
    if not _JOBS["sweep"]:
        return f"{what} after the run ended; its records are complete"
    return (f"{what} between the jobs of the sweep; the {ended} job(s) that ran are kept as they ended ({DONE} marks "
            "each completed one) and the others did not start: run the same command again to run them (completed "
            "jobs are skipped)")  # fmt: skip


@hydra.main(version_base="1.3", config_path="pkg://gradrunner.conf", config_name="config")
def app(cfg: DictConfig) -> None:
    """Run one job: `run(cfg)`, with user mistakes reported as one paragraph (see the module doc).

    Example::

        python -m gradrunner +experiment=sigmoid2 steps=1 capture.values=full
    """
    mark_task_started()
    _JOBS["started"] += 1
    _JOBS["sweep"] = int(HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN)
    guard_log_files()
    try:
        with job_log():  # gradrunner.log keeps the last word whatever level quiets the console
            run(cfg)
    except (GradrunnerError, OmegaConfBaseException) as e:
        _fail(e)
    except KeyboardInterrupt as e:  # Terminated (SIGTERM, SIGHUP) too
        signals.ignore_further_signals()
        if int(os.environ.get("RANK", "0") or 0) == 0:  # under torchrun every rank stops; rank 0 says it, once
            what = f"terminated ({e.signal_name})" if isinstance(e, Terminated) else "interrupted"
            print(f"gradrunner: {_kept(what)}", file=sys.stderr, flush=True)
        sys.exit(signals.exit_status(e))
    finally:
        _JOBS["ended"] += 1
