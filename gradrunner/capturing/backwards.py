"""The backward side of a capture session: each backward's begin and end, and the step's records.

A backward begins when the session runs one (`Capture.backward`) or when the first of its hooks fires inside one it did
not run (`Backwards._seen`: the user's or a framework's `loss.backward()`; a pre-hook on the root module's outputs,
registered as each forward returns, or on a tapped value's edge where no root forward ran, `Firing`, fires first
whenever the backward reaches the model; a root run inside a reentrant checkpoint: its first recomputed tap). It ends
when the session's own call returns, or by a callback queued on autograd's engine from that first hook
(`torch_compat.at_backward_end`: after the whole graph ran, and after DDP's finalize); without callbacks, lazily, at
the next `records()`, forward or `cap.backward`. Between the two, the strategy reads the tapped gradients (`_deliver`,
once per slot).

The step's records are one `Collector`: each backward adds its slots' rows (`micro_step` = its number in the step), the
parameter taps add one row each for the whole step (`_settle_params`), and `_finish_step` makes the one host transfer.
A closure evaluated again inside one `optimizer.step()` (`Capture._note_end`: LBFGS) starts the step again: the rows of
the backwards before it are dropped. Row numbers (`order`) put each backward's rows after the previous backward's, and
in a backward: fired slots in firing order, the parameters, then the taps that did not fire.

Example::

    class Capture(Backwards): ...      # the session supplies the forward side and the parameters
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.dtensors import is_dtensor, like
from gradrunner.capturing.elements import tensors_in
from gradrunner.capturing.grad_context import CHANGED_IN_PLACE, GRAPH_FREED, NO_PART, NOT_CALLED, not_assigned
from gradrunner.capturing.open_sessions import refuse_inside_engine_call
from gradrunner.capturing.params import ddp_world_size
from gradrunner.capturing.pending import holds, through_older
from gradrunner.capturing.per_example_check import settle_rows
from gradrunner.capturing.recorded_norms import record_norm
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.strategies import Slot
from gradrunner.capturing.strategies.autograd_grad import OWN_BACKWARD_ONLY
from gradrunner.capturing.torch_compat import at_backward_end, fills_grad, in_backward, reentrant_checkpoint, version
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import StepRecords, TapKey

if TYPE_CHECKING:
    from gradrunner.capturing.session import Capture
    from gradrunner.capturing.taps import Tap


def unscaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`grad` times `scale` (0-d, e.g. 1/loss scale), on the gradient's device without a host sync.

    Example::

        unscaled(g, scaler.scale(torch.ones(())).reciprocal())   # the true gradient under fp16 loss scaling

    In float32 at least (statistics are float32 anyway): a float16 gradient divided by the scale could
    underflow. A new tensor: the caller's gradient is untouched.
    """
    if is_dtensor(grad):  # a sharded gradient: its piece, still placed as it was
        return like(grad, unscaled(grad.to_local(), scale))  # type: ignore[attr-defined]
    wide = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    return wide * scale.to(device=grad.device, dtype=wide.dtype)


@dataclass(eq=False)
class _Pass:
    """One backward as the session sees it."""

    #: fired slots (firing order), then a slot per tap that did not fire; empty when not captured
    slots: list[Slot]
    base: int = 0  # the first row number of this backward's records
    fired: int = 0  # how many of `slots` fired
    captured: bool = False
    explicit: bool = False  # run by `Capture.backward` (its end is known)
    retain_graph: bool = False
    armed: bool = False  # its end callback is queued (or cannot be)
    older: int = 0  # the last backward's fired slots in front of `slots` (retain_graph), a forward held since: `_read`
    edited: dict[TapKey, torch.Tensor] = field(default_factory=dict)


