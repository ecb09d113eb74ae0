"""Parameter taps, read one way whatever the strategy: held gradient edges, or `.grad` after synchronisation.

Each tapped parameter's gradient edge (its `AccumulateGrad` node) is taken once and held for the
whole session, as DDP's reducer holds them, with ONE node pre-hook: it receives every part of the
gradient a backward brings (a reentrant checkpoint brings several) after the parameter's own tensor
hooks, before it is added to `.grad`. Nothing touches `.grad`: the model's post-accumulate-grad
hooks see what they see without capture, and `.grad` stays the same tensor. The parts are summed
over the step's backwards (gradient accumulation): a parameter's record is that step sum, which is
the accumulated `.grad` when the step began with zeroed gradients, and is reduced once, when the
step's records are taken (`ParamTaps.rows`).

A held node stays the parameter's accumulator until the parameter changes dtype or device
(`module.double()`, `p.data = <other dtype>`): `check()` compares those once per forward and takes
the edge again. Under DDP (`synced` given) a parameter's record is instead its `.grad` at the end of
a backward that synchronised the gradients (the session's end-of-backward callback runs after DDP's
finalize): the averaged gradient the optimiser uses. That mode is also the seam for sharded
training (FSDP2 hands a parameter's local piece out after its reduce-scatter).

`autograd_grad` needs every parameter's edge (`ParamBackward`): the same held nodes, its
`torch.autograd.grad` results reported through `arrived`, and `.grad` filled by calling each node.

Example::

    taps = ParamTaps([(tap, model.fc1.weight)], seen=lambda: None, capturing=lambda: True)
    taps.install(stack)
    loss.backward(); taps.end_backward()
    for i, key, grad, reason in taps.rows(): ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.extras import value_norms
from gradrunner.capturing.grad_context import FROZEN, NO_PART
from gradrunner.capturing.taps import Tap
from gradrunner.capturing.torch_compat import FEATURES, Edge, accumulate, gradient_edge
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import TapKey

#: Why a parameter tap has no record of its own gradient under DDP when no backward of the step synchronised.
NOT_SYNCED = "no backward of this step synchronised the gradients (DDP's no_sync on every one)"


@dataclass(eq=False)
class _Held:
    """One parameter's held gradient edge, the dtype and device it was taken for, and its pre-hook."""

    param: nn.Parameter
    edge: Edge | None = None
    meta: tuple[torch.dtype, torch.device] | None = None
    handle: RemovableHandle | None = None


def _take(held: _Held) -> None:
    held.edge = gradient_edge(held.param)
    held.meta = (held.param.dtype, held.param.device)


def _valid(held: _Held) -> bool:
    p = held.param
    return held.edge is not None and held.meta == (p.dtype, p.device)


