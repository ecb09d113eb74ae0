"""The one small interface every capture strategy implements, and the slot a tap's gradient lands in.

A `Capture` session calls, per step: `attach(tensor, slot)` when a tap fires in the forward pass
(the returned tensor is what the model goes on with), then `backward(loss, slots, params, ...)`,
which must run backward, hand each slot's gradient to `deliver(slot, grad)` and leave every
parameter's `.grad` exactly as `loss.backward()` would.

Example::

    class MyStrategy(Strategy):
        name = "mine"
        def attach(self, tensor, slot): ...
        def backward(self, loss, slots, params, retain_graph): ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradrunner.records.columns import TapKey


@dataclass(eq=False)
class Slot:
    """Where one firing of a tap (one call) receives its gradient.

    `tensor` is set by `attach` for strategies that read the gradient after backward;
    `param` is set for parameter taps, which do not fire in the forward pass. The fields after
    `reason` are per-strategy scratch, cleared when the step's backward ends.
    """

    key: TapKey
    order: int
    param: torch.nn.Parameter | None = None
    tensor: torch.Tensor | None = None
    delivered: bool = False
    #: Why the tap cannot have a gradient (not a tensor, not floating point, ...), if known at forward time.
    reason: str | None = None
    #: False for the row of a tap that did not fire at all in the step (its module was not called).
    fired: bool = True
    #: The tapped value was a leaf (a parameter or an input): its gradient may become `.grad`.
    leaf: bool = False
    #: The tapped tensor's own norm (0-d float64, on its device), taken when the tap fired.
    value_norm: torch.Tensor | None = None
    #: `autograd_grad`: the tensor's gradient edge, taken when the tap fired.
    edge: object | None = None
    #: The tensor's in-place version when the tap fired.
    version: int | None = None
    #: The tapped tensor when it is a view: if written in place later, autograd never computes the
    #: gradient of its value before the write (the record's `reason` says so).
    view: torch.Tensor | None = None
    #: `hook`: a parameter's gradient, summed over the parts backward delivers.
    param_grad: torch.Tensor | None = None


#: The session's `_deliver(slot, grad)`: every tapped gradient passes through it once. It returns None,
#: or a gradient to flow on in place of `grad` where the strategy can pass one on (`hook`).
Deliver = Callable[[Slot, "torch.Tensor | None"], "torch.Tensor | None"]


class Strategy(ABC):
    """Attach to tapped tensors in the forward pass; run backward and deliver their gradients."""

    #: The strategy's one name: config value, registry key, file name and `strategy` column.
    name: ClassVar[str]

    def __init__(self, deliver: Deliver) -> None:
        self.deliver = deliver

    @abstractmethod
    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        """Called when a tap fires on a tensor that requires grad; returns the tensor the model uses."""

    @abstractmethod
    def backward(
        self, loss: torch.Tensor, slots: Sequence[Slot], params: Sequence[torch.nn.Parameter], retain_graph: bool
    ) -> None:
        """Run backward from `loss`; deliver every slot's gradient; fill `.grad` of `params`."""

    def install(self, params: Sequence[tuple[torch.nn.Parameter, Callable[[], Slot | None]]]) -> None:  # noqa: B027 (optional)
        """Called once when the session opens, with the tapped parameters and a lookup of their current slot."""

    def close(self) -> None:  # noqa: B027 (optional)
        """Remove anything `install` or `attach` left behind (called on exit, also after an exception)."""
