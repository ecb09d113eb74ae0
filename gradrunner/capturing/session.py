"""`capture(model, taps, strategy=...)`: the context manager that taps a model and collects gradients.

Opening it resolves every tap, installs forward hooks (outputs, inputs), rewrites the `forward()`
of modules with local-variable taps, and registers parameter hooks where the strategy needs them;
leaving it, normally or by an exception, removes all of it.

Example::

    with capture(model, ["fc1:output", ":hidden"], strategy="hook") as cap:
        loss = loss_fn(model(x), y)
        cap.backward(loss)
    cap.grads["fc1:output"]            # call 0's gradient
    cap.grads["fc1:output", 1]         # call 1's, when the tap fired twice
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from gradrunner.capturing.edits import Edits
from gradrunner.capturing.elements import bind_input, get_element, set_element
from gradrunner.capturing.extras import value_norm, value_norms
from gradrunner.capturing.forward_patch import patch_forward
from gradrunner.capturing.grad_context import (
    CHANGED_IN_PLACE,
    FROZEN,
    GRAPH_FREED,
    NO_PART,
    NOT_ASSIGNED,
    NOT_CALLED,
    TRANSFORMED,
    in_backward,
    input_alias,
    no_grad_reason,
    reentrant_checkpoint,
    refuse_compiled,
    refuse_transformed,
    unwrap_compiled,
)
from gradrunner.capturing.grads import Grads
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.strategies import Slot, Strategy, get_strategy
from gradrunner.capturing.taps import Tap, TapSpec, resolve_taps
from gradrunner.capturing.torch_compat import is_view, version
from gradrunner.config.choices import VALUES_MODES
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import StepRecords, TapKey

_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    """`fn` run as plain Python even inside a compiled model: under torch.compile the session's hooks
    are graph breaks, so that every call opens its slot and attaches the strategy, as in eager mode."""
    return torch.compiler.disable(fn)


def unscaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`grad` times `scale` (0-d, e.g. 1/loss scale), on the gradient's device without a host sync.

    Example::

        unscaled(g, scaler.scale(torch.ones(())).reciprocal())   # the true gradient under fp16 loss scaling

    In float32 at least (statistics are float32 anyway): a float16 gradient divided by the scale could
    underflow. A new tensor: the caller's gradient is untouched.
    """
    wide = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    return wide * scale.to(device=grad.device, dtype=wide.dtype)


