"""`retain_grad`: `tensor.retain_grad()` in the forward pass, read `.grad` after `backward()`.

The teaching strategy: it shows how autograd treats non-leaf tensors, and what that costs, since
every retained gradient stays alive until the backward ends. The model goes on with the tapped
tensor itself (never a copy: writes through its views must reach it). Two cases read the gradient
at the tensor's gradient edge instead, which gives what `.grad` would hold of this backward:

- a tensor changed in place after it was tapped (`ReLU(inplace=True)`, `K.diagonal().add_(jitter)`)
  would have its `.grad` taken for the new value: its version (`torch_compat.version`) tells when
  the backward begins;
- a leaf (an input that requires grad): its `.grad` accumulates over backwards, and setting it aside
  would change what the model's own post-accumulate-grad hooks see.

`.grad` of the retained tensors is cleared once read, so the next backward reads its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import UNKNOWN, gradient_edge, running_node, version, watch_edge


def _watch(slot: Slot) -> None:
    parts: list[torch.Tensor] = []

    def keep(grad: torch.Tensor) -> None:
        parts.append(grad)

    slot.parts = parts
    slot.handle = watch_edge(slot.edge, keep)  # type: ignore[arg-type]


class RetainGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="retain_grad")`."""

    name = "retain_grad"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.tensor = tensor
        slot.edge = gradient_edge(tensor)
        if tensor.is_leaf:
            _watch(slot)
        else:
            tensor.retain_grad()
            slot.version = version(tensor)
        return tensor

    def before_backward(self, slots: Sequence[Slot]) -> None:
        # The node whose hook saw this backward begin (None: the session's own, begun before it runs): a tap on
        # its output has its `.grad` of this backward already. Any other retained `.grad` is a `torch.autograd.grad`
        # of the user's (a gradient penalty, not recorded: it fills retained `.grad` too), dropped here.
        running = running_node()
        for slot in slots:
            held = slot.tensor
            if held is not None and slot.parts is None and (slot.version is None or version(held) != slot.version):
                _watch(slot)
            elif slot.parts is not None:
                slot.parts.clear()  # a second backward through the same forward
            elif held is not None and held.grad is not None and running is not UNKNOWN and slot.edge[0] is not running:  # type: ignore[index]
                held.grad = None

    def after_backward(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.parts is not None:
                parts = slot.parts
                self.deliver(slot, parts[0] if len(parts) == 1 else (sum(parts[1:], parts[0]) if parts else None))
                continue
            held = slot.tensor
            if held is not None:
                self.deliver(slot, held.grad)
        for slot in slots:  # read (one tensor may be several slots): the next backward reads its own
            if slot.parts is None and slot.tensor is not None:
                slot.tensor.grad = None
