"""What waits for a backward and goes with its graph: root forwards freed before any backward reached them (their
slots and held leaves; a tap's call outside a root forward, `model[:3](x)`, watched as one), and reentrant
checkpoint contexts freed with their forward (their deferred calls).

An evaluation loop that forgot `torch.no_grad()`, a forward whose loss is discarded: each such forward opened slots
(and, in a step `every=N` leaves out, held edited leaves) for a backward that will never reach it. Plain torch frees
its graph once nothing holds it; the session must not hold it either, nor hand its calls to the next backward. Each
root forward that returned autograd nodes leaves a sentinel in their `metadata` (no hook, nothing run by backward):
the sentinel goes with the last of them. The strategies keep nothing that holds a tapped output's node
(`Strategy.let_go`: it is read at the node), so a forward whose output is tapped goes too. As the next forward or
backward begins, each such forward's slots let go of its graph too (a leaf a later hook turned on is hooked first,
`Firing.attach_late`); where that freed every node they hooked, the forward goes (slots, held leaves, its calls'
numbers); where something still holds an inner node or leaf (module state, a cache the next forward reads), a
gradient may yet reach it there: its slots stay, watched through those nodes from then on (the forward goes as they
go: the state reset, the cache dropped). A `create_graph` backward of the user's (a gradient penalty) keeps a
forward's inner nodes in its own graph: nothing is dropped after one (`pin`). A forward still held as a backward
begins after a `retain_graph=True` one may wait past it: which graph that backward ran through shows as it ends
(`through_older`).

Example::

    pending = PendingForwards(firing)
    pending.watch(nodes, slots, late, calls_at_start, calls_at_end)   # as the root's forward returns
    pending.drop_freed()                                                # as a forward or backward begins
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gradrunner.capturing.strategies import Slot
from gradrunner.capturing.torch_compat import gradient_edge, sequence_nr

if TYPE_CHECKING:
    from gradrunner.capturing.firing import Firing
    from gradrunner.records.columns import TapKey


def hook_held(handle: Any) -> bool:
    """Whether the node hook `handle` removes is still held: the autograd node it was registered on still exists."""
    return handle.hooks_dict_ref() is not None


def holds(slot: Slot) -> bool:
    """Whether `slot`'s node may still exist: held by the slot itself (a strategy that cannot let go), or holding the
    slot's hook."""
    return (slot.edge is not None and slot.edge[0] is not None) or (slot.handle is not None and hook_held(slot.handle))  # type: ignore[index]


def _returned(slot: Slot, ids: set[int]) -> bool:
    """Whether `slot` holds one of the nodes (by `id`) the model returned: its edge's, or its tensor's now (a tapped
    value the model changed in place and returned, `ReLU(inplace=True)` last)."""
    held = slot.tensor
    return (slot.edge is not None and id(slot.edge[0]) in ids) or (held is not None and id(held.grad_fn) in ids)  # type: ignore[index]


def _upstream(nodes: Sequence[Any], slots: Sequence[Slot]) -> set[int]:
    """The nodes (by `id`) of `nodes`, the forward's returned ones, that a node `slots` hold reaches: an inner hidden
    state (`output_hidden_states=True`). The slots hold them as long as they hold their own nodes, so their life says
    nothing of the user's: they are watched apart (`PendingForwards.watch`).

    A node's inputs are made before it (a lower `torch_compat.sequence_nr`): returned nodes all made after every slot's node
    (the logits) are reached by none, and the search stops below the oldest returned node.
    """
    starts: list[Any] = []
    for slot in slots:
        if slot.edge is not None and slot.edge[0] is not None:  # type: ignore[index]
            starts.append(slot.edge[0])  # type: ignore[index]
        starts.extend(t.grad_fn for t in (slot.tensor, slot.view) if t is not None and t.grad_fn is not None)
    made = {id(n): sequence_nr(n) for n in nodes}
    newest = max((sequence_nr(n) for n in starts if n.next_functions), default=-1)  # a leaf's accumulator: none
    if not any(nr < newest for nr in made.values()):
        return set()
    oldest = min(made.values())
    seen: dict[int, Any] = {id(n): n for n in starts}  # holds each node met: no id reused while searching
    found: set[int] = set()
    todo = list(starts)
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is None or id(nxt) in seen or sequence_nr(nxt) < oldest:
                continue
            seen[id(nxt)] = nxt
            if id(nxt) in made:
                found.add(id(nxt))
            todo.append(nxt)
    return found