class Capture:
    """A capture session over one model: tap `model` and capture the gradients flowing through `taps`,
    the `strategy`'s way (`capture` is the same class, the documented spelling).

    Example::

        with capture(model, ["*:output", "fc1:weight"], strategy="retain_grad") as cap:
            cap.backward(loss_fn(model(x), y))
        cap.grads["fc1:output"]

    `strategy` is `retain_grad`, `hook` or `autograd_grad`; all three give the same gradients.
    `keep_grads=False` keeps only statistics (and `values`: `none`, `full` or a fixed `sample`),
    reduced on the gradient's device as it arrives: what the runner uses. Every tap is resolved
    here, before any forward pass: a bad tap raises `GradrunnerError`. `wrap_strategy` wraps the
    strategy (the runner's DDP support delivers parameter gradients after the all-reduce this way).
    `per_example=True` adds each record's per-row gradient norms (taps other than parameters),
    `histogram=True` counts of |g| in the fixed bins of `records.columns.HIST_EDGES`; every record
    carries `value_norm`, the tapped tensor's own norm (see `Capture.records` for update norms).
    `edits` (`[{"tap": "fc1:output", "scale": 0.0}, ...]`, see `gradrunner.capturing.edits`) change the
    gradients flowing back through those taps, on every step; each edited tap is tapped too, its record
    holding the gradient before the edit, `edited` and `edited_norm` (the norm after it).
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
        wrap_strategy: Callable[[Strategy], Strategy] | None = None,
        per_example: bool = False,
        histogram: bool = False,
        edits: Sequence[Any] | None = None,
    ) -> None:
        model = unwrap_compiled(model)  # torch.compile(model): tap its eager modules, call the compiled one
        refuse_compiled(model)
        if values not in VALUES_MODES:
            raise GradrunnerError(f"capture.values={values!r} is not a values mode; allowed: {', '.join(VALUES_MODES)}")
        self.model = model
        self.taps: list[Tap] = resolve_taps(model, taps)
        self._edits = Edits(model, edits, seed) if edits else None
        if self._edits is not None:  # an edited tap not tapped is tapped too: one row per firing
            self.taps += [t for t in self._edits.taps if t.tap not in {k.tap for k in self.taps}]
        self.strategy = get_strategy(strategy)(self._deliver)
        if wrap_strategy is not None:  # e.g. DDP: parameters from `.grad` after the all-reduce
            self.strategy = wrap_strategy(self.strategy)
        self.strategy_name = strategy
        self.keep_grads = keep_grads
        self.values, self.sample_size, self.seed = values, sample_size, seed
        self.per_example, self.histogram = per_example, histogram
        self.enabled = True
        #: A 0-d tensor every captured gradient is multiplied by before its statistics (on its device, no
        #: sync): the runner sets 1/loss scale under fp16 loss scaling, so records hold the true gradients.
        self.grad_scale: torch.Tensor | None = None
        self.grads = Grads([t.tap for t in self.taps], [])
        self._collector: Collector | None = None if keep_grads else self._new_collector()
        self._slots: list[Slot] = []
        self._kept: dict[int, torch.Tensor | None] = {}
        self._calls: dict[str, int] = {}
        #: The slot of each parameter tap (keyed by tap: two taps on one tied parameter get one each).
        self._param_slots: dict[str, Slot] = {}
        #: (slots, calls) as they were when the outermost forward began: restored if it fails.
        self._forward_mark: tuple[int, dict[str, int]] | None = None
        self._stack = contextlib.ExitStack()
        self._params: list[nn.Parameter] | None = None  # the model's parameters, listed once (`_watch_params`)
        self._last: list[Slot] = []
        self._tap_params: list[tuple[Tap, nn.Parameter]] = []
        #: Grad mode at each (nested) entry into the root's forward: tells no_grad blocks from evaluation.
        self._grad_forward: list[bool] = []
        #: Slots opened in a reentrant checkpoint's no-grad forward, attached when backward recomputes them.
        self._deferred: dict[tuple[int, str], list[Slot]] = {}
        #: The last forward's slots, kept after a `backward(retain_graph=True)`: a further backward without
        #: a new forward (two losses, as in a GAN step) captures through them again.
        self._retained: list[Slot] | None = None
        #: Whether the root module's forward ran since the last backward.
        self._forward_since_backward = False
        #: How many backwards ran since the last forward: 0 for the first (`Capture.backward_index`).
        self.backward_index = -1

    # -- opening and closing -------------------------------------------------------------------
    def __enter__(self) -> Capture:
        try:
            self._install()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and restore every patched `forward` (idempotent)."""
        self._stack.close()
        self._slots = []

    def _install(self) -> None:
        modules = dict(self.model.named_modules(remove_duplicate=False))
        self._stack.callback(self.strategy.close)
        self._watch_params()
        self._track_grad_mode()
        by_module: dict[str, list[Tap]] = {}
        for tap in self.taps:
            by_module.setdefault(tap.module, []).append(tap)
        locals_by_instance: dict[int, tuple[nn.Module, list[Tap]]] = {}
        for path, taps in by_module.items():
            module = modules[path]
            outputs = [t for t in taps if t.kind == "output"]
            inputs = [t for t in taps if t.kind == "input"]
            if inputs:
                handle = module.register_forward_pre_hook(self._input_hook(inputs), with_kwargs=True)
                self._stack.callback(handle.remove)
            if outputs:
                handle = module.register_forward_hook(self._output_hook(outputs), with_kwargs=True)
                self._stack.callback(handle.remove)
            # one module object under several paths: one rewrite serves every path's local taps
            entry = locals_by_instance.setdefault(id(module), (module, []))
            entry[1].extend(t for t in taps if t.kind == "local")
        for module, local_taps in locals_by_instance.values():
            if local_taps:
                self._patch_forward(module, local_taps)
        self._tap_params = [(t, getattr(modules[t.module], t.name)) for t in self.taps if t.kind == "param"]
        self.strategy.install([(p, self._slot_lookup(t.tap)) for t, p in self._tap_params])
        if self._edits is not None:
            self._edits.install(self._stack, lambda: self.enabled)

    def _watch_params(self) -> None:
        """Forget the cached parameter list whenever any module registers a parameter or submodule.

        Listing the parameters walks every module: for a model of hundreds of modules that costs
        microseconds per tap firing if done every step.
        """

        def forget(*_: object) -> None:
            self._params = None

        for register in (
            nn.modules.module.register_module_parameter_registration_hook,
            nn.modules.module.register_module_module_registration_hook,
        ):
            self._stack.callback(register(forget).remove)

    def _slot_lookup(self, tap: str) -> Callable[[], Slot | None]:
        """The parameter tap's slot in the step being captured (None outside `backward`)."""
        return lambda: self._param_slots.get(tap)

    def _track_grad_mode(self) -> None:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._grad_forward:
                self._forward_mark = (len(self._slots), dict(self._calls))
                self._forward_since_backward = True
                for slot in self._retained or ():  # a new forward: the last one's graph is no longer held here
                    slot.tensor, slot.edge, slot.view = None, None, None
                self._retained = None
            self._grad_forward.append(torch.is_grad_enabled())

        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._grad_forward:
                self._grad_forward.pop()
            # Called with output None from inside torch's `except` when the forward raised: forget the
            # calls it opened, so a retry of the step has no phantom calls.
            if not self._grad_forward and output is None and sys.exc_info()[1] is not None:
                if self._forward_mark is not None:
                    del self._slots[self._forward_mark[0] :]
                    self._calls = self._forward_mark[1]
                self._deferred = {}

        handle = self.model.register_forward_pre_hook(_eager(enter), prepend=True)
        self._stack.callback(handle.remove)
        handle = self.model.register_forward_hook(_eager(leave), always_call=True)
        self._stack.callback(handle.remove)

    def _patch_forward(self, module: nn.Module, taps: list[Tap]) -> None:
        by_name: dict[str, list[Tap]] = {}
        for t in taps:
            by_name.setdefault(t.variable, []).append(t)

        def tap_fn(name: str, value: object) -> object:
            for tap in by_name[name]:
                value = self._fire(tap, value)
            return value

        # what is actually called (an instance-level forward kept), restored exactly on exit
        self._stack.callback(patch_forward(module, by_name, _eager(tap_fn)))

    # -- forward pass ----------------------------------------------------------------------------
    def _output_hook(self, taps: list[Tap]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            changed = False
            for tap in taps:
                element = get_element(output, tap.path, tap.tap, tap.from_glob)
                new = self._fire(tap, element)
                if new is not element:
                    output, changed = set_element(output, tap.path, new), True
            return output if changed else None

        return _eager(hook)

    def _input_hook(self, taps: list[Tap]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            changed = False
            for tap in taps:
                path = bind_input(module, tap.path or (0,), args, kwargs)
                source: Any = args if isinstance(path[0], int) else kwargs
                element = get_element(source, path, tap.tap, tap.from_glob)
                new = self._fire(tap, element, is_input=True)
                if new is not element:
                    changed = True
                    if isinstance(path[0], int):
                        args = set_element(args, path, new)
                    else:
                        kwargs = set_element(kwargs, path, new)
            return (args, kwargs) if changed else None

        return _eager(hook)

    def _fire(self, tap: Tap, value: object, is_input: bool = False) -> object:
        """A tap fired in the forward pass: open a slot (one call) and let the strategy attach."""
        if not self.enabled:
            return value if self._edits is None else self._edits.on_fire(tap, value, None)
        if in_backward():
            return self._fire_recomputed(tap, value, is_input)
        if not torch.is_grad_enabled():
            return self._fire_without_grad(tap, value)
        return self._attach(tap, self._open_slot(tap), value, is_input)

    def _open_slot(self, tap: Tap) -> Slot:
        call = self._calls.get(tap.tap, 0)
        self._calls[tap.tap] = call + 1
        slot = Slot(TapKey(tap.module, tap.name, call), order=len(self._slots))
        self._slots.append(slot)
        return slot

    def _fire_without_grad(self, tap: Tap, value: object) -> object:
        """Gradients are off: an evaluation pass, a reentrant checkpoint's first forward, or a no_grad block."""
        if not self._grad_forward or not self._grad_forward[-1]:
            return value  # evaluation (the model was called under no_grad), or a submodule called on its own
        ctx = reentrant_checkpoint("forward")
        if ctx is not None:
            # checkpoint(use_reentrant=True) runs this part under no_grad now and again, with grad,
            # inside backward: this call is captured then, counted once, in its forward place.
            self._deferred.setdefault((id(ctx), tap.tap), []).append(self._open_slot(tap))
            return value
        return self._attach(tap, self._open_slot(tap), value, False)  # in a no_grad block: no gradient

    def _fire_recomputed(self, tap: Tap, value: object, is_input: bool) -> object:
        """A tap fired while backward recomputes checkpointed activations."""
        ctx = reentrant_checkpoint("backward") if self._deferred and torch.is_grad_enabled() else None
        waiting = self._deferred.get((id(ctx), tap.tap)) if ctx is not None else None
        if not waiting:
            return value  # use_reentrant=False: this call was captured in the forward pass already
        return self._attach(tap, waiting.pop(0), value, is_input)

    def _attach(self, tap: Tap, slot: Slot, value: object, is_input: bool) -> object:
        if isinstance(value, torch.Tensor) and refuse_transformed(tap, value):
            slot.reason = TRANSFORMED
            return value
        why = no_grad_reason(value, is_input)
        if why is not None:
            if self._edits is not None:
                self._edits.refuse(tap, why[1])
            if not tap.from_glob:
                raise GradrunnerError(
                    f"tap {tap.tap!r} cannot carry a gradient: its value is {why[1]}.{_element_hint(tap, value)} "
                    "Tap a tensor computed from parameters or from an input that requires grad (an input tap on "
                    "the root makes floating-point inputs require grad), or drop the tap."
                )
            hint = _element_hint(tap, value).strip().rstrip(".")  # a tuple/dict: which element taps exist
            slot.reason = f"{why[0]}; {hint[0].lower()}{hint[1:]}" if hint else why[0]  # from a glob: no gradient
            return value
        assert isinstance(value, torch.Tensor)
        if is_input and not value.is_leaf and tap.module == "" and len(self._grad_forward) == 1:
            # The caller's own tensor: tap an alias, so nothing (retains_grad, hooks) stays on theirs.
            value = value.view_as(value)
        if not value.requires_grad:
            # An input tap on a floating-point leaf: the model gets an alias that requires grad and shares
            # the storage (writes, `x.sub_(mean)` included, reach the caller's tensor as without capture);
            # the caller's tensor itself is left as it is.
            value = input_alias(value)
        slot.leaf = value.is_leaf
        if is_view(value):
            slot.view, slot.version = value, version(value)
        slot.value_norm = value_norm(value)  # on the device, no sync: it goes to the host with the step
        if self._edits is not None:  # the strategy reads the gradient that arrives, the edit acts upstream of it
            value = self._edits.on_fire(tap, value, slot.key)
        return self.strategy.attach(value, slot)

    # -- backward pass ---------------------------------------------------------------------------
    def _deliver(self, slot: Slot, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Every tapped gradient passes through here, once per slot and backward, whatever the strategy.

        `grad` is the gradient flowing into the tapped value as autograd delivers it to the tensor's
        `.grad` (after the model's own hooks on that tensor). The seam for gradient edits: with the
        `hook` strategy a tensor returned here flows on in place of `grad`.
        """
        if slot.delivered or grad is None:
            return None
        slot.delivered = True
        if slot.param is not None and self._edits is not None:
            grad = self._edits.arrived(slot.param, slot.key, grad)  # recorded: the gradient before the edit
        if self.grad_scale is not None:
            grad = unscaled(grad, self.grad_scale)
        # A leaf's gradient may become its .grad, which can be changed in place later (zero_grad,
        # accumulation); an intermediate's gradient is handed to us alone.
        leaf = slot.param is not None or slot.leaf
        if self._collector is not None:
            # A complex gradient's statistics are those of its magnitude |z| (documented in the README).
            # Handed over after autograd's backward returned (a parameter's, or `.grad` read by a strategy):
            # nothing changes it before `backward` flushes the collector, so a small one is not copied.
            self._collector.add(slot.key, grad.abs() if grad.is_complex() else grad, order=slot.order, mutable=leaf,
                                value_norm=slot.value_norm, batched=slot.param is None,
                                settled=not in_backward())  # fmt: skip
        if self.keep_grads:
            self._kept[slot.order] = grad.detach().clone() if leaf else grad.detach()
        return None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the strategy's way; every parameter's `.grad` is filled as by `loss.backward()`.

        Example::

            cap.backward(loss_fn(model(x), y))
        """
        if self._edits is not None:
            self._edits.begin_backward()
        if not self.enabled:
            loss.backward(retain_graph=retain_graph)
            return
        again = not self._forward_since_backward and not self._slots
        if again and self._retained is not None:
            # no forward since a backward(retain_graph=True): this backward's gradients, through the same taps
            self._slots = [dataclasses.replace(s, delivered=False) for s in self._retained]
        self.backward_index = self.backward_index + 1 if again else 0
        self._retained, self._forward_since_backward = None, False
        slots, fired = self._slots, {s.key.tap for s in self._slots}
        forward_slots = list(slots)
        self._slots, self._calls, self._forward_mark = [], {}, None
        norms = value_norms([p for _, p in self._tap_params])  # batched on an accelerator: a few launches for all
        for (tap, param), norm in zip(self._tap_params, norms, strict=True):
            slot = Slot(TapKey(tap.module, tap.name, 0), order=len(slots), param=param, value_norm=norm)
            slot.reason = None if param.requires_grad else FROZEN
            slots.append(slot)
            self._param_slots[tap.tap] = slot
        for tap in self.taps:  # resolved but did not fire: still a row, saying why
            if tap.kind != "param" and tap.tap not in fired:
                why = GRAPH_FREED if again else NOT_ASSIGNED if tap.kind == "local" else NOT_CALLED
                slots.append(Slot(TapKey(tap.module, tap.name, 0), order=len(slots), reason=why, fired=False))
        self._kept = {}
        try:
            if self._params is None:
                self._params = list(self.model.parameters())
            params = [p for p in self._params if p.requires_grad]
            self.strategy.backward(loss, slots, params, retain_graph)
        except BaseException:
            # Nothing of a failed backward reaches the next step's records.
            self._last, self._kept, retain_graph = [], {}, False
            if self._collector is not None:
                self._collector = self._new_collector()
            raise
        finally:
            self._param_slots = {}
            self._deferred = {}
            if retain_graph:
                self._retained = forward_slots
            else:  # the graph is freed: let go of the tensors and edges that hold it
                for slot in slots:
                    slot.tensor, slot.edge = None, None
        for slot in slots:
            if not slot.delivered:
                if slot.view is not None and version(slot.view) != slot.version:
                    slot.reason = slot.reason or CHANGED_IN_PLACE
                slot.reason = slot.reason or NO_PART
                if self._collector is not None:
                    self._collector.add(slot.key, None, order=slot.order, value_norm=slot.value_norm)
            if not retain_graph:
                slot.view = None
        if self._collector is not None:
            self._collector.flush()  # the step's small gradients, reduced together; let go of them
        self._last = slots
        if self.keep_grads:
            kept = [(s.key, self._kept.get(s.order)) for s in slots if s.fired]
            self.grads = Grads([t.tap for t in self.taps], kept)
            self._kept = {}

    def skip_backwards(self, n: int) -> None:
        """Go on as if `n` backwards had already run (a job resumed mid-run from a checkpoint).

        Example::

            cap.skip_backwards(start_step * accumulate)

        Seeded edits (`dropout`, `noise_std`) draw per backward: they then draw what the
        uninterrupted run drew.
        """
        if self._edits is not None:
            self._edits.step += n

    def reset(self) -> None:
        """Forget the step in progress (calls fired since the last `backward`), e.g. after the loss failed.

        Example::

            try:
                loss = loss_fn(model(x), y)
            except ValueError:
                cap.reset()     # the retried step starts at call 0 again
        """
        self._slots, self._calls, self._deferred, self._forward_mark = [], {}, {}, None
        if self._edits is not None:
            self._edits.reset()

    def records(self, loss: torch.Tensor | None = None, before: ParamSnapshot | None = None) -> StepRecords:
        """Statistics (and values) of the last captured step, in one device-to-host transfer.

        Example::

            recs = cap.records(loss)   # recs.row(0)["norm"], recs.loss

            before = cap.snapshot_params()      # after backward, before the optimiser step
            optimizer.step()
            recs = cap.records(loss, before)    # recs.update_norm, recs.update_ratio of parameter taps

        With `before`, each parameter tap's `update_norm` is ||p now - p before||, computed on the
        device and moved with everything else. The records may be taken after the step: nothing they
        read changes with it (gradients are reduced, or copied where they may become `.grad`, as they
        arrive; tests/test_extra_columns.py checks this under Adam with weight decay and SGD momentum).
        """
        updates = {} if before is None else before.update_norms()
        edited = None if self._edits is None else self._edits.norms
        if edited and self.grad_scale is not None:  # fp16 loss scaling: after the edit, in true units too
            edited = {k: v * self.grad_scale.to(device=v.device, dtype=v.dtype) for k, v in edited.items()}
        if self._collector is not None:
            recs = self._collector.finish(loss, updates, edited)
        else:
            collector = self._new_collector()
            for slot in self._last:
                grad = self.grads.calls(slot.key.tap)[slot.key.call] if slot.fired else None
                collector.add(slot.key, grad.abs() if grad is not None and grad.is_complex() else grad,
                              order=slot.order, value_norm=slot.value_norm, batched=slot.param is None,
                              settled=True)  # fmt: skip  (finished right below: nothing changes it)
            recs = collector.finish(loss, updates, edited)
        why = {s.key: s.reason for s in self._last}
        recs.reason = [None if g else why.get(k, NO_PART) for k, g in zip(recs.keys, recs.has_grad, strict=True)]
        return recs

    def snapshot_params(self) -> ParamSnapshot:
        """A device copy of every tapped parameter as it is now (call it after backward, before the step).

        Example::

            before = cap.snapshot_params()
            optimizer.step()
            cap.records(loss, before).update_norm
        """
        copies: dict[int, torch.Tensor] = {}  # a tied parameter tapped twice is copied once
        kept = []
        for tap, param in self._tap_params:
            if id(param) not in copies:
                copies[id(param)] = param.detach().clone()
            kept.append((TapKey(tap.module, tap.name, 0), param, copies[id(param)]))
        return ParamSnapshot(kept)

    def _new_collector(self) -> Collector:
        return Collector(self.values, self.sample_size, self.seed, per_example=self.per_example,
                         histogram=self.histogram)  # fmt: skip

    def reasons(self) -> dict[TapKey, str]:
        """Why taps of the last step got no gradient, where that was known in the forward pass."""
        return {s.key: s.reason for s in self._last if s.reason is not None}


#: `capture(model, taps, strategy=...)`: the documented spelling of `Capture(...)` (one signature, one place).
capture = Capture


class ParamSnapshot:
    """Copies of the tapped parameters before an optimiser step (`Capture.snapshot_params`)."""

    def __init__(self, kept: list[tuple[TapKey, nn.Parameter, torch.Tensor]]) -> None:
        self.kept = kept

    def update_norms(self) -> dict[TapKey, torch.Tensor]:
        """||p now - p before|| per parameter tap: 0-d float64 tensors on the parameter's device."""
        first: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # a tied parameter once
        for _, param, old in self.kept:
            first.setdefault(id(param), (param, old))
        now = [p.detach() for p, _ in first.values()]
        olds = [o for _, o in first.values()]
        # one subtraction for all on an accelerator (multi-tensor ops), then the norms batched likewise
        diffs = torch._foreach_sub(now, olds) if now and not now[0].is_cpu else [a - b for a, b in zip(now, olds, strict=True)]
        done = dict(zip(first, value_norms(list(diffs)), strict=True))
        return {key: done[id(param)] for key, param, _ in self.kept}


def _element_hint(tap: Tap, value: object) -> str:
    """For a tuple or dict value: the element taps that reach its tensors (`attn:output.0`, `:output.logits`).

    For None where attention weights are tapped: HF attention returns no weights under SDPA/flash.
    """
    if value is None and "attn" in tap.tap.lower():
        return (" Attention weights are None unless the attention computes them: build the model with "
                "attn_implementation=\"eager\" (in YAML, attn_implementation: eager in the model's config node).")  # fmt: skip
    if isinstance(value, Mapping):
        names = [f"{tap.tap}.{k}" for k, v in value.items() if isinstance(v, torch.Tensor)]
    elif isinstance(value, (tuple, list)):
        names = [f"{tap.tap}.{i}" for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    else:
        return ""
    return f" Tap one of its elements instead: {', '.join(names[:4])}." if names else ""
