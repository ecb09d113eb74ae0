"""`GradientCaptureCallback`: a `transformers.TrainerCallback` writing the runner's records (extra `gradrunner[hf]`).

Example::

    from gradrunner.integrations.hf import GradientCaptureCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradientCaptureCallback(taps=["transformer.h.*.mlp:output"], dir="runs/gpt2")])
    trainer.train()                     # runs/gpt2/grads.parquet, steps.parquet, done.json

A thin adapter over `gradrunner.run.recording.Recorder` (the runner's step engine); the Trainer's own
backward (through accelerate, after the loss is divided for accumulation and, under fp16, scaled)
runs unchanged, nothing of transformers, accelerate or torch is patched:

- `on_train_begin` opens the recorder on the model; the capture reads the gradients around the
  Trainer's own `loss.backward()` (`hook` or `retain_grad`; `autograd_grad`, which needs an engine
  call of its own, is refused);
- a step is one optimiser step (`state.global_step`): with `gradient_accumulation_steps=N` each
  micro-batch's backward is captured as the runner's `train.accumulate=N` (activation taps one
  record per micro-batch, `micro_step`; parameter taps one per step, the sum of what arrived,
  `micro_step` null); the gradients are those before clipping (`max_grad_norm`), and divided by a
  GradScaler's scale (fp16): true gradients;
- `steps.parquet`'s `loss` is what the Trainer backpropagated over the step's micro-batches,
  unscaled: read where backward meets the model's own `loss` output (the model's loss times the
  gradient backward brings to it, 1/N under accumulation); null for a model whose output has no
  `loss` (a custom `compute_loss`). The Trainer's own `grad_norm` (what it logs, the total norm
  before clipping) goes into the `grad_norm` column where it logs the step (`logging_steps=1`: every row);
- the session ends with the Trainer's `on_train_end` (`done.json`). The Trainer has no event for a
  `train()` that raised (an exception, Ctrl-C): then the session ends, keeping the completed steps'
  records without `done.json`, when the process exits, when the callback is garbage-collected, at
  the next `train()`, or at `callback.close()` (in a notebook, call it to have the records now);
- under multi-process training (`torchrun`) rank 0 writes every rank's rows (`rank` column), and
  parameter taps are read after the backward that synchronised (accelerate's last micro-batch).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradrunner.capturing.taps import TapSpec
from gradrunner.errors import GradrunnerError
from gradrunner.run.engine import StepEngine
from gradrunner.run.recording import CallbackOptions, Recorder


class GradientCaptureCallback(CallbackOptions, TrainerCallback):
    """Capture gradients at `taps` in a `transformers.Trainer` run; records in `dir`, like a runner job's.

    Example::

        Trainer(..., callbacks=[GradientCaptureCallback(taps=["lm_head:input"], dir="runs/a", every=10)])

    `strategy` (`hook` or `retain_grad`) and the options (`values`, `sample_size`, `per_example`,
    `histogram`, `on_nonfinite`, `seed`, `update_norms`, `live_every`, `log_to`) are `gradrunner.record`'s.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._stack = contextlib.ExitStack()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        #: a step the Trainer completed whose row waits for its log (grad_norm): [pending, grad_norm]
        self._step: list[Any] = [False, None]

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
        optimizer: Any = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        if self.recorder is not None:  # a train() that raised never ended its session: close it now
            self.close()
        if model is None:
            raise GradrunnerError("GradientCaptureCallback got no model from the Trainer; pass model= to Trainer(...).")
        dist, synced = _distributed()
        rec = Recorder(model, self.taps, self.dir, strategy=self.strategy, every=self.every, dist=dist,
                       scaler=getattr(optimizer, "scaler", None),  # accelerate's optimizer holds the GradScaler
                       params_synced=synced, experiment=type(model).__name__, **self.options)  # fmt: skip
        stack = contextlib.ExitStack()
        stack.enter_context(rec)
        stack.enter_context(_loss_from_output(model, rec.engine))
        rec.start_at(state.global_step)
        self.recorder, self._stack = rec, stack
        # The Trainer says nothing when train() raises: the session ends at the process's exit (or when this
        # callback is collected) unless on_train_end or close() ended it first.
        self._step = [False, None]
        self._finalizer = weakref.finalize(self, _end_unfinished, stack, rec, self._step)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._flush()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # Written at the Trainer's log of this step (it carries grad_norm), or before the next step begins.
        self._step[:] = [self.recorder is not None, None]

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if self._step[0] and logs is not None and "grad_norm" in logs:
            self._step[1] = float(logs["grad_norm"])
            self._flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        try:
            self._flush()
        except BaseException as e:
            self._close(e)
            raise
        self._close(None)

    def _flush(self) -> None:
        if self.recorder is not None:
            _write_completed(self.recorder, self._step)

    def close(self) -> None:
        """End the session after a `train()` that raised: the completed steps' records kept, no `done.json` (idempotent).

        Example::

            try:
                trainer.train()
            finally:
                callback.close()
        """
        if self.recorder is not None:
            try:
                self._flush()  # a step the Trainer completed before it failed
            finally:
                self._close(RuntimeError("train() did not end"))

    def _close(self, error: BaseException | None) -> None:
        self.recorder = None
        self._step[:] = [False, None]
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.__exit__(type(error) if error is not None else None, error, None)


def _write_completed(rec: Recorder, pending: list[Any]) -> None:
    """Write the row of the step the Trainer completed, if it waits (with the grad_norm its log gave, if any)."""
    if pending[0]:
        grad_norm = pending[1]
        pending[:] = [False, None]
        rec.step(extra={} if grad_norm is None else {"grad_norm": grad_norm})


def _end_unfinished(stack: contextlib.ExitStack, rec: Recorder, pending: list[Any]) -> None:
    """A session the Trainer never ended (its train() raised): the completed steps kept, ended as interrupted."""
    try:
        _write_completed(rec, pending)
    finally:
        stack.__exit__(RuntimeError, RuntimeError("the Trainer's train() did not end"), None)


def _distributed() -> tuple[Any, Callable[[], bool] | None]:
    """Under multi-process training: this rank's place (run id from rank 0) and whether a backward synchronised."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() <= 1:
        return None, None
    from accelerate.state import GradientState

    from gradrunner.run.distributed import Distributed

    return Distributed.joined(), lambda: bool(GradientState().sync_gradients)


@contextlib.contextmanager
def _loss_from_output(model: nn.Module, engine: StepEngine) -> Iterator[None]:
    """Count what the Trainer backpropagates into the step's loss, where backward meets the model's `loss` output.

    The Trainer backpropagates the model's own loss times a constant (1/N under accumulation, a
    GradScaler's scale under fp16): that constant is the gradient backward brings to the model's loss.
    """

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not (module.training and torch.is_grad_enabled() and isinstance(loss, torch.Tensor)) or loss.grad_fn is None:
            return
        value, nr = loss.detach(), loss.output_nr

        def backpropagated(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            grad = grad_outputs[nr]
            if grad is not None:
                engine.add_loss(value * grad)

        loss.grad_fn.register_prehook(backpropagated)

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
