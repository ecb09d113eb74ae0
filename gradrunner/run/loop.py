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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from gradrunner.analysis import health
from gradrunner.capturing.session import Capture, capture
from gradrunner.config.schema import edit_list
from gradrunner.records.columns import GRADS_FILE, RECORD_FILES, STEPS_FILE
from gradrunner.run import accumulation, distributed, watch
from gradrunner.run.build import Job, setup
from gradrunner.run.checkpoint import CHECKPOINT_DIR, Checkpointer, Tee
from gradrunner.run.distributed import Distributed, GatheredWriter
from gradrunner.run.evaluation import evaluate
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
    from gradrunner.records.columns import StepRecords
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


@dataclass
class StepContext:
    """What every step of a job reads, taken from the config once (OmegaConf lookups cost more than a tiny step)."""

    every: int
    accumulate: int
    clip_norm: float | None
    clip_value: float | None
    autocast: str
    eval_every: int
    eval_batches: int
    source: str
    model_name: str
    loss_name: str
    scaler: torch.amp.GradScaler

    @classmethod
    def of(cls, cfg: DictConfig, device: torch.device) -> StepContext:
        t = cfg.train
        return cls(
            every=int(cfg.capture.every), accumulate=int(t.accumulate),
            clip_norm=None if t.clip_grad_norm is None else float(t.clip_grad_norm),
            clip_value=None if t.clip_grad_value is None else float(t.clip_grad_value),
            autocast=str(t.autocast), eval_every=int(t.eval_every), eval_batches=int(t.eval_batches),
            source=str(cfg.data._target_), model_name=str(cfg.model._target_), loss_name=str(cfg.loss._target_),
            scaler=torch.amp.GradScaler(device.type, enabled=str(t.autocast) == "fp16"),
        )  # fmt: skip


def train_step(
    step: int, job: Job, cap: Capture, ctx: StepContext, grads: RecordWriter | GatheredWriter,
    steps: StepsWriter | GatheredWriter,
) -> tuple[float, StepRecords | None]:  # fmt: skip
    """One optimisation step, top to bottom; returns its loss and (on a captured step) its last records.

    1. `ctx.accumulate` micro-batches: forward and loss under `torch.autocast` (bf16, fp16 or off), the
       loss divided by `accumulate` and multiplied by the GradScaler's scale (fp16 only), backward the
       capture strategy's way. Parameter `.grad` accumulates over the micro-batches.
    2. `scaler.unscale_`: `.grad` holds the true gradient. The capture multiplies every captured
       gradient (activations too) by 1/scale on its device, so the records hold true gradients.
    3. `grad_norm`: total 2-norm over all parameters' `.grad`, before clipping, on the device.
    4. Clipping: `train.clip_grad_norm` exactly as `clip_grad_norm_` (with that norm), then
       `train.clip_grad_value` as `clip_grad_value_`.
    5. `scaler.step` (skipped on inf/NaN gradients under fp16) and `scaler.update`; the scheduler steps
       once per optimisation step; `lr` is the rate this step used.
    6. Records hold gradients BEFORE clipping (as `grad_norm`). With accumulation, activation taps
       are recorded per micro-batch (`micro_step`: the gradient of that micro-batch's loss / N) and
       parameter taps once, on the last micro-batch, from the accumulated `.grad`
       (`gradrunner.run.accumulation`).
    """
    t0 = time.perf_counter()
    captured = step % ctx.every == 0
    params = [p for g in job.optimizer.param_groups for p in g["params"]]
    lrs = [float(g["lr"]) for g in job.optimizer.param_groups]  # the rates this step uses
    scaler = ctx.scaler
    micro: list[tuple[int, torch.Tensor, StepRecords | None]] = []
    losses: list[torch.Tensor] = []
    for m in range(ctx.accumulate):
        x, y = next_batch(job.batches, step, source=ctx.source)
        cap.enabled = captured
        cap.grad_scale = scaler.scale(torch.ones((), device=job.device)).reciprocal() if scaler.is_enabled() else None
        with autocast(job.device, ctx.autocast):
            loss = forward_loss(job.model, job.loss_fn, x, y, step, model_name=ctx.model_name, loss_name=ctx.loss_name)
        backward(cap.backward, scaler.scale(loss / ctx.accumulate), step)
        losses.append(loss.detach())
        last = m == ctx.accumulate - 1
        if captured and not last:  # the collector holds one backward's records: take them now
            micro.append((m, loss, accumulation.drop_param_rows(cap.records(loss.detach()), cap)))
    scale = scaler.get_scale() if scaler.is_enabled() else None  # one host sync per step, fp16 only
    scaler.unscale_(job.optimizer)
    accumulated = accumulation.param_grad_records(cap) if captured and ctx.accumulate > 1 else None
    grad_norm = total_norm(params)
    clipped = clip(params, grad_norm, ctx.clip_norm, ctx.clip_value)
    before = cap.snapshot_params() if captured else None  # tapped parameters only: their update norms
    optimizer_step(job.optimizer, step, scaler if scaler.is_enabled() else None)
    scaler.update()
    skipped = scale is not None and scaler.get_scale() < scale  # the scaler backs off only after a skipped step
    if job.scheduler is not None:
        job.scheduler.step()
    capture_time = None
    recs = None
    if captured:
        t1 = time.perf_counter()
        recs = cap.records(losses[-1], before)
        if accumulated is not None:
            recs = accumulation.replace_param_rows(recs, accumulated)
        micro.append((ctx.accumulate - 1, losses[-1], recs))
        capture_time = time.perf_counter() - t1
    job.optimizer.zero_grad(set_to_none=True)
    eval_loss = evaluate(job, cap, autocast(job.device, ctx.autocast)) if ctx.eval_every and (step + 1) % ctx.eval_every == 0 else None
    wide = torch.float32 if job.device.type == "mps" else torch.float64  # MPS has no float64
    on_host = [torch.stack(losses).to(wide).mean(), grad_norm.to(wide), clipped.to(wide)]
    host = torch.stack([t.to(losses[0].device) for t in on_host]).tolist()  # the step's one transfer
    _sync(job.device)
    peak = peak_memory_bytes(job.device)
    from gradrunner.records.writer import deferred_signals  # pyarrow: imported once writing starts

    with deferred_signals():  # a step's rows go into both tables, or into neither
        t2 = time.perf_counter()
        for m, _, r in micro:
            assert r is not None
            grads.write_step(step, r, micro_step=accumulation.micro_steps(r, m, cap) if ctx.accumulate > 1 else None)
        if captured:
            capture_time = (capture_time or 0.0) + time.perf_counter() - t2
        steps.write(step, captured, host[0], time.perf_counter() - t0, capture_time, peak, lr=lrs[0], lrs=lrs,
                    grad_norm=host[1], clipped=bool(host[2]), loss_scale=scale, skipped=skipped if scale else None,
                    eval_loss=eval_loss)  # fmt: skip
    return host[0], recs


