"""`hook`: a hook on each tapped tensor's gradient; the gradient is seen while backward runs, nothing is retained.

The cheapest strategy: each gradient is reduced inside its hook and dropped, so memory does not grow
with the number of taps. The hook sits on the tensor's gradient edge taken when the tap fired
(`torch_compat.watch_edge`): it receives the gradient of that value even when the model later
changes the tensor in place, and it runs after the tensor's own hooks (the model's gradient
scaling or clipping), so it sees what autograd delivers to the tensor's `.grad`, as `retain_grad`
does. A tapped parameter's hook goes on its gradient accumulator for each backward; its parts are
summed, then delivered when backward returns (inside `checkpoint(..., use_reentrant=True)` a
parameter's gradient arrives in parts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import backward_running, gradient_edge, watch_edge


class HookStrategy(Strategy):
    """Example: `capture(model, taps, strategy="hook")`."""

    name = "hook"

    def __init__(self, deliver: Callable[[Slot, torch.Tensor | None], None]) -> None:
        super().__init__(deliver)
        self._handles: list[RemovableHandle] = []
        self._running = False

    def _watch(self, slot: Slot) -> None:
        def on_grad(grad: torch.Tensor) -> torch.Tensor | None:
            return self.deliver(slot, grad)

        self._handles.append(watch_edge(slot.edge, on_grad))  # type: ignore[arg-type]

    def _watch_param(self, slot: Slot) -> None:
        def on_grad(grad: torch.Tensor) -> None:
            # Summed, delivered after backward: a parameter inside checkpoint(use_reentrant=True) gets its
            # gradient in parts. `+` makes a new tensor before the part is added to .grad in place.
            slot.param_grad = grad if slot.param_grad is None else slot.param_grad + grad

        assert slot.param is not None
        # Held until backward ends: a parameter's accumulator lives only while something holds it, and
        # a new one (without the hook) would take its place, e.g. when a reentrant checkpoint recomputes.
        slot.edge = gradient_edge(slot.param)
        self._handles.append(watch_edge(slot.edge, on_grad))

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.edge = gradient_edge(tensor)
        if self._running:  # fired while backward recomputes a reentrant checkpoint
            self._watch(slot)
        return tensor

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        try:
            for slot in slots:
                if slot.param is not None:
                    if slot.param.requires_grad:
                        self._watch_param(slot)
                elif slot.edge is not None:
                    self._watch(slot)
            self._running = True
            with backward_running():
                loss.backward(retain_graph=retain_graph)
            for slot in slots:
                grad, slot.param_grad = slot.param_grad, None
                if slot.param is not None and grad is not None:
                    self.deliver(slot, grad)
        finally:
            self._running = False
            self.close()
            for slot in slots:
                slot.param_grad = None
                if slot.param is not None:
                    slot.edge = None

    def close(self) -> None:
        while self._handles:
            self._handles.pop().remove()
