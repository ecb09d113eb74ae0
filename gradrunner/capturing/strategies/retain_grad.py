"""`retain_grad`: `tensor.retain_grad()` in the forward pass, read `.grad` after `backward()`.

The teaching strategy: it shows how autograd treats non-leaf tensors, and what that costs, since
every retained gradient stays alive until the step ends. A retained tensor modified in place later
(`ReLU(inplace=True)`) would have its `.grad` taken for the new value, so the model goes on with a
clone and the tapped tensor itself stays untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradrunner.capturing.strategies.base import Slot, Strategy


class RetainGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="retain_grad")`."""

    name = "retain_grad"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.tensor = tensor
        if tensor.is_leaf:
            return tensor
        tensor.retain_grad()
        return tensor.clone()

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        # Leaves accumulate into .grad: stash what is there, so this step's gradient is read alone.
        leaves = {id(t): t for t in (_leaf(s) for s in slots) if t is not None}
        stashed = {k: t.grad for k, t in leaves.items()}
        for t in leaves.values():
            t.grad = None
        try:
            loss.backward(retain_graph=retain_graph)
            for slot in slots:
                held = slot.param if slot.param is not None else slot.tensor
                self.deliver(slot, None if held is None else held.grad)
        finally:
            for k, t in leaves.items():
                prev = stashed[k]
                if prev is not None:
                    t.grad = prev if t.grad is None else prev + t.grad
            for slot in slots:
                if slot.tensor is not None and not slot.tensor.is_leaf:
                    slot.tensor.grad = None
                slot.tensor = None


def _leaf(slot: Slot) -> torch.Tensor | None:
    if slot.param is not None:
        return slot.param
    if slot.tensor is not None and slot.tensor.is_leaf:
        return slot.tensor
    return None
