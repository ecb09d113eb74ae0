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
import functools
import gc
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gradrunner.analysis import health
from gradrunner.config.schema import edit_list
from gradrunner.records.columns import GRADS_FILE, RECORD_FILES, STEPS_FILE
from gradrunner.run import distributed, watch
from gradrunner.run.books import checkpoint_held
from gradrunner.run.build import Job, setup
from gradrunner.run.checkpoint import CHECKPOINT_DIR, Checkpointer
from gradrunner.run.distributed import Distributed
from gradrunner.run.engine import RunFiles, StepEngine, StepResult
from gradrunner.run.evaluation import evaluate
from gradrunner.run.guards import (
    NonFinite,
    backward,
    check_writable,
    checkpoint_write_errors,
    forward_loss,
    next_batch,
    optimizer_step,
    write_errors,
)
from gradrunner.run.numerics import autocast, clip, total_norm
from gradrunner.run.progress import Progress

log = logging.getLogger(__name__)


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


@dataclass
class StepContext:
    """What every step of a job reads, taken from the config once (OmegaConf lookups cost more than a tiny step)."""

    every: int
    accumulate: int
    clip_norm: float | None
    clip_value: float | None
    autocast: str
    eval_every: int
    source: str
    model_name: str
    loss_name: str
    scaler: torch.amp.GradScaler
    #: every parameter the optimiser steps (the total gradient norm and clipping are over them)
    params: list[torch.nn.Parameter]

    @classmethod
    def of(cls, cfg: DictConfig, job: Job) -> StepContext:
        t, device = cfg.train, job.device
        return cls(
            every=int(cfg.capture.every), accumulate=int(t.accumulate),
            clip_norm=None if t.clip_grad_norm is None else float(t.clip_grad_norm),
            clip_value=None if t.clip_grad_value is None else float(t.clip_grad_value),
            autocast=str(t.autocast), eval_every=int(t.eval_every),
            source=str(cfg.data._target_), model_name=str(cfg.model._target_), loss_name=str(cfg.loss._target_),
            scaler=torch.amp.GradScaler(device.type, enabled=str(t.autocast) == "fp16"),
            params=[p for g in job.optimizer.param_groups for p in g["params"]],
        )  # fmt: skip


def train_step(step: int, job: Job, engine: StepEngine, ctx: StepContext) -> StepResult:
    """One optimisation step, top to bottom, as nanoGPT's step, plus the step engine's few calls.

    1. `ctx.accumulate` micro-batches: forward and loss under `torch.autocast` (bf16, fp16 or off), the
       loss divided by `accumulate` and multiplied by the GradScaler's scale (fp16 only), backward the
       capture strategy's way (`engine.backward`); under DDP the gradients are all-reduced on the last
       micro-batch only. Parameter `.grad` accumulates over the micro-batches.
    2. `engine.settle()`: the step's parameter records are reduced now (before clipping, from the
       gradients that arrived: activation taps one record per micro-batch, parameter taps one per
       step). Every captured gradient is divided by the GradScaler's scale: true gradients.
    3. `scaler.unscale_`, then `grad_norm`: the total 2-norm over all parameters' `.grad`, before
       clipping, accumulated in float64 (`numerics.total_norm`: finite for finite gradients); clipping:
       `train.clip_grad_norm` by torch's `clip_grad_norm_` (its own norm), then `train.clip_grad_value`
       by `clip_grad_value_`.
    4. `scaler.step` (skipped on inf/NaN gradients under fp16) and `scaler.update`; the scheduler steps
       once per optimisation step; `lr` is the rate this step used.
    5. `engine.end_step`: the step's records (one transfer) and its `steps.parquet` row, written together.
    """
    engine.begin_step()
    lrs = [float(g["lr"]) for g in job.optimizer.param_groups]  # the rates this step uses
    scaler, n = ctx.scaler, ctx.accumulate
    for m in range(n):
        x, y = next_batch(job.batches, step, source=ctx.source)
        with distributed.micro_batch(job.model, last=m == n - 1):
            with autocast(job.device, ctx.autocast):
                loss = forward_loss(job.model, job.loss_fn, x, y, step, model_name=ctx.model_name,
                                    loss_name=ctx.loss_name)  # fmt: skip
            backward(engine.backward, scaler.scale(loss / n), step)
    engine.settle()
    scale = scaler.get_scale() if scaler.is_enabled() else None  # one host sync per step, fp16 only
    scaler.unscale_(job.optimizer)
    grad_norm = total_norm(ctx.params)
    clipped = clip(ctx.params, ctx.clip_norm, ctx.clip_value)
    optimizer_step(job.optimizer, step, scaler if scaler.is_enabled() else None)
    scaler.update()
    skipped = scale is not None and scaler.get_scale() < scale  # the scaler backs off only after a skipped step
    if job.scheduler is not None:
        job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    eval_loss = evaluate(job, engine.capture, autocast(job.device, ctx.autocast)) if ctx.eval_every and (step + 1) % ctx.eval_every == 0 else None
    return engine.end_step(grad_norm=grad_norm, clipped=clipped, lr=lrs[0], lrs=lrs, loss_scale=scale,
                           skipped=skipped if scale else None, eval_loss=eval_loss)  # fmt: skip


