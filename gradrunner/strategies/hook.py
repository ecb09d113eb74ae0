"""`hook`: `tensor.register_hook(...)`; the gradient is seen while backward runs, nothing is retained.

The cheapest strategy: each gradient is reduced inside its hook and dropped, so memory does not grow
with the number of taps. Hooks registered before an in-place op receive the gradient of the value
they were registered on, so no clone is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.strategies.base import Slot, Strategy


class HookStrategy(Strategy):
    """Example: `capture(model, taps, strategy="hook")`."""

    name = "hook"

    def __init__(self, deliver: Callable[[Slot, torch.Tensor | None], None]) -> None:
        super().__init__(deliver)
        self._step_handles: list[RemovableHandle] = []
        self._param_handles: list[RemovableHandle] = []

    def _hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            self.deliver(slot, grad)

        return on_grad

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        self._step_handles.append(tensor.register_hook(self._hook(slot)))
        return tensor

    def install(self, params: Sequence[tuple[torch.nn.Parameter, Callable[[], Slot | None]]]) -> None:
        for param, current_slot in params:

            def on_grad(grad: torch.Tensor, current_slot: Callable[[], Slot | None] = current_slot) -> None:
                slot = current_slot()
                if slot is not None:
                    self.deliver(slot, grad)

            self._param_handles.append(param.register_hook(on_grad))

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._remove(self._step_handles)

    def close(self) -> None:
        self._remove(self._step_handles)
        self._remove(self._param_handles)

    @staticmethod
    def _remove(handles: list[RemovableHandle]) -> None:
        while handles:
            handles.pop().remove()
