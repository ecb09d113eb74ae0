"""Every use of Hydra's internals, in one place: what gradrunner needs from Hydra beyond its public API.

Contents:
    JobFailed, JobRefused        -- a sweep job's mistake, or refusal, as Hydra reports it at the end of the sweep
    task_overrides()             -- this job's own command-line overrides ([] outside a Hydra app)
    job_error(job_return)        -- the exception a failed job raised, without re-raising it
    expand_sweep(overrides)      -- the basic sweeper's job list for parsed overrides
    sweep_jobs(config)           -- every job's overrides of a sweep the basic sweeper (or gradrunner's) runs
    config_loader()              -- the running app's config loader (to compose a sweep's jobs up front)
    mistakes_as_one_paragraph()  -- errors Hydra meets before the job (composing, saving .hydra/) as one paragraph
    config_composed_once()       -- the app's config composed once, not once for `hydra.mode` and again to run;
                                    a sweep job's once, not by its up-front check and again by the launcher
    keeps_job_configs(config, n) -- whether the up-front check keeps the n jobs' configs for the launcher
    keep_job_config(config, overrides, job_config) -- keep one (`load_sweep_config(config, overrides)`'s)
    yaml_parsed_once()           -- a config file's text parsed once per process, not at every composition
    split_options(argv)          -- a command line's overrides, and Hydra's own options (`--cfg job`, `--config-dir D`)

Hydra 1.3 offers no public way to read a failed job's exception (`JobReturn.return_value` re-raises
it), to expand a sweep the way its basic sweeper does, or to reach the config loader from a callback:
those reach into `hydra._internal` / private attributes here, and nowhere else. `yaml_parsed_once` parses
a config file the way `OmegaConf.load` does, with the loader it uses (`omegaconf._utils.get_yaml_loader`).

Example::

    meta = run_metadata(yaml, seed, overrides=task_overrides())
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator
from typing import IO, Any, NoReturn

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf._utils import get_yaml_loader


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
    # Unresolved, as the command line gave them: `steps=${seed}` is each job's to resolve, not the primary config's
    found = OmegaConf.select(config, "hydra.sweeper.params")
    params: dict[str, Any] = OmegaConf.to_container(found, resolve=False) if found else {}  # type: ignore[assignment]
    task: list[Any] = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)  # type: ignore[assignment]
    arguments = [f"{k}={v}" for k, v in params.items()] + [str(o) for o in task]
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


#: Hydra's options that print and exit while its command line is parsed.
_PRINTING_OPTIONS = ("-h", "--help", "--hydra-help", "--version")


def split_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv`'s overrides and Hydra's own options (`--cfg job`, `--config-dir D`, ...), each kept in order.

    Example::

        split_options(["+experiment=mlp", "--cfg", "job", "steps=1"])   # (['+experiment=mlp', 'steps=1'], ['--cfg', 'job'])

    Hydra's parser (argparse) takes one run of overrides: overrides a command adds to the user's, put between
    theirs and an option of theirs, were refused as 'unrecognized arguments', naming what the user never typed.
    `(argv, [])` where Hydra's parser refuses `argv` (Hydra then says why) or prints and exits (`--help`).
    """
    from hydra._internal.utils import get_args_parser

    if any(a in _PRINTING_OPTIONS for a in argv):
        return argv, []
    parser = get_args_parser()

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # type: ignore[method-assign]  # argparse would print the usage and exit
    try:
        overrides = list(parser.parse_intermixed_args(argv).overrides)
    except ValueError:
        return argv, []
    options, waiting = [], list(overrides)
    for arg in argv:
        if waiting and arg == waiting[0]:
            waiting.pop(0)
        else:
            options.append(arg)
    return overrides, options


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


#: Hydra's own values of a run-mode override that its `_run_app` appends after `get_mode`.
_MODE_OVERRIDES = ("hydra.mode=RUN", "hydra.mode=MULTIRUN")
#: A sweep of at most this many jobs to launch, by Hydra's basic launcher (in this process), keeps the configs its
#: up-front check composed (about 150 kB each) for its jobs to run on; a larger one composes each job again.
KEPT_JOBS_AT_MOST = 256
#: The job configs kept while `config_composed_once` is open: (id of the sweep's config, overrides) -> both.
_JOB_CONFIGS: dict[tuple[int, tuple[str, ...]], tuple[DictConfig, DictConfig]] | None = None


def keeps_job_configs(config: DictConfig, jobs: int) -> bool:
    """Whether the up-front check of a sweep (`config`) with `jobs` jobs to launch keeps their configs for them.

    Example::

        if keeps_job_configs(config, len(jobs)):
            keep_job_config(config, overrides, loader.load_sweep_config(config, overrides))
    """
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    return _JOB_CONFIGS is not None and jobs <= KEPT_JOBS_AT_MOST and launcher.endswith(".BasicLauncher")


