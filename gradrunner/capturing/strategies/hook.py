"""`hook`: a hook on each tapped tensor's gradient edge; the gradient is seen while backward runs, nothing is retained.

The cheapest strategy: each gradient is reduced inside its hook and dropped, so memory does not grow
with the number of taps. The hook is registered when the tap fires, on the tensor's gradient edge
taken then (a node pre-hook, as `torch_compat.watch_edge` registers): it receives the gradient of that value even when the model
later changes the tensor in place, and it runs after the tensor's own hooks (the model's gradient
scaling or clipping), so it sees what autograd delivers to the tensor's `.grad`, as `retain_grad`
does. Whoever runs the backward (the session, the user, a framework), the hooks see it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.torch_compat import gradient_edge


class HookStrategy(Strategy):
    """Example: `capture(model, taps, strategy="hook")`."""

    name = "hook"

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.edge = edge = gradient_edge(tensor)
        slot.sink = self.deliver  # never replaces the gradient
        slot.handle = edge[0].register_prehook(slot)
        return tensor

    def let_go(self, slots: Sequence[Slot]) -> None:
        for slot in slots:  # the node holds the slot as its pre-hook; the slot needs only the edge's index
            if slot.edge is not None:
                slot.edge = (None, slot.edge[1])  # type: ignore[index]
