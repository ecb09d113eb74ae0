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
  record per micro-batch, `micro_step`; parameter taps one per step, the `.grad` accumulated since
  its last reset, `micro_step` null); the gradients are those before clipping (`max_grad_norm`), and divided by a
  GradScaler's scale (fp16): true gradients;
- `steps.parquet`'s `loss` is what the Trainer backpropagated over the step's micro-batches,
  unscaled: read where backward meets the model's own `loss` output (the model's loss times the
  gradient backward brings to it, 1/N under accumulation), checked against every loss the Trainer
  logs. From a log that disagrees on (a custom `compute_loss` adding a term, or a non-linear one) it
  is null, with a warning, as for a model whose output has no `loss` (`compute_loss_func`,
  `label_smoothing_factor`), except for a step the Trainer logs alone: the Trainer's own loss
  (`logging_steps=1`: every step; NaN or null where its gradients are NaN/Inf and the log may hold
  `logging_nan_inf_filter`'s stand-in, `_Run._own`). The Trainer's own `grad_norm` (what it logs, the total norm before
  clipping) goes into the `grad_norm` column where it logs the step (`logging_steps=1`: every row);
- a step is complete when the Trainer counts it (`state.global_step`, before `on_step_end`, whatever
  the callbacks' order); the session ends with the Trainer's `on_train_end` (`done.json`; a stop inside an
  accumulation window leaves its micro-batches, which no optimiser step took, unwritten). The Trainer
  has no event for a `train()` that raised (an exception, Ctrl-C): then the session ends, keeping the
  completed steps' records without `done.json`, at the first training forward of the model outside
  the Trainer's steps and its `train()` (`hf_frames.training`: the user goes on with the model; before that
  forward runs, every hook and edit is removed), when the process exits, when the callback is garbage-collected, when the next `train()`
  into the same dir begins (with this or a new callback), or at `callback.close()`; the last word names
  the error where it is in sight (`trainer_error`). An error the session itself raises into `train()`
  (`on_nonfinite="stop"`'s `NonFinite`, records that cannot be written) ends it at once, with that error.
  A training forward of a callback's while `train()` runs (`on_step_end`, `on_log`, `on_evaluate`) is not
  captured: the capture closes before it runs (no hook, tap or edit on it or its backward) until the next step;
- `lr`/`lrs` are the rates of the step's optimizer step (`on_pre_optimizer_step`), `clipped` the
  logged `grad_norm` above `max_grad_norm`; `resume=True` with `train(resume_from_checkpoint=...)`
  keeps the records of the steps before the checkpoint's `global_step`, and seeded edits (`dropout`,
  `noise_std`) draw on from the micro-batches the Trainer ran before it (`_backwards_before`);
- under multi-process training (`torchrun`) rank 0 writes every rank's rows (`rank` column), and
  parameter taps are read after the backward that synchronised (accelerate's last micro-batch).
  `fsdp` asked for on CPU trains DDP (accelerate enables FSDP on accelerators only): a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gradrunner.capturing.owned import owned
from gradrunner.capturing.taps import TapSpec
from gradrunner.capturing.torch_compat import in_backward
from gradrunner.errors import GradrunnerError
from gradrunner.integrations.hf_frames import trainer_error, training
from gradrunner.run.recording import CallbackOptions, Recorder
from gradrunner.run.session_log import EndedOutside

log = logging.getLogger(__name__)


class GradientCaptureCallback(CallbackOptions, TrainerCallback):
    """Capture gradients at `taps` in a `transformers.Trainer` run; records in `dir`, like a runner job's.

    Example::

        Trainer(..., callbacks=[GradientCaptureCallback(taps=["lm_head:input"], dir="runs/a", every=10)])

    `strategy` (`hook` or `retain_grad`) and the options (`values`, `sample_size`, `per_example`,
    `histogram`, `on_nonfinite`, `seed`, `update_norms`, `live_every`, `log_to`, `edits`, `resume`,
    `overwrite`, `anomaly`) are `gradrunner.record`'s, checked here in the constructor.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        super().__init__(taps, dir, every, strategy, **options)
        self._stack = contextlib.ExitStack()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._run: _Run | None = None
        self._watch: _Watch | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None,
        optimizer: Any = None, train_dataloader: Any = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        if self.recorder is not None:  # a train() that raised never ended its session: close it now
            self.close()
        unfinished = _UNFINISHED.pop(_key(self.dir), None)
        if unfinished is not None:  # another callback's session on this dir, whose train() raised: end it first
            unfinished()
        if model is None:
            raise GradrunnerError("GradientCaptureCallback got no model from the Trainer; pass model= to Trainer(...).")
        dist, synced = _distributed()
        scaler = getattr(optimizer, "scaler", None)  # accelerate's optimizer holds the GradScaler
        rec = self._recorder(model, accumulate=args.gradient_accumulation_steps, dist=dist, params_synced=synced,
                             scaler=scaler)  # fmt: skip
        run = _Run(state, float(args.max_grad_norm or 0.0), last_log=state.global_step, begun=state.global_step,
                   ranks=dist is not None, filtered=bool(args.logging_nan_inf_filter))  # fmt: skip
        stack = contextlib.ExitStack()
        stack.enter_context(rec)
        # The Trainer says nothing when train() raises: the session ends at the next forward of the model outside
        # the Trainer's steps, at the process's exit (or when this callback is collected) unless on_train_end or
        # close() ended it first.
        finalizer = weakref.finalize(self, _end_unfinished, stack, rec, run)
        try:
            watch = stack.enter_context(_watch_model(model, rec, run, finalizer))
            # resume=True with resume_from_checkpoint: the records before it kept, seeded edits drawn on from its backwards
            rec.start_at(state.global_step, _backwards_before(state.global_step, args.gradient_accumulation_steps,
                                                              train_dataloader))  # fmt: skip
        except BaseException as e:
            finalizer.detach()
            stack.__exit__(type(e), e, None)
            raise
        self.recorder, self._stack, self._run, self._finalizer, self._watch = rec, stack, run, finalizer, watch
        if rec.main and args.fsdp and not _sharded(model):
            log.warning("the Trainer was asked for FSDP (TrainingArguments.fsdp) but trains the model unsharded (DDP): "
                        "accelerate turns FSDP on for accelerators only, not on CPU; the records are DDP's (parameter "
                        "taps: the whole gradients averaged over the ranks), see docs/scale-out.md")  # fmt: skip
        _UNFINISHED[_key(self.dir)] = finalizer

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        self._flush()
        if self._run is not None and self._alive():
            if self._run.suspended:  # a callback's forward between the steps closed the capture: the step's is on
                assert self.recorder is not None and self._watch is not None
                try:
                    self.recorder.capture.__enter__()
                except BaseException as e:
                    self._close(e)
                    raise
                self._run.suspended = False
                self._watch.last()  # after the session's own pre-hooks again
            self._run.in_step = True

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, optimizer: Any = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if optimizer is not None and self._run is not None:
            self._run.lrs = [float(g["lr"]) for g in optimizer.param_groups]  # the rates this step uses

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # The step is complete (`state.global_step` counts it); written at the Trainer's log of it (grad_norm, loss)
        # or before the next step begins.
        if self._run is not None:
            self._run.in_step = False

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        run, rec = self._run, self.recorder
        if run is None or rec is None or logs is None or not self._alive():
            return
        if "loss" in logs:
            grad_norm = logs.get("grad_norm")
            run.logged(rec, float(logs["loss"]), None if grad_norm is None else float(grad_norm))
        elif "train_loss" in logs and run.last_log == run.begun:  # the last log, and no loss was logged before it
            run.logged(rec, float(logs["train_loss"]))  # the mean over the run: checks every step's reading
        if "grad_norm" in logs and state.global_step > rec.step_index:
            run.grad_norm = float(logs["grad_norm"])
            self._flush()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        if not self._alive():  # ended already (a forward outside the Trainer's steps): its books are written
            self._close(None)
            return
        self._flush()
        assert self.recorder is not None
        self.recorder.end_within_step("the Trainer")  # should_training_stop inside an accumulation window: a normal end
        self._close(None)

    def _alive(self) -> bool:
        return self.recorder is not None and self._finalizer is not None and self._finalizer.alive

    def _flush(self) -> None:
        """Write the step the Trainer completed, if it waits. An error of the session's own (`on_nonfinite="stop"`'s
        `NonFinite`, a full disk) ends the session with it, as it leaves `train()`: the records and the last word are
        in the run dir then, not at a later `close()`."""
        if self._alive():
            assert self.recorder is not None and self._run is not None
            try:
                _write_completed(self.recorder, self._run)
            except BaseException as e:
                self._close(e)
                raise

    def close(self) -> None:
        """End the session after a `train()` that raised: the completed steps' records kept, no `done.json` (idempotent).

        Example::

            try:
                trainer.train()
            finally:
                callback.close()

        Called in the `except` or `finally` around `train()`, the last word names the error that ended it.
        """
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()  # the steps the Trainer completed before it failed are written
        self._close(None)

    def _close(self, error: BaseException | None) -> None:
        self.recorder, self._run, self._watch = None, None, None
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
            if _UNFINISHED.get(_key(self.dir)) is finalizer:
                del _UNFINISHED[_key(self.dir)]
        stack, self._stack = self._stack, contextlib.ExitStack()
        stack.__exit__(type(error) if error is not None else None, error, None)


#: The session of each run dir whose Trainer has not ended it (its train() raised), by resolved dir: a new
#: callback's train() into that dir ends it first (a notebook cell run again needs no `close()`).
_UNFINISHED: dict[str, weakref.finalize[Any, Any]] = {}


def _key(directory: str | os.PathLike[str]) -> str:
    return str(Path(directory).resolve())


@dataclass
class _Run:
    """What the session knows of the Trainer's run (the finalizer holds it, never the callback).

    The loss of a step is the model's `loss` output times the gradient backward brought to it
    (`_watch_model`), as long as every log of the Trainer (the mean of what `training_step` returned: what
    it backpropagated) agreed with those readings, within 0.1%; a custom `compute_loss` adding a term, or
    a non-linear one, does not: from a log that disagrees on, null (a warning says why, naming the steps
    written before it), but the Trainer's own loss for a step it logs alone (`logging_steps=1`), as for a
    model whose output has no loss. A run with no log of a loss is checked by its last log's `train_loss`
    (the mean over the run). Under several processes the Trainer logs the ranks' mean: each rank's row
    keeps its own reading.
    """

    state: TrainerState  # the Trainer's, updated in place: `global_step` counts the completed steps
    clip: float
    last_log: int  # the `global_step` of the Trainer's last log of a loss
    begun: int  # the `global_step` the Trainer's `train()` began at
    ranks: bool = False  # several processes: the Trainer logs the ranks' mean, no rank's own loss
    filtered: bool = True  # `logging_nan_inf_filter`: the Trainer logs a stand-in for a micro-batch's NaN/Inf loss
    in_step: bool = False  # between on_step_begin and on_step_end
    suspended: bool = False  # the capture is closed for a forward of a callback's between the steps, until the next
    lrs: list[float] | None = None
    grad_norm: float | None = None
    loss: float | None = None  # the Trainer's logged loss of the completed step, logged alone
    readings: list[float | None] = field(default_factory=list)  # the model-output losses written since the last log
    counted: bool = False  # the last log counted the reading of the completed step not yet written
    trusted: bool = True  # no log of the Trainer disagreed with the readings
    warned_filter: bool = False  # `_own` said that a logged loss may be a stand-in

    def completed(self, rec: Recorder) -> bool:
        """Whether the Trainer completed the step the session is in (its optimiser stepped, `global_step` counts it)."""
        return self.state.global_step > rec.step_index

    def logged(self, rec: Recorder, loss: float, grad_norm: float | None = None) -> None:
        """The Trainer logged `loss`, the mean of what it backpropagated over the steps since its last log (and the
        last step's `grad_norm`, where it logs one)."""
        steps, self.last_log = self.state.global_step - self.last_log, self.state.global_step
        readings, self.readings = self.readings, []
        if self.ranks:
            return
        if self.completed(rec):  # the log's last step, not written yet: its reading counts here, not when written
            now = rec.engine.step_loss
            readings.append(None if now is None else float(now))  # one host sync per log
            self.counted = True
        known = [r for r in readings if r is not None]
        if len(known) == steps and all(math.isfinite(r) for r in known) and not (
            math.isclose(sum(known) / steps, loss, rel_tol=1e-3, abs_tol=1e-4)  # transformers 4 rounds it
        ):  # fmt: skip
            self.trusted, known = False, []
            first = self.state.global_step - steps  # the first step of the log
            before = f"; steps {first}..{rec.step_index - 1}, written before this log, hold the model's own loss" if (
                rec.step_index > first) else ""  # fmt: skip
            log.warning("the Trainer backpropagated a loss other than the model's own `loss` output (a custom "
                        "compute_loss): steps.parquet's loss is null from step %d on but for the steps the Trainer "
                        "logs alone (logging_steps=1 records every step's)%s", rec.step_index, before)  # fmt: skip
        if steps == 1 and self.completed(rec) and len(known) != steps:
            self.loss = self._own(rec, loss, grad_norm)  # the model's loss is none, or not what it backpropagated

    def _own(self, rec: Recorder, loss: float, grad_norm: float | None) -> float | None:
        """The loss of a step the Trainer logged alone, as its log gives it: NaN or null where it may be a stand-in.

        With `logging_nan_inf_filter` on, the Trainer logs in place of a micro-batch's NaN/Inf loss the mean of
        what it counted since its last log: 0.0 for a step whose every micro-batch was NaN/Inf, a mix of stand-in
        and losses for one where some were. A step whose gradients are NaN/Inf (its logged `grad_norm`) may be
        either: NaN where the log says 0.0, else null (not known).
        """
        if not self.filtered or grad_norm is None or math.isfinite(grad_norm):
            return loss
        if not self.warned_filter:
            self.warned_filter = True
            log.warning("the Trainer's logged loss of step %d (%g) may be logging_nan_inf_filter's stand-in for a "
                        "NaN/Inf loss: the step's gradients are NaN/Inf (grad_norm %g). steps.parquet holds NaN for "
                        "such a step logged as 0.0 (every micro-batch's loss replaced), null for one logged otherwise "
                        "(its loss not known); TrainingArguments(logging_nan_inf_filter=False) has the Trainer log the "
                        "loss itself", rec.step_index, loss, grad_norm)  # fmt: skip
        return math.nan if loss == 0 else None


def _write_completed(rec: Recorder, run: _Run) -> None:
    """Write the row of the step the Trainer completed, if it waits (with what its log gave: grad_norm, loss)."""
    if not run.completed(rec):
        return
    extra: dict[str, Any] = {} if run.lrs is None else {"lr": run.lrs[0], "lrs": run.lrs}
    if run.grad_norm is not None:  # the Trainer clips so
        extra.update(grad_norm=run.grad_norm, clipped=bool(run.clip > 0 and run.grad_norm > run.clip))
    loss, run.lrs, run.grad_norm, run.loss = run.loss, None, None, None
    if loss is None and not run.trusted:
        rec.engine.forget_loss()  # the model's own loss, not what the Trainer backpropagated
    result = rec.step(loss, extra=extra)
    if loss is None and not run.counted:  # for the next log (a log that counted it has cleared the readings)
        run.readings.append(result.loss)
    run.counted = False


def _end_unfinished(stack: contextlib.ExitStack, rec: Recorder, run: _Run) -> None:
    """A session the Trainer never ended (its train() raised): the completed steps kept, ended by the error that
    ended `train()` where it is in sight (`trainer_error`), else as one the Trainer did not end."""
    # the error itself is only named: passed through the session, a user's OSError would read as the records' own
    end = EndedOutside("the session ended before the Trainer's train() did (no on_train_end)", trainer_error(run.state))
    try:
        _write_completed(rec, run)
    finally:
        stack.__exit__(EndedOutside, end, None)


def _backwards_before(step: int, accumulate: int, dataloader: Any) -> int | None:
    """The micro-batches the Trainer ran before optimiser step `step`, counted as its own resume counts them.

    An epoch of `len(dataloader)` micro-batches is `ceil(len / accumulate)` steps, the last holding what is left
    (4 micro-batches at `accumulate=3`: windows of 3 and 1), so after whole epochs the count is not
    `step * accumulate`. None (that default) where the dataloader has no length: every window is whole.
    """
    from transformers.trainer_utils import has_length  # the Trainer's own test (an unsized or Ray dataset: False)

    if not has_length(dataloader):
        return None
    per_epoch = len(dataloader)
    steps_per_epoch = max(per_epoch // accumulate + int(per_epoch % accumulate > 0), 1)  # the Trainer's own rule
    epochs, within = divmod(step, steps_per_epoch)
    return epochs * per_epoch + within * accumulate


def _sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are sharded (`DTensor`s: FSDP2 or tensor parallel)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def _distributed() -> tuple[Any, Callable[[], bool] | None]:
    """Under multi-process training: this rank's place (run id from rank 0) and whether a backward synchronised."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() <= 1:
        return None, None
    from accelerate.state import GradientState

    from gradrunner.run.distributed import Distributed

    return Distributed.joined(), lambda: bool(GradientState().sync_gradients)


class _Watch:
    """The callback's pre-hook on the model's forwards (`_watch_model`), kept the last to run."""

    def __init__(self, model: nn.Module, before: Callable[[nn.Module, Any], None]) -> None:
        self.model, self.before = model, before
        self.handle = model.register_forward_pre_hook(owned(model, before))

    def last(self) -> None:
        """After the pre-hooks the session installed again: torch calls those it listed as the call began, one removed
        by this hook too (a `with_kwargs` one then without its kwargs); closed after them, the session resets them."""
        self.handle.remove()
        self.handle = self.model.register_forward_pre_hook(owned(self.model, self.before))


@contextlib.contextmanager
def _watch_model(model: nn.Module, rec: Recorder, run: _Run, end: Callable[[], Any]) -> Iterator[_Watch]:
    """The model's forwards as the session needs them: where the model's `loss` output is backpropagated, and
    a training forward outside the Trainer's steps (none began since the last completed), which is not the Trainer's.

    The Trainer backpropagates the model's own loss times a constant (1/N under accumulation, a
    GradScaler's scale under fp16): that constant is the gradient backward brings to the model's loss.
    A training forward (grad on, `model.training`) outside the Trainer's steps while its `train()` runs is a
    callback's (`on_step_end`, `on_log`, `on_evaluate`): the capture closes before it runs (no hook, tap or edit
    touches it or its backward) until the next step begins. Outside `train()`, that `train()` raised and the
    user goes on with the model: `end()` writes the completed steps and removes every hook and edit first.
    """
    engine = rec.engine

    def before(module: nn.Module, args: Any) -> None:
        outside = not run.in_step or run.completed(rec)  # no step of the Trainer began since the last completed
        if not outside or not (module.training and torch.is_grad_enabled()) or in_backward():
            return
        if training(run.state):  # a callback's forward while train() runs: not captured, the session goes on
            if not run.suspended:
                run.suspended = True
                rec.capture.close()
            return
        log.warning("a training forward of the model outside the Trainer's steps and its train() (which raised): the "
                    "session ends before it runs, keeping in %s the records of the steps the Trainer completed "
                    "(global_step %d)", rec.directory, run.state.global_step)  # fmt: skip
        end()

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not (module.training and torch.is_grad_enabled() and isinstance(loss, torch.Tensor)) or loss.grad_fn is None:
            return
        if not run.trusted or run.suspended:  # the Trainer backpropagates another loss (`_Run.logged`); a callback's
            return
        value, nr = loss.detach().clone(), loss.output_nr  # a copy on the device: `loss *= k` after this is not in it

        def backpropagated(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            grad = grad_outputs[nr]
            if grad is not None:
                engine.add_loss(value * grad)

        loss.grad_fn.register_prehook(backpropagated)

    # owned: a copy of the model made during training (a reference model) is not the Trainer's
    watch, handle = _Watch(model, before), model.register_forward_hook(owned(model, hook))
    try:
        yield watch
    finally:
        watch.handle.remove()
        handle.remove()
