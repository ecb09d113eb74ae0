"""`hook`: `tensor.register_hook(...)`; the gradient is seen while backward runs, nothing is retained.

The cheapest strategy: each gradient is reduced inside its hook and dropped, so memory does not grow
with the number of taps. Hooks registered before an in-place op receive the gradient of the value
they were registered on, so no clone is needed. A tapped parameter's hook is registered once the
parameter requires grad (a frozen one can take none) and its parts are summed, then delivered when
backward returns (inside `checkpoint(..., use_reentrant=True)` a parameter's gradient arrives in parts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.strategies.base import Slot, Strategy

#: Our key in a tensor's hook dict: negative, so never one of `RemovableHandle`'s ids (counted from 0).
_HOOK_KEY = -1
_HookDict = OrderedDict[int, Callable[[torch.Tensor], "torch.Tensor | None"]]


class HookStrategy(Strategy):
    """Example: `capture(model, taps, strategy="hook")`."""

    name = "hook"

    def __init__(self, deliver: Callable[[Slot, torch.Tensor | None], None]) -> None:
        super().__init__(deliver)
        self._step_handles: list[RemovableHandle] = []
        self._step_dicts: list[_HookDict] = []
        self._param_handles: list[RemovableHandle] = []
        self._params: list[tuple[torch.nn.Parameter, Callable[[], Slot | None]]] = []
        #: Indices into `_params` already hooked: one hook per tap, so two taps on one tied parameter both get it.
        self._hooked: set[int] = set()

    def _hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            self.deliver(slot, grad)

        return on_grad

    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        if type(tensor) is torch.Tensor and tensor._backward_hooks is None and tensor.grad_fn is not None:
            # What `register_hook` does, less its per-call import, checks and handle (about half of
            # a firing's forward cost): the hook dict goes to the tensor's grad_fn; clearing the dict
            # removes the hook, as `RemovableHandle.remove()` would.
            hooks: _HookDict = OrderedDict([(_HOOK_KEY, self._hook(slot))])  # torch keeps a weak reference to it
            tensor._backward_hooks = hooks
            tensor.grad_fn._register_hook_dict(tensor)
            self._step_dicts.append(hooks)
        else:
            self._step_handles.append(tensor.register_hook(self._hook(slot)))
        return tensor

    def install(self, params: Sequence[tuple[torch.nn.Parameter, Callable[[], Slot | None]]]) -> None:
        self._params = list(params)

    def _hook_params(self) -> None:
        """Hook each tapped parameter once it requires grad (a frozen one cannot take a hook, nor has a gradient)."""
        for i, (param, current_slot) in enumerate(self._params):
            if i in self._hooked or not param.requires_grad:
                continue

            def on_grad(grad: torch.Tensor, current_slot: Callable[[], Slot | None] = current_slot) -> None:
                slot = current_slot()
                if slot is not None:
                    # Summed, delivered after backward: a parameter inside checkpoint(use_reentrant=True)
                    # gets its gradient in parts, one per recomputation. `+` makes a new tensor, so the
                    # first part (which may become .grad and be added to in place) is read before that.
                    slot.param_grad = grad if slot.param_grad is None else slot.param_grad + grad

            self._param_handles.append(param.register_hook(on_grad))
            self._hooked.add(i)

    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        try:
            self._hook_params()
            loss.backward(retain_graph=retain_graph)
            for slot in slots:
                grad, slot.param_grad = slot.param_grad, None
                if slot.param is not None and grad is not None:
                    self.deliver(slot, grad)
        finally:
            self._remove(self._step_handles)
            self._clear(self._step_dicts)
            for slot in slots:
                slot.param_grad = None

    def close(self) -> None:
        self._remove(self._step_handles)
        self._clear(self._step_dicts)
        self._remove(self._param_handles)
        self._hooked.clear()

    @staticmethod
    def _clear(dicts: list[_HookDict]) -> None:
        while dicts:
            dicts.pop().pop(_HOOK_KEY, None)

    @staticmethod
    def _remove(handles: list[RemovableHandle]) -> None:
        while handles:
            handles.pop().remove()
