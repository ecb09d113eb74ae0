"""`retain_grad`: `tensor.retain_grad()` in the forward pass, read `.grad` after `backward()`.

The teaching strategy: it shows how autograd treats non-leaf tensors, and what that costs, since
every retained gradient stays alive until the step ends. The model goes on with the tapped tensor
itself (never a copy: writes through its views must reach it). A tensor changed in place after it
was tapped (`ReLU(inplace=True)`, `K.diagonal().add_(jitter)`) would have its `.grad` taken for the
new value: its version (`torch_compat.version`) tells, and then the gradient of the tapped value is
read at the gradient edge taken when the tap fired, which is the same gradient `.grad` would have
held had the tensor not been changed (after the tensor's own hooks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import backward_running, gradient_edge, version, watch_edge


class RetainGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="retain_grad")`."""

    name = "retain_grad"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.tensor = tensor
        if not tensor.is_leaf:
            tensor.retain_grad()
            slot.edge = gradient_edge(tensor)
            slot.version = version(tensor)
        return tensor

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        # Leaves accumulate into .grad: stash what is there, so this step's gradient is read alone.
        leaves = {id(t): t for t in (_leaf(s) for s in slots) if t is not None}
        stashed = {k: t.grad for k, t in leaves.items()}
        for t in leaves.values():
            t.grad = None
        handles: list[RemovableHandle] = []
        changed: dict[int, list[torch.Tensor]] = {}
        try:
            for slot in slots:
                held = slot.tensor
                if held is not None and not held.is_leaf and (slot.version is None or version(held) != slot.version):
                    box = changed[id(slot)] = []
                    handles.append(watch_edge(slot.edge, box.append))  # type: ignore[arg-type]
            with backward_running():
                loss.backward(retain_graph=retain_graph)
            for slot in slots:
                if id(slot) in changed:
                    box = changed[id(slot)]
                    self.deliver(slot, box[0] if len(box) == 1 else (sum(box[1:], box[0]) if box else None))
                    continue
                read = slot.param if slot.param is not None else slot.tensor
                self.deliver(slot, None if read is None else read.grad)
        finally:
            for h in handles:
                h.remove()
            for k, t in leaves.items():
                prev = stashed[k]
                if prev is not None:
                    t.grad = prev if t.grad is None else prev + t.grad
            for slot in slots:
                if slot.tensor is not None and not slot.tensor.is_leaf:
                    slot.tensor.grad = None


def _leaf(slot: Slot) -> torch.Tensor | None:
    if slot.param is not None:
        return slot.param
    if slot.tensor is not None and slot.tensor.is_leaf:
        return slot.tensor
    return None
