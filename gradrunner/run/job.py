"""One job of the CLI: `run(cfg)` is `runner.train(cfg)` inside the run dir's books.

What `run` adds to `train`: the run dir's lock (one live run per dir), the existing-run-dir rule
(refuse, or resume after verifying), the completion marker `done.json` written last, the end-of-run
report (`report=true`), and DDP under torchrun (the process group, rank 0's run dir for every rank). See `gradrunner.records.rundir` and `gradrunner.run.distributed`.

Example::

    run(cfg)    # in the Hydra app: <run dir>/grads.parquet, steps.parquet, then done.json
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradrunner.config.schema import validate
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.columns import GRADS_FILE
from gradrunner.run import books, branch, distributed
from gradrunner.run.distributed import Distributed
from gradrunner.run.guards import NonFinite
from gradrunner.run.hydra_adapter import task_overrides
from gradrunner.run.loop import output_dir, train

log = logging.getLogger(__name__)


def _decide(
    directory: Path, cfg: DictConfig, resume: bool, dist: Distributed | None, hold: Callable[[], object]
) -> str:
    """`hold()` (take the run dir's lock) and `books.prepare` on rank 0 only; the answer (or error) on every rank."""
    if dist is None:
        hold()
        return books.prepare(directory, cfg, resume=resume)
    outcome: str | GradrunnerError = ""
    if dist.is_main:
        try:
            hold()
            outcome = books.prepare(directory, cfg, resume=resume)
        except GradrunnerError as e:
            outcome = e
    outcome = dist.broadcast(outcome)
    if isinstance(outcome, GradrunnerError):
        raise outcome
    return outcome


def run(cfg: DictConfig, out_dir: str | Path | None = None) -> Path:
    """Run the job with its books kept; return the path of its `grads.parquet`.

    Example::

        run(cfg)                            # in a Hydra app: the job's output dir
        run(cfg, out_dir="runs/a")          # anywhere else

    - The run holds the run dir's `books.RunLock` throughout: a dir another live run holds is refused
      (`books.LiveRun`); in a sweep, a job whose live holder runs the same overrides is skipped with a
      warning (that run completes the job), and one held by a run of another config is refused (it fails).
    - A run dir that already holds records is refused, unless `resume=true` (a sweep always resumes):
      then a completed job (`done.json`, same config, files verified) is skipped, anything else runs again.
    - `done.json` is written last, once the records are closed: a job without it did not complete.
    - `report=true`: matplotlib is checked before step 0 and a single run writes its report at the end
      (a sweep writes one for the sweep dir, in `gradrunner.cli.sweep_books`); a failing report never fails the run.
    - Under torchrun (`WORLD_SIZE > 1`) the job is one DDP rank; see `gradrunner.run.distributed`.
    """
    validate(cfg)
    if cfg.report:
        from gradrunner.report.write import check_available

        check_available()
    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    multirun = hydra is not None and hydra.mode == RunMode.MULTIRUN
    main = True
    with distributed.session(cfg) as dist:
        cfg = dist.device_config(cfg) if dist is not None else cfg
        directory = output_dir(out_dir)
        directory = dist.shared_dir(directory) if dist is not None else directory
        run_id = dist.run_id if dist is not None else uuid.uuid4().hex
        with contextlib.ExitStack() as held:
            lock = books.RunLock(directory, run_id)
            try:
                decision = _decide(directory, cfg, bool(cfg.resume) or multirun, dist, lambda: held.enter_context(lock))
            except books.LiveRun as e:
                if not multirun:
                    raise
                theirs, ours = e.holder_overrides(), task_overrides()
                if theirs is None or sorted(theirs) != sorted(ours):  # the live run will never do this job
                    raise books.LiveRun(
                        f"{one_paragraph(e)} That run is {_config_words(theirs)}, not this job's "
                        f"({' '.join(ours) or 'no overrides'}): this job did not run, and counts as failed in this "
                        "sweep; run the sweep again once that run has ended, or sweep into another dir.",
                        e.owner,
                    ) from None
                log.warning("skipped: %s", one_paragraph(e))  # the sweep goes on; the live run completes the job
                return directory / GRADS_FILE
            except books.Refused:
                lock.leave_no_trace()
                raise
            if decision == "skip":
                lock.leave_no_trace()  # Hydra rewrote .hydra/ of the completed job: put it back
                if dist is None:
                    _replay(directory, cfg)  # a replay the job's first run did not finish (killed): the rest of them
                return directory / GRADS_FILE
            if dist is None:
                branch.seed(directory, cfg)  # train.branch_from: the state it starts from (run.branch)
            try:
                path = train(cfg, out_dir=directory, run_id=run_id, dist=dist)
            except NonFinite:
                if dist is None:
                    _replay(directory, cfg)  # stopped on the spike (capture.on_nonfinite=stop): replayed all the same
                raise
            main = dist is None or dist.is_main
            if main:
                _mark_complete(directory, cfg, run_id, dist.world_size if dist is not None else 1, task_overrides())
    if main and dist is None:
        _replay(directory, cfg)  # the replays of the run's loss spikes, once its records are complete
    if cfg.report and main and not multirun:
        from gradrunner.report.write import try_report

        try_report(directory)
    return path


def _config_words(overrides: list[str] | None) -> str:
    """How a refusal names the live run's config: its overrides, or that its lock record does not say."""
    if overrides is None:
        return "of a config its lock record does not name"
    return f"of another config ({' '.join(overrides) or 'no overrides'})"


def _replay(directory: Path, cfg: DictConfig) -> None:
    """`anomaly.replay=K`: replay the run's loss spikes (`run.replay.after_run`), after its records are closed."""
    if int(OmegaConf.select(cfg, "anomaly.replay", default=0) or 0) > 0:
        from gradrunner.run.replay import after_run

        after_run(directory, cfg, run)


def _mark_complete(directory: Path, cfg: DictConfig, run_id: str, world: int, overrides: list[str]) -> None:
    """`books.mark_complete`, with a filesystem failure told in one paragraph (the records stay)."""
    files = [n for n in rundir.RECORD_NAMES if (directory / n).is_file()]
    try:
        books.mark_complete(directory, cfg, files=files, run_id=run_id, world_size=world, overrides=overrides)
    except OSError as e:
        raise GradrunnerError(
            f"the records in {directory} ({', '.join(files)}) are complete, but the completion marker "
            f"{directory / rundir.DONE} could not be written: {one_paragraph(e)}. Without it the job counts as "
            "not completed; free some disk space (or make the dir writable), then run again with resume=true."
        ) from e
