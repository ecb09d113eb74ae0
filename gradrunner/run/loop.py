"""The step loop behind `python -m gradrunner`: build what the config names, train, write the records.

`train(cfg)` needs no Hydra app (only a composed config): it validates the config, seeds, builds the
model, data, loss and optimizer, opens a capture over the taps (every tap resolved before step 0),
and streams `grads.parquet` and `steps.parquet` into the job's output directory.

Example::

    with initialize_config_module("gradrunner.conf", version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=mlp", "steps=2"])
    path = train(cfg, out_dir="runs/a")     # runs/a/grads.parquet
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from gradrunner.capturing.session import Capture, capture
from gradrunner.records.columns import GRADS_FILE, RECORD_FILES, STEPS_FILE
from gradrunner.run import distributed, watch
from gradrunner.run.build import Job, setup
from gradrunner.run.distributed import Distributed, GatheredWriter
from gradrunner.run.guards import (
    NonFinite,
    backward,
    check_finite,
    check_writable,
    forward_loss,
    next_batch,
    optimizer_step,
    sigterm_as_interrupt,
    write_errors,
)

if TYPE_CHECKING:
    from gradrunner.records.writer import RecordWriter, StepsWriter

log = logging.getLogger(__name__)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA allocator's peak on a GPU, else the process's peak RSS.

    Example::

        peak_memory_bytes(torch.device("cpu"))   # e.g. 412_000_000
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class Progress:
    """A tqdm bar on a terminal, a log line every ~10% of the steps otherwise (and in the log file either way).

    Example::

        bar = Progress(total=100)
        for step in range(100): bar.update(step, loss=0.5)
        bar.close()

    Steps are named as the records name them, from 0 (`step 9 (10/100)`). On a terminal the log
    lines go above the bar (tqdm's logging redirect), so `gradrunner.log` gets them too.
    """

    def __init__(self, total: int, stream: TextIO | None = None, min_interval: float = 0.1) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, math.ceil(total / 10))
        self._stack = contextlib.ExitStack()
        self._bar: tqdm | None = None
        if self.tty:
            self._bar = self._stack.enter_context(
                tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True, mininterval=min_interval)
            )
            self._stack.enter_context(logging_redirect_tqdm())

    def update(self, step: int, loss: float) -> None:
        done = step + 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"step {step}  loss {loss:.6g}", refresh=False)
            self._bar.update(done - self._bar.n)
        if done % self.every == 0 or done == self.total:
            log.info("step %d (%d/%d, %d%%)  loss %.6g", step, done, self.total, 100 * done // max(self.total, 1), loss)

    def close(self) -> None:
        self._stack.close()


def output_dir(out_dir: str | Path | None = None) -> Path:
    """Where the job's records go: `out_dir` if given, else Hydra's job output dir, else the cwd.

    Example::

        output_dir("runs/a")   # PosixPath('/abs/runs/a')
    """
    if out_dir is not None:
        return Path(out_dir).resolve()
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).resolve()
    return Path.cwd()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_steps(
    cfg: DictConfig, job: Job, cap: Capture, grads: RecordWriter | GatheredWriter, steps: StepsWriter | GatheredWriter
) -> None:
    """The step loop: forward, loss, backward, optimizer step, records (on captured steps).

    The records of a captured step are taken after the optimizer step, so that the tapped
    parameters' update norms ride in the step's one transfer; nothing else they read changes
    with the step (gradients are reduced or copied as they arrive).
    """
    from gradrunner.records.writer import deferred_signals  # pyarrow: imported once writing starts

    bar = Progress(cfg.steps)
    # Read from the config once: OmegaConf lookups cost more than a tiny model's step.
    every, on_nonfinite = int(cfg.capture.every), str(cfg.capture.get("on_nonfinite", "record"))
    full_values, zeros = cfg.capture["values"] == "full", watch.ZeroWatch(int(cfg.steps))
    source, model_name, loss_name = str(cfg.data._target_), str(cfg.model._target_), str(cfg.loss._target_)
    warned: set[str] = set()
    try:
        for step in range(int(cfg.steps)):
            t0 = time.perf_counter()
            x, y = next_batch(job.batches, step, source=source)
            cap.enabled = captured = step % every == 0
            loss = forward_loss(job.model, job.loss_fn, x, y, step, model_name=model_name, loss_name=loss_name)
            backward(cap.backward, loss, step)
            capture_time = None
            before = cap.snapshot_params() if captured else None  # tapped parameters only: their update norms
            optimizer_step(job.optimizer, step)
            if captured:
                t1 = time.perf_counter()
                recs = cap.records(loss, before)
                watch.warn_without_grad(recs, step, warned)
                if full_values and step == 0:
                    watch.warn_values_size(recs, watch.captured_steps(int(cfg.steps), every), int(cfg.capture.sample_size))
                capture_time = time.perf_counter() - t1
                loss_value = float("nan") if recs.loss is None else recs.loss
            else:
                loss_value = float(loss.detach())
            job.optimizer.zero_grad(set_to_none=True)
            _sync(job.device)
            peak = peak_memory_bytes(job.device)
            with deferred_signals():  # a step's rows go into both tables, or into neither
                t2 = time.perf_counter()
                if captured:
                    grads.write_step(step, recs)
                    capture_time = (capture_time or 0.0) + time.perf_counter() - t2
                steps.write(step, captured, loss_value, time.perf_counter() - t0, capture_time, peak)
            bar.update(step, loss_value)
            zeros.step(step, loss_value, recs if captured else None)
            check_finite(on_nonfinite, step, loss_value, recs if captured else None)
    finally:
        bar.close()


def train(
    cfg: DictConfig, out_dir: str | Path | None = None, *, run_id: str | None = None, dist: Distributed | None = None
) -> Path:
    """Run the job `cfg` describes; return the path of its `grads.parquet`.

    Example::

        path = train(cfg, out_dir=tmp_path)          # tmp_path/grads.parquet, tmp_path/steps.parquet
        pd.read_parquet(path).groupby("tap")["norm"].mean()

    Every config mistake (bad value, bad target, bad tap, model/data mismatch at step 0, an unwritable
    output dir) raises `GradrunnerError` before any record is written; no `grads.parquet` is left behind
    then. Later failures (see `gradrunner.run.guards`: a forward or loss that raises, data that runs out,
    `capture.on_nonfinite=stop`, a full disk) are `GradrunnerError`s too; SIGTERM raises `Terminated`
    (a KeyboardInterrupt) and, like Ctrl-C, keeps the completed steps' records.
    `dist` (from `distributed.session`) runs it as one rank of a DDP job; `run()` adds the run dir's books.
    """
    job = setup(cfg)
    if job.device.type == "cuda":  # jobs of a sweep run in one process: each starts its own peak
        torch.cuda.reset_peak_memory_stats(job.device)
    if dist is not None:
        job = distributed.wrap(job, dist)
    directory = output_dir(out_dir)
    check_writable(directory)
    constants = {
        "run_id": run_id or uuid.uuid4().hex,
        "experiment": str(cfg.experiment),
        "strategy": str(cfg.capture.strategy),
        "device": str(job.device),
        "dtype": str(cfg.dtype),
    }
    from gradrunner.records.writer import run_metadata  # pyarrow: not needed to find a config mistake
    from gradrunner.run.hydra_adapter import task_overrides

    meta = run_metadata(OmegaConf.to_yaml(cfg, resolve=True), seed=int(cfg.seed), overrides=task_overrides())
    taps = OmegaConf.to_container(cfg.taps, resolve=True)
    assert isinstance(taps, list), taps  # validate() checked it
    watch.warn_nothing_captured(taps, int(cfg.steps))
    try:
        _train_in(cfg, job, directory, constants, meta, taps, dist)
    except KeyboardInterrupt:
        kept = [n for n in RECORD_FILES if (directory / n).is_file()]
        steps_kept = _steps_in(directory / STEPS_FILE)
        log.warning("interrupted; %s", f"the records of {steps_kept} completed step(s) are kept in {directory} "
                    f"({', '.join(kept)})" if kept else f"no records were kept in {directory}")  # fmt: skip
        raise
    if dist is None or dist.is_main:
        watch.last_word(directory)  # loss, NaN/Inf, vanishing/exploding taps, where the records are
    return directory / GRADS_FILE


def _steps_in(path: Path) -> int:
    try:
        return int(pq.read_metadata(path).num_rows)
    except (OSError, pa.ArrowException):
        return 0


def _train_in(
    cfg: DictConfig, job: Job, directory: Path, constants: dict[str, str], meta: dict[str, str], taps: list[Any],
    dist: Distributed | None,
) -> None:  # fmt: skip
    """The body of `train`: capture, writers and the step loop, closed in the right order."""
    c = cfg.capture
    with contextlib.ExitStack() as stack:
        stack.enter_context(write_errors(directory))  # first in, last out: sees the writers' close too
        wrap = None if dist is None else distributed.strategy_wrapper(job.model, str(c.strategy), lambda: cap.enabled)
        per_example, histogram = bool(c.get("per_example", False)), bool(c.get("histogram", False))
        cap = capture(distributed.unwrap(job.model), taps, c.strategy, values=c["values"],
                      sample_size=c.sample_size, seed=cfg.seed, keep_grads=False, wrap_strategy=wrap,
                      per_example=per_example, histogram=histogram)  # fmt: skip
        stack.enter_context(cap)
        log.info("run %s: %d taps resolved (%s), %d steps on %s/%s", constants["run_id"], len(cap.taps),
                 ", ".join(t.tap for t in cap.taps[:6]) + (", ..." if len(cap.taps) > 6 else ""),
                 cfg.steps, job.device, cfg.dtype)  # fmt: skip
        # Before the writers, so that it still holds while they close: a preempted job keeps its steps.
        stack.enter_context(sigterm_as_interrupt())
        grads, steps = _open_writers(stack, directory, constants, meta, dist, per_example, histogram)
        try:
            _run_steps(cfg, job, cap, grads, steps)
        except NonFinite as e:
            e.directory = directory
            raise


def _open_writers(
    stack: contextlib.ExitStack, directory: Path, constants: dict[str, str], meta: dict[str, str],
    dist: Distributed | None, per_example: bool = False, histogram: bool = False,
) -> tuple[RecordWriter | GatheredWriter, StepsWriter | GatheredWriter]:  # fmt: skip
    """The job's grads and steps writers, closed by `stack`; under DDP rank 0 writes every rank's rows."""
    from gradrunner.records.writer import RecordWriter, StepsWriter, closing_together

    if dist is not None:
        return distributed.open_writers(stack, dist, directory, constants, meta, per_example, histogram)
    grads = RecordWriter(directory / GRADS_FILE, constants=constants, metadata=meta, per_example=per_example,
                         histogram=histogram)  # fmt: skip
    steps = StepsWriter(directory / STEPS_FILE, constants=constants, metadata=meta)
    stack.enter_context(closing_together(grads, steps))  # both kept (with the same steps) or both dropped
    return grads, steps

