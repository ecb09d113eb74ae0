"""`retain_grad`: `tensor.retain_grad()` in the forward pass, read `.grad` after `backward()`.

The teaching strategy: it shows how autograd treats non-leaf tensors, and what that costs, since
every retained gradient stays alive until the backward ends. The model goes on with the tapped
tensor itself (never a copy: writes through its views must reach it). `.grad` is read where it
holds this backward's gradient alone; elsewhere the gradient is read at the tensor's gradient edge,
which gives what `.grad` would get of this backward:

- a tensor changed in place after it was tapped (`ReLU(inplace=True)`, `K.diagonal().add_(jitter)`)
  would have its `.grad` taken for the new value: its version (`torch_compat.version`) tells when
  the backward begins;
- a leaf (an input that requires grad): its `.grad` accumulates over backwards, and setting it aside
  would change what the model's own post-accumulate-grad hooks see;
- a `.grad` already set when the backward begins: by an earlier backward through the same forward,
  or by a `torch.autograd.grad` of the user's (a gradient penalty: it fills retained `.grad` too);
- a tensor of the node where the session sees a backward of the user's begin (the model's output):
  autograd fills its `.grad` before that node's pre-hooks run.

`.grad` is never cleared: a `.grad` the model or the user retained (Grad-CAM keeps `h.grad`) reads
as without capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import gradient_edge, version, watch_edge


def _watch(slot: Slot) -> None:
    parts: list[torch.Tensor] = []

    def keep(grad: torch.Tensor) -> None:
        parts.append(grad.clone() if slot.written else grad)  # a custom Function's node may write it next

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

    def seen_at(self, slots: Sequence[Slot], nodes: Sequence[object]) -> None:
        at = {id(n) for n in nodes}
        for slot in slots:
            if slot.parts is None and slot.edge is not None and id(slot.edge[0]) in at:  # type: ignore[index]
                _watch(slot)  # registered after the session's pre-hook there: it runs once the backward was seen

    def let_go(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.parts is None and slot.edge is not None:
                _watch(slot)  # read at the node from now on, as for a tensor changed in place
            slot.tensor, slot.edge = None, None

    def before_backward(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            held = slot.tensor
            if slot.parts is not None:
                slot.parts.clear()  # a second backward through the same forward, or a torch.autograd.grad's parts
            elif held is not None and (held.grad is not None or slot.version is None or version(held) != slot.version):
                _watch(slot)

    def after_backward(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.parts is not None:
                parts = slot.parts
                self.deliver(slot, parts[0] if len(parts) == 1 else (sum(parts[1:], parts[0]) if parts else None))
            elif slot.tensor is not None:
                self.deliver(slot, slot.tensor.grad)
