"""Parameter taps, read one way whatever the strategy: held gradient edges, or `.grad` after synchronisation.

Each tapped parameter's gradient edge (its `AccumulateGrad` node) is taken once and held for the
whole session, as DDP's reducer holds them, with ONE node pre-hook: it receives every part of the
gradient a backward brings (a reentrant checkpoint brings several) after the parameter's own tensor
hooks, before it is added to `.grad`. Nothing touches `.grad`: the model's post-accumulate-grad
hooks see what they see without capture, and `.grad` stays the same tensor. The parts are summed
over the step's backwards (gradient accumulation), except that a gradient arriving after the
parameter's `.grad` was reset to None (`zero_grad` between two backwards, `begin_backward`) replaces
what arrived before: a parameter's record is the gradient accumulated in `.grad` since it was last
reset, the one the optimiser steps with, and is reduced once, when the step's records are taken
(`ParamTaps.rows`).

A held node stays the parameter's accumulator until the parameter changes dtype or device
(`module.double()`, `p.data = <other dtype>`, also there and back: `model.double(); model.float()`) or its
tensor (`torch.utils.swap_tensors(p, new)` keeps the object): `check()` compares those and the storage once
per forward, looks the accumulator up where the storage was replaced, and takes the edge again if it changed.
Under DDP (`synced` given) a parameter's record is instead its `.grad` at the end of a backward that
synchronised the gradients (the session's end-of-backward callback runs after DDP's finalize): the averaged
gradient the optimiser uses.

Sharded parameters (`sharded=True`: the model holds `DTensor` parameters, FSDP2, HSDP or tensor
parallel) are read the same way, `.grad` after a backward that synchronised, where "synchronised"
is seen by a post-accumulate-grad hook on each tapped parameter: FSDP2 calls it once the
reduce-scattered piece is `.grad` (never under `set_requires_gradient_sync(False)`; its own
parameters have no gradient edge in the graph, so nothing else could see them), tensor parallel
after each backward's accumulation. The record is then the whole parameter's gradient, merged from
the ranks' pieces by the `Collector` (`capturing.sharded`).

`autograd_grad` needs every parameter's edge (`ParamBackward`): the same held nodes, its
`torch.autograd.grad` results reported through `arrived`, and `.grad` filled by calling each node; and
the edges of the loss's other leaves (found by a walk of its graph), whose `.grad` is filled the same way.

Example::

    taps = ParamTaps([(tap, model.fc1.weight)], seen=lambda: None, capturing=lambda: True)
    taps.install(stack)
    loss.backward(); taps.end_backward()
    for i, key, grad, reason in taps.rows(): ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradrunner.capturing.dtensors import PieceNorm, is_dtensor, local_piece
from gradrunner.capturing.extras import value_norms
from gradrunner.capturing.grad_context import FROZEN, NO_PART, NOT_FILLED
from gradrunner.capturing.held_edges import Held, take, valid
from gradrunner.capturing.leaves import leaf_accumulators
from gradrunner.capturing.taps import Tap
from gradrunner.capturing.torch_compat import (
    FEATURES,
    Edge,
    accumulate,
    accumulator_edge,
    accumulator_leaf,
    shares_memory,
)
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import TapKey

#: Why a parameter tap has no record of its own gradient under DDP when no backward of the step synchronised.
NOT_SYNCED = "no backward of this step synchronised the gradients (DDP's no_sync on every one)"


def ddp_synced(model: nn.Module) -> Callable[[], bool] | None:
    """For a `DistributedDataParallel` wrapper: whether the backward that just ended synchronised the gradients (the
    `synced` of `ParamTaps`); None for any other model.

    Example::

        capture(ddp_model.module, taps, params_synced=ddp_synced(ddp_model))

    DDP all-reduces in the backward of a forward run with `require_backward_grad_sync` (off inside
    `no_sync()`, the way `run.distributed.micro_batch` and the frameworks accumulate).
    """
    if isinstance(model, DistributedDataParallel):
        return lambda: bool(model.require_backward_grad_sync)
    return None


def ddp_world_size() -> int:
    """The processes DDP averages a synchronised gradient over (its default: the whole world)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ParamTaps:
    """The session's parameter taps: `(tap, parameter)` pairs, tied parameters held once."""

    def __init__(
        self, taps: Sequence[tuple[Tap, nn.Parameter]], *, seen: Callable[[], None], capturing: Callable[[], bool],
        synced: Callable[[], bool] | None = None, sharded: bool = False,
    ) -> None:  # fmt: skip
        self.taps = list(taps)
        self.keys = [TapKey(t.module, t.name, 0) for t, _ in self.taps]
        self._seen, self._capturing = seen, capturing
        #: Sharded parameters: `.grad` is read after a backward in which their post-accumulate-grad hooks fired.
        self.sharded = sharded
        #: The parameters whose post-accumulate-grad hooks fired in the backward going on (sharded, DDP): those a
        #: synchronised backward read again; the others keep what an earlier backward of the step read.
        self._fired: set[int] = set()
        #: Whether a backward of the step filled `.grad` (None: no backward yet; False: only `torch.autograd.grad`s).
        self.filled: bool | None = None
        self._fired_hook: Callable[[torch.Tensor], None] | None = None
        if sharded:
            synced = lambda: bool(self._fired)  # noqa: E731
        #: DDP: whether the backward that just ended synchronised the gradients (then `.grad` is read).
        self.synced = synced
        self._held: dict[int, Held] = {}
        for _, p in self.taps:
            self._held.setdefault(id(p), Held(p))
        self._part: dict[int, torch.Tensor] = {}  # this backward's gradient, summed over its parts
        self._sum: dict[int, torch.Tensor] = {}  # the step's, summed over its backwards
        self._cleared: set[int] = set()  # those with a step sum whose `.grad` was reset since (`begin_backward`)
        # the parameters' own norms, taken as the last backward began (a sharded one's piece's: `PieceNorm`)
        self._norms: dict[int, torch.Tensor | PieceNorm] = {}
        self._synced_read: dict[int, torch.Tensor | None] | None = None  # `.grad` after the last synchronised backward
        #: The backward that just ended synchronised the gradients (DDP): read `.grad` now.
        self.synced_now = False
        #: The parameters the last synchronised backward read (their rows are placed again); None: every one.
        self.read_now: set[int] | None = None
        #: The step's rows were taken (`rows`): what arrives later in the step is an error.
        self.done = False

    def __bool__(self) -> bool:
        return bool(self.taps)

    def held(self) -> dict[str, nn.Parameter]:
        """Each tap's name and the parameter it holds (resolved when the session was made)."""
        return {k.tap: p for k, (_, p) in zip(self.keys, self.taps, strict=True)}

    # -- holding the edges -----------------------------------------------------------------------
    def install(self, stack: contextlib.ExitStack) -> None:
        """Take every tapped parameter's edge and hook it (unhooked when `stack` closes)."""
        stack.callback(self._unhook)
        if self.sharded or self.synced is not None:
            self._hook_fired()
        self.check()

    def _hook_fired(self) -> None:
        """A post-accumulate-grad hook on each tapped parameter: which ones the backward gave a gradient (sharded: it
        also says the backward synchronised their `.grad`)."""
        fired, seen, capturing = self._fired, self._seen, self._capturing

        def hook(param: torch.Tensor) -> None:
            seen()
            if capturing() and param.grad is not None:
                fired.add(id(param))

        self._fired_hook = hook
        self._hook_unhooked()

    def _hook_unhooked(self) -> None:
        """The post-accumulate-grad hook on every tapped parameter that requires grad now (one unfrozen after the
        session opened too: it had none)."""
        for held in self._held.values():
            if held.handle is None and held.param.requires_grad:
                if is_dtensor(held.param):
                    _check_mesh(held.param, next(t.tap for t, p in self.taps if p is held.param))
                held.handle = held.param.register_post_accumulate_grad_hook(self._fired_hook)

    def check(self) -> None:
        """Take again the edge of a parameter whose accumulator changed (its dtype or device did); cheap."""
        if self.synced is not None:
            self._hook_unhooked()
            return
        for held in self._held.values():
            if held.param.requires_grad and not valid(held):
                if held.handle is not None:
                    held.handle.remove()
                take(held)
                held.handle = held.edge[0].register_prehook(self._prehook(held))  # type: ignore[index]

    def _prehook(self, held: Held) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
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
        """A captured backward begins: the parameters' own norms (before any optimiser step); a parameter whose
        `.grad` is None now although gradients of the step arrived for it was reset (`zero_grad`): the next
        gradient that arrives for it replaces its step sum (`replacing`).

        Only a parameter that gets a gradient again loses what arrived before: a GAN step's generator, stepped
        and then zeroed before the discriminator's backward, keeps the gradient its optimiser used. An in-place
        zero (`zero_grad(set_to_none=False)`) is not seen (that would take a read of every `.grad`'s version
        after each backward). Under DDP and sharding the record is `.grad` itself, read after the sync.
        """
        params: list[torch.Tensor] = [p for _, p in self.taps]
        # batched on an accelerator: a few launches for all; a sharded parameter's own piece (merged in the records)
        pieces = [local_piece(p) for p in params] if self.sharded else params
        norms = value_norms(pieces)
        self._norms = {id(p): n for p, n in zip(params, norms, strict=True)}
        if self.sharded:  # a DTensor's piece's norm is merged by its own placement, whether its gradient comes or not
            from gradrunner.capturing.sharded import piece_norm  # DTensor's machinery: only where one is

            at = (i for i, p in enumerate(params) if is_dtensor(p))
            self._norms.update((id(params[i]), piece_norm(params[i], norms[i], pieces[i])) for i in at)
        if self.synced is None and self._sum:  # one `is None` per parameter with gradients this step
            self._cleared.update(pid for pid in self._sum if self._held[pid].param.grad is None)

    def replacing(self) -> set[int]:
        """The parameters (`id`s) whose gradient in the backward ending now replaces their step sum: reset before it."""
        return self._cleared.intersection(self._part) if self._cleared else set()

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is tapped."""
        return id(param) in self._held

    def arrived(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A gradient an engine call of the strategy's own computed (`autograd_grad`): as the pre-hook would."""
        pid = id(param)
        if pid in self._held:
            before = self._part.get(pid)
            self._part[pid] = grad if before is None else before + grad

    def end_backward(self) -> dict[int, torch.Tensor | None]:
        """The captured backward ended: its gradients join the step's; returns them (for `cap.grads`)."""
        done, replaced = dict(self._part), self.replacing()
        self._part.clear()  # in place: the pre-hooks hold this dict
        if self.done and done:
            raise GradrunnerError(
                "a backward ended after the step's parameter gradients were reduced (cap.settle()): call settle() "
                "after the step's last backward, or leave it to cap.records()"
            )
        self._cleared -= replaced
        for pid, g in done.items():
            before = self._sum.get(pid)
            # kept as it arrived: copied where another leaf's `.grad` is a view of it (`x + a.view(..) + b.view(..)`)
            self._sum[pid] = (g.clone() if shares_memory(g) else g) if before is None or pid in replaced else before + g
        self.synced_now = self.synced is not None and self.synced()
        fired = set(self._fired)
        self._fired.clear()
        if self.synced_now:  # `.grad` of the parameters this backward gave a gradient (all, the step's first read)
            self.done = False
            first = self._synced_read is None
            read = {pid: (None if h.param.grad is None else h.param.grad.detach())
                    for pid, h in self._held.items() if first or pid in fired}  # fmt: skip
            self.read_now = None if first else set(read)
            self._synced_read = {**(self._synced_read or {}), **read}
            return read
        return dict(done)

    def abort_backward(self) -> None:
        """A backward failed: nothing of it reaches the step."""
        self._part.clear()
        self._fired.clear()

    # -- the step ----------------------------------------------------------------------------------
    def note_backward(self, fills: bool) -> None:
        """A backward of the step begins; `fills`: it adds to `.grad` (not a `torch.autograd.grad` of the user's)."""
        self.filled = bool(self.filled) or fills

    def rows(self) -> Iterator[tuple[int, TapKey, nn.Parameter, torch.Tensor | None, str | None]]:
        """Each tap's (index, key, parameter, step gradient or None, reason), in tap order; the sums are let go.

        Under DDP the gradient is `.grad` as the last synchronised backward left it (read then: the caller
        reduces it before anything changes `.grad`); else the step's sum of what arrived since `.grad` was reset.
        """
        synced, sums, missing = self._synced_read, self._sum, NO_PART if self.filled is not False else NOT_FILLED
        self._sum, self._cleared, self.synced_now, self.done, self.filled = {}, set(), False, True, None
        # which were read stays (a later backward of the step adds to it); the gradients are let go
        self._synced_read = None if synced is None else dict.fromkeys(synced)
        for i, (key, (_, p)) in enumerate(zip(self.keys, self.taps, strict=True)):
            if not p.requires_grad and id(p) not in sums:
                yield i, key, p, None, FROZEN
            elif self.synced is not None:
                g = None if synced is None else synced.get(id(p))
                yield i, key, p, g, (NOT_SYNCED if synced is None else NO_PART) if g is None else None
            else:
                g = sums.get(id(p))
                yield i, key, p, g, missing if g is None else None

    def value_norm(self, param: nn.Parameter) -> torch.Tensor | PieceNorm | None:
        return self._norms.get(id(param))

    def forget(self) -> None:
        """A new step begins: forget what the last one held."""
        self._part.clear()
        self._fired.clear()
        self._sum, self._synced_read, self.synced_now, self.done, self.read_now = {}, None, False, False, None
        self._cleared, self.filled = set(), None


