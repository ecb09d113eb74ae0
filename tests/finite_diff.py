"""Reference gradients for the tests, computed without any gradrunner code.

A *point* is a place in a forward pass where a perturbation `delta` can be added: a module's
output or input (by a plain forward / forward-pre hook written here), a parameter, or a local
variable of a test's own re-implementation of a model's math. `loss_at(delta)` runs the forward
with `delta` added at that point and returns the scalar loss; the gradient of the loss with
respect to the tensor at that point is the gradient with respect to `delta` at `delta = 0`.

Example::

    point = output_point(model, "fc1", lambda: loss_fn(model(x), y))
    exact = autograd_at(point)        # torch.autograd.grad wrt a zero delta
    approx = central_diff(point)      # (L(+eps e_i) - L(-eps e_i)) / 2 eps, in float64
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Point:
    """`loss_at(delta)` adds `delta` at the point (None: unperturbed); `shape` is the tensor's shape there."""

    loss_at: Callable[[torch.Tensor | None], torch.Tensor]
    shape: torch.Size
    #: How to take the exact gradient when a zero delta cannot be added (parameters).
    exact: Callable[[], torch.Tensor] | None = None


def _probe_shape(loss_at: Callable[[torch.Tensor | None], torch.Tensor], seen: list[torch.Size]) -> torch.Size:
    seen.clear()
    with torch.no_grad():
        loss_at(None)
    if not seen:
        raise AssertionError("the perturbation point was never reached in the forward pass")
    return seen[0]


def _element(value: Any, element: int | str | None) -> Any:
    return value if element is None else value[element]


def _with_element(value: Any, element: int | str | None, new: torch.Tensor) -> Any:
    if element is None:
        return new
    if isinstance(value, dict):
        return {**value, element: new}
    items = list(value)
    items[element] = new  # type: ignore[index]
    return type(value)(items)


def output_point(
    model: nn.Module,
    path: str,
    forward_loss: Callable[[], torch.Tensor],
    element: int | str | None = None,
    call: int = 0,
) -> Point:
    """Perturb the output of module `path` (or its element `element`) on its `call`-th call."""
    module = dict(model.named_modules())[path]
    seen: list[torch.Size] = []

    def loss_at(delta: torch.Tensor | None) -> torch.Tensor:
        calls = [0]

        def hook(mod: nn.Module, args: Any, out: Any) -> Any:
            n = calls[0]
            calls[0] += 1
            if n != call:
                return None
            target = _element(out, element)
            seen.append(target.shape)
            return None if delta is None else _with_element(out, element, target + delta)

        handle = module.register_forward_hook(hook)
        try:
            return forward_loss()
        finally:
            handle.remove()

    return Point(loss_at, _probe_shape(loss_at, seen))


def input_point(
    model: nn.Module, path: str, forward_loss: Callable[[], torch.Tensor], index: int = 0, call: int = 0
) -> Point:
    """Perturb positional input `index` of module `path` on its `call`-th call."""
    module = dict(model.named_modules())[path]
    seen: list[torch.Size] = []

    def loss_at(delta: torch.Tensor | None) -> torch.Tensor:
        calls = [0]

        def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            n = calls[0]
            calls[0] += 1
            if n != call:
                return None
            seen.append(args[index].shape)
            if delta is None:
                return None
            new = list(args)
            new[index] = args[index] + delta
            return tuple(new)

        handle = module.register_forward_pre_hook(pre_hook)
        try:
            return forward_loss()
        finally:
            handle.remove()

    return Point(loss_at, _probe_shape(loss_at, seen))


def param_point(param: torch.Tensor, forward_loss: Callable[[], torch.Tensor]) -> Point:
    """Perturb a parameter: its data is shifted by `delta` for one forward pass, then restored.

    The exact gradient is `torch.autograd.grad(forward_loss(), [param])`.
    """
    original = param.detach().clone()

    def loss_at(delta: torch.Tensor | None) -> torch.Tensor:
        if delta is None:
            return forward_loss()
        with torch.no_grad():
            param.copy_(original + delta)
        try:
            return forward_loss()
        finally:
            with torch.no_grad():
                param.copy_(original)

    def exact() -> torch.Tensor:
        (grad,) = torch.autograd.grad(forward_loss(), [param])
        return grad

    return Point(loss_at, param.shape, exact)


class LocalPerturb:
    """Hand to a test's re-implementation of a forward: `v = p("name", expr)` adds delta at one assignment."""

    def __init__(self, name: str, call: int, delta: torch.Tensor | None, seen: list[torch.Size]) -> None:
        self.name, self.call, self.delta, self.seen = name, call, delta, seen
        self.count = 0

    def __call__(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name != self.name:
            return value
        n = self.count
        self.count += 1
        if n != self.call:
            return value
        self.seen.append(value.shape)
        return value if self.delta is None else value + self.delta


def local_point(loss_with: Callable[[LocalPerturb], torch.Tensor], name: str, call: int = 0) -> Point:
    """Perturb assignment number `call` of local `name` in a re-implemented forward `loss_with(p)`."""
    seen: list[torch.Size] = []

    def loss_at(delta: torch.Tensor | None) -> torch.Tensor:
        return loss_with(LocalPerturb(name, call, delta, seen))

    return Point(loss_at, _probe_shape(loss_at, seen))


def autograd_at(point: Point) -> torch.Tensor:
    """The exact gradient at the point: `torch.autograd.grad` with respect to a zero delta."""
    if point.exact is not None:
        return point.exact()
    delta = torch.zeros(point.shape, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(point.loss_at(delta), [delta])
    return grad


def central_diff(point: Point, eps: float = 1e-6) -> torch.Tensor:
    """Central finite differences, element by element, in float64."""
    grad = torch.zeros(point.shape, dtype=torch.float64)
    flat = grad.view(-1)
    with torch.no_grad():
        for i in range(flat.numel()):
            delta = torch.zeros(point.shape, dtype=torch.float64)
            delta.view(-1)[i] = eps
            plus = float(point.loss_at(delta))
            minus = float(point.loss_at(-delta))
            flat[i] = (plus - minus) / (2 * eps)
    return grad
