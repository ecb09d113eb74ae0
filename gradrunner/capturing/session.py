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
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.elements import get_element, set_element
from gradrunner.capturing.forward_locals import rewrite
from gradrunner.capturing.grad_context import in_backward, no_grad_reason, reentrant_checkpoint, refuse_compiled
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.strategies import Slot, Strategy, get_strategy
from gradrunner.capturing.taps import Tap, TapSpec, resolve_taps
from gradrunner.choices import VALUES_MODES
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import StepRecords, TapKey


class Grads(Mapping[str, "torch.Tensor | None"]):
    """Gradients of the last captured step: `grads[tap]` (call 0), `grads[tap, n]`, `grads.calls(tap)`.

    Example::

        cap.grads["relu1:output"]        # tensor or None (the tap took no part in the loss)
        cap.grads.calls("act:output")    # [call 0's gradient, call 1's, ...]
    """

    def __init__(self, taps: Sequence[str], slots: Sequence[tuple[TapKey, torch.Tensor | None]]) -> None:
        self._calls: dict[str, list[torch.Tensor | None]] = {t: [] for t in taps}
        for key, grad in slots:
            self._calls.setdefault(key.tap, []).append(grad)

    def calls(self, tap: str) -> list[torch.Tensor | None]:
        """Every call's gradient for `tap`, in firing order (empty if the tap never fired)."""
        self._check(tap)
        return list(self._calls[tap])

    def _check(self, tap: str) -> None:
        if tap not in self._calls:
            raise KeyError(f"{tap!r} is not a tap of this capture; taps: {', '.join(self._calls) or 'none'}")

    def __getitem__(self, item: str | tuple[str, int]) -> torch.Tensor | None:
        tap, call = (item, 0) if isinstance(item, str) else item
        self._check(tap)
        calls = self._calls[tap]
        if call >= len(calls):
            if call == 0:
                return None  # the tap never fired (its module was not called)
            raise KeyError(f"tap {tap!r} fired {len(calls)} time(s) in the last step; there is no call {call}")
        return calls[call]

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)


