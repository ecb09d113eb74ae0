"""`GradientCapture`: a Lightning callback writing the runner's records (extra `gradrunner[lightning]`).

Example::

    from gradrunner.integrations.lightning import GradientCapture
    trainer = Trainer(callbacks=[GradientCapture(taps=["*:output", "*:weight"], dir="runs/mine", every=10)])
    trainer.fit(module, loader)           # runs/mine/grads.parquet, steps.parquet, done.json

A thin adapter over `gradrunner.run.recording.Recorder` (the runner's capture session and writers):

- `on_train_start` opens the recorder on the `LightningModule` (after Lightning's DDP wrapping);
- `on_before_backward` routes Lightning's own `loss.backward()` through the capture strategy;
- a step is one optimiser step (`trainer.global_step`): under `accumulate_grad_batches=N` each
  micro-batch's backward is captured as the runner's `train.accumulate=N`: activation taps one
  record per micro-batch (`micro_step`), parameter taps one per step from the accumulated `.grad`
  (`micro_step` null); the gradients are those before clipping (`gradient_clip_val` clips after
  the records' gradients were reduced);
- under a precision plugin with a GradScaler (`precision="16-mixed"`), gradients are multiplied by
  1/scale as they arrive (the capture's `grad_scale`): the records hold the true, unscaled gradients;
- `steps.parquet`'s `loss` is the sum of the losses Lightning backpropagated in the step (divided
  for accumulation, so their mean; unscaled);
- under DDP every rank captures and rank 0 writes every rank's rows (`rank` column); parameter
  taps are read from `.grad` after each backward, as the runner does (after DDP's all-reduce; with
  accumulation, the running sum, all-reduced on the step's last micro-batch). `autograd_grad` computes
  the gradients itself, out of DDP's reducer, and is refused there; strategies other than a single
  device, `ddp` and `ddp_spawn` (FSDP, DeepSpeed) run their own backward and are refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradrunner.capturing.taps import TapSpec
from gradrunner.errors import GradrunnerError
from gradrunner.integrations._backward import route
from gradrunner.run.recording import CallbackOptions, Recorder, scaler_scale

#: Lightning strategies whose backward is the module's own `loss.backward()`.
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
#: Capture strategies that run inside Lightning's own backward under DDP (DDP's reducer must see it).
DDP_CAPTURE_STRATEGIES = ("hook", "retain_grad")


class GradientCapture(CallbackOptions, Callback):
    """Capture gradients at `taps` in a Lightning run; records in `dir`, like a runner job's.

    Example::

        Trainer(callbacks=[GradientCapture(taps=["net.0:output"], dir="runs/a", every=5, histogram=True)])

    `strategy` and the options (`values`, `sample_size`, `per_example`, `histogram`, `on_nonfinite`,
    `seed`) are `gradrunner.record`'s.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._global_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dist, wrap = self._distributed(trainer)
        precision = trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)
        scale = None if scaler is None else (lambda: scaler_scale(scaler))
        rec = Recorder(pl_module, self.taps, self.dir, strategy=self.strategy, every=self.every, loss_scale=scale,
                       dist=dist, wrap_strategy=wrap, experiment=type(pl_module).__name__, **self.options)  # fmt: skip
        rec.__enter__()
        self._global_step = trainer.global_step
        rec.start_at(trainer.global_step)
        self.recorder = rec

    def _distributed(self, trainer: Trainer) -> tuple[Any, Any]:
        name = type(trainer.strategy).__name__
        if name not in SUPPORTED_STRATEGIES:
            raise GradrunnerError(
                f"GradientCapture cannot run under Lightning's {name}: it runs its own backward (sharded or "
                f"offloaded gradients), where the capture strategies cannot follow. Supported: a single device "
                f"and DDP (strategy='ddp' or 'ddp_spawn'); capture on one of those, or drop the callback."
            )
        if trainer.world_size <= 1:
            return None, None
        if self.strategy not in DDP_CAPTURE_STRATEGIES:
            raise GradrunnerError(
                f"strategy={self.strategy!r} cannot run inside Lightning's DDP backward: it computes the gradients "
                f"with torch.autograd.grad, which DDP's reducer never sees (the ranks' gradients would not be "
                f"averaged). Under DDP use one of {', '.join(DDP_CAPTURE_STRATEGIES)} (the same gradients, "
                "captured while DDP's own backward runs)."
            )
        import torch.distributed as tdist

        from gradrunner.run.distributed import Distributed, SyncedParams

        ddp = trainer.strategy.model
        d = Distributed(trainer.global_rank, trainer.world_size, trainer.local_rank, str(tdist.get_backend()))
        box = [os.urandom(16).hex()]
        tdist.broadcast_object_list(box, src=0)
        d.run_id = box[0]
        return d, lambda inner: SyncedParams(inner, ddp, manual=False)  # type: ignore[arg-type]

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.recorder is not None:
            route(loss, self.recorder.backward)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rec = self.recorder
        if rec is None:
            return
        if trainer.global_step == self._global_step:
            return  # a micro-batch of an accumulating step: the optimiser has not stepped yet
        self._global_step = trainer.global_step
        rec.step()  # the step's loss: the sum of the (unscaled) losses Lightning backpropagated, on the device

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close(None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close(None)

    def _close(self, error: BaseException | None) -> None:
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.__exit__(type(error) if error is not None else None, error, None)