def _run_steps(cfg: DictConfig, job: Job, engine: StepEngine, ctx: StepContext, ckpt: Checkpointer | None) -> None:
    """The step loop: `train_step` for every step, with progress, the run's watches and checkpoints."""
    bar = Progress(cfg.steps)
    start = 0
    engine.accumulate = ctx.accumulate
    if ckpt is not None:
        start = ckpt.restore(job, ctx.scaler, engine.grads, engine.steps, engine.run_id)  # a sweep re-run resumes too
        ckpt.start(start)
        engine.tee(ckpt.tee)
        engine.start_at(start)  # one backward per micro-batch: seeded edits draw on from start * accumulate
    full_values, zeros = cfg.capture["values"] == "full", watch.ZeroWatch(int(cfg.steps))
    warned: set[str] = set()
    try:
        for step in range(start, int(cfg.steps)):
            done = train_step(step, job, engine, ctx)
            if ckpt is not None and step + 1 < int(cfg.steps):
                with checkpoint_write_errors(step, functools.partial(checkpoint_held, ckpt.directory)):
                    ckpt.maybe_save(step, job, ctx.scaler)
            recs = done.records
            if recs is not None:
                watch.warn_without_grad(recs, step, warned)
                if full_values and step == 0:
                    watch.warn_values_size(
                        recs, watch.captured_steps(int(cfg.steps), ctx.every), int(cfg.capture.sample_size)
                    )
            bar.update(step, done.loss)
            zeros.step(step, float("nan") if done.loss is None else done.loss, recs)
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
    _free_the_last_job()
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
    watch.warn_nothing_captured(taps, int(cfg.steps), edit_list(cfg))  # an edited tap gets rows, tapped or not
    c = cfg.capture
    files = RunFiles(directory, constants, meta, per_example=bool(c.get("per_example", False)),
                     histogram=bool(c.get("histogram", False)))  # fmt: skip
    try:
        _train_in(cfg, job, files, taps, dist)
    except BaseException as e:
        if dist is None or dist.is_main:  # rank 0 keeps the books (and says so, once)
            if isinstance(e, KeyboardInterrupt):
                kept = [n for n in RECORD_FILES if (directory / n).is_file()]
                steps_kept = _steps_in(directory / STEPS_FILE)
                log.warning("interrupted; %s", f"the records of {steps_kept} completed step(s) are kept in {directory} "
                            f"({', '.join(kept)})" if kept else f"no records were kept in {directory}")  # fmt: skip
            health.try_last_word(directory)  # an interrupted or failed run's too: what its kept steps say
        raise
    if dist is None or dist.is_main:
        health.last_word(directory)  # loss, NaN/Inf, vanishing/exploding taps, where the records are
    return directory / GRADS_FILE