def through_older(
    slots: list[Slot], older: int, fired: int, key: Callable[[TapKey, int], TapKey]
) -> tuple[list[Slot], list[Slot], list[Slot], dict[int, TapKey]]:
    """A backward's `slots` as it ends, where it began with a forward since the last backward still held (its fired
    slots `slots[older:fired]`) and the last backward's forward kept for another backward through its graph
    (`retain_graph=True`; its slots `slots[:older]`): which graph it ran through shows in what arrived. Returns the
    backward's slots, its fired ones, those let go of, and the keys of the rows added already (by `order`) that change.

    None of the older slots got a gradient: the backward is the new forward's (a GAN's generator loss after the
    critic's), and the older slots go, without rows. One did (`loss.backward(retain_graph=True)`, a metric's forward
    still held, `(2 * loss).backward()`): the older forward's calls are this backward's, as with no forward since, and
    the new forward's come after them, numbered on from the older's calls of each tap (rows without gradient where
    none reached them); a tap the new forward did not call has the older call's row, none saying it was not called.

    Example::

        slots, fired, gone, moved = through_older(p.slots, p.older, p.fired, firing.key)
    """
    before, new, unfired = slots[:older], slots[older:fired], slots[fired:]
    if not any(s.delivered for s in before):
        return [*new, *unfired], new, before, {}
    calls: dict[str, int] = {}
    for s in before:
        calls[s.key.tap] = max(calls.get(s.key.tap, 0), s.key.call + 1)
    moved: dict[int, TapKey] = {}
    for s in new:
        if s.key.tap in calls:
            s.key = moved[s.order] = key(s.key, s.key.call + calls[s.key.tap])
    return [*before, *new, *(s for s in unfired if s.key.tap not in calls)], [*before, *new], [], moved


def _alive(ref: weakref.ref[_Sentinel] | None) -> bool:
    return ref is not None and ref() is not None