def autocast(device: torch.device, mode: str) -> torch.autocast:
    """`torch.autocast` for `train.autocast` (`bf16`, `fp16`; `off`: a disabled one)."""
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=mode != "off")


def total_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all parameters' `.grad` together (0 without any), on their device, no host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, 2.0)


def clip(
    params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float | None, max_value: float | None
) -> torch.Tensor:
    """Clip `.grad` in place as `clip_grad_norm_` (given the total `norm`) then `clip_grad_value_` do; whether it changed them."""
    clipped = torch.zeros((), dtype=torch.bool, device=norm.device)
    with_grad = [p for p in params if p.grad is not None]
    if max_norm is not None and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
        clipped = clipped | (norm > max_norm)
    if max_value is not None and with_grad:
        peak = torch.stack([p.grad.detach().abs().max() for p in with_grad if p.grad is not None and p.grad.numel()])
        clipped = clipped | (peak.max().to(clipped.device) > max_value)
        torch.nn.utils.clip_grad_value_(with_grad, max_value)
    return clipped


def _run_steps(
    cfg: DictConfig, job: Job, cap: Capture, grads: RecordWriter | GatheredWriter, steps: StepsWriter | GatheredWriter,
    ckpt: Checkpointer | None = None, run_id: str = "",
) -> None:  # fmt: skip
    """The step loop: `train_step` for every step, with progress, the run's watches and checkpoints."""
    bar = Progress(cfg.steps)
    ctx = StepContext.of(cfg, job.device)
    start = 0
    if ckpt is not None:
        start = ckpt.restore(job, ctx.scaler, grads, steps, run_id)  # a sweep re-run resumes too
        ckpt.start(start)
        cap.skip_backwards(start * ctx.accumulate)  # one backward per micro-batch: seeded edits draw on
        grads, steps = Tee(grads, ckpt), Tee(steps, ckpt)  # type: ignore[assignment]
    on_nonfinite = str(cfg.capture.get("on_nonfinite", "record"))
    full_values, zeros = cfg.capture["values"] == "full", watch.ZeroWatch(int(cfg.steps))
    warned: set[str] = set()
    try:
        for step in range(start, int(cfg.steps)):
            loss_value, recs = train_step(step, job, cap, ctx, grads, steps)
            if ckpt is not None and step + 1 < int(cfg.steps):
                ckpt.maybe_save(step, job, ctx.scaler)
            if recs is not None:
                watch.warn_without_grad(recs, step, warned)
                if full_values and step == 0:
                    watch.warn_values_size(
                        recs, watch.captured_steps(int(cfg.steps), ctx.every), int(cfg.capture.sample_size)
                    )
            bar.update(step, loss_value)
            zeros.step(step, loss_value, recs)
            check_finite(on_nonfinite, step, loss_value, recs)
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
        health.last_word(directory)  # loss, NaN/Inf, vanishing/exploding taps, where the records are
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
                      per_example=per_example, histogram=histogram,
                      edits=edit_list(cfg))  # fmt: skip
        stack.enter_context(cap)
        log.info("run %s: %d taps resolved (%s), %d steps on %s/%s", constants["run_id"], len(cap.taps),
                 ", ".join(t.tap for t in cap.taps[:6]) + (", ..." if len(cap.taps) > 6 else ""),
                 cfg.steps, job.device, cfg.dtype)  # fmt: skip
        # Before the writers, so that it still holds while they close: a preempted job keeps its steps.
        stack.enter_context(sigterm_as_interrupt())
        grads, steps = _open_writers(stack, directory, constants, meta, dist, per_example, histogram)
        ckpt = _checkpointer(cfg, directory, constants, meta, per_example, histogram) if dist is None else None
        if dist is not None and int(cfg.train.checkpoint_every) > 0:
            log.warning("train.checkpoint_every is not supported under DDP yet: no checkpoints are written")
        try:
            _run_steps(cfg, job, cap, grads, steps, ckpt, constants["run_id"])
        except NonFinite as e:
            e.directory = directory
            raise
        finally:
            if ckpt is not None:
                ckpt.abort()  # the segment after the last checkpoint: the job's own records hold its steps
    if ckpt is not None:
        ckpt.finish()  # the records are closed and whole: the checkpoint is not needed any more