def _check_mesh(param: torch.Tensor, tap: str) -> None:
    """A sharded parameter's statistics are merged over every rank: its mesh must span them all (a sub-mesh's
    parameters are not merged: which ranks hold copies of which pieces is not known from the sub-mesh alone)."""
    import torch.distributed as dist

    size, world = param.device_mesh.size(), dist.get_world_size()  # type: ignore[attr-defined]
    if size != world:
        raise GradrunnerError(
            f"the parameter of tap {tap} is a DTensor on a device mesh of {size} of the {world} processes, a sub-mesh "
            "(such as mesh['dp'] of a 2-D data x tensor parallel mesh, which fully_shard gives the layers left out of "
            "the tensor-parallel plan): gradrunner merges a sharded parameter's statistics over all processes and "
            "does not merge parameters on a sub-mesh, so parameter taps on one are refused (a glob such as *:weight "
            "matches them too). Tap parameters whose mesh spans every process (there, the tensor-parallel layers', "
            "on the 2-D mesh), or this layer's output or input instead."
        )


class ParamBackward:
    """What `autograd_grad`'s own engine call needs of the leaves: every trainable parameter's held edge,
    and the edge of every other leaf `loss.backward()` would fill.

    Example::

        edges = pb.edges(loss)                 # each parameter that requires grad, in model order, then the rest
        grads = torch.autograd.grad(loss, edges, allow_unused=True)
        pb.arrived(list(grads))                # tapped ones recorded; each leaf's .grad filled by its node

    Each backward walks `loss`'s graph for the accumulators `loss.backward()` would run
    (`leaves.leaf_accumulators`): those that are not held are the other leaves (an input made with
    `requires_grad=True`, another model's parameters used in the loss, a learnable scalar of the loss),
    whose `.grad` `autograd.grad` would leave unfilled. The held list is kept from one backward to the next
    while the model's parameter list is the same, and taken again when the walk meets a parameter's
    accumulator that is not held (its dtype or device changed, or it requires grad now); a held parameter
    absent from the graph (frozen, unused) gets no gradient from the engine call, as from `loss.backward()`.
    A non-leaf in a parameter's slot (a tensor made of it and left there, accelerate-style lending) is no
    accumulator: `loss.backward()` fills only its leaves, which the walk finds (a tapped one is recorded).
    """

    def __init__(self, params: Callable[[], list[nn.Parameter]], taps: ParamTaps, by_backward: bool) -> None:
        self._params, self._taps = params, taps
        self._held: dict[int, Held] = {}
        self._order: list[Held] = []
        #: the parameter list `_order` was built from, and the ids of its parameters
        self._for: list[nn.Parameter] | None = None
        self._param_ids: set[int] = set()
        self._edges: list[Edge | torch.Tensor] = []
        self._nodes: list[object] = []
        self._tapped: list[int] = []  # positions in `_order` of tapped parameters
        self._held_nodes: set[int] = set()  # ids of the held parameters' accumulator nodes
        self._others: list[object] = []  # this backward's other leaves' accumulator nodes
        #: `.grad` must come from `loss.backward()` (no callable accumulator, or DDP's reducer must see it).
        self.by_backward = by_backward or not FEATURES["call_accumulate_grad"]

    def edges(self, loss: torch.Tensor) -> list[Edge | torch.Tensor]:
        """The held edge of every parameter that required grad when the list was (re)built (taken again where
        `loss`'s graph shows a parameter's accumulator changed), then the edge of every other leaf of the graph."""
        params = self._params()
        if params is not self._for:
            self._build(params)
        nodes = leaf_accumulators(loss)
        others = [node for node in nodes if id(node) not in self._held_nodes]
        leaves = [accumulator_leaf(node) for node in others]
        if any(id(leaf) in self._param_ids for leaf in leaves):
            # a parameter's accumulator in this graph is not the held one: its dtype or device changed (a new
            # accumulator), or it requires grad now and did not when the list was built; take its edge again
            for leaf in leaves:
                h = self._held.get(id(leaf))
                if h is not None and h.param is leaf:
                    h.edge = None
            self._build(params)
            others = [node for node in nodes if id(node) not in self._held_nodes]
        self._others = others
        # autograd.grad takes edges only where torch has them
        base: list[Edge | torch.Tensor] = (
            self._edges if FEATURES["get_gradient_edge"] else [h.param for h in self._order]
        )
        return base + [accumulator_edge(node) for node in self._others] if self._others else base

    def _build(self, params: list[nn.Parameter]) -> None:
        held, order = self._held, []
        for p in params:
            if not p.requires_grad or p.grad_fn is not None:  # a non-leaf lent the slot: the walk finds its leaves
                continue
            h = held.get(id(p))
            if h is None or h.param is not p:
                h = held[id(p)] = Held(p)
            if not valid(h):
                take(h)
            order.append(h)
        self._for, self._order = params, order
        self._param_ids = {id(p) for p in params}
        self._edges = [h.edge for h in order]  # type: ignore[misc]
        self._nodes = [h.edge[0] for h in order]  # type: ignore[index]
        self._held_nodes = {id(node) for node in self._nodes}
        self._tapped = [i for i, h in enumerate(order) if self._taps.holds(h.param)]

    def arrived(self, grads: Sequence[torch.Tensor | None]) -> None:
        """`edges()`'s gradients, in its order: recorded for tapped parameters, accumulated into every `.grad`."""
        n = len(self._order)
        assert len(grads) == n + len(self._others)
        for i in self._tapped:
            g = grads[i]
            if g is not None:
                self._taps.arrived(self._order[i].param, g)
        if not self._others:
            accumulate(self._nodes, grads)
            return
        for node, g in zip(self._others, grads[n:], strict=True):  # a tapped one whose slot holds a tensor made of it
            if g is not None and self._taps.holds(leaf := accumulator_leaf(node)):
                self._taps.arrived(leaf, g)
        accumulate(self._nodes, grads[:n])
        accumulate(self._others, grads[n:])
        self._others = []