class ParamTaps:
    """The session's parameter taps: `(tap, parameter)` pairs, tied parameters held once."""

    def __init__(
        self, taps: Sequence[tuple[Tap, nn.Parameter]], *, seen: Callable[[], None], capturing: Callable[[], bool],
        synced: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        self.taps = list(taps)
        self.keys = [TapKey(t.module, t.name, 0) for t, _ in self.taps]
        self._seen, self._capturing = seen, capturing
        #: DDP: whether the backward that just ended synchronised the gradients (then `.grad` is read).
        self.synced = synced
        self._held: dict[int, _Held] = {}
        for _, p in self.taps:
            self._held.setdefault(id(p), _Held(p))
        self._part: dict[int, torch.Tensor] = {}  # this backward's gradient, summed over its parts
        self._sum: dict[int, torch.Tensor] = {}  # the step's, summed over its backwards
        self._norms: dict[int, torch.Tensor] = {}  # the parameters' own norms, taken as the last backward began
        self._synced_read: dict[int, torch.Tensor | None] | None = None  # `.grad` after the last synchronised backward
        #: The backward that just ended synchronised the gradients (DDP): read `.grad` now.
        self.synced_now = False
        #: The step's rows were taken (`rows`): what arrives later in the step is an error.
        self.done = False

    def __bool__(self) -> bool:
        return bool(self.taps)

    # -- holding the edges -----------------------------------------------------------------------
    def install(self, stack: contextlib.ExitStack) -> None:
        """Take every tapped parameter's edge and hook it (unhooked when `stack` closes)."""
        stack.callback(self._unhook)
        self.check()

    def check(self) -> None:
        """Take again the edge of a parameter whose accumulator changed (its dtype or device did); cheap."""
        if self.synced is not None:
            return
        for held in self._held.values():
            if held.param.requires_grad and not _valid(held):
                if held.handle is not None:
                    held.handle.remove()
                _take(held)
                held.handle = held.edge[0].register_prehook(self._prehook(held))  # type: ignore[index]

    def _prehook(self, held: _Held) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        pid = id(held.param)
        part, seen, capturing = self._part, self._seen, self._capturing

        def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            seen()
            grad = grad_outputs[0]
            if grad is not None and capturing():
                # Held here, so the accumulator copies it into `.grad` rather than taking it: nothing that
                # changes `.grad` in place later (clipping, zero_grad) reaches it.
                before = part.get(pid)
                part[pid] = grad if before is None else before + grad

        return prehook

    def _unhook(self) -> None:
        for held in self._held.values():
            if held.handle is not None:
                held.handle.remove()
            held.handle, held.edge = None, None

    # -- one backward ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """A captured backward begins: the parameters' own norms (before any optimiser step)."""
        params: list[torch.Tensor] = [p for _, p in self.taps]
        norms = value_norms(params)  # batched on an accelerator: a few launches for all
        self._norms = {id(p): n for p, n in zip(params, norms, strict=True)}

    def arrived(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """A gradient an engine call of the strategy's own computed (`autograd_grad`): as the pre-hook would."""
        pid = id(param)
        if pid in self._held:
            before = self._part.get(pid)
            self._part[pid] = grad if before is None else before + grad

    def end_backward(self) -> dict[int, torch.Tensor | None]:
        """The captured backward ended: its gradients join the step's; returns them (for `cap.grads`)."""
        done = dict(self._part)
        self._part.clear()  # in place: the pre-hooks hold this dict
        if self.done and done:
            raise GradrunnerError(
                "a backward ended after the step's parameter gradients were reduced (cap.settle()): call settle() "
                "after the step's last backward, or leave it to cap.records()"
            )
        for pid, g in done.items():
            before = self._sum.get(pid)
            self._sum[pid] = g if before is None else before + g
        self.synced_now = self.synced is not None and self.synced()
        if self.synced_now:  # a read that replaces any earlier one of the step
            self.done = False
            self._synced_read = {pid: (None if h.param.grad is None else h.param.grad.detach())
                                 for pid, h in self._held.items()}  # fmt: skip
            return dict(self._synced_read)
        return dict(done)

    def abort_backward(self) -> None:
        """A backward failed: nothing of it reaches the step."""
        self._part.clear()

    # -- the step ----------------------------------------------------------------------------------
    def rows(self) -> Iterator[tuple[int, TapKey, nn.Parameter, torch.Tensor | None, str | None]]:
        """Each tap's (index, key, parameter, step gradient or None, reason), in tap order; the sums are let go.

        Under DDP the gradient is `.grad` as the last synchronised backward left it (read then: the caller
        reduces it before anything changes `.grad`); else the step's sum of what arrived.
        """
        synced, sums = self._synced_read, self._sum
        self._synced_read, self._sum, self.synced_now, self.done = None, {}, False, True
        for i, (key, (_, p)) in enumerate(zip(self.keys, self.taps, strict=True)):
            if not p.requires_grad and id(p) not in sums:
                yield i, key, p, None, FROZEN
            elif self.synced is not None:
                g = None if synced is None else synced.get(id(p))
                yield i, key, p, g, (NOT_SYNCED if synced is None else NO_PART) if g is None else None
            else:
                g = sums.get(id(p))
                yield i, key, p, g, NO_PART if g is None else None

    def value_norm(self, param: nn.Parameter) -> torch.Tensor | None:
        return self._norms.get(id(param))

    def forget(self) -> None:
        """A new step begins: forget what the last one held."""
        self._part.clear()
        self._sum, self._synced_read, self.synced_now, self.done = {}, None, False, False


class ParamBackward:
    """What `autograd_grad`'s own engine call needs of the parameters: every trainable one's held edge.

    Example::

        edges = pb.edges()                     # one per parameter that requires grad, in model order
        grads = torch.autograd.grad(loss, edges, allow_unused=True)
        pb.arrived(list(grads))                # tapped ones recorded; each one's .grad filled by its node
    """

    def __init__(self, params: Callable[[], list[nn.Parameter]], taps: ParamTaps, by_backward: bool) -> None:
        self._params, self._taps = params, taps
        self._held: dict[int, _Held] = {}
        self._order: list[_Held] = []
        #: `.grad` must come from `loss.backward()` (no callable accumulator, or DDP's reducer must see it).
        self.by_backward = by_backward or not FEATURES["call_accumulate_grad"]

    def edges(self) -> list[Edge | nn.Parameter]:
        """The held edge of every parameter that requires grad now (taken again where dtype or device changed)."""
        held = self._held
        order = []
        for p in self._params():
            if not p.requires_grad:
                continue
            h = held.get(id(p))
            if h is None or h.param is not p:
                h = held[id(p)] = _Held(p)
            if not _valid(h):
                _take(h)
            order.append(h)
        self._order = order
        if not FEATURES["get_gradient_edge"]:  # autograd.grad takes edges only where torch has them
            return [h.param for h in order]
        return [h.edge for h in order]  # type: ignore[misc]

    def arrived(self, grads: list[torch.Tensor | None]) -> None:
        """`edges()`'s gradients, in its order: recorded for tapped parameters, accumulated into every `.grad`."""
        arrived = [(h, g) for h, g in zip(self._order, grads, strict=True) if g is not None]
        for h, g in arrived:
            self._taps.arrived(h.param, g)
        accumulate((h.edge[0], g) for h, g in arrived)  # type: ignore[index]
