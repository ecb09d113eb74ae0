"""Routing a framework's own `loss.backward()` through a `Recorder`: the one place that patches `Tensor.backward`.

Frameworks call `loss.backward()` themselves (Lightning's precision plugin, HF's accelerate); the
capture strategies must run that backward their way. `route(loss, rec)` does it for one tensor
(an instance attribute shadowing the method, removed when it runs); `NextBackward` for the first
`Tensor.backward` after the model's training forward, where the framework never shows the loss.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradrunner.errors import GradrunnerError

#: Keyword arguments a routed backward takes; a framework passing others is refused, not ignored.
_TAKEN = ("retain_graph",)


def _run(rec_backward: Callable[..., None], loss: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    extra = [k for k, v in kwargs.items() if k not in _TAKEN and v is not None and v is not False]
    if (args and not (len(args) == 1 and args[0] is None)) or extra:
        raise GradrunnerError(
            f"the framework called loss.backward() with {', '.join(extra) or 'a gradient argument'}; gradrunner "
            "captures backward calls of a scalar loss with at most retain_graph. Remove the GradientCapture callback "
            "for this run, or capture in your own loop with gradrunner.record."
        )
    rec_backward(loss, retain_graph=bool(kwargs.get("retain_graph") or False))


def route(loss: torch.Tensor, rec_backward: Callable[..., None]) -> None:
    """Make the next `loss.backward()` call `rec_backward(loss, retain_graph=...)` instead (once).

    Example::

        route(loss, rec.backward)     # in Lightning's on_before_backward
    """

    def backward(*args: Any, **kwargs: Any) -> None:
        del loss.backward  # the tensor's own method again: the strategy's backward calls it
        _run(rec_backward, loss, args, kwargs)

    loss.backward = backward  # type: ignore[method-assign]


class NextBackward:
    """While open: the first `Tensor.backward` after each training forward of `model` goes to `rec_backward`.

    Example::

        with NextBackward(model, rec.backward):
            trainer.train()     # accelerate's loss.backward() runs the capture strategy's backward

    A forward of `model` in training mode with gradients enabled arms it (in this thread); the next
    `Tensor.backward` call, whatever tensor it is on (a loss divided for accumulation, scaled by a
    GradScaler), is routed and disarms it. Closing restores `torch.Tensor.backward`.
    """

    def __init__(self, model: nn.Module, rec_backward: Callable[..., None]) -> None:
        self.model, self.rec_backward = model, rec_backward
        self._local = threading.local()
        self._original: Callable[..., Any] | None = None
        self._handle: Any = None

    def __enter__(self) -> NextBackward:
        original = torch.Tensor.backward
        router = self

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not getattr(router._local, "armed", False):
                return original(tensor, *args, **kwargs)
            router._local.armed = False
            torch.Tensor.backward = original  # type: ignore[method-assign]  # the strategy's own backward call
            try:
                _run(router.rec_backward, tensor, args, kwargs)
            finally:
                torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]
            return None

        def arm(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self._local.armed = True

        self._original = original
        self._handle = self.model.register_forward_hook(arm)
        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._original is not None:
            torch.Tensor.backward = self._original  # type: ignore[method-assign]
            self._original = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
