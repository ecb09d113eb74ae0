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
- a step is one optimiser step (`trainer.global_step`): under `accumulate_grad_batches=N` each
  micro-batch's backward is captured as the runner's `train.accumulate=N`: activation taps one
  record per micro-batch (`micro_step`), parameter taps one per step, the sum of what arrived
  (`micro_step` null); the gradients are those before clipping (`gradient_clip_val`);
- under a precision plugin with a GradScaler (`precision="16-mixed"`), gradients are divided by its
  scale on their device: the records hold the true, unscaled gradients;
- `steps.parquet`'s `loss` is the sum of the losses Lightning backpropagated in the step (divided
  for accumulation, so their mean; unscaled);
- under DDP every rank captures and rank 0 writes every rank's rows (`rank` column); parameter
  taps are read from `.grad` after the backward that synchronised (DDP's all-reduce, on the step's
  last micro-batch). Strategies other than a single device, `ddp` and `ddp_spawn` (FSDP, DeepSpeed)
  run their own backward and are refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gradrunner.capturing.taps import TapSpec
from gradrunner.errors import GradrunnerError
from gradrunner.run.recording import CallbackOptions, Recorder

#: Lightning strategies whose backward is the module's own `loss.backward()`.
SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")


class GradientCapture(CallbackOptions, Callback):
    """Capture gradients at `taps` in a Lightning run; records in `dir`, like a runner job's.

    Example::

        Trainer(callbacks=[GradientCapture(taps=["net.0:output"], dir="runs/a", every=5, histogram=True)])

    `strategy` (`hook` or `retain_grad`) and the options (`values`, `sample_size`, `per_example`,
    `histogram`, `on_nonfinite`, `seed`, `update_norms`, `live_every`, `log_to`) are `gradrunner.record`'s.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._global_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dist = self._distributed(trainer)
        synced = None
        if dist is not None:
            ddp = trainer.strategy.model  # the DDP wrapper Lightning put around the module
            synced = lambda: bool(getattr(ddp, "require_backward_grad_sync", True))  # noqa: E731
        rec = Recorder(pl_module, self.taps, self.dir, strategy=self.strategy, every=self.every, dist=dist,
                       scaler=getattr(trainer.precision_plugin, "scaler", None), params_synced=synced,
                       experiment=type(pl_module).__name__, **self.options)  # fmt: skip
        rec.__enter__()
        self._global_step = trainer.global_step
        rec.start_at(trainer.global_step)
        self.recorder = rec

    def _distributed(self, trainer: Trainer) -> Any:
        name = type(trainer.strategy).__name__
        if name not in SUPPORTED_STRATEGIES:
            raise GradrunnerError(
                f"GradientCapture cannot run under Lightning's {name}: it runs its own backward (sharded or "
                f"offloaded gradients), where the capture strategies cannot follow. Supported: a single device "
                f"and DDP (strategy='ddp' or 'ddp_spawn'); capture on one of those, or drop the callback."
            )
        if trainer.world_size <= 1:
            return None
        from gradrunner.run.distributed import Distributed

        return Distributed.joined(trainer.local_rank)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.engine.add_loss(loss)  # scaled by the precision plugin's GradScaler: unscaled there
            self.recorder.capture.before_backward(loss)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.capture.finish_backward()

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