class Backwards:
    """Begin and end of each backward, and the step's records (the `Capture` session's backward side)."""

    def __init__(self: Capture, collector: Collector) -> None:  # type: ignore[misc]
        self._collector = collector
        self._pass: _Pass | None = None
        self._closed, self._raised = True, False  # raised: its last block ended by an exception (`Capture._install`)
        #: The last backward's slots (reasons), and those kept for another backward through the same forward.
        self._last: list[Slot] = []
        self._retained: list[Slot] | None = None
        self._forward_since_backward = False
        #: How many backwards ran since the last forward: 0 for the first (a GAN step's second loss: 1).
        self.backward_index = -1
        #: A 0-d tensor every captured gradient is multiplied by (1/loss scale), taken as each backward begins.
        self.grad_scale: torch.Tensor | None = None
        self._kept: dict[int, torch.Tensor] = {}
        self._root_hooks: list[RemovableHandle] = []
        self._tap_names: list[tuple[Tap, str]] | None = None  # the taps that fire (not parameters), and their names
        # the step in progress: its backwards, the one it started again at (`Capture._note_end`), the next row's number
        self._backwards_in_step = self._restart_at = self._next_order = 0
        #: where the parameter rows go, and those added (the tap's index -> its row's order)
        self._param_rows: tuple[int, dict[int, int]] | None = None
        self._edited: dict[int, torch.Tensor] = {}
        #: Gradient accumulation is configured (the runner's `train.accumulate`, the Trainer's, Lightning's): every
        #: step numbers its backwards in `micro_step`, a last window of one micro-batch too; else only a step of several.
        self.accumulating = False
        #: Called at the end of every backward, with whether it was captured (the step engine's update norms).
        self.backward_ended: Callable[[bool], None] | None = None
        #: Per-example norms of parameters: why each None is (this step), and the taps already named in a warning.
        self._pex_reasons: dict[str, str | None] = {}
        self._pex_warned: set[str] = set()

    # -- a backward is seen ---------------------------------------------------------------------------
    def _seen(self: Capture, recomputing: bool = False) -> None:  # type: ignore[misc]
        """Called first by every session hook firing inside a backward (`recomputing`: a reentrant checkpoint's)."""
        p = self._pass
        if p is None:
            if self._closed:
                return
            if torch.is_grad_enabled() and fills_grad(self._all_params()) is False:
                self._firing.pending.pin()  # its graph may hold the forwards' inner nodes: none of them is dropped
                return  # the user's torch.autograd.grad(..., create_graph=True): part of a loss, not its backward
            refuse_inside_engine_call(self)  # another session's autograd_grad call, run through this model
            if self.strategy.owns_backward:
                self._forget_forward()  # that backward fails, and frees the graph those calls were in
                raise GradrunnerError(OWN_BACKWARD_ONLY)
            self._check_unchanged()  # a tap replaced since the forward, as `Capture.backward` refuses it
            p = self._begin(explicit=False, retain_graph=False)
        # a callback queued in a reentrant checkpoint's inner backward runs as that ends: wait for the outer backward
        if not p.armed and in_backward() and (recomputing or reentrant_checkpoint("backward") is None):
            p.armed = True

            def ended() -> None:
                if self._pass is p:
                    self._end()

            at_backward_end(ended)

    def _finish_pending(self: Capture) -> None:  # type: ignore[misc]
        """End a backward the session did not run whose end it was not told (no engine callbacks)."""
        if self._pass is not None and not self._pass.explicit and not in_backward():
            self._end()

    def _forward_begins(self: Capture) -> None:  # type: ignore[misc]
        """The root module's outermost forward begins."""
        if in_backward():
            return
        self._finish_pending()
        self._check_unchanged(forward=True)  # before anything of this step runs
        self._forward_since_backward = True
        if self._retained is not None:  # a new forward: the user's references alone hold the last one's graph now
            self._firing.pending.let_go(self._retained)  # (its slots, if no forward since is kept: `_begin`)
        self._params.check()

    def _forward_returned(self: Capture, output: Any) -> list[Any]:  # type: ignore[misc]
        """The root module's outermost forward returned `output`: a backward will be seen first at the nodes returned."""
        return [] if not torch.is_grad_enabled() or in_backward() or self._closed else self.before_backward(output)

    def before_backward(self: Capture, output: Any) -> list[Any]:  # type: ignore[misc]
        """A backward through `output` (a loss, a model's output's tensors) may come: see it begin there (the nodes returned).

        Example::

            cap.before_backward(loss)     # Lightning's on_before_backward: the loss its backward starts from

        The session does this itself for the root module's output; a framework whose loop never calls the
        root module (Lightning calls submodules in `training_step`) says where the backward starts.
        """
        if len(self._root_hooks) > 16:  # hooks on the outputs of long-gone forwards
            self._drop_root_hooks(keep=8)
        seen = self._seen
        nodes = []
        for t in tensors_in(output):
            if t.grad_fn is not None:
                self._root_hooks.append(t.grad_fn.register_prehook(lambda _g: seen()))
                nodes.append(t.grad_fn)
        if nodes and self._firing.slots:
            self.strategy.seen_at(self._firing.slots, nodes)
        return nodes

    def finish_backward(self: Capture) -> None:  # type: ignore[misc]
        """A backward the session did not run has returned: end it now if its end was not seen yet.

        Example::

            loss.backward(); cap.finish_backward()    # Lightning's on_after_backward

        Without autograd's end-of-backward callbacks the session would otherwise end it at its next
        `records()`, forward or `backward()`.
        """
        self._finish_pending()

    def _drop_root_hooks(self: Capture, keep: int = 0) -> None:  # type: ignore[misc]
        dropped = self._root_hooks[: len(self._root_hooks) - keep] if keep else self._root_hooks
        for h in dropped:
            h.remove()
        self._root_hooks = self._root_hooks[len(dropped) :]

    # -- begin and end -------------------------------------------------------------------------------
    def _begin(self: Capture, explicit: bool, retain_graph: bool) -> _Pass:  # type: ignore[misc]
        self._note_begin()
        self._params.note_backward(explicit or fills_grad(self._all_params()) is not False)
        if self.edits is not None:
            self.edits.begin_backward()
        # the last forward again (retain_graph): no forward since, or none kept (`none_since`; `model[:2](x)` too)
        dropped = self._retained is not None and self._firing.pending.none_since()
        again = not (self._forward_since_backward and not dropped) and not self._firing.slots
        self.backward_index = self.backward_index + 1 if again else 0
        self._forward_since_backward = False
        if not self.enabled:
            self._firing.edit_late_uncaptured()
            self._forget_forward()
            self._pass = _Pass([], explicit=explicit, retain_graph=retain_graph, armed=explicit)
            return self._pass
        retained, self._retained, older = self._retained, None, 0
        fresh = not (again and retained is not None)
        if again and retained is not None:  # no forward since: this backward, through the same taps
            forward = retained
            for slot in forward:
                slot.delivered = False
            fired: Collection[str] = {s.key.tap for s in forward}
        else:
            forward, fired = self._forward_slots()
            # a forward since, held: this backward may run through either graph, where the older one's nodes live
            live = [s for s in retained if holds(s)] if retained is not None and forward else []
            for slot in live:
                slot.delivered = False
            forward, older = [*live, *forward], len(live)
            self._release([s for s in retained or () if s not in live])
        if self.loss_scale is not None:  # else `grad_scale` stays as the caller set it (None by default)
            scale = self.loss_scale()
            self.grad_scale = None if scale is None else torch.as_tensor(scale).detach().double().reciprocal()
        if self._tap_names is None:
            self._tap_names = [(t, t.tap) for t in self.taps if t.kind != "param"]
        unfired = [Slot(TapKey(t.module, t.name, 0), 0, reason=GRAPH_FREED if again else not_assigned(self.model, t.module)
                        if t.kind == "local" else NOT_CALLED, fired=False)
                   for t, name in self._tap_names if name not in fired]  # fmt: skip
        base = self._next_order
        params = len(self._params.taps)
        self._next_order += len(forward) + params + len(unfired)
        if base or not fresh or older:  # fresh slots are numbered from 0 in firing order already
            for i, slot in enumerate(forward):
                slot.order = base + i
        for i, slot in enumerate(unfired):
            slot.order = base + len(forward) + params + i
        if self._params:
            self._params.check()
            self._params.begin_backward()
        self.strategy.before_backward(forward)
        self._kept = {}
        self._pass = _Pass([*forward, *unfired], base, len(forward), True, explicit, retain_graph, explicit, older=older)
        return self._pass

    def _end(self: Capture) -> None:  # type: ignore[misc]
        p = self._pass
        assert p is not None
        try:
            self._read(p, self._note_end())
        finally:
            self._pass = None
        if self.backward_ended is not None:
            self.backward_ended(p.captured)

    def _read(self: Capture, p: _Pass, restart: bool) -> None:  # type: ignore[misc]
        """The end of backward `p`: its gradients into the step's records (`restart`: in place of the step's so far)."""
        replacing = self._params.replacing()  # parameters reset before it: their gradient of the step is this one
        arrived = self.edits.end_backward(replacing) if self.edits is not None else {}
        self._forget_deferred()  # its recomputations are done (an uncaptured backward's too)
        if not p.captured:
            return
        self.strategy.after_backward(p.slots)
        fired = p.slots[: p.fired]
        if p.older:  # which forward's backward it was shows in what arrived
            p.slots, fired, gone, moved = through_older(p.slots, p.older, p.fired, self._firing.key)
            self._release(gone)
            self._collector.rekey(moved)
        parts = self._params.end_backward()
        if replacing and self._pex is not None:
            self._pex.drop(replacing)
        micro = self._backwards_in_step
        for slot in p.slots:
            if not slot.delivered:
                if slot.view is not None and version(slot.view) != slot.version:
                    slot.reason = slot.reason or CHANGED_IN_PLACE
                slot.reason = slot.reason or NO_PART
                self._collector.add(slot.key, None, order=slot.order, value_norm=slot.value_norm, micro=micro,
                                    reason=slot.reason)  # fmt: skip
        if self.edits is not None:
            orders = {s.order for s in p.slots}
            self._edited.update((o, n) for o, n in self.edits.norms.items() if o in orders)
            self.edits.last_arrived = arrived
        self._collector.flush()  # the backward's small gradients, reduced together; let go of them
        if restart and self._backwards_in_step:  # the backwards before it are in no `.grad` (`Capture._note_end`)
            kept = set(self._param_rows[1].values()) if self._param_rows is not None else set()  # DDP's, read
            self._collector.discard(set(range(p.base)) - kept)
            self._restart_at = self._backwards_in_step
        self._backwards_in_step += 1
        self._param_rows = (p.base + p.fired, {} if self._param_rows is None else self._param_rows[1])
        if self._params.synced_now:  # DDP: `.grad` as this backward left it, reduced before anything changes it
            self._settle_params()
        if self.keep_grads:
            self._kept_grads(p.slots, parts)
        self._last = p.slots
        if p.explicit and not p.retain_graph:  # the graph it ran through is freed: let go of what holds it
            kept = {id(s) for s in fired if not s.delivered}  # one it did not reach is not (`D(fake.detach())`'s G)
            self._release([s for s in p.slots if id(s) not in kept])
            self._retained = [s for s in fired if id(s) in kept] or None
        else:
            self._retained = fired  # a second backward through this forward may come

    def _abort(self: Capture) -> None:  # type: ignore[misc]
        """The session's own backward raised (or an entry found a step left by one before): none of it is recorded."""
        p, self._pass = self._pass, None
        if p is not None:
            self._release(p.slots)
        self._forget_deferred()
        if self.edits is not None:  # its draws and calls end with it (the step's, dropped below)
            self.edits.end_backward()
        self._params.abort_backward()
        self._params.forget()
        self._collector = Collector(self.values, self.sample_size, self.seed, per_example=self.per_example,
                                    histogram=self.histogram)  # fmt: skip
        self._new_step()

    def _release(self: Capture, slots: list[Slot]) -> None:  # type: ignore[misc]
        self.strategy.forget(slots)
        for slot in slots:
            slot.tensor, slot.edge, slot.view, slot.parts = None, None, None, None

    # -- gradients arriving ------------------------------------------------------------------------------
    def _deliver(self: Capture, slot: Slot, grad: torch.Tensor | None) -> torch.Tensor | None:  # type: ignore[misc]
        """Every tapped gradient passes through here, once per slot and backward, whatever the strategy.

        `grad` is the gradient flowing into the tapped value as autograd delivers it to the tensor's
        `.grad` (after the model's own hooks on that tensor).
        """
        p = self._pass
        if p is None or not p.armed:
            self._seen()
            p = self._pass
        if slot.delivered or grad is None or p is None or not p.captured:
            return None
        slot.delivered = True
        if is_dtensor(grad):  # an activation's under tensor parallel
            from gradrunner.capturing.sharded import mergeable  # DTensor's machinery: only where one is

            grad = mergeable(grad)
        if self.grad_scale is not None:
            grad = unscaled(grad, self.grad_scale)
        # A complex gradient's statistics are those of its magnitude |z| (README); `mutable`: may change in place later.
        self._collector.add(slot.key, grad.abs() if grad.is_complex() else grad, order=slot.order, mutable=slot.mutable,
                            value_norm=slot.value_norm, settled=not in_backward(), micro=self._backwards_in_step)  # fmt: skip
        if self.keep_grads:
            self._keep(slot, grad)
        return None

    def _deliver_all(self: Capture, slots: Sequence[Slot], grads: Sequence[torch.Tensor | None]) -> None:  # type: ignore[misc]
        """`_deliver` for each pair, handed over together (the session's own engine call returned them): the backward
        is checked once, and a plain tensor's gradient (no loss scale, none kept, not complex) goes straight on."""
        p = self._pass
        plain = p is not None and p.armed and p.captured and self.grad_scale is None and not self.keep_grads
        add, micro, settled = self._collector.add, self._backwards_in_step, not in_backward()
        for slot, grad in zip(slots, grads, strict=True):
            if not plain or slot.delivered or type(grad) is not torch.Tensor or grad.is_complex():
                self._deliver(slot, grad)  # None, a DTensor's, a complex one: one by one
            else:
                slot.delivered = True
                add(slot.key, grad, slot.order, slot.mutable, value_norm=slot.value_norm, settled=settled, micro=micro)

    def _settle_params(self: Capture) -> None:  # type: ignore[misc]
        """The parameter taps' rows of the step (placed in its last backward), reduced once, on their device."""
        if self._param_rows is None or not self._params or self._params.done:
            return
        at, added = self._param_rows
        again = self._params.read_now  # DDP: a later synchronised backward replaces the rows of what it read again
        if again is None:
            self._collector.discard(set(added.values()))
            added = {}
        rows = self._per_example_params()
        for i, key, param, grad, reason in self._params.rows():
            if again is not None:
                if id(param) not in again:
                    continue  # no gradient in this backward: the row an earlier one read stands (`.grad` may be reset)
                self._collector.discard({added.pop(i)} if i in added else set())
            order = at + i
            before = self.edits.step_arrived(param) if self.edits is not None else None
            if before is not None:  # edited: its record is what arrived, `edited_norm` the gradient after the edit
                if grad is not None:
                    self._edited[order] = record_norm(grad)
                grad = before
            if grad is not None and self.grad_scale is not None:
                grad = unscaled(grad, self.grad_scale)
            if grad is not None and grad.is_complex():
                grad = grad.abs()
            self._collector.add(key, grad, order=order, mutable=self._params.synced is not None, batched=False,
                                value_norm=self._params.value_norm(param), settled=True, reason=reason,
                                per_example=None if grad is None else rows.get(key.tap))  # fmt: skip
            added[i] = order
        self._param_rows = (at, added)

    def _per_example_params(self: Capture) -> dict[str, torch.Tensor | None]:  # type: ignore[misc]
        """Each parameter tap's per-example norms so far, on the device, in true units (`PerExampleNorms`).

        Under a GradScaler times 1/scale, as every captured gradient; under DDP divided by the world
        size: each rank's rows are then their shares of the averaged `.grad` the record holds.
        """
        if self._pex is None:
            return {}
        scale = self.grad_scale
        if self._params.synced is not None and ddp_world_size() > 1:
            scale = torch.tensor(1.0 / ddp_world_size(), dtype=torch.float64) * (1.0 if scale is None else scale)
        norms, self._pex_reasons = self._pex.device_norms(scale=scale)
        return norms

    def _finish_step(self: Capture, loss: torch.Tensor | None, updates: Mapping[TapKey, torch.Tensor]) -> StepRecords:  # type: ignore[misc]
        edited = self._edited
        if edited and self.grad_scale is not None:  # fp16 loss scaling: after the edit, in true units too
            edited = {k: v * self.grad_scale.to(device=v.device, dtype=v.dtype) for k, v in edited.items()}
        numbered = self.accumulating or self._backwards_in_step - self._restart_at > 1
        recs = self._collector.finish(loss, updates, edited, micro_steps=numbered)
        if not numbered:
            recs.micro_step = None
        elif self._restart_at and recs.micro_step is not None:  # numbered from the backward the step restarted at
            recs.micro_step = [None if m is None else m - self._restart_at for m in recs.micro_step]
        if recs.reason is None:
            recs.reason = [None] * len(recs)
        if self._pex is not None:  # a failed check's or overflowed rows become None, each left None named once
            settle_rows(recs, set(self._params.keys), self._pex_reasons, self._pex_warned)
        self._new_step()
        return recs

    def _new_step(self: Capture) -> None:  # type: ignore[misc]
        self._backwards_in_step, self._restart_at, self._next_order, self._param_rows, self._edited = 0, 0, 0, None, {}
        if self._pex is not None:
            self._pex.end_step()
        self._params.forget()
        if self.edits is not None:
            self.edits.forget_step()
