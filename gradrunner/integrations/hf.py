"""`GradientCaptureCallback`: a `transformers.TrainerCallback` writing the runner's records (extra `gradrunner[hf]`).

Example::

    from gradrunner.integrations.hf import GradientCaptureCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradientCaptureCallback(taps=["transformer.h.*.mlp:output"], dir="runs/gpt2")])
    trainer.train()                     # runs/gpt2/grads.parquet, steps.parquet, done.json

A thin adapter over `gradrunner.run.recording.Recorder` (the runner's capture session and writers):

- `on_train_begin` opens the recorder on the model; the Trainer's own `loss.backward()` (through
  accelerate, after the loss is divided for accumulation and, under fp16, scaled) is routed
  through the capture strategy (`integrations._backward.NextBackward`);
- a step is one optimiser step (`state.global_step`): with `gradient_accumulation_steps=N` each
  micro-batch's backward is captured as the runner's `train.accumulate=N` (activation taps one
  record per micro-batch, `micro_step`; parameter taps one per step from the accumulated `.grad`,
  `micro_step` null); the gradients are those before clipping (`max_grad_norm`), and divided by a GradScaler's scale (fp16): true gradients;
- `steps.parquet`'s `loss` is the sum of the micro-batches' backpropagated losses (unscaled), and
  the Trainer's own `grad_norm` (what it logs, the total norm before clipping) goes into the
  `grad_norm` column where the steps writer has it; log every step (`logging_steps=1`) to have it
  on every row.
- the Trainer has no event for a failed `train()`: after one raised, call `callback.close()` (or the
  next `train()` does) to end the session, release the run dir and restore `torch.Tensor.backward`;
- under multi-process training (`torchrun`) rank 0 writes every rank's rows (`rank` column);
  `autograd_grad` (outside DDP's reducer) is refused there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradrunner.capturing.taps import TapSpec
from gradrunner.errors import GradrunnerError
from gradrunner.integrations._backward import NextBackward
from gradrunner.run.recording import CallbackOptions, Recorder, scaler_scale


class GradientCaptureCallback(CallbackOptions, TrainerCallback):
    """Capture gradients at `taps` in a `transformers.Trainer` run; records in `dir`, like a runner job's.

    Example::

        Trainer(..., callbacks=[GradientCaptureCallback(taps=["lm_head:input"], dir="runs/a", every=10)])

    `strategy` and the options (`values`, `sample_size`, `per_example`, `histogram`, `on_nonfinite`,
    `seed`) are `gradrunner.record`'s.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._stack = contextlib.ExitStack()
        self._pending = False
        self._grad_norm: float | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
        optimizer: Any = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        if self.recorder is not None:  # a train() that raised never ended its session: close it now
            self._close(RuntimeError("the previous train() did not end"))
        if model is None:
            raise GradrunnerError("GradientCaptureCallback got no model from the Trainer; pass model= to Trainer(...).")
        dist = self._distributed()
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer holds the GradScaler under fp16
        scale = None if scaler is None else (lambda: scaler_scale(scaler))
        rec = Recorder(model, self.taps, self.dir, strategy=self.strategy, every=self.every, loss_scale=scale,
                       dist=dist, experiment=type(model).__name__, **self.options)  # fmt: skip
        self._stack.enter_context(rec)
        self._stack.enter_context(NextBackward(model, rec.backward))
        rec.start_at(state.global_step)
        self.recorder = rec

    def _distributed(self) -> Any:
        import torch.distributed as tdist

        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() <= 1:
            return None
        if self.strategy == "autograd_grad":
            raise GradrunnerError(
                "strategy='autograd_grad' cannot run inside the Trainer's distributed backward: it computes the "
                "gradients with torch.autograd.grad, which DDP's reducer never sees. Use hook or retain_grad (the "
                "same gradients, captured while DDP's own backward runs)."
            )
        from gradrunner.run.distributed import Distributed

        rank = tdist.get_rank()
        d = Distributed(rank, tdist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)), str(tdist.get_backend()))
        box = [os.urandom(16).hex()]
        tdist.broadcast_object_list(box, src=0)
        d.run_id = box[0]
        return d

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._flush()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # Written at the Trainer's log of this step (it carries grad_norm), or before the next step begins.
        self._pending, self._grad_norm = self.recorder is not None, None

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if self._pending and logs is not None and "grad_norm" in logs:
            self._grad_norm = float(logs["grad_norm"])
            self._flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        try:
            self._flush()
        except BaseException as e:
            self._close(e)
            raise
        self._close(None)

    def _flush(self) -> None:
        if self._pending and self.recorder is not None:
            self._pending = False
            extra = {} if self._grad_norm is None else {"grad_norm": self._grad_norm}
            self.recorder.step(extra=extra)

    def close(self) -> None:
        """End the session after a `train()` that raised: records kept, no `done.json` (idempotent).

        Example::

            try:
                trainer.train()
            finally:
                callback.close()
        """
        if self.recorder is not None:
            self._close(RuntimeError("train() did not end"))

    def _close(self, error: BaseException | None) -> None:
        self.recorder = None
        self._stack.__exit__(type(error) if error is not None else None, error, None)
        self._stack = contextlib.ExitStack()