def _checkpointer(
    cfg: DictConfig, directory: Path, constants: dict[str, str], meta: dict[str, str], per_example: bool,
    histogram: bool,
) -> Checkpointer | None:  # fmt: skip
    """The job's `Checkpointer` when `train.checkpoint_every` is set (or a checkpoint waits to be resumed)."""
    every = int(cfg.train.checkpoint_every)
    if every <= 0 and not (directory / CHECKPOINT_DIR).is_dir():  # one that is there is resumed, then removed
        return None
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.run.books import NEUTRAL_KEYS, config_dict

    def open_segment(path: Path, kind: str) -> RecordWriter | StepsWriter:
        if kind == "grads":
            return RecordWriter(path, constants=constants, metadata=meta, per_example=per_example, histogram=histogram)
        return StepsWriter(path, constants=constants, metadata=meta)

    config = OmegaConf.to_yaml({k: v for k, v in config_dict(cfg).items() if k not in NEUTRAL_KEYS})
    t = cfg.train
    return Checkpointer(directory, every, config, open_segment, batches_per_step=int(t.accumulate),
                        eval_batches=int(t.eval_batches), eval_every=int(t.eval_every))  # fmt: skip


def _open_writers(
    stack: contextlib.ExitStack, directory: Path, constants: dict[str, str], meta: dict[str, str],
    dist: Distributed | None, per_example: bool = False, histogram: bool = False,
) -> tuple[RecordWriter | GatheredWriter, StepsWriter | GatheredWriter]:  # fmt: skip
    """The job's grads and steps writers, closed by `stack`; under DDP rank 0 writes every rank's rows."""
    from gradrunner.records.table_writer import closing_together
    from gradrunner.records.writer import RecordWriter, StepsWriter

    if dist is not None:
        return distributed.open_writers(stack, dist, directory, constants, meta, per_example, histogram)
    grads = RecordWriter(directory / GRADS_FILE, constants=constants, metadata=meta, per_example=per_example,
                         histogram=histogram)  # fmt: skip
    steps = StepsWriter(directory / STEPS_FILE, constants=constants, metadata=meta)
    stack.enter_context(closing_together(grads, steps))  # both kept (with the same steps) or both dropped
    return grads, steps
