"""The one small interface every capture strategy implements, and the slot a tap's gradient lands in.

A strategy is what happens around a backward, not the backward itself: `attach(tensor, slot)` when a
tap fires in the forward pass (the returned tensor is what the model goes on with; it may register
what it needs on the tensor's gradient edge right there), `before_backward(slots)` when the session
sees a backward begin, and `after_backward(slots)` when it ended (read what it needs and hand each
slot's gradient to `deliver(slot, grad)`). The backward itself is the user's, the framework's or
`Capture.backward`'s own `loss.backward()`. Only a strategy that computes the gradients with an
engine call of its own says so (`owns_backward = True`) and implements `run_backward`; the session
then calls it instead of `loss.backward()` (the gradients it returns at once go to `deliver_all(slots,
grads)`, which checks the backward once for all). Parameters are not the strategies' business: the session
reads them one way for all (`capturing.params`).

Example::

    class MyStrategy(Strategy):
        name = "mine"
        def attach(self, tensor, slot): ...
        def after_backward(self, slots): ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from gradrunner.records.columns import TapKey

if TYPE_CHECKING:
    from gradrunner.capturing.dtensors import PieceNorm
    from gradrunner.capturing.params import ParamBackward


@dataclass(eq=False, slots=True)  # one object per tap firing, no __dict__
class Slot:
    """Where one firing of a tap (one call) receives its gradient.

    The fields after `value_norm` are per-strategy scratch, cleared when the backward that reads them ends.
    """

    key: TapKey
    order: int
    tensor: torch.Tensor | None = None
    delivered: bool = False
    #: Why the tap cannot have a gradient (not a tensor, not floating point, ...), if known at forward time.
    reason: str | None = None
    #: False for the row of a tap that did not fire at all in the step (its module was not called).
    fired: bool = True
    #: The tapped value was a leaf (an input that requires grad): its gradient may become its `.grad`.
    leaf: bool = False
    #: The node the gradient flows into may write it in place (a custom Function's: `torch_compat.writes_grad`).
    written: bool = False
    #: The tapped tensor's own norm (0-d float64, on its device), taken when the tap fired; a DTensor's on a mesh
    #: spanning the world: its piece's (`PieceNorm`), merged over the ranks with the step's rows.
    value_norm: torch.Tensor | PieceNorm | None = None
    #: The tensor's gradient edge, taken when the tap fired.
    edge: object | None = None
    #: The tensor's in-place version when the tap fired.
    version: int | None = None
    #: The tapped tensor when it is a view: if written in place later, autograd never computes the
    #: gradient of its value before the write (the record's `reason` says so).
    view: torch.Tensor | None = None
    #: A hook the strategy registered for this slot (removed when its backward ends, or the forward is forgotten).
    handle: RemovableHandle | None = None
    #: The session's pre-hook on the edge's node that sees a backward begin, where no root forward ran
    #: (`Firing.fire`: `model[:3](x)`); removed with `handle`.
    seen: RemovableHandle | None = None
    #: `retain_grad`: the gradients a watched edge received in this backward (summed when read).
    parts: list[torch.Tensor] | None = None
    #: `hook`: where the gradient goes when the slot itself, registered as its edge's node pre-hook, is called.
    sink: Deliver | None = None
    #: The tap and its value, a leaf that did not require grad when the tap fired: a forward hook after the tap's may
    #: still turn it on in place (transformers' `enable_input_require_grads`); looked at again as the backward begins.
    late: tuple[Any, torch.Tensor] | None = None

    @property
    def mutable(self) -> bool:
        """Whether the gradient may change in place after it arrived (a leaf's `.grad`, a custom Function's node)."""
        return self.leaf or self.written

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        """The slot as its edge's node pre-hook (`hook`): hands the gradient flowing into the edge to `sink`.

        `torch_compat.watch_edge`'s pre-hook, without a closure per tap firing (fewer objects for the GC).
        """
        grad = grad_outputs[self.edge[1]]  # type: ignore[index]
        if grad is not None:
            self.sink(self, grad)  # type: ignore[misc]


#: The session's `_deliver(slot, grad)`: every tapped gradient passes through it once per backward.
#: It returns None (or a gradient to flow on in place of `grad`, where the strategy can pass one on).
Deliver = Callable[[Slot, "torch.Tensor | None"], "torch.Tensor | None"]
#: `Deliver` for many (slot, gradient) pairs at once, in that order (the session's `_deliver_all`).
DeliverAll = Callable[[Sequence[Slot], Sequence["torch.Tensor | None"]], None]


class Strategy(ABC):
    """Attach to tapped tensors in the forward pass; read their gradients around a backward."""

    #: The strategy's one name: config value, registry key, file name and `strategy` column.
    name: ClassVar[str]
    #: True: the gradients come from the strategy's own engine call (`run_backward`), never from a
    #: `loss.backward()` the session did not run (which it refuses, saying why).
    owns_backward: ClassVar[bool] = False

    def __init__(self, deliver: Deliver, deliver_all: DeliverAll | None = None) -> None:
        self.deliver = deliver
        #: `deliver` for gradients handed over together (an engine call of the strategy's own returns them at once)
        self.deliver_all: DeliverAll = deliver_all or self._deliver_each

    def _deliver_each(self, slots: Sequence[Slot], grads: Sequence[torch.Tensor | None]) -> None:
        for slot, grad in zip(slots, grads, strict=True):
            self.deliver(slot, grad)

    @abstractmethod
    def attach(self, tensor: torch.Tensor, slot: Slot) -> torch.Tensor:
        """Called when a tap fires on a tensor that requires grad; returns the tensor the model uses."""

    def fires_recomputed(self, tap: str) -> None:  # noqa: B027 (optional)
        """`tap` fired inside `checkpoint(..., use_reentrant=True)`: attached when backward recomputes it; raise if
        the strategy cannot read a gradient there."""

    def seen_at(self, slots: Sequence[Slot], nodes: Sequence[object]) -> None:  # noqa: B027 (optional)
        """A backward of the user's will be seen begin at a pre-hook on `nodes` (the model's outputs), registered now."""

    def let_go(self, slots: Sequence[Slot]) -> None:  # noqa: B027 (optional)
        """Keep nothing of `slots`' graph (their tensors, edge nodes) where the strategy can: a gradient that still
        reaches one is read at its edge's node, whose hook holds the slot. Called for a tap on the model's output as the
        forward returns (after `seen_at`), and for every slot of a forward whose outputs went (`capturing.pending`)."""

    def before_backward(self, slots: Sequence[Slot]) -> None:  # noqa: B027 (optional)
        """A backward through `slots` begins (before any of their gradients is computed)."""

    def after_backward(self, slots: Sequence[Slot]) -> None:  # noqa: B027 (optional)
        """The backward through `slots` ended: deliver what was not delivered while it ran; clean up."""

    def run_backward(self, loss: torch.Tensor, slots: Sequence[Slot], params: ParamBackward,
                     retain_graph: bool) -> None:  # fmt: skip
        """`owns_backward` strategies only: compute every slot's and parameter's gradient from `loss`."""
        raise NotImplementedError(f"{self.name} reads gradients around the caller's own backward")

    def forget(self, slots: Sequence[Slot]) -> None:
        """`slots` will see no backward (the forward was abandoned, or a new one began): drop their hooks."""
        for slot in slots:
            if slot.handle is not None:
                slot.handle.remove()
                slot.handle = None
            if slot.seen is not None:
                slot.seen.remove()
                slot.seen = None

    def close(self) -> None:  # noqa: B027 (optional)
        """Remove anything left behind (called on exit, also after an exception)."""
