"""`autograd_grad`: one `torch.autograd.grad(loss, [taps..., params...])` call per step.

Taps are held as gradient edges taken when they fire (`torch_compat.gradient_edge`), so a later
in-place op on the tensor does not change which value's gradient is returned. Where autograd
captures an edge before the tensor's own hooks ran (the edge's node also leads to a parameter),
the gradient is read as the node receives it, after those hooks (`torch_compat.watch_edge`): the
same gradient the other strategies see. `autograd.grad` does not touch `.grad`, so each parameter's
gradient is accumulated through its own accumulator (`torch_compat.accumulate`), exactly as
`loss.backward()` does, post-accumulate-grad hooks included (optimizer-in-backward, FSDP2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import FEATURES, accumulate, backward_running, gradient_edge, watch_edge
from gradrunner.errors import GradrunnerError


class AutogradGradStrategy(Strategy):
    """Example: `capture(model, taps, strategy="autograd_grad")`."""

    name = "autograd_grad"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.edge = gradient_edge(tensor)
        if not FEATURES["get_gradient_edge"]:  # autograd.grad takes edges only where torch has them
            slot.tensor = tensor
        return tensor

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        params = [p for p in params if p.requires_grad]
        param_index = {id(p): i for i, p in enumerate(params)}
        tensor_slots = [s for s in slots if s.param is None and s.edge is not None]
        inputs: list[Any] = [s.edge if s.tensor is None else s.tensor for s in tensor_slots] + list(params)
        seen: dict[int, list[torch.Tensor]] = {id(s): [] for s in tensor_slots}
        handles: list[RemovableHandle] = [watch_edge(s.edge, seen[id(s)].append) for s in tensor_slots]  # type: ignore[arg-type]
        try:
            if not inputs:
                with backward_running():
                    loss.backward(retain_graph=retain_graph)
                return
            with backward_running():
                grads = _grad(loss, inputs, retain_graph)
            for slot, grad in zip(tensor_slots, grads[: len(tensor_slots)], strict=True):
                # the node ran (it leads on to a parameter): what it received, after the tensor's hooks
                self.deliver(slot, seen[id(slot)][0] if seen[id(slot)] else grad)
            param_grads = grads[len(tensor_slots) :]
            for slot in slots:
                if slot.param is not None:
                    self.deliver(slot, param_grads[param_index[id(slot.param)]] if id(slot.param) in param_index else None)
            for p, g in zip(params, param_grads, strict=True):
                if g is not None:
                    accumulate(p, g)
        finally:
            for h in handles:
                h.remove()


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
