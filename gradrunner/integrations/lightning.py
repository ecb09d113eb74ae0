"""`GradientCapture`: a Lightning callback writing the runner's records (extra `gradrunner[lightning]`).

Example::

    from gradrunner.integrations.lightning import GradientCapture
    trainer = Trainer(callbacks=[GradientCapture(taps=["*:output", "*:weight"], dir="runs/mine", every=10)])
    trainer.fit(module, loader)           # runs/mine/grads.parquet, steps.parquet, done.json

A thin adapter over `gradrunner.run.recording.Recorder` (the runner's step engine); Lightning's own
backward runs unchanged, nothing of Lightning or torch is patched:

- `on_train_start` opens the recorder on the `LightningModule` (after Lightning's DDP wrapping);
- `on_before_backward` counts the loss Lightning backpropagates into the step's loss and tells the
  capture where that backward starts; the capture reads the gradients around Lightning's own
  `loss.backward()` (`hook` or `retain_grad`; `autograd_grad`, which needs an engine call of its own,
  is refused); `on_after_backward` ends the backward;
- validation (sanity check included), test and predict loops are not training: capture is paused from their
  `on_*_start` to their `on_*_end` (a backward there, a saliency metric's `torch.autograd.grad` under
  `inference_mode=False`, is neither recorded nor left pending), and resumed as it was;
- a step ends with the training batch that stepped the optimiser(s), and holds the batches since the last
  step (a window accumulated by hand under manual optimisation: `manual_backward` every batch, `opt.step()`
  every N-th); it is numbered `trainer.global_step` with one optimiser; in manual optimisation with
  several, `global_step` counts each optimiser's step and the records count the batch, as Lightning's
  loggers do (a GAN's generator and discriminator steps are one record step);
  under `accumulate_grad_batches=N` each
  micro-batch's backward is captured as the runner's `train.accumulate=N`: activation taps one
  record per micro-batch (`micro_step`), parameter taps one per step, the `.grad` accumulated since
  its last reset (`micro_step` null; LBFGS's closure evaluations: the last one's, `Capture.restarted`); the gradients are those before clipping (`gradient_clip_val`);
  a stop inside a window (`trainer.should_stop`: `EarlyStopping` at a validation mid-window) ends the run normally,
  that window's micro-batches, which no optimiser step took, unwritten (`Recorder.end_within_step`);
- under a precision plugin with a GradScaler (`precision="16-mixed"`), gradients are divided by its
  scale on their device: the records hold the true, unscaled gradients;
- `steps.parquet`'s `loss` is the sum of the losses Lightning backpropagated in the step (divided
  for accumulation, so their mean; unscaled); `lr`/`lrs` the rates of the step's optimizer step,
  `grad_norm` the total norm (`numerics.total_norm`, float64) of the gradients of that optimizer's parameters (its
  `param_groups`, which Lightning clips; the first optimizer's under manual optimisation with several), read at
  `on_before_optimizer_step` (after a GradScaler's unscale, before Lightning clips), null where none has a gradient
  (a `training_step` that returned None); `clipped` whether clipping changed them, observed, not inferred from
  `gradient_clip_val`: their norm at the batch's end (after `configure_gradient_clipping`, overrides included, and
  the optimizer step, which leaves `.grad` as it found it) below that one. Under manual optimisation the module
  clips before its optimizer step: `grad_norm` is the norm as the step begins, `clipped` null;
- `resume=True` with `fit(ckpt_path=...)`: the records of the steps before the checkpoint's step
  are kept, the rest recorded again; the checkpoint holds the run's count of backwards (`checkpoint["gradrunner"]`),
  from which seeded edits (`dropout`, `noise_std`) draw on as the uninterrupted run did;
- under DDP every rank captures and rank 0 writes every rank's rows (`rank` column); parameter
  taps are read from `.grad` after the backward that synchronised (DDP's all-reduce, on the step's
  last micro-batch);
- under `ModelParallelStrategy` (FSDP2 / TP applied in `configure_model`, which runs before
  `on_train_start`: the parameters are already `DTensor`s when the session opens) parameter taps are
  the statistics of the whole parameter's gradient, merged from the ranks' shards as `record()` does in
  a user's own `fully_shard` loop; activation taps per rank, as DDP's. Lightning's `FSDPStrategy`
  (FSDP1's flat parameters) and DeepSpeed run their own backward on flattened or offloaded gradients
  and are refused.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradrunner.capturing.taps import TapSpec
from gradrunner.errors import GradrunnerError
from gradrunner.run.recording import CallbackOptions

log = logging.getLogger(__name__)

#: Lightning strategies whose backward is the module's own `loss.backward()`.
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "ModelParallelStrategy")
#: Of those, the one whose parameters are sharded (`DTensor`s, FSDP2 / TP): read after their reduce-scatter.
SHARDED_STRATEGIES = ("ModelParallelStrategy",)
#: The key of a Lightning checkpoint holding what the callback keeps there (`on_save_checkpoint`).
CHECKPOINT_KEY = "gradrunner"


class GradientCapture(CallbackOptions, Callback):
    """Capture gradients at `taps` in a Lightning run; records in `dir`, like a runner job's.

    Example::

        Trainer(callbacks=[GradientCapture(taps=["net.0:output"], dir="runs/a", every=5, histogram=True)])

    `strategy` (`hook` or `retain_grad`) and the options (`values`, `sample_size`, `per_example`,
    `histogram`, `on_nonfinite`, `seed`, `update_norms`, `live_every`, `log_to`, `edits`, `resume`,
    `overwrite`, `anomaly`) are `gradrunner.record`'s, checked here in the constructor.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._global_step = 0
        #: the step's training columns, from Lightning's on_before_optimizer_step (lr, grad_norm, clipped)
        self._train: dict[str, Any] = {}
        #: automatic optimisation: the optimizer's parameters and their norm before Lightning's clipping, this step
        self._before_clipping: tuple[list[torch.nn.Parameter], torch.Tensor | None] | None = None
        #: the evaluation loops running (a sanity check's validation inside it), and whether capture was on as the first began
        self._evaluating, self._was_enabled = 0, False
        #: the run's backwards so far (for a checkpoint: `on_save_checkpoint`), and those a restored checkpoint says ran
        self._backwards = 0
        self._restored_backwards: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dist = self._distributed(trainer)
        synced = None
        if dist is not None and type(trainer.strategy).__name__ not in SHARDED_STRATEGIES:
            ddp = trainer.strategy.model  # the DDP wrapper Lightning put around the module
            synced = lambda: bool(getattr(ddp, "require_backward_grad_sync", True))  # noqa: E731
        rec = self._recorder(pl_module, accumulate=trainer.accumulate_grad_batches, dist=dist,
                             scaler=getattr(trainer.precision_plugin, "scaler", None), params_synced=synced)  # fmt: skip
        rec.__enter__()
        self._global_step, self._train, self._before_clipping = trainer.global_step, {}, None
        self._evaluating = 0  # an evaluation loop that raised in an earlier fit never ended
        if not pl_module.automatic_optimization:
            log.info("GradientCapture: manual optimisation, where clipping is the module's own (before its optimizer "
                     "step): steps.parquet's grad_norm is the norm as the step begins, clipped is null")  # fmt: skip
        self.recorder = rec  # numbered at the first batch (`on_train_batch_start`), once Lightning's loop restored its count

    def _distributed(self, trainer: Trainer) -> Any:
        name = type(trainer.strategy).__name__
        if name not in SUPPORTED_STRATEGIES:
            raise GradrunnerError(
                f"GradientCapture cannot run under Lightning's {name}: it runs its own backward on flattened "
                f"(FSDP1) or offloaded (DeepSpeed) gradients, where the capture strategies cannot follow. "
                f"Supported: a single device and DDP (strategy='ddp' or 'ddp_spawn'), and ModelParallelStrategy "
                f"(FSDP2 / tensor parallel applied with fully_shard in configure_model, which also runs on CPU "
                f"with gloo; Lightning's strategy='fsdp' needs a GPU); use one of those, or drop the callback."
            )
        if trainer.world_size <= 1:
            return None
        from gradrunner.run.distributed import Distributed

        return Distributed.joined(trainer.local_rank)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        rec = self.recorder
        if rec is None or rec.engine.has_loss or rec.engine.pending_backwards:
            return  # the step in progress backpropagated already (captured or not): a batch of it keeps its number
        step = _logging_step(trainer)
        backwards, self._restored_backwards = self._restored_backwards, None  # the first batch after a restore
        if rec.step_index != step or backwards is not None:
            # resume=True with ckpt_path=: the records before the checkpoint's step are kept (the first batch);
            # several optimisers under manual optimisation: a batch that stepped none counts in Lightning's loggers
            rec.start_at(step, backwards)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.engine.add_loss(loss)  # scaled by the precision plugin's GradScaler: unscaled there
            self.recorder.capture.before_backward(loss)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.capture.finish_backward()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """The checkpoint keeps the run's backwards so far: a fit resumed from it draws seeded edits on from there."""
        backwards = self.recorder.engine.backwards_run if self.recorder is not None else self._backwards
        checkpoint[CHECKPOINT_KEY] = {"backwards": backwards}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        backwards = checkpoint.get(CHECKPOINT_KEY, {}).get("backwards")
        self._restored_backwards = int(backwards) if isinstance(backwards, int) else None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.recorder is None or (self._train and self._train["optimizer"] is not optimizer):
            return  # the first optimiser of a step gives the step's rates
        # the same one again: a closure evaluated again (LBFGS), whose last evaluation is the step's record
        lrs = [float(g["lr"]) for g in optimizer.param_groups]  # the rates this step uses
        params = _optimizer_params(optimizer)
        self._train = {"optimizer": optimizer, "lr": lrs[0], "lrs": lrs, "grad_norm": _grad_norm(params)}
        if pl_module.automatic_optimization:  # Lightning clips after this event: compared at the batch's end
            self._before_clipping = (params, self._train["grad_norm"])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rec = self.recorder
        if rec is None:
            return
        if trainer.global_step == self._global_step:
            return  # a micro-batch of an accumulating step: the optimiser has not stepped yet
        self._global_step = trainer.global_step
        train, self._train = self._train, {}
        train.pop("optimizer", None)
        watched, self._before_clipping = self._before_clipping, None
        train["clipped"] = None if watched is None else _clipped(*watched)
        rec.step(extra=train)  # the step's loss: the sum of the (unscaled) losses Lightning backpropagated, on the device

    # -- evaluation loops are not training: nothing of them is captured -----------------------------------
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def _pause(self) -> None:
        """An evaluation loop begins: its forwards and backwards are not the step's."""
        self._evaluating += 1
        if self.recorder is not None and self._evaluating == 1:
            self._was_enabled, self.recorder.capture.enabled = self.recorder.capture.enabled, False

    def _resume(self) -> None:
        """An evaluation loop ended: after the outermost, capture is on again if it was as that one began."""
        self._evaluating = max(0, self._evaluating - 1)
        if self.recorder is not None and self._evaluating == 0:
            self.recorder.capture.enabled = self._was_enabled

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder is not None:  # should_stop (EarlyStopping) inside an accumulation window: a normal end
            self.recorder.end_within_step("Lightning's fit")
        self._close(None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close(None)

    def _close(self, error: BaseException | None) -> None:
        # a checkpoint restored for this call (validate or test with ckpt_path=, or a fit that trained no batch) does
        # not number the next fit's backwards
        rec, self.recorder, self._restored_backwards = self.recorder, None, None
        if rec is not None:
            self._backwards = rec.engine.backwards_run  # a checkpoint saved after the fit
            rec.__exit__(type(error) if error is not None else None, error, None)


def _logging_step(trainer: Trainer) -> int:
    """The number of the step a batch starting with no step in progress begins (both restored from a checkpoint).

    One optimiser: `trainer.global_step`, its steps (under manual optimisation Lightning's loggers count every
    batch, also one of a window accumulated by hand, which steps nothing). Several (manual optimisation, where
    `global_step` counts each one's step): the batch, as Lightning's loggers count it (its training epoch loop's
    `_batches_that_stepped`; `global_step` where a Lightning lacks it).
    """
    if len(trainer.optimizers) <= 1:
        return int(trainer.global_step)
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    count = getattr(loop, "_batches_that_stepped", None)
    return int(count) if isinstance(count, int) else int(trainer.global_step)


def _optimizer_params(optimizer: Any) -> list[torch.nn.Parameter]:
    """The parameters `optimizer` steps that have a `.grad`: those Lightning's `clip_gradients` clips (its param groups'),
    not the module's (a parameter that requires grad but is in no optimizer is neither clipped nor stepped)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """`grad_norm`: the total 2-norm of `params`' `.grad` (float64, as the runner's), None where none has a gradient."""
    from gradrunner.run.numerics import total_norm

    return total_norm(params) if params else None


def _clipped(params: list[torch.nn.Parameter], before: torch.Tensor | None) -> torch.Tensor | None:
    """Whether clipping changed `params`' gradients: their norm now (after Lightning's `configure_gradient_clipping`
    and the optimizer step, which leaves `.grad` as it found it) below `before`, their norm before clipping. Observed,
    not inferred from `gradient_clip_val`: an override that clips some steps only is followed. None where it cannot be
    known (no gradient, or one gone by the batch's end)."""
    if before is None or any(p.grad is None for p in params):
        return None
    after = _grad_norm(params)
    return None if after is None else after < before