def _free_the_last_job() -> None:
    """Before a job on a process that has used CUDA (an earlier job of the sweep): free what that job left.

    A finished job's model, optimizer and capture session outlive it in reference cycles until the garbage
    collector's next full pass (the errors OmegaConf raises and catches inside `key in cfg` and `cfg.get`
    keep the frames that called them, `train`'s among them; the capture session's hooks point back at it).
    On a GPU that is the last job's memory beside this one's: an out-of-memory error the job alone would
    not hit, and a `peak_memory_bytes` that counts the last job's tensors. A full pass costs about 0.1 s,
    next to a GPU job's start-up.
    """
    if torch.cuda.is_initialized():
        gc.collect()


def _steps_in(path: Path) -> int:
    """The number of steps `steps.parquet` holds (under torchrun it has a row per rank and step)."""
    try:
        return len(pc.unique(pq.read_table(path, columns=["step"]).column("step")))
    except (OSError, pa.ArrowException):
        return 0


def _train_in(cfg: DictConfig, job: Job, files: RunFiles, taps: list[Any], dist: Distributed | None) -> None:
    """The body of `train`: the step engine (capture, writers) and the step loop, closed in the right order."""
    c, ctx = cfg.capture, StepContext.of(cfg, job)
    engine = StepEngine(job.model, taps, strategy=c.strategy, every=ctx.every, values=c["values"],
                        sample_size=c.sample_size, seed=cfg.seed, per_example=files.per_example,
                        histogram=files.histogram, edits=edit_list(cfg), on_nonfinite=str(c.get("on_nonfinite", "record")),
                        update_norms=True, scaler=ctx.scaler, dist=dist,
                        anomaly=_anomaly(cfg))  # fmt: skip
    ckpt: Checkpointer | None = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(write_errors(files.directory))  # first in, last out: sees the writers' close too
            cap = engine.capture
            log.info("run %s: %d taps resolved (%s), %d steps on %s/%s", files.run_id, len(cap.taps),
                     ", ".join(t.tap for t in cap.taps[:6]) + (", ..." if len(cap.taps) > 6 else ""),
                     cfg.steps, job.device, cfg.dtype)  # fmt: skip
            engine.open(stack, files)
            ckpt = _checkpointer(cfg, files, dist)
            try:
                _run_steps(cfg, job, engine, ctx, ckpt)  # capture.on_nonfinite=stop: NonFinite names files.directory
            finally:
                if ckpt is not None:
                    ckpt.abort()  # the segment after the last checkpoint: the job's own records hold its steps
    except NonFinite:
        if ckpt is not None and ckpt.keeps and dist is None:
            ckpt.finish()  # stopped on the spike: the states anomaly.replay needs are kept (`run.job` replays it)
        raise
    if ckpt is not None:
        ckpt.finish()  # the records are closed and whole: the checkpoint is not needed any more


def _anomaly(cfg: DictConfig) -> dict[str, Any] | bool:
    """`anomaly.*` as the engine's `anomaly` option (a config without the group: on, the defaults)."""
    return {str(k): v for k, v in cfg.anomaly.items()} if "anomaly" in cfg else True


def _checkpointer(cfg: DictConfig, files: RunFiles, dist: Distributed | None = None) -> Checkpointer | None:
    """The job's `Checkpointer` when `train.checkpoint_every` is set (or a checkpoint waits to be resumed)."""
    every = int(cfg.train.checkpoint_every)
    if every <= 0 and not (files.directory / CHECKPOINT_DIR).is_dir():  # one that is there is resumed, then removed
        return None
    from gradrunner.run.config_compare import NEUTRAL_KEYS, config_dict

    def open_segment(path: Path, kind: str) -> Any:
        return files.grads_writer(path) if kind == "grads" else files.steps_writer(path)

    config = OmegaConf.to_yaml({k: v for k, v in config_dict(cfg).items() if k not in NEUTRAL_KEYS})
    if dist is not None:  # under torchrun: the model and optimizer through torch.distributed.checkpoint
        from gradrunner.run.parallel_checkpoint import ShardedCheckpointer

        return ShardedCheckpointer(files.directory, every, config, open_segment, dist=dist)
    return Checkpointer(files.directory, every, config, open_segment)
