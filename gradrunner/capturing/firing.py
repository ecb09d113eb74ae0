"""The forward side of a capture session: taps fire, each firing opens a slot and the strategy attaches.

`Firing` installs the forward hooks (outputs, inputs), rewrites the `forward()` of modules with
local-variable taps, and tracks the root module's forward (grad mode at each entry, calls to forget
when it raises). Each firing of a tap in a forward with gradients is one call: a `Slot` numbered in
firing order, which the session hands to the backward that follows. It tells the session when an
outermost forward of the root begins and what it returned (`Capture._forward_begins`,
`Capture._forward_returned`).

Example::

    firing = Firing(session)
    firing.install(modules, stack)     # hooks removed when `stack` closes
    model(x)                           # firing.slots: one per tap and call
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.elements import bind_input, element_hint, get_element, set_element, tensors_in
from gradrunner.capturing.forward_patch import patch_forward
from gradrunner.capturing.grad_context import (
    NOT_REQUIRING_GRAD,
    TRANSFORMED,
    eager,
    in_backward,
    in_graph,
    input_alias,
    no_grad_reason,
    note_alias_error,
    reentrant_checkpoint,
    refuse_transformed,
)
from gradrunner.capturing.owned import owned
from gradrunner.capturing.pending import CheckpointContexts, Numbered, PendingForwards
from gradrunner.capturing.recorded_norms import record_value_norm
from gradrunner.capturing.strategies import Slot
from gradrunner.capturing.taps import Tap
from gradrunner.capturing.torch_compat import gradient_edge, is_view, version, writes_grad
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import TapKey

if TYPE_CHECKING:
    from gradrunner.capturing.session import Capture


class Firing:
    """The taps' forward hooks and the slots they open, for one session."""

    def __init__(self, session: Capture) -> None:
        self.session = session
        #: Slots opened since the last backward began, in firing order.
        self.slots: list[Slot] = []
        self.calls: dict[str, int] = {}
        self._keys: dict[str, list[TapKey]] = {}  # each tap's record keys by call, made once
        #: Slots opened in a reentrant checkpoint's no-grad forward, attached when backward recomputes them.
        self.deferred: dict[tuple[int, str], list[Slot | None]] = {}
        #: ... in an uncaptured step: the edited calls' numbers (`_fire_uncaptured`).
        self.deferred_calls: dict[tuple[int, str], list[Numbered]] = {}
        #: The checkpoint contexts keyed in those two by `id`, watched so that a freed one's entries go.
        self.contexts = CheckpointContexts(self)
        #: Edited leaves without grad when their tap fired in an uncaptured step, with the call (`edit_late_uncaptured`).
        self.late_uncaptured: list[tuple[Tap, torch.Tensor, int]] = []
        #: The hooks that edit those turned on since (removed as the next forward begins, or on exit).
        self._late_hooks: list[RemovableHandle] = []
        #: Grad mode at each (nested) entry into the root's forward: tells no_grad blocks from evaluation.
        self.grad_forward: list[bool] = []
        #: (slots, calls) as they were when the outermost forward began: restored if it fails.
        self._mark: tuple[int, dict[str, int]] | None = None
        self._late_mark = 0  # `late_uncaptured` as that forward began
        #: The input taps given `input_alias` in that forward: named on its error if it raises (`note_alias_error`).
        self.aliased: list[str] = []
        #: The root forwards those slots are of, dropped once their graph is freed before a backward reached it.
        self.pending = PendingForwards(self)

    def take(self) -> tuple[list[Slot], Collection[str]]:
        """The slots opened so far and the taps they are of, handed to the backward that begins; numbering restarts."""
        self.pending.drop_freed()  # a forward whose graph went cannot be this backward's
        self.pending.clear()
        slots, calls = self.slots, self.calls
        self.slots, self.calls, self._mark = [], {}, None
        for slot in slots:
            if slot.late is not None:
                self.attach_late(slot)
        return slots, [tap for tap, n in calls.items() if n]  # a tap whose calls all went with dropped forwards: none

    def attach_late(self, slot: Slot) -> None:
        """A leaf that did not require grad when its tap fired, turned on in place since by a hook that ran after the
        tap's (transformers' `enable_input_require_grads()` registered after the session opened): its gradient arrives
        at its edge, so the strategy attaches there now, as the backward begins (else the row would say it has none);
        or as its forward's outputs went (`PendingForwards`: a later forward's graph may still reach the leaf)."""
        assert slot.late is not None
        (tap, value), slot.late = slot.late, None
        if not value.requires_grad:
            return
        slot.reason = None
        edits = self.session.edits
        if edits is None or tap.tap not in edits.by_tap:
            self._attach(tap, slot, value, is_input=False)
            return
        # Edited: the forward went on with the leaf itself, no edit node after it to attach behind. A hook on the
        # leaf reads what arrives (the session's one `deliver`, in place of the strategy) and passes the edit on.
        slot.leaf, slot.value_norm = True, record_value_norm(value)
        deliver = self.session.strategy.deliver
        slot.handle = edits.on_late_leaf(tap, value, slot.key.call, slot, lambda grad: deliver(slot, grad))

    def edit_late_uncaptured(self) -> None:
        """An uncaptured backward begins: edit the gradient of each edited leaf a later forward hook turned on
        (`attach_late`'s edit, without a record), as the edit node edits it where the leaf required grad at once."""
        self.pending.drop_freed()
        edits, late, self.late_uncaptured = self.session.edits, self.late_uncaptured, []
        if edits is None:
            return
        for tap, value, call in late:
            if value.requires_grad:
                self._late_hooks.append(edits.on_late_leaf(tap, value, call, None, lambda _grad: None))

    def drop_late_hooks(self) -> None:
        """Remove `edit_late_uncaptured`'s hooks: their backward is over (a new forward began, or the session closes)."""
        hooks, self._late_hooks = self._late_hooks, []
        for h in hooks:
            h.remove()

    def reset(self) -> None:
        """Forget every slot opened since the last backward (their hooks too)."""
        self.session._release(self.slots)  # their tensors and edges too: an edit node's editor holds its slot
        self.slots, self.calls, self.deferred, self._mark = [], {}, {}, None
        self.pending.clear(kept=True)

    # -- installing ------------------------------------------------------------------------------
    def install(self, model: nn.Module, taps: list[Tap], stack: contextlib.ExitStack) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        by_module: dict[str, list[Tap]] = {}
        for tap in taps:
            by_module.setdefault(tap.module, []).append(tap)
        locals_by_instance: dict[int, tuple[nn.Module, list[Tap]]] = {}
        for path, module_taps in by_module.items():
            module = modules[path]
            outputs = [t for t in module_taps if t.kind == "output"]
            inputs = [t for t in module_taps if t.kind == "input"]
            if inputs:
                hook = owned(module, self._input_hook(inputs))  # a copy of the module made meanwhile: not captured
                stack.callback(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
            if outputs:
                hook = owned(module, self._output_hook(outputs))
                stack.callback(module.register_forward_hook(hook, with_kwargs=True).remove)
            # one module object under several paths: one rewrite serves every path's local taps
            entry = locals_by_instance.setdefault(id(module), (module, []))
            entry[1].extend(t for t in module_taps if t.kind == "local")
        for module, local_taps in locals_by_instance.values():
            if local_taps:
                self._patch_forward(module, local_taps, stack)
        # last: the root's `leave` runs after its own output taps fired (their slots exist when it is told)
        self._track_root(model, stack)
        stack.callback(self.drop_late_hooks)
        stack.callback(lambda: self.late_uncaptured.clear())

    def _track_root(self, model: nn.Module, stack: contextlib.ExitStack) -> None:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            # the first, no-grad pass of a reentrant checkpoint the root runs in (a layer checkpointed by its parent),
            # called with grad on an input that requires grad, is a forward with gradients: its taps are captured as
            # backward recomputes them (`_fire_without_grad`); called under no_grad it is an evaluation
            grad = torch.is_grad_enabled() or in_graph(reentrant_checkpoint("forward"))
            if not self.grad_forward:
                if grad:  # an evaluation forward between two backwards leaves the graph held
                    self.session._forward_begins()
                    self.drop_late_hooks()
                    if not in_backward():
                        self.pending.drop_freed()  # forwards before it whose graph went: no backward will use them
                self._mark, self._late_mark = (len(self.slots), dict(self.calls)), len(self.late_uncaptured)
                self.aliased = []
            self.grad_forward.append(grad)

        def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.grad_forward:
                self.grad_forward.pop()
            if self.grad_forward:
                return
            # Called with output None from inside torch's `except` when the forward raised: forget the
            # calls it opened, so a retry of the step has no phantom calls.
            if output is None and sys.exc_info()[1] is not None:
                note_alias_error(sys.exc_info()[1], self.aliased)
                if self._mark is not None:
                    self.session._release(self.slots[self._mark[0] :])
                    del self.slots[self._mark[0] :]
                    self.calls = self._mark[1]
                self.deferred, self.deferred_calls = {}, {}
                return
            nodes = self.session._forward_returned(output)
            if nodes and self._mark is not None:
                start, calls = self._mark
                late = self.late_uncaptured[self._late_mark :]
                # an input returned unchanged (`inputs_embeds` among the hidden states): its node is the caller's
                given = {id(t.grad_fn) for t in tensors_in((args, kwargs), depth=3) if t.grad_fn is not None}
                made = [n for n in nodes if id(n) not in given]
                self.pending.watch(made, self.slots[start:], late, calls, dict(self.calls))

        stack.callback(model.register_forward_pre_hook(owned(model, eager(enter)), prepend=True).remove)
        hook = owned(model, eager(leave))
        stack.callback(model.register_forward_hook(hook, with_kwargs=True, always_call=True).remove)

    def _patch_forward(self, module: nn.Module, taps: list[Tap], stack: contextlib.ExitStack) -> None:
        by_name: dict[str, list[Tap]] = {}
        for t in taps:
            by_name.setdefault(t.variable, []).append(t)

        def tap_fn(name: str, value: object) -> object:
            for tap in by_name[name]:
                value = self.fire(tap, value)
            return value

        # what is actually called (an instance-level forward kept), restored exactly on exit
        stack.callback(patch_forward(module, by_name, eager(tap_fn)))

    def _output_hook(self, taps: list[Tap]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            changed = False
            for tap in taps:
                element = get_element(output, tap.path, tap.tap, tap.from_glob) if tap.path else output
                new = self.fire(tap, element)
                if new is not element:
                    output, changed = set_element(output, tap.path, new), True
            return output if changed else None

        return eager(hook)

    def _input_hook(self, taps: list[Tap]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            changed = False
            for tap in taps:
                path = bind_input(module, tap.path or (0,), args, kwargs)
                source: Any = args if isinstance(path[0], int) else kwargs
                element = get_element(source, path, tap.tap, tap.from_glob)
                new = self.fire(tap, element, is_input=True)
                if new is not element:
                    changed = True
                    if self._aliased(tap, element, new):  # the same data tensor in every slot holding it
                        args = tuple(new if a is element else a for a in args)
                        kwargs = {k: new if v is element else v for k, v in kwargs.items()}
                    if isinstance(path[0], int):
                        args = set_element(args, path, new)
                    else:
                        kwargs = set_element(kwargs, path, new)
            return (args, kwargs) if changed else None

        return eager(hook)

    def _aliased(self, tap: Tap, element: object, new: object) -> bool:
        """Whether `new` is the stand-in `_attach` made for an input that did not require grad (an unedited tap).

        The module gets it wherever it gets that tensor: self-attention's `self_attn(x, x, x)` keeps `query is
        key is value` (PyTorch's packed in-projection and fast path: the same numbers as without capture) and
        the tap records d loss / d x, as on a layer whose input already requires grad.
        """
        edits = self.session.edits
        return (isinstance(element, torch.Tensor) and isinstance(new, torch.Tensor) and not element.requires_grad
                and (edits is None or tap.tap not in edits.by_tap))  # fmt: skip

    # -- a tap fires ------------------------------------------------------------------------------
    def fire(self, tap: Tap, value: object, is_input: bool = False) -> object:
        """A tap fired in the forward pass: open a slot (one call) and let the strategy attach."""
        session = self.session
        if session._closed:  # a rewritten forward chosen before the session closed (in a pre-hook of its call)
            return value
        if not session.enabled:
            edits = session.edits
            return value if edits is None or tap.tap not in edits.by_tap else self._fire_uncaptured(tap, value)
        if in_backward():
            return self._fire_recomputed(tap, value, is_input)
        if not torch.is_grad_enabled():
            return self._fire_without_grad(tap, value)
        return self._attach(tap, self._open_slot(tap), value, is_input, outside=not self.grad_forward)

    def _count(self, name: str) -> int:
        """The call number of this firing of tap `name` (from 0 since the last backward began)."""
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        return call

    def _open_slot(self, tap: Tap) -> Slot:
        keys = self._keys.get(tap.tap)  # the same (immutable) key for the same call every step: less for the GC
        call = self._count(tap.tap)
        key = keys[call] if keys is not None and call < len(keys) else self.key(TapKey(tap.module, tap.name, 0), call)
        slot = Slot(key, len(self.slots))
        self.slots.append(slot)
        return slot

    def key(self, key: TapKey, call: int) -> TapKey:
        """The record key of call `call` of `key`'s tap (one object per tap and call, made once)."""
        keys = self._keys.setdefault(key.tap, [])
        while len(keys) <= call:
            keys.append(TapKey(key.module, key.name, len(keys)))
        return keys[call]

    def _fire_uncaptured(self, tap: Tap, value: object) -> object:
        """An edited tap fired in an uncaptured step: no slot, the edit with the call a captured step numbers it.

        The calls are counted as `fire` counts them (a no_grad block's, a frozen value's included; an evaluation's
        not); a call in a reentrant checkpoint's first pass, counted in its forward place, is edited when backward
        recomputes it. So `dropout` and `noise_std` draw what a captured step draws (`call` in their seed).
        """
        edits = self.session.edits
        assert edits is not None
        if in_backward():
            ctx = reentrant_checkpoint("backward") if torch.is_grad_enabled() else None
            waiting = self.deferred_calls.get((id(ctx), tap.tap)) if ctx is not None else None
            # none waiting: a non-reentrant checkpoint's recomputation, edited in the forward already
            return edits.on_fire(tap, value, waiting.pop(0)) if waiting else value
        if torch.is_grad_enabled():
            call = self._count(tap.tap)
            if isinstance(value, torch.Tensor) and value.is_leaf and not value.requires_grad:
                self.late_uncaptured.append((tap, value, call))  # a later forward hook may turn it on in place
            out = edits.on_fire(tap, value, self.pending.number(tap.tap, call))
            return out if self.grad_forward else self.pending.watch_call(out, tap.tap, call, [])  # as a captured step
        if self.grad_forward and self.grad_forward[-1]:  # a no_grad block inside a forward with grad: no gradient
            call = self._count(tap.tap)
            ctx = reentrant_checkpoint("forward")
            if ctx is not None:
                self.deferred_calls.setdefault(self.contexts.key(ctx, tap.tap), []).append(
                    self.pending.number(tap.tap, call)
                )
        return value

    def _fire_without_grad(self, tap: Tap, value: object) -> object:
        """Gradients are off: an evaluation pass, a reentrant checkpoint's first forward, or a no_grad block."""
        if not self.grad_forward or not self.grad_forward[-1]:
            return value  # evaluation (the model was called under no_grad), or a submodule called on its own
        ctx = reentrant_checkpoint("forward")
        if ctx is not None:
            # checkpoint(use_reentrant=True) runs this part under no_grad now and again, with grad,
            # inside backward: this call is captured then, counted once, in its forward place. A value made
            # with grad outside the block (its input) is tapped now, whole: the recomputation sees a detached
            # copy that gets only the block's part of the gradient (None keeps the recomputed calls in step).
            waiting = self.deferred.setdefault(self.contexts.key(ctx, tap.tap), [])
            edits = self.session.edits
            # an edit acts inside the block: on its recomputation
            edited = edits is not None and tap.tap in edits.by_tap
            if edited or not (isinstance(value, torch.Tensor) and value.requires_grad):
                self.session.strategy.fires_recomputed(tap.tap)
                waiting.append(self._open_slot(tap))
                return value
            waiting.append(None)
        return self._attach(tap, self._open_slot(tap), value, False)  # in a no_grad block: no gradient

    def _fire_recomputed(self, tap: Tap, value: object, is_input: bool) -> object:
        """A tap fired while backward recomputes checkpointed activations."""
        ctx = reentrant_checkpoint("backward") if self.deferred and torch.is_grad_enabled() else None
        waiting = self.deferred.get((id(ctx), tap.tap)) if ctx is not None else None
        if not waiting:
            return value  # use_reentrant=False: this call was captured in the forward pass already
        slot = waiting.pop(0)
        if slot is None:
            return value
        # the backward reached the checkpoint: seen here when no hook of the session ran before it in that backward
        # (the root's forward ran inside the checkpoint: its output, a checkpoint's input, is no tensor of the root's)
        self.session._seen(recomputing=True)
        return self._attach(tap, slot, value, is_input)

    def _attach(self, tap: Tap, slot: Slot, value: object, is_input: bool, outside: bool = False) -> object:
        """The strategy attaches to `value` in `slot` (or the slot says why it cannot carry a gradient).

        `outside`: no forward of the root module runs (`model[:3](x)`, submodules called on their own).
        """
        edits = self.session.edits
        tensor = value if isinstance(value, torch.Tensor) else None
        if tensor is not None and refuse_transformed(tap, tensor):
            slot.reason = TRANSFORMED
            return value
        # only floating-point and complex tensors can require grad: the usual case needs no further look
        why = None if tensor is not None and tensor.requires_grad else no_grad_reason(value, is_input)
        if why is not None:
            frozen = self._frozen_for_now(why[0])  # this call only: the edit does nothing in it, the row says why
            if edits is not None and not frozen:
                edits.refuse(tap, why[1])
            if not tap.from_glob and not frozen:
                raise GradrunnerError(
                    f"tap {tap.tap!r} cannot carry a gradient: its value is {why[1]}.{element_hint(tap, value)} "
                    "Tap a tensor computed from parameters or from an input that requires grad (an input tap on "
                    "the root makes floating-point inputs require grad), or drop the tap."
                )
            hint = element_hint(tap, value).strip().rstrip(".")  # a tuple/dict: which element taps exist
            slot.reason = f"{why[0]}; {hint[0].lower()}{hint[1:]}" if hint else why[0]  # from a glob: no gradient
            if tensor is not None and tensor.is_leaf and why[0] == NOT_REQUIRING_GRAD:
                slot.late = (tap, tensor)  # a later hook may still make it require grad: `take` looks again
            return value
        assert isinstance(value, torch.Tensor)
        if is_input and not value.is_leaf and tap.module == "" and len(self.grad_forward) == 1:
            # The caller's own tensor: tap an alias, so nothing (retains_grad, hooks) stays on theirs.
            value = value.view_as(value)
        if not value.requires_grad:
            # An input tap on a floating-point leaf: the model gets an alias that requires grad and shares
            # the storage (writes, `x.sub_(mean)` included, reach the caller's tensor as without capture);
            # the caller's tensor itself is left as it is.
            value = input_alias(value)
            self.aliased.append(tap.tap)
        slot.leaf, slot.written = value.is_leaf, writes_grad(value.grad_fn)
        if is_view(value):
            slot.view, slot.version = value, version(value)
        slot.value_norm = record_value_norm(value)  # on the device, no sync: it goes to the host with the step
        if edits is not None:  # the strategy reads the gradient that arrives, the edit acts upstream of it
            value = edits.on_fire(tap, value, slot.key.call, slot)
        if outside:
            return self._attach_outside_root(value, slot)
        return self.session.strategy.attach(value, slot)

    def _attach_outside_root(self, value: torch.Tensor, slot: Slot) -> torch.Tensor:
        """Attach where no root forward runs: no pre-hook on the root's output will see a backward through `value`.

        A pre-hook on the value's own gradient edge sees it begin instead, registered before the strategy's
        hooks there, as the root output's pre-hook runs before any tap's: `retain_grad` then reads this
        backward's gradient (not a `.grad` it took for one set before the backward), `autograd_grad` refuses
        a backward it did not run, and the slots go to the backward that reaches them, not to a later one.
        """
        session = self.session
        session._finish_pending()  # a backward of the user's not yet ended (no engine callbacks): before this forward
        node = gradient_edge(value)[0]
        seen = session._seen
        slot.seen = node.register_prehook(lambda _g: seen())
        out = session.strategy.attach(value, slot)
        session.strategy.seen_at([slot], [node])  # `retain_grad`: its `.grad` is filled before this node's pre-hooks
        self.pending.watch_call(value, slot.key.tap, slot.key.call, [slot])
        return out

    def _frozen_for_now(self, reason: str) -> bool:
        """Whether a value that does not require grad may be so because parameters are frozen for now (a fine-tuning
        schedule's frozen backbone, a GAN step's other network): then it is a row without gradient, not an error."""
        return reason == NOT_REQUIRING_GRAD and any(not p.requires_grad for p in self.session.model.parameters())
