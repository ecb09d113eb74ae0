"""`autograd_grad`: one `torch.autograd.grad(loss, [taps..., params...])` call per step.

Taps are held as gradient edges taken when they fire (`torch.autograd.graph.get_gradient_edge`),
so a later in-place op on the tensor does not change which value's gradient is returned.
`autograd.grad` does not touch `.grad`, so parameter gradients are accumulated here exactly as
`loss.backward()` would, and the optimiser step is the same as with the other strategies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.errors import GradrunnerError

_get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)


class AutogradGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="autograd_grad")`."""

    name = "autograd_grad"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.tensor = tensor
        if _get_edge is not None and not tensor.is_leaf:
            slot.edge = _get_edge(tensor)
        return tensor

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        params = [p for p in params if p.requires_grad]
        param_index = {id(p): i for i, p in enumerate(params)}
        tensor_slots = [s for s in slots if s.param is None and s.tensor is not None]
        inputs: list[Any] = [s.tensor if s.edge is None else s.edge for s in tensor_slots] + list(params)
        try:
            if not inputs:
                loss.backward(retain_graph=retain_graph)
                return
            grads = _grad(loss, inputs, retain_graph)
            for slot, grad in zip(tensor_slots, grads[: len(tensor_slots)], strict=True):
                self.deliver(slot, grad)
            param_grads = grads[len(tensor_slots) :]
            for slot in slots:
                if slot.param is not None:
                    self.deliver(slot, param_grads[param_index[id(slot.param)]] if id(slot.param) in param_index else None)
            for p, g in zip(params, param_grads, strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        finally:
            for slot in slots:
                slot.tensor = None
                slot.edge = None


def _grad(loss: torch.Tensor, inputs: list[Any], retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    try:
        return torch.autograd.grad(loss, inputs, retain_graph=retain_graph, allow_unused=True)
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise GradrunnerError(
            "capture.strategy='autograd_grad' cannot run through torch.utils.checkpoint(..., use_reentrant=True): "
            "PyTorch's reentrant checkpointing does not support torch.autograd.grad. Use capture.strategy=hook "
            "or retain_grad, or checkpoint with use_reentrant=False."
        ) from e