class Capture:
    """A capture session over one model; see `capture()`."""

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
    ) -> None:
        refuse_compiled(model)
        if values not in VALUES_MODES:
            raise GradrunnerError(f"capture.values={values!r} is not a values mode; allowed: {', '.join(VALUES_MODES)}")
        self.model = model
        self.taps: list[Tap] = resolve_taps(model, taps)
        self.strategy = get_strategy(strategy)(self._deliver)
        if wrap_strategy is not None:  # e.g. DDP: parameters from `.grad` after the all-reduce
            self.strategy = wrap_strategy(self.strategy)
        self.strategy_name = strategy
        self.keep_grads = keep_grads
        self.values, self.sample_size, self.seed = values, sample_size, seed
        self.enabled = True
        self.grads = Grads([t.tap for t in self.taps], [])
        self._collector: Collector | None = None if keep_grads else Collector(values, sample_size, seed)
        self._slots: list[Slot] = []
        self._kept: dict[int, torch.Tensor | None] = {}
        self._calls: dict[str, int] = {}
        self._param_slots: dict[int, Slot] = {}
        self._made_leaf_require_grad: list[weakref.ref[torch.Tensor]] = []
        self._stack = contextlib.ExitStack()
        self._last: list[Slot] = []
        self._tap_params: list[tuple[Tap, nn.Parameter]] = []
        #: Grad mode at each (nested) entry into the root's forward: tells no_grad blocks from evaluation.
        self._grad_forward: list[bool] = []
        #: Slots opened in a reentrant checkpoint's no-grad forward, attached when backward recomputes them.
        self._deferred: dict[tuple[int, str], list[Slot]] = {}

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
        self._stack.callback(self._restore_inputs)
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
        self.strategy.install([(p, self._slot_lookup(p)) for _, p in self._tap_params])

    def _slot_lookup(self, param: nn.Parameter) -> Callable[[], Slot | None]:
        """The parameter's slot in the step being captured (None outside `backward`)."""
        return lambda: self._param_slots.get(id(param))

    def _track_grad_mode(self) -> None:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._grad_forward.append(torch.is_grad_enabled())

        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._grad_forward:
                self._grad_forward.pop()

        handle = self.model.register_forward_pre_hook(enter, prepend=True)
        self._stack.callback(handle.remove)
        handle = self.model.register_forward_hook(leave, always_call=True)
        self._stack.callback(handle.remove)

    def _patch_forward(self, module: nn.Module, taps: list[Tap]) -> None:
        by_name: dict[str, list[Tap]] = {}
        for t in taps:
            by_name.setdefault(t.name, []).append(t)

        def tap_fn(name: str, value: object) -> object:
            for tap in by_name[name]:
                value = self._fire(tap, value)
            return value

        fn = rewrite(type(module).forward, by_name, tap_fn)
        had_instance_forward = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        module.forward = types.MethodType(fn, module)

        def restore() -> None:
            if had_instance_forward:
                module.forward = previous  # type: ignore[assignment]
            else:
                module.__dict__.pop("forward", None)

        self._stack.callback(restore)

    def _restore_inputs(self) -> None:
        """Inputs that an input tap made require grad go back as they were, with no .grad left on them."""
        while self._made_leaf_require_grad:
            tensor = self._made_leaf_require_grad.pop()()
            if tensor is not None:
                tensor.requires_grad_(False)
                tensor.grad = None

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

        return hook

    def _input_hook(self, taps: list[Tap]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            changed = False
            for tap in taps:
                path = tap.path or (0,)
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

        return hook

    def _fire(self, tap: Tap, value: object, is_input: bool = False) -> object:
        """A tap fired in the forward pass: open a slot (one call) and let the strategy attach."""
        if not self.enabled:
            return value
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
        reason = no_grad_reason(value, is_input)
        if reason is not None:
            if not tap.from_glob:
                raise GradrunnerError(
                    f"tap {tap.tap!r} cannot carry a gradient: its value is {reason}.{_element_hint(tap, value)} "
                    "Tap a tensor computed from parameters or from an input that requires grad (an input tap on "
                    "the root makes floating-point inputs require grad), or drop the tap."
                )
            slot.reason = reason  # a glob also matched this one: recorded as having no gradient
            return value
        assert isinstance(value, torch.Tensor)
        if not value.requires_grad:  # an input tap on a floating-point leaf: make it get a gradient
            value.requires_grad_(True)
            # weakly: a new input each step must not be kept alive by the session
            self._made_leaf_require_grad = [r for r in self._made_leaf_require_grad if r() is not None]
            self._made_leaf_require_grad.append(weakref.ref(value))
        slot.extra["leaf"] = value.is_leaf
        return self.strategy.attach(value, slot)

    # -- backward pass ---------------------------------------------------------------------------
    def _deliver(self, slot: Slot, grad: torch.Tensor | None) -> None:
        if slot.delivered or grad is None:
            return
        slot.delivered = True
        # A leaf's gradient may become its .grad, which can be changed in place later (zero_grad,
        # accumulation); an intermediate's gradient is handed to us alone.
        leaf = slot.param is not None or slot.extra.get("leaf", False) is True
        if self._collector is not None:
            self._collector.add(slot.key, grad, order=slot.order, mutable=leaf)
        if self.keep_grads:
            self._kept[slot.order] = grad.detach().clone() if leaf else grad.detach()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the strategy's way; every parameter's `.grad` is filled as by `loss.backward()`.

        Example::

            cap.backward(loss_fn(model(x), y))
        """
        if not self.enabled:
            loss.backward(retain_graph=retain_graph)
            return
        slots, self._slots, self._calls = self._slots, [], {}
        for tap, param in self._tap_params:
            slot = Slot(TapKey(tap.module, tap.name, 0), order=len(slots), param=param)
            slots.append(slot)
            self._param_slots[id(param)] = slot
        self._kept = {}
        try:
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.strategy.backward(loss, slots, params, retain_graph)
        finally:
            self._param_slots = {}
            self._deferred = {}
        for slot in slots:
            if not slot.delivered and self._collector is not None:
                self._collector.add(slot.key, None, order=slot.order)
        self._last = slots
        if self.keep_grads:
            self.grads = Grads([t.tap for t in self.taps], [(s.key, self._kept.get(s.order)) for s in slots])
            self._kept = {}

    def records(self, loss: torch.Tensor | None = None) -> StepRecords:
        """Statistics (and values) of the last captured step, in one device-to-host transfer.

        Example::

            recs = cap.records(loss)   # recs.row(0)["norm"], recs.loss
        """
        if self._collector is not None:
            return self._collector.finish(loss)
        collector = Collector(self.values, self.sample_size, self.seed)
        for slot in self._last:
            collector.add(slot.key, self.grads.calls(slot.key.tap)[slot.key.call], order=slot.order)
        return collector.finish(loss)

    def reasons(self) -> dict[TapKey, str]:
        """Why taps of the last step got no gradient, where that was known in the forward pass."""
        return {s.key: s.reason for s in self._last if s.reason is not None}


def capture(
    model: nn.Module,
    taps: Sequence[TapSpec] | TapSpec,
    strategy: str = "hook",
    *,
    values: str = "none",
    sample_size: int = 64,
    seed: int = 0,
    keep_grads: bool = True,
    wrap_strategy: Callable[[Strategy], Strategy] | None = None,
) -> Capture:
    """Tap `model` and capture the gradients flowing through `taps`, the `strategy`'s way.

    Example::

        with capture(model, ["*:output", "fc1:weight"], strategy="retain_grad") as cap:
            cap.backward(loss_fn(model(x), y))
        cap.grads["fc1:output"]

    `strategy` is `retain_grad`, `hook` or `autograd_grad`; all three give the same gradients.
    `keep_grads=False` keeps only statistics (and `values`: `none`, `full` or a fixed `sample`),
    reduced on the gradient's device as it arrives: what the runner uses. Every tap is resolved
    here, before any forward pass: a bad tap raises `GradrunnerError`. `wrap_strategy` wraps the
    strategy (the runner's DDP support delivers parameter gradients after the all-reduce this way).
    """
    return Capture(model, taps, strategy, values=values, sample_size=sample_size, seed=seed, keep_grads=keep_grads,
                   wrap_strategy=wrap_strategy)


def _element_hint(tap: Tap, value: object) -> str:
    """For a tuple or dict value: the element taps that reach its tensors (`attn:output.0`, `:output.logits`)."""
    if isinstance(value, Mapping):
        names = [f"{tap.tap}.{k}" for k, v in value.items() if isinstance(v, torch.Tensor)]
    elif isinstance(value, (tuple, list)):
        names = [f"{tap.tap}.{i}" for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    else:
        return ""
    return f" Tap one of its elements instead: {', '.join(names[:4])}." if names else ""
