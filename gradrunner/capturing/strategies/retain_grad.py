"""`retain_grad`: `tensor.retain_grad()` in the forward pass, read `.grad` after `backward()`.

The teaching strategy: it shows how autograd treats non-leaf tensors, and what that costs, since
every retained gradient stays alive until the step ends. A retained tensor modified in place later
(`ReLU(inplace=True)`) would have its `.grad` taken for the new value, so the model goes on with a
clone and the tapped tensor itself stays untouched. When another tap reaches that clone unchanged (a local
that is also an output element, `fc1:output` and `fc2:input`), it shares the retained original:
every tap on one tensor reads the same `.grad`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from gradrunner.capturing.strategies.base import Deliver, Slot, Strategy


class RetainGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="retain_grad")`."""

    name = "retain_grad"

    def __init__(self, deliver: Deliver) -> None:
        super().__init__(deliver)
        #: id(clone handed to the model) -> (the clone, weakly; its version then; the retained original).
        self._clones: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        made = self._clones.get(id(tensor))
        if made is not None and made[0]() is tensor and made[1] == tensor._version:
            slot.tensor = made[2]  # a clone this strategy made, unchanged since: its gradient is the original's
            return tensor
        slot.tensor = tensor
        if tensor.is_leaf:
            return tensor
        tensor.retain_grad()
        clone = tensor.clone()
        self._clones[id(clone)] = (weakref.ref(clone), clone._version, tensor)
        return clone

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        self._clones = {}
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

    def close(self) -> None:
        self._clones = {}


def _leaf(slot: Slot) -> torch.Tensor | None:
    if slot.param is not None:
        return slot.param
    if slot.tensor is not None and slot.tensor.is_leaf:
        return slot.tensor
    return None
