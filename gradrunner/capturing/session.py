"""`capture(model, taps, strategy=...)`: the context manager that taps a model and collects gradients.

Opening it resolves every tap, installs forward hooks (outputs, inputs), rewrites the `forward()`
of modules with local-variable taps (`capturing.firing`) and holds the tapped parameters' gradient
edges (`capturing.params`); leaving it, normally or by an exception, removes all of it.

Capture happens around a backward, whoever runs it: `cap.backward(loss)`, or the user's (or a
framework's) own `loss.backward()` under `hook` and `retain_grad`. The session sees a backward begin
at the first of its hooks to fire inside it (a pre-hook on the root module's outputs is the first
in practice; where the root's forward did not run, one on each tapped value's edge) and end by a
callback queued on autograd's engine (`torch_compat.at_backward_end`; without it, at the next
`records()`, forward or `cap.backward`). A step may hold several backwards (gradient
accumulation): `records()` covers every backward since the previous `records()`.

Example::

    with capture(model, ["fc1:output", ":hidden"], strategy="hook") as cap:
        loss = loss_fn(model(x), y)
        cap.backward(loss)             # or loss.backward(): the same records
    cap.grads["fc1:output"]            # call 0's gradient
    cap.grads["fc1:output", 1]         # call 1's, when the tap fired twice
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradrunner.capturing.backwards import Backwards, unscaled
from gradrunner.capturing.dtensors import any_dtensor
from gradrunner.capturing.edits import Edits
from gradrunner.capturing.firing import Firing
from gradrunner.capturing.grad_context import refuse_compiled
from gradrunner.capturing.grads import Grads
from gradrunner.capturing.open_sessions import hold_open
from gradrunner.capturing.owned import owned
from gradrunner.capturing.params import ParamBackward, ParamTaps, ddp_synced
from gradrunner.capturing.per_example import PerExampleNorms
from gradrunner.capturing.snapshot import ParamSnapshot
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.step_calls import StepArgs, around_closure
from gradrunner.capturing.strategies import Slot, get_strategy
from gradrunner.capturing.taps import Placed, Tap, TapSpec, check_still_resolved, resolve_taps
from gradrunner.capturing.torch_compat import backward_running, compiled_inner, running_ddp, shares_memory
from gradrunner.config.choices import VALUES_MODES
from gradrunner.errors import GradrunnerError, whole_number
from gradrunner.records.columns import StepRecords, TapKey

__all__ = ["Capture", "ParamSnapshot", "capture", "unscaled"]


class Capture(Backwards):
    """A capture session over one model: tap `model` and capture the gradients flowing through `taps`,
    the `strategy`'s way (`capture` is the same class, the documented spelling).

    Example::

        with capture(model, ["*:output", "fc1:weight"], strategy="retain_grad") as cap:
            cap.backward(loss_fn(model(x), y))
        cap.grads["fc1:output"]

    `strategy` is `retain_grad`, `hook` or `autograd_grad`; all three give the same gradients.
    `keep_grads=False` keeps only statistics (and `values`: `none`, `full` or a fixed `sample`), reduced on
    the gradient's device as it arrives (what the runner uses; reading `cap.grads` is refused). Every tap is resolved
    here, before any forward pass: a bad tap raises `GradrunnerError`.
    `per_example=True` adds each record's per-row gradient norms: an activation's row norms, and for a
    parameter each batch row's share of `.grad` (`capturing.per_example`; None, with a warning naming
    the tap and why, for a parameter whose shares cannot be computed exactly),
    `histogram=True` counts of |g| in the fixed bins of `records.columns.HIST_EDGES`; every record
    carries `value_norm`, the tapped tensor's own norm (see `Capture.records` for update norms).
    `edits` (`[{"tap": "fc1:output", "scale": 0.0}, ...]`, see `gradrunner.capturing.edits`) change the
    gradients flowing back through those taps, on every step; each edited tap is tapped too, its record
    holding the gradient before the edit, `edited` and `edited_norm` (the norm after it).
    `loss_scale` (a callable giving the current loss scale, a 0-d tensor or None) divides every captured
    gradient by it, on its device: the true gradients of a loss multiplied by a GradScaler's scale.
    `params_synced` (DDP: a callable saying whether the backward that just ended synchronised the
    gradients) makes parameter taps read `.grad` after that backward, the averaged gradient; given a
    `DistributedDataParallel` wrapper itself (`capture(ddp_model, ["module.fc1:weight"])`) the session takes
    it from the wrapper (`require_backward_grad_sync`). Without it, a model with parameter taps whose
    forward a DDP wrapper runs is refused there (they would read each rank's gradient before the
    all-reduce: pass the wrapper to `record` or `capture`, or `params_synced`). A model
    whose parameters are `DTensor`s (`fully_shard`, HSDP, `parallelize_module`) is seen as such: a
    parameter tap's record is then the whole parameter's gradient as the optimiser gets it (merged
    from the ranks' pieces, one SUM and one MAX all-reduce per captured step), no argument needed.
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Sequence[TapSpec] | TapSpec,
        strategy: str = "hook",
        *,
        values: str = "none",
        sample_size: int = 64,
        seed: int = 0,
        keep_grads: bool = True,
        per_example: bool = False,
        histogram: bool = False,
        edits: Sequence[Any] | None = None,
        loss_scale: Callable[[], torch.Tensor | float | None] | None = None,
        params_synced: Callable[[], bool] | None = None,
    ) -> None:
        refuse_compiled(model)
        model = compiled_inner(model)  # torch.compile(model): tap its eager modules, call the compiled one
        if values not in VALUES_MODES:
            raise GradrunnerError(f"capture.values={values!r} is not a values mode; allowed: {', '.join(VALUES_MODES)}")
        sample_size = whole_number("sample_size", sample_size, 1)  # as record() and the runner check them
        seed = whole_number("seed", seed)  # a numpy integer too, as a plain int
        self.model = model
        self.taps: list[Tap] = resolve_taps(model, taps)
        #: The model holds DTensor parameters (FSDP2, HSDP, TP): parameter records are merged over the ranks.
        self.sharded = any_dtensor(model.parameters())
        self.edits = Edits(model, edits, seed, sharded=self.sharded) if edits else None
        if self.edits is not None:  # an edited tap not tapped is tapped too: one row per firing
            self.taps += [t for t in self.edits.taps if t.tap not in {k.tap for k in self.taps}]
        self.strategy = get_strategy(strategy)(self._deliver, self._deliver_all)
        self.strategy_name = strategy
        #: How errors name this session (`record()` names its own: `open_sessions`).
        self.label = f"capture({type(model).__name__}, strategy={strategy!r})"
        self.keep_grads = keep_grads
        self.values, self.sample_size, self.seed, self.per_example, self.histogram = values, sample_size, seed, per_example, histogram  # fmt: skip
        self.enabled = True
        self.loss_scale = loss_scale
        self.grads = Grads([t.tap for t in self.taps], [], kept=keep_grads)
        modules = dict(model.named_modules(remove_duplicate=False))
        tap_params = [(t, getattr(modules[t.module], t.name)) for t in self.taps if t.kind == "param"]
        synced = params_synced if params_synced is not None else ddp_synced(model)  # the DDP wrapper itself
        self._params = ParamTaps(tap_params, seen=self._seen, capturing=lambda: self.enabled, synced=synced,
                                 sharded=self.sharded)  # fmt: skip
        self._pex = PerExampleNorms(model, [(t.tap, modules[t.module], p) for t, p in tap_params],
                                    enabled=lambda: self.enabled) if per_example and tap_params else None  # fmt: skip
        self._param_backward: ParamBackward | None = None
        self._model_params: list[nn.Parameter] | None = None  # listed once (`_watch_params`)
        self._witness: nn.Parameter | None = None  # a parameter last seen with a `.grad` (`gradients_reset`)
        self._registered, self._placed = False, Placed(model, self.taps, self._params.held())  # `_check_unchanged`
        #: The backward that ended last started the step again (`_note_end`): the step's loss is its loss.
        self.restarted = False
        self._filled, self._cleared_all = False, False  # the last backward (in a step call) left a `.grad`; all reset
        #: The `optimizer.step()` call whose closure runs now (a number), and the one the last backward ran in.
        self._in_step: int | None = None
        self._last_in: int | None = None
        self._steps_begun = 0
        self._firing = Firing(self)
        self._last_records: StepRecords | None = None
        self._stack = contextlib.ExitStack()
        super().__init__(Collector(values, sample_size, seed, per_example=per_example, histogram=histogram))

    # -- opening and closing -------------------------------------------------------------------
    def __enter__(self) -> Capture:
        if not self._closed:  # before anything is touched: its hooks again would fire every tap twice per forward
            raise GradrunnerError(f"{self.label} is open already: a session is entered once at a time (`with cap:` "
                                  "inside its own `with` block); use the open one, or a second capture(...)")  # fmt: skip
        try:
            self._install()
        except BaseException:
            self.close()  # closed, not left open: `backward()` outside a block refused, entered again once fixed
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._raised = exc[0] is not None  # only then is a step the block left dropped at the next entry (`_install`)
        self.close()

    def close(self) -> None:
        """Remove every hook and restore every patched `forward` (idempotent)."""
        self._closed = True
        self._stack.close()
        self._release(self._retained or [])
        self._retained, self._pass = None, None
        self._firing.reset()

    def _install(self) -> None:
        hold_open(self, self._stack)  # first: a session refused beside another leaves nothing behind
        if self._next_order and self._raised:  # a step an earlier block left as it raised, that no records() took
            self._abort()  # (a block that ended normally leaves its backwards to the next records(), as documented)
        self._placed = check_still_resolved(self.model, self.taps, self._params.held(), self.label)  # replaced, gone
        self._closed = False
        self._stack.callback(self.strategy.close)
        self._stack.callback(self._drop_root_hooks)
        self._in_step = self._last_in = None  # optimizer.step() calls (`_note_end`): one an earlier entry ran is over
        self._stack.callback(register_optimizer_step_pre_hook(self._step_begins).remove)
        self._watch_params()
        self._firing.install(self.model, [t for t in self.taps if t.kind != "param"], self._stack)
        self._params.install(self._stack)
        dist = torch.distributed
        if self._params and self._params.synced is None and dist.is_available() and dist.is_initialized():
            # DDP given as its `.module`: refused at its first forward (`_refuse_ddp_inner`)
            self._stack.callback(self.model.register_forward_pre_hook(owned(self.model, self._refuse_ddp_inner)).remove)
        if self._pex is not None:  # before the edits' hooks: its check sees a parameter's gradient before an edit
            self._stack.enter_context(self._pex)
        if self.edits is not None:
            self.edits.install(self._stack, lambda: self.enabled, self._seen)

    def _refuse_ddp_inner(self, module: nn.Module, args: object) -> None:
        """A forward run by a DDP wrapper the session was not given: parameter taps would read pre-all-reduce grads."""
        ddp = running_ddp()
        if ddp is None or not any(m is self.model for m in ddp.modules()):
            return
        taps = ", ".join(k.tap for k in self._params.keys)
        raise GradrunnerError(
            f"the model was given to the capture as the module inside a DistributedDataParallel wrapper "
            f"({type(self.model).__name__}, run by ddp(x)), so its parameter taps ({taps}) would record each "
            "rank's own gradient before DDP's all-reduce, not the averaged .grad the optimizer steps with; pass "
            "the DDP wrapper itself (record(ddp_model, ...) or capture(ddp_model, ...)), or to capture() pass "
            "params_synced=lambda: ddp_model.require_backward_grad_sync"
        )

    def _watch_params(self) -> None:
        """Forget the cached parameter list, and check the taps at the next step (`_check_unchanged`), whenever any
        module registers a parameter (its slot noted) or submodule: listing walks every module, microseconds a firing"""

        def forget(*_: object) -> None:
            self._model_params, self._witness, self._registered = None, None, True

        def assigned(module: nn.Module, name: str, _param: object) -> None:  # `lin.weight = ...`: `Placed.note`
            self._placed.note(module, name)
            forget()

        forget()  # changed while the session was closed: listed again
        self._stack.callback(nn.modules.module.register_module_parameter_registration_hook(assigned).remove)
        self._stack.callback(nn.modules.module.register_module_module_registration_hook(forget).remove)

    def _check_unchanged(self, forward: bool = False) -> None:
        """Refuse the step about to run (root `forward`, a backward) if a tap was replaced or deleted in the block."""
        if self._registered or not self._placed.intact():  # deleting runs no registration hook: `Placed`
            held, self._registered = self._params.held(), False  # refused again while `intact()` is False
            self._placed = check_still_resolved(self.model, self.taps, held, self.label, self._placed, forward)

    def _all_params(self) -> list[nn.Parameter]:
        if self._model_params is None:
            self._model_params = list(self.model.parameters())
        return self._model_params

    def gradients_reset(self) -> bool:
        """Whether the model trains and every parameter's `.grad` is None now.

        Example::

            cap.gradients_reset()     # True after model.zero_grad(), before the next backward

        Never for a sharded model (FSDP2 leaves `.grad` None while it accumulates without syncing). Cheap
        where a `.grad` is held: the parameter last seen with one is looked at first.
        """
        if self.sharded or (self._witness is not None and self._witness.grad is not None):
            return False
        trains = False
        for p in self._all_params():
            if p.grad is not None:
                self._witness = p
                return False
            trains = trains or p.requires_grad
        return trains

    def _step_begins(self, _opt: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepArgs | None:
        """An `optimizer.step()` call begins: counted as the step run now while its closure runs (`step_calls`)."""
        self._steps_begun = n = self._steps_begun + 1
        return around_closure(args, kwargs, lambda: self._step_running(n), self._step_running)

    def _step_running(self, n: int | None) -> int | None:
        was, self._in_step = self._in_step, n
        return was

    def _note_begin(self) -> None:
        """A backward begins: was every `.grad` reset since an earlier backward of the same `optimizer.step()` call
        left one (`_note_end`)?"""
        again = self._in_step is not None and self._in_step == self._last_in
        self._cleared_all = again and self._filled and self.gradients_reset()

    def _note_end(self) -> bool:
        """A backward ended: whether it starts the step again (`restarted`).

        It does when it ran inside the same `optimizer.step()` call as the backward before it (its closure,
        evaluated again: LBFGS), every `.grad` was reset before it, and the parameter seen with a `.grad` before
        has one again: what the backwards before brought is then in no `.grad`, and no optimiser stepped with it.
        Backwards between optimiser steps (a WGAN's critic steps, a GAN's second optimiser, accumulation with a
        `zero_grad()` by mistake) add to the step; the parameter records still drop what a reset dropped.
        """
        w = self._witness
        self.restarted = self._cleared_all and w is not None and w.grad is not None
        # only a backward inside an optimizer.step() call can be followed by one that restarts (`_note_begin`)
        self._filled = self._in_step is not None and not self.gradients_reset()
        self._last_in = self._in_step
        return self.restarted

    # -- a backward the session runs -------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the strategy's way; every parameter's `.grad` is filled as by `loss.backward()`.

        Example::

            cap.backward(loss_fn(model(x), y))

        Under `hook` and `retain_grad` this is `loss.backward()` with the session's bookkeeping around
        it; under `autograd_grad`, the strategy's own `torch.autograd.grad` call.
        """
        if self._closed:  # no hook is installed: its taps' records would say they got no gradient
            raise GradrunnerError(f"{self.label}.backward() was called outside its `with` block, where nothing is "
                                  "captured; call it inside the block, or loss.backward() to backpropagate uncaptured")  # fmt: skip
        self._finish_pending()
        self._check_unchanged()  # a tap replaced since the forward: its records would not be the model's
        p = self._begin(explicit=True, retain_graph=retain_graph)
        try:
            with backward_running():
                if p.captured and self.strategy.owns_backward:
                    self.strategy.run_backward(loss, p.slots, self._owned_params(), retain_graph)
                else:
                    loss.backward(retain_graph=retain_graph)
        except BaseException:
            self._abort()  # nothing of a failed backward reaches the records
            raise
        self._end()

    def _owned_params(self) -> ParamBackward:
        if self._param_backward is None:
            by_backward = self._params.synced is not None  # DDP's reducer must see the parameters' backward
            self._param_backward = ParamBackward(self._all_params, self._params, by_backward)
        return self._param_backward

    def start_backwards_at(self, n: int) -> None:
        """Number the next backward `n` (from 0): a run resumed mid-way, whose first `n` backwards ran before.

        Example::

            cap.start_backwards_at(start_step * accumulate)

        Seeded edits (`dropout`, `noise_std`) draw per backward: they then draw what the
        uninterrupted run drew. Call it before the forward of that backward.
        """
        if self.edits is not None:
            self.edits.step = int(n) - 1  # `begin_backward` counts the next one

    def reset(self) -> None:
        """Forget the calls fired since the last backward (e.g. after the loss failed).

        Example::

            try:
                loss = loss_fn(model(x), y)
            except ValueError:
                cap.reset()     # the retried step starts at call 0 again
        """
        self._firing.reset()
        self._forget_deferred()
        if self._pex is not None:
            self._pex.forget_forward()

    # -- the step's records ------------------------------------------------------------------------
    def settle(self) -> None:
        """The step's backwards are done: reduce its parameter gradients now, on their device.

        Example::

            cap.backward(loss); cap.settle()     # before the optimiser step: the step sums are let go

        `records()` does it if it was not done; calling it early frees the parameters' step sums
        before the optimiser step allocates its state.
        """
        self._finish_pending()
        self._settle_params()

    def records(self, loss: torch.Tensor | None = None, before: ParamSnapshot | None = None) -> StepRecords:
        """Statistics (and values) of every backward since the last `records()`, in one device-to-host transfer.

        Example::

            recs = cap.records(loss)   # recs.row(0)["norm"], recs.loss

            before = cap.snapshot_params()      # after backward, before the optimiser step
            optimizer.step()
            recs = cap.records(loss, before)    # recs.update_norm, recs.update_ratio of parameter taps

        Activation, input and local taps get one record per backward and call; with several backwards
        (gradient accumulation) `micro_step` numbers them 0, 1, ... Parameter taps get one record
        for the step (`micro_step` None): the sum of what arrived over its backwards since `.grad` was
        reset (a `zero_grad()` between two of them: `ParamTaps.begin_backward`). With `before`,
        each parameter tap's `update_norm` is ||p now - p before||, computed on the device and moved
        with everything else. The records may be taken after the optimiser step: nothing they read
        changes with it (gradients are reduced, or held where nothing changes them in place). Called
        again with no backward since, it returns the same records.
        """
        self.settle()
        if self._pass is None:  # a forward since the last backward none used (a metric, a skipped step): not the next's
            self.reset()
        if self._last_records is not None and self._next_order == 0:
            return self._last_records  # no backward since: the same records
        updates = {} if before is None else before.update_norms()
        self._last_records = self._finish_step(loss, updates)
        self._filled = False  # the next backward begins a step: no reset to look for (`_note_begin`)
        return self._last_records

    def snapshot_params(self) -> ParamSnapshot:
        """A device copy of every tapped parameter as it is now (call it after backward, before the step).

        Example::

            before = cap.snapshot_params()
            optimizer.step()
            cap.records(loss, before).update_norm
        """
        copies: dict[int, torch.Tensor] = {}  # a tied parameter tapped twice is copied once
        kept = []
        for key, (_, param) in zip(self._params.keys, self._params.taps, strict=True):
            if id(param) not in copies:
                copies[id(param)] = param.detach().clone()
            kept.append((key, param, copies[id(param)]))
        return ParamSnapshot(kept)

    def reasons(self) -> dict[TapKey, str]:
        """Why taps of the last backward got no gradient."""
        return {s.key: s.reason for s in self._last if s.reason is not None}

    @property
    def pending_backwards(self) -> int:
        """Captured backwards since the last `records()` (a backward still running counts)."""
        return self._backwards_in_step + (1 if self._pass is not None and self._pass.captured else 0)

    # -- what the backward side needs of the session -----------------------------------------------
    def _forward_slots(self) -> tuple[list[Slot], Collection[str]]:
        return self._firing.take()

    def _forget_forward(self) -> None:
        self._firing.reset()

    def _forget_deferred(self) -> None:
        self._firing.deferred, self._firing.deferred_calls = {}, {}

    def _keep(self, slot: Slot, grad: torch.Tensor) -> None:
        self._kept[slot.order] = grad.detach().clone() if slot.mutable else grad.detach()

    def _kept_grads(self, slots: list[Slot], params: Mapping[int, torch.Tensor | None]) -> None:
        # an intermediate's gradient was kept as it is: copied now where a leaf's `.grad` took it as a view
        kept = [(s.key, None if (g := self._kept.get(s.order)) is None else g.clone() if shares_memory(g) else g)
                for s in slots if s.fired]  # fmt: skip
        arrived = {} if self.edits is None else self.edits.last_arrived
        for key, (_, p) in zip(self._params.keys, self._params.taps, strict=True):
            g = arrived.get(id(p), params.get(id(p)))
            if g is not None and self.grad_scale is not None:
                g = unscaled(g, self.grad_scale)
            kept.append((key, None if g is None else g.detach().clone()))
        self.grads = Grads([t.tap for t in self.taps], kept)
        self._kept = {}


#: `capture(model, taps, strategy=...)`: the documented spelling of `Capture(...)` (one signature, one place).
capture = Capture
