"""What `PerExampleNorms` holds while a step runs: its micro-batches, its parameters, their holders (`find_holders`)
and calls.

Example::

    t = Tracked(param, ["fc1:weight"])      # one parameter object, under every name it is tapped by
    t.reset()                               # a new step: its shares, expected calls and check start again
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.dtensors import is_dtensor
from gradrunner.capturing.per_example_check import Projection
from gradrunner.capturing.per_example_layers import ROLES, SEQUENCE_FIRST, Call, kind_of, storage
from gradrunner.capturing.per_example_math import Form
from gradrunner.capturing.torch_compat import drop_hook_dict, tensor_impl, version

#: Why a parameter's per-example norms are None in a step whose backwards its `.grad` was reset between.
RESET = (
    "its .grad was reset (zero_grad) between the step's backwards: the rows of those before are in no .grad, "
    "and per-example shares are not kept across a reset"
)
#: The same where the parameter's tensor was swapped between those backwards: `swap_tensors` swaps `.grad` with it.
RESET_BY_SWAP = (
    "its tensor was swapped (torch.utils.swap_tensors) between the step's backwards, and its .grad with it: the "
    "rows of those before are in no .grad, and per-example shares are not kept across a reset"
)
#: Why a parameter's per-example norms are None once its tensor was swapped under hooks of the user's (`Tracked.rehook`).
SWAPPED = (
    "its tensor was swapped (torch.utils.swap_tensors) while the Parameter held hooks of yours, or hooks this torch does "
    "not let gradrunner read: torch leaves those with the old tensor, and the per-example check's hook would not fire"
)


@dataclass
class Micro:
    """One backward's micro-batch: the batch sizes of its fired calls (`batch`: of its model call), whether a
    backward that fills `.grad` reached it (a forward never backwarded, a metric's, has no rows), where a
    row-mixing module was called last; how many forwards of the model it had, and which of them (numbered from
    0) a backward that fills `.grad` reached."""

    rows: set[int] = field(default_factory=set)
    batch: int = 0
    backward: bool = False
    mix_clock: tuple[int, int] = (-1, 0)
    mix_name: str = ""
    forwards: int = 0
    reached: set[int] = field(default_factory=set)
    #: Each forward's first input tensor: where it lies (`given`), so that forwards on one batch tensor are told apart.
    given: dict[int, tuple[Any, ...]] = field(default_factory=dict)

    def forwards_reason(self) -> str | None:
        """Why no parameter has rows in this micro-batch, or None: a backward reached forwards of the model given
        different batch tensors (forwards given the same one, `loss(model(x)[i]) for i`, share its rows: summed)."""
        if len({self.given.get(f) for f in self.reached}) < 2:
            return None
        return (f"one backward reached {len(self.reached)} forwards of the model given different batch tensors "
                f"(called {self.forwards} times before it): whether row i of each is the same example or another cannot "
                "be told, so their rows are neither summed nor concatenated (backward each forward's loss before the "
                "next forward)")  # fmt: skip

    def reason(self, first_clock: tuple[int, int] | None) -> str | None:
        """Why a parameter first called at `first_clock` (None: not called) has no rows in this micro-batch, or None."""
        if first_clock is not None and first_clock < self.mix_clock:
            return f"called before {self.mix_name}, which mixes rows: no per-example share"
        if len(self.rows) > 1:
            return f"calls backwarded together had different batch sizes {sorted(self.rows)}: rows are ambiguous"
        return None


@dataclass
class Tracked:
    """One parameter object: its names, its holders, and this step's shares and check."""

    param: nn.Parameter
    names: list[str]
    reason: str | None = None
    check: Projection | None = None
    step_reason: str | None = None
    expected: dict[int, int] = field(default_factory=dict)
    pending: dict[int, list[Form]] = field(default_factory=dict)
    sq: dict[int, torch.Tensor] = field(default_factory=dict)
    first_clock: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The check's hook on the parameter's gradient and the tensor it sits on (`torch.utils.swap_tensors(p, new)`
    #: swaps the tensor inside the Parameter object; the hooks registered on it stay with the old one).
    hook: RemovableHandle | None = None
    impl: object = None
    #: The tensor it held as the step began: where `.grad` was reset mid-step, whether a swap did it (`reset_reason`).
    step_impl: object = None

    def hooked(self) -> bool:
        """Whether the check's hook sits on the tensor the parameter holds now."""
        return self.hook is not None and self.impl == tensor_impl(self.param)

    def rehook(self, fn: Callable[[torch.Tensor], None] | None) -> None:
        """The check's hook `fn` on the tensor the parameter holds now (None: the hook removed, the parameter's hook
        dict set back to None where it is empty, as without one). Where the tensor was swapped and hooks of the
        user's sit in the object's dict (torch tied it to the old tensor: a hook added there would not fire, and
        tying it to the new tensor would make the user's fire where they do not without capture): `reason` SWAPPED."""
        swapped = self.hook is not None and self.impl != tensor_impl(self.param)
        if self.hook is not None:
            self.hook.remove()
        self.hook = self.impl = None
        if (swapped or fn is None) and not drop_hook_dict(self.param):
            self.reason = self.reason or (SWAPPED if swapped else None)
        elif fn is not None:
            self.hook, self.impl = self.param.register_hook(fn), tensor_impl(self.param)

    def reset_reason(self) -> str:
        """Why its rows are None in a step whose `.grad` was reset between backwards: RESET, or RESET_BY_SWAP."""
        return RESET_BY_SWAP if self.step_impl is not None and self.step_impl != tensor_impl(self.param) else RESET

    def reset(self) -> None:
        self.step_impl = tensor_impl(self.param)
        self.step_reason = None
        self.expected, self.pending, self.sq, self.first_clock = {}, {}, {}, {}
        if self.check is not None:
            self.check.reset()


@dataclass
class Holder:
    """A supported layer of the model and its tracked parameters; none for a layer hooked only to say where its
    output's rows come from (`RowOrigins.mark`: an expert's first Linear, whose second one alone is tapped)."""

    module: nn.Module
    path: str
    kind: str
    tracked: list[tuple[Tracked, str]]


@dataclass
class CallRecord:
    holder: Holder
    call: Call | None
    micro: int
    clock: int
    rows: int
    #: Which forward of the model in its micro-batch (`Micro.forwards`) the call was made in.
    forward: int
    #: The output's shape (its gradient may arrive as the viewed tensor's: `per_example_layers.output_edge`).
    shape: tuple[int, ...] = ()
    handle: Any = None
    fired: bool = False


def find_holders(model: nn.Module, by_id: dict[int, Tracked], tracked: list[Tracked]) -> list[Holder]:
    """Every supported module of `model`, with the parameters of `by_id` (`id(param)` -> its `Tracked`) it holds
    (none: its calls only mark outputs whose rows are not the batch's, for the tracked layers they feed); sets the
    `reason` of every tracked parameter that can have no per-example norms (unsupported holder, sharded, a
    sequence-first model; a frozen one has none only while it is frozen: `PerExampleNorms._on_call`)."""
    holders: list[Holder] = []
    held: set[int] = set()
    for path, module in model.named_modules():
        mine = [(by_id[id(p)], role) for role, p in module._parameters.items() if p is not None and id(p) in by_id]
        kind, why = kind_of(module)
        if not mine:
            holders += [Holder(module, path, kind, [])] if kind is not None else []
            continue
        for t, role in mine:
            held.add(id(t.param))
            if kind is None or role not in ROLES[kind]:
                what = why if kind is None else f"{type(module).__name__}.{role} is not one of {ROLES[kind]}"
                t.reason = t.reason or f"held by {path or 'the model'!r}: {what}"
        if kind is not None:
            holders.append(Holder(module, path, kind, [(t, r) for t, r in mine if r in ROLES[kind]]))
    for t in tracked:
        if id(t.param) not in held:
            t.reason = "not a parameter of any module of the model (used directly in a forward?)"
        elif is_dtensor(t.param):
            t.reason = "a sharded parameter (a DTensor: FSDP2 or tensor parallel): each rank holds a piece of it"
    seq = [(p, m) for p, m in model.named_modules() if isinstance(m, SEQUENCE_FIRST) and not m.batch_first]
    for t in tracked if seq else ():
        t.reason = t.reason or (f"the model has {seq[0][0]!r} ({type(seq[0][1]).__name__}) with batch_first=False: dim "
                                "0 of its inputs is the sequence, not the batch's rows (build it with batch_first=True)")  # fmt: skip
    return holders


def given(x: torch.Tensor | None, forward: int) -> tuple[Any, ...]:
    """Where forward number `forward`'s batch tensor `x` lies (storage, offset, shape, strides, version): equal for the
    same tensor; a forward without one, or whose storage is not readable, is told from every other."""
    where = storage(x) if x is not None else -1
    if x is None or where == -1:
        return ("unknown", forward) if x is None else ("unknown", id(x))
    return where, x.storage_offset(), tuple(x.shape), x.stride(), version(x)