class _Sentinel:
    """Lives as long as the autograd nodes a root forward returned, or those its slots still hook once they went (held
    in their `metadata` only)."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False, slots=True)
class Numbered:
    """A call of an edited tap in an uncaptured step (no slot): its number, read as its edit draws (`Edits.on_fire`),
    moved down as a forward before it is dropped, as a captured step's slot's is (`PendingForwards.number`)."""

    tap: str
    call: int

    def __call__(self) -> int:
        return self.call


@dataclass(eq=False)
class _Forward:
    slots: list[Slot]
    late: list[tuple[Any, ...]]
    calls_at_start: dict[str, int]
    calls_at_end: dict[str, int]
    alive: weakref.ref[_Sentinel]
    returned: weakref.ref[_Sentinel] | None = None  # the returned nodes its slots reach (`_upstream`), while they live


class PendingForwards:
    """The outermost root forwards since the last backward began, each watched through the nodes it returned (a call
    outside one: through its tapped value's node)."""

    def __init__(self, firing: Firing) -> None:
        self._firing = firing
        self._key = f"gradrunner.forward.{id(self)}"
        self._forwards: list[_Forward] = []
        self._freed = False  # a watched forward's nodes went (set by the sentinel's weakref callback)
        self._pinned = False  # a backward with create_graph ran through them: `pin`
        self._numbered: list[Numbered] = []  # the uncaptured step's edited calls since the last backward began
        self._unwatched = False  # a forward since the last backward began is not watched: a node without `metadata`

    def number(self, tap: str, call: int) -> Numbered:
        """Call `call` of `tap`, an edited call of an uncaptured step: its number, moved down by `drop_freed`."""
        numbered = Numbered(tap, call)
        self._numbered.append(numbered)
        return numbered

    def watch(
        self,
        nodes: Sequence[Any],
        slots: list[Slot],
        late: list[tuple[Any, ...]],
        calls_at_start: dict[str, int],
        calls_at_end: dict[str, int],
    ) -> None:
        """A root forward returned `nodes` (its outputs' `grad_fn`s), having opened `slots` and held `late` entries.

        It is watched through the returned nodes no slot reaches (the logits); those a slot reaches (an inner hidden
        state) would live as long as the slots do: they are watched apart, and keep the forward once its slots let go
        (`drop_freed`) while something else holds them (the user kept a hidden state).
        """
        ids = {id(n) for n in nodes}
        ends = [s for s in slots if _returned(s, ids)]
        upstream = _upstream(nodes, [s for s in slots if s not in ends])
        tips = [n for n in nodes if id(n) not in upstream]
        # every returned node held by a slot (a tapped view written in place, the output its base): none tells the
        # user's hold from the slots', so the forward is kept, as an unwatched one
        sentinel = self._sentinel(tips) if tips else None
        returned = self._sentinel([n for n in nodes if id(n) in upstream]) if upstream else None
        if sentinel is None or (upstream and returned is None):  # a node without metadata: never known to be freed
            self._unwatched = True
            return
        # a tap on the model's output: the slot must not keep the forward's graph alive (an output view, `.squeeze(-1)`:
        # nothing of the model writes it after it returned)
        self.let_go(ends)
        forward = _Forward(slots, late, calls_at_start, calls_at_end, weakref.ref(sentinel, self._went))
        forward.returned = None if returned is None else weakref.ref(returned, self._went)
        self._forwards.append(forward)

    def let_go(self, slots: Sequence[Slot]) -> None:
        """Hold nothing of `slots`' graph (`Strategy.let_go`, their views too): a gradient that still reaches one is
        read at its node, whose hook holds the slot; the graph goes when the user's last reference to it goes."""
        self._firing.session.strategy.let_go(slots)
        for slot in slots:
            slot.view = None

    def none_since(self) -> bool:
        """Whether every root forward since the last backward began went before any backward reached it (a metric's
        forward whose output was dropped): a backward beginning now runs through an older graph (`retain_graph`)."""
        self.drop_freed()
        return not self._forwards and not self._unwatched

    def watch_call(self, value: object, tap: str, call: int, slots: list[Slot]) -> object:
        """Call `call` of `tap` fired outside a root forward (`model[:3](x)`, another model sharing the module) with
        `value`: watched through its gradient edge as a root forward of that one call (its slot, or in an uncaptured
        step its edit's number), dropped once nothing holds that node. Returns `value`."""
        if isinstance(value, torch.Tensor) and value.requires_grad:
            self.watch([gradient_edge(value)[0]], slots, [], {tap: call}, {tap: call + 1})
        return value

    def _sentinel(self, nodes: Sequence[Any]) -> _Sentinel | None:
        """A sentinel held by `nodes`' `metadata` only (None: a node has none)."""
        sentinel = _Sentinel()
        try:
            for node in nodes:
                node.metadata.setdefault(self._key, []).append(sentinel)
        except (AttributeError, TypeError):
            return None
        return sentinel

    def _went(self, _ref: object) -> None:
        self._freed = True  # runs wherever the last node went (even inside the GC): only a flag

    def pin(self) -> None:
        """A `torch.autograd.grad(..., create_graph=True)` of the user's ran (a gradient penalty): its graph may hold a
        forward's inner nodes after the forward's outputs went (WGAN-GP's interpolates), so none is dropped until the
        next backward begins (`clear`)."""
        self._pinned = True

    def clear(self, kept: bool = False) -> None:
        """Forget the forwards watched since the last backward began: a backward took them, or (`kept`) `Firing.reset`
        forgot their slots, where one still alive is no dropped forward for `none_since`."""
        alive = kept and (self._unwatched or any(f.alive() is not None for f in self._forwards))
        self._forwards, self._freed, self._pinned, self._numbered, self._unwatched = [], False, False, [], alive

    def drop_freed(self) -> None:
        """Forget the slots and held leaves of every watched forward whose nodes are gone (their hooks, with them), and
        number the calls left as if those forwards had never run: a tap's calls stay 0, 1, ... in firing order, and the
        next forward's is the one it would have had without them. (Edits read a slot's call when they draw.)
        """
        if not self._freed or self._pinned:
            return
        self._freed = False
        firing, forwards = self._firing, self._forwards
        freed = [f for f in forwards if f.alive() is None]
        if not freed:
            return
        self._forwards = [f for f in forwards if f.alive() is not None]
        # a call waiting for its reentrant checkpoint's recomputation (in `deferred` while the context lives)
        waiting = {id(s): key for key, calls in firing.deferred.items() for s in calls if s is not None}
        # Each freed forward is watched from now on through the nodes its slots hook (and its checkpoints' contexts),
        # a sentinel in their metadata: kept where something holds them (module state, a cache), it goes with them.
        sentinels: dict[int, _Sentinel | None] = {}
        for f in freed:  # hold nothing of their graphs: what still holds an inner node shows
            for slot in f.slots:
                if slot.late is not None:  # a leaf a later hook turned on: hooked now, held only where a graph uses it
                    firing.attach_late(slot)
            contexts = (firing.contexts.get(waiting[id(s)][0]) for s in f.slots if id(s) in waiting)
            edges = (s.edge[0] for s in f.slots if s.edge is not None and s.edge[0] is not None)  # type: ignore[index]
            sentinels[id(f)] = self._sentinel([n for n in (*edges, *contexts) if n is not None])
            self.let_go(f.slots)
        # a forward whose inner nodes something still holds may yet get gradients through them: its slots stay, until
        # those nodes go too (the state reset, the cache dropped)
        gone = [f for f in freed if not any(holds(s) or id(s) in waiting for s in f.slots) and not _alive(f.returned)]
        for f in freed:
            if f not in gone and (sentinel := sentinels[id(f)]) is not None:
                f.alive = weakref.ref(sentinel, self._went)
                self._forwards.append(f)
        dropped = {id(s) for f in gone for s in f.slots}
        late = {id(e) for f in gone for e in f.late}
        slots = [s for s in firing.slots if id(s) in dropped]
        firing.slots = [s for s in firing.slots if id(s) not in dropped]
        firing.session._release(slots)
        # each tap's call numbers the freed forwards took: the calls after them move down past them
        taken: dict[str, list[tuple[int, int]]] = {}
        for f in gone:
            for tap, end in f.calls_at_end.items():
                begin = f.calls_at_start.get(tap, 0)
                if end > begin:
                    taken.setdefault(tap, []).append((begin, end))

        def moved(tap: str, call: int) -> int:
            return call - sum(min(end, call) - begin for begin, end in taken.get(tap, ()) if begin < call)

        for i, slot in enumerate(firing.slots):
            slot.order = i  # slots are numbered in firing order from 0 until a backward takes them
            if slot.key.tap in taken:
                slot.key = firing.key(slot.key, moved(slot.key.tap, slot.key.call))
        kept = {id(e): (e[0], e[1], moved(e[0].tap, e[2])) for e in firing.late_uncaptured if id(e) not in late}
        firing.late_uncaptured = list(kept.values())
        # a dropped forward's own calls went with it; the others move down past them
        self._numbered = [n for n in self._numbered if moved(n.tap, n.call + 1) == moved(n.tap, n.call) + 1]
        for n in self._numbered:
            n.call = moved(n.tap, n.call)
        firing.calls = {tap: moved(tap, n) for tap, n in firing.calls.items()}
        for f in self._forwards:
            f.late = [kept.get(id(e), e) for e in f.late]
            f.calls_at_start = {tap: moved(tap, n) for tap, n in f.calls_at_start.items()}
            f.calls_at_end = {tap: moved(tap, n) for tap, n in f.calls_at_end.items()}


class CheckpointContexts:
    """Reentrant checkpoint contexts, keyed by `id` in `Firing.deferred` and `deferred_calls`: a freed one's entries go.

    A context freed before any backward reached it (a forward whose output no backward used) takes its entries with
    it: a later checkpoint's context allocated at the same address would otherwise take over the freed one's calls,
    and its recomputation be recorded under the dropped forward's call numbers.

    Example::

        key = contexts.key(ctx, "fc1:output")     # firing.deferred[key]
    """

    def __init__(self, firing: Firing) -> None:
        self._firing = firing
        self._contexts: dict[int, weakref.ref[Any]] = {}

    def key(self, ctx: object, tap: str) -> tuple[int, str]:
        """The key of `ctx`'s calls of `tap`: its `id`, watched from now on."""
        key = id(ctx)
        if key not in self._contexts:
            self._contexts[key] = weakref.ref(ctx, lambda _ref: self._freed(key))
        return key, tap

    def get(self, key: int) -> Any:
        """The context keyed `key`, None where it went."""
        ref = self._contexts.get(key)
        return None if ref is None else ref()

    def _freed(self, key: int) -> None:
        del self._contexts[key]
        firing = self._firing
        for table in (firing.deferred, firing.deferred_calls):
            for k in [k for k in table if k[0] == key]:
                del table[k]