def keep_job_config(config: DictConfig, overrides: list[str], job_config: DictConfig) -> None:
    """Keep `job_config` (`load_sweep_config(config, overrides)`'s) for the launcher's composition of that job.

    Only while `config_composed_once` is open; the launcher takes it once, and only where Hydra would
    compose the same config again (`config_composed_once`).
    """
    if _JOB_CONFIGS is not None:
        _JOB_CONFIGS[(id(config), tuple(overrides))] = (config, job_config)


def _kept_job(config: DictConfig, overrides: list[str]) -> DictConfig | None:
    """The job config kept for `load_sweep_config(config, overrides)`, where Hydra would compose it the same now."""
    entry = _JOB_CONFIGS.pop((id(config), tuple(overrides)), None) if _JOB_CONFIGS is not None else None
    if entry is None or entry[0] is not config:
        return None
    job = entry[1]
    hydra = job.hydra
    env_moved = any(hydra.job.env_set.get(k) != os.environ.get(k) for k in hydra.job.env_copy)
    if env_moved or hydra.runtime.cwd != os.getcwd():
        return None  # Hydra reads both as it composes: it would compose another config now
    OmegaConf.copy_cache(from_config=config, to_config=job)  # as `load_sweep_config` does, at the launch
    return job


@contextlib.contextmanager
def config_composed_once() -> Iterator[None]:
    """While open, the app's config is composed once where Hydra composes it twice with the same inputs.

    Example::

        with config_composed_once():
            app()          # `python -m gradrunner +experiment=mlp`: one composition, not two

    Hydra's `_run_hydra` composes the config (`Hydra.get_mode`) only to read `hydra.mode`, then
    `Hydra.run` or `Hydra.multirun` composes it again from the same config name and overrides, plus
    `hydra.mode=RUN` (or `MULTIRUN`) where the config sets no mode: two compositions of about 0.1 s
    each to start a run, where one does. Here `get_mode` keeps what it composed, and the next composition
    of the same name and overrides takes it, with that one override applied the way Hydra applies
    overrides, and Hydra's own sweep-override checks for its run mode. The config is the one Hydra
    would compose (a test compares the two). Where the two compositions could differ, Hydra composes
    anew: `get_mode` composes in Hydra's RUN mode, which refuses a missing (`???`) config group, unless
    an override sweeps or RUN mode failed (then in its MULTIRUN mode, as Hydra's `get_mode` does); the
    kept config serves one composition, the next, and only if it has the same config name and
    overrides and a mode the kept one can serve (one composed in RUN mode serves both).

    A sweep's jobs: the up-front check (`cli.app.SweepCheck`) composes each job (`load_sweep_config`)
    to validate it, and Hydra's basic launcher composes it again to run it. Where `keeps_job_configs`
    says so, the check keeps each config it validated (`keep_job_config`) and the launcher's
    `load_sweep_config` of the same sweep config and overrides takes it (and the sweep config's
    resolver cache, as Hydra's does), unless the working directory or a variable of
    `hydra.job.env_copy` changed since: Hydra reads both as it composes. So a job runs on the config
    that was checked, read from the config files as they were when the sweep started.
    """
    global _JOB_CONFIGS
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra

    kept: list[tuple[str | None, list[str], RunMode, DictConfig]] = []
    original_get_mode, original_load = Hydra.get_mode, ConfigLoaderImpl.load_configuration

    def get_mode(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        kept.clear()
        try:
            sweeps = any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(overrides))
        except Exception:
            return original_get_mode(self, config_name, overrides)  # Hydra reports it when it composes to run
        loader: Any = self.config_loader
        for mode in [RunMode.MULTIRUN] if sweeps else [RunMode.RUN, RunMode.MULTIRUN]:  # Hydra's: MULTIRUN
            try:
                cfg = original_load(loader, config_name, list(overrides), mode, validate_sweep_overrides=False)
            except Exception:
                continue
            kept.append((config_name, list(overrides), mode, cfg))
            return cfg.hydra.mode
        return None  # as Hydra's `get_mode` on any error: its composition to run reports it

    def load_configuration(self: ConfigLoaderImpl, config_name: str | None, overrides: list[str], run_mode: RunMode,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> DictConfig:  # fmt: skip
        taken = _take_kept(kept, config_name, overrides, run_mode)
        if taken is None:
            return original_load(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        cfg, extra = taken
        parsed = OverridesParser.create().parse_overrides(overrides)
        if validate_sweep_overrides:
            self.validate_sweep_overrides_legal(overrides=parsed, run_mode=run_mode, from_shell=from_shell)
        for override in parsed[len(parsed) - extra :]:  # as `_load_configuration_impl` applies the last override
            ConfigLoaderImpl._apply_overrides_to_config([override], cfg)
            cfg.hydra.overrides.hydra.append(override.input_line)
        return cfg

    original_sweep = ConfigLoaderImpl.load_sweep_config

    def load_sweep_config(self: ConfigLoaderImpl, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        job = _kept_job(master_config, sweep_overrides)
        return job if job is not None else original_sweep(self, master_config, sweep_overrides)

    patched = (get_mode, load_configuration, load_sweep_config)
    originals = (original_get_mode, original_load, original_sweep)
    Hydra.get_mode, ConfigLoaderImpl.load_configuration, ConfigLoaderImpl.load_sweep_config = patched  # type: ignore[method-assign]
    _JOB_CONFIGS = {}
    try:
        with yaml_parsed_once():
            yield
    finally:
        _JOB_CONFIGS = None
        Hydra.get_mode, ConfigLoaderImpl.load_configuration, ConfigLoaderImpl.load_sweep_config = originals  # type: ignore[method-assign]


#: Parsed YAML of config files read in this process, by their text (what `yaml_parsed_once` reuses).
_PARSED: dict[str, object] = {}
#: At most this many texts are kept (the oldest let go first), none longer than `PARSED_TEXT_AT_MOST` characters.
PARSED_AT_MOST = 1024
PARSED_TEXT_AT_MOST = 1 << 20
_parsing_once = [0]


@contextlib.contextmanager
def yaml_parsed_once() -> Iterator[None]:
    """While open, a config file Hydra reads is parsed as YAML once per process, not at every composition.

    Example::

        with yaml_parsed_once():
            compose("config", overrides=["+experiment=mlp"])   # the second time: no YAML parsed

    Hydra reads and parses every config file of the defaults list afresh at each composition (16 files
    for `+experiment=mlp`): YAML parsing is about a fifth of a composition's 0.1 s, paid again by each
    job of a sweep (composed by the up-front check) and by each composition of a process that composes
    many. Here Hydra's `OmegaConf.load(file)` reads the file's text; a text parsed before in this
    process is not parsed again, its parsed YAML is deep-copied and made into a config as
    `OmegaConf.load` makes it. Keyed by the whole text, so an edited file is parsed anew (nothing by
    file name or time). A text not seen before is parsed from the file itself, so a YAML error names
    the file as it does without this. Loads of a path (not an open file) pass through unchanged.
    Re-entrant; `OmegaConf.load` is restored when the outermost block closes, also on an error.
    """
    original = OmegaConf.__dict__["load"]
    load = original.__func__

    def once(file_: str | os.PathLike[str] | IO[Any]) -> DictConfig | ListConfig:
        if isinstance(file_, (str, os.PathLike)) or not file_.seekable():
            return load(file_)
        start = file_.tell()
        text = file_.read()
        if not isinstance(text, str):
            file_.seek(start)
            return load(file_)
        if text in _PARSED:
            obj = copy.deepcopy(_PARSED[text])
        else:
            file_.seek(start)
            obj = yaml.load(file_, Loader=get_yaml_loader())
            if len(text) <= PARSED_TEXT_AT_MOST:
                if len(_PARSED) >= PARSED_AT_MOST:
                    del _PARSED[next(iter(_PARSED))]
                _PARSED[text] = copy.deepcopy(obj)
        if obj is not None and not isinstance(obj, (list, dict, str)):
            raise OSError(f"Invalid loaded object type: {type(obj).__name__}")  # as OmegaConf.load
        return OmegaConf.create() if obj is None else OmegaConf.create(obj)

    if _parsing_once[0] == 0:
        OmegaConf.load = staticmethod(once)  # type: ignore[method-assign]
    _parsing_once[0] += 1
    try:
        yield
    finally:
        _parsing_once[0] -= 1
        if _parsing_once[0] == 0:
            OmegaConf.load = original  # type: ignore[method-assign]


def _take_kept(kept: list[tuple[str | None, list[str], RunMode, DictConfig]], config_name: str | None,
               overrides: list[str], run_mode: RunMode) -> tuple[DictConfig, int] | None:  # fmt: skip
    """The config `get_mode` kept and how many overrides (0 or 1) it lacks, where it serves this composition.

    It serves once, and only the composition right after `get_mode`: of the same config name and
    overrides, plus at most the run-mode override Hydra appends; in its own run mode, or in any where it
    was composed in RUN mode (nothing was missing, so MULTIRUN's skipping of missing groups changes nothing).
    """
    if not kept:
        return None
    name, before, mode, cfg = kept.pop()
    extra = overrides[len(before) :]
    if name != config_name or overrides[: len(before)] != before or any(o not in _MODE_OVERRIDES for o in extra):
        return None
    if len(extra) > 1 or mode not in (run_mode, RunMode.RUN):
        return None
    return cfg, len(extra)


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
