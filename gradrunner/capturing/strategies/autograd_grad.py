"""`autograd_grad`: one `torch.autograd.grad(loss, [taps..., params...])` call per backward.

The one strategy with an engine call of its own (`owns_backward`): the session runs it from
`cap.backward(loss)`, and refuses a `loss.backward()` it did not run. Taps are held as gradient edges
taken when they fire (`torch_compat.gradient_edge`), so a later in-place op on the tensor does not
change which value's gradient is returned. Where the tapped tensor has hooks of its own, autograd may
capture its edge before they ran (when the edge's node also leads to a parameter): that tap is read
as its node receives the gradient, after those hooks (`torch_compat.watch_edge`), the gradient the
other strategies see. `autograd.grad` does not touch `.grad`, so each parameter's gradient is
accumulated through its own held accumulator (`torch_compat.accumulate`), exactly as
`loss.backward()` does, post-accumulate-grad hooks included (optimizer-in-backward); so is every other
leaf of the loss's graph that `loss.backward()` would fill (an input made with `requires_grad=True`,
another model's parameters, a learnable scalar of the loss), found by a walk of the graph
(`ParamBackward.edges`). Hooks registered on an accumulator node itself do not fire (README). Where that
cannot be done (no callable accumulator, or DDP and FSDP2, whose hooks must see the parameters' backward,
once), the one engine call is `loss.backward()`, each tap read as its held edge's node receives the
gradient (`watch_edge`, after the tensor's own hooks). A tap inside `checkpoint(..., use_reentrant=True)` is
refused when it fires (`fires_recomputed`): `autograd.grad` cannot run that block's backward, and its tensor
is made only inside the backward, after the edges to read were chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import FEATURES, grad_of, gradient_edge, has_own_hooks, watch_edge
from gradrunner.errors import GradrunnerError

if TYPE_CHECKING:
    from gradrunner.capturing.params import ParamBackward


#: The paragraph for a `loss.backward()` the session did not run, under a strategy with its own engine call.
OWN_BACKWARD_ONLY = (
    "capture.strategy='autograd_grad' computes the gradients with its own torch.autograd.grad call, so it cannot "
    "read a loss.backward() it did not run (yours, or a framework's; or a torch.autograd.grad of yours without "
    "create_graph=True): call cap.backward(loss) (rec.backward(loss) under gradrunner.record) in place of "
    "loss.backward(), or use strategy hook or retain_grad, which read the gradients around your own "
    "loss.backward() (or torch.autograd.grad) and give the same records."
)


class AutogradGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="autograd_grad")`."""

    name = "autograd_grad"
    owns_backward = True

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.edge = gradient_edge(tensor)
        slot.tensor = tensor  # its own hooks are looked up when backward runs (the model may add them later)
        return tensor

    def let_go(self, slots: Sequence[Slot]) -> None:
        for slot in slots:  # read as the node receives the gradient, as `_one_backward` reads every tap
            if slot.edge is not None:
                box: list[torch.Tensor] = []
                slot.parts = box
                slot.handle = watch_edge(slot.edge, _into(box, slot))  # type: ignore[arg-type]
            # A leaf holds no graph: kept, for `_retake`. Its accumulator's pre-hook runs only where the engine runs
            # the node, never where `autograd.grad` takes the leaf's gradient as an input, as `run_backward` does.
            slot.tensor = slot.tensor if slot.leaf else None
            slot.edge = None

    def fires_recomputed(self, tap: str) -> None:
        """Refused: `autograd.grad` cannot run a reentrant checkpoint's backward, and where the one engine call is
        `loss.backward()` (DDP, FSDP2) the tap's edge exists only once that backward runs, unwatched."""
        raise GradrunnerError(reentrant_refusal(tap))

    def run_backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: ParamBackward, retain_graph: bool
    ) -> None:
        if params.by_backward:
            self._one_backward(loss, slots, retain_graph)
            return
        by_edge = FEATURES["get_gradient_edge"]
        self._retake(slots)
        watched = self._watched(slots)
        tapped: list[Slot] = []
        inputs: list[Any] = []
        seen: dict[int, list[torch.Tensor]] = {}
        handles: list[RemovableHandle] = []
        for s in slots:
            edge = s.edge
            if edge is None:
                continue
            tapped.append(s)
            inputs.append(edge if by_edge else s.tensor)
            # without edges autograd.grad takes the tensor as it is now: read its node too
            if s.tensor is not None and (not by_edge or s.written or has_own_hooks(s.tensor)):
                box = seen[id(s)] = []  # a custom Function's node may write the gradient in place: a copy first
                handles.append(watch_edge(edge, _into(box, s)))  # type: ignore[arg-type]
        try:
            edges = params.edges(loss)
            if not inputs and not edges:
                loss.backward(retain_graph=retain_graph)
                return
            grads = _grad(loss, inputs + edges, retain_graph)
            n = len(tapped)
            self._deliver_taps(tapped, grads[:n], seen)
            params.arrived(grads[n:])
        finally:
            for h in handles:
                h.remove()
        self._deliver_watched(watched)

    @staticmethod
    def _retake(slots: Sequence[Slot]) -> None:
        """The leaves `let_go` left (a forward whose outputs went while a later graph still reaches them): an input of
        this engine call again, through their accumulator (the one that graph holds; a new one reached by nothing
        gives None, as for a leaf whose graph went)."""
        for s in slots:
            if s.edge is None and s.leaf and s.tensor is not None and s.parts is not None:
                s.edge, s.parts = gradient_edge(s.tensor), None

    @staticmethod
    def _watched(slots: Sequence[Slot]) -> list[Slot]:
        """The slots `let_go` left reading at their node, their boxes emptied for this backward."""
        watched = [s for s in slots if s.edge is None and s.parts is not None]
        for s in watched:
            s.parts.clear()  # type: ignore[union-attr]
        return watched

    def _deliver_watched(self, watched: list[Slot]) -> None:
        self.deliver_all(watched, [sum(s.parts[1:], s.parts[0]) if s.parts else None for s in watched])

    def _one_backward(self, loss: torch.Tensor, slots: Sequence[Slot], retain_graph: bool) -> None:
        """`loss.backward()` once, each tap read as its held edge's node receives the gradient (`watch_edge`).

        Where `.grad` must come from `loss.backward()` (DDP's reducer, FSDP2's reduce-scatter, no callable
        accumulator): a second engine call for the taps would run the framework's backward hooks twice (FSDP2
        reduce-scattered an accumulating micro-batch's gradient in the first and added the second's: other
        `.grad` bits, post-accumulate-grad hooks fired twice). A tap whose node never ran gets None, as
        `autograd.grad(..., allow_unused=True)` gives it.
        """
        tapped, watched = [s for s in slots if s.edge is not None], self._watched(slots)
        boxes: list[list[torch.Tensor]] = [[] for _ in tapped]
        handles = [watch_edge(s.edge, _into(box, s)) for s, box in zip(tapped, boxes, strict=True)]  # type: ignore[arg-type]
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            for h in handles:
                h.remove()
        self.deliver_all(tapped, [box[0] if box else None for box in boxes])
        self._deliver_watched(watched)

    def _deliver_taps(self, tapped: list[Slot], grads: Sequence[torch.Tensor | None],
                      seen: dict[int, list[torch.Tensor]]) -> None:  # fmt: skip
        if seen:  # where the node ran: what it received, after the tensor's hooks
            grads = [got[0] if (got := seen.get(id(slot))) else grad for slot, grad in zip(tapped, grads, strict=True)]
        self.deliver_all(tapped, grads)


def _into(box: list[torch.Tensor], slot: Slot) -> Callable[[torch.Tensor], None]:
    """What keeps the gradient `slot`'s edge receives in `box`: a copy where the node may write it in place next."""
    return (lambda g: box.append(g.clone())) if slot.written else box.append


def _grad(loss: torch.Tensor, inputs: list[Any], retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    try:
        return grad_of(loss, inputs, retain_graph)
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise GradrunnerError(reentrant_refusal(None)) from e


def reentrant_refusal(tap: str | None) -> str:
    """Why `autograd_grad` refuses `checkpoint(..., use_reentrant=True)` (`tap`: one that fires inside it, if known)."""
    inside = f" (tap {tap!r} fires inside one)" if tap is not None else ""
    return (
        f"capture.strategy='autograd_grad' cannot run through torch.utils.checkpoint(..., use_reentrant=True){inside}: "
        "PyTorch's reentrant checkpointing does not support torch.autograd.grad. Use capture.strategy=hook "
        "or retain_grad, or checkpoint with use_reentrant=False."
    )
