"""A parameter's held gradient edge (its `AccumulateGrad` node) and whether it is still the parameter's accumulator.

torch gives a parameter a new accumulator when its dtype or device changes (`module.double()`, `p.data = <other
dtype>`), also when it changes there and back (`model.double(); model.float()`: the dtype, device and tensor are then
as they were), and when `torch.utils.swap_tensors(p, new)` swaps the tensor inside the object. `valid` compares the
dtype, device, tensor and storage it was taken for, cheaply (no lookup); only where the storage was replaced does it
look the accumulator up (a clone, `p.data = p.data.clone()`, keeps the old one).

Example::

    held = Held(model.fc.weight)
    take(held)
    model.double(); model.float()
    valid(held)          # False: take(held) again, the old node never runs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.torch_compat import Edge, gradient_edge, same_storage, storage_ref, tensor_impl


@dataclass(eq=False)
class Held:
    """One parameter's held gradient edge, the dtype, device, tensor and storage it was taken for, its pre-hook."""

    param: nn.Parameter
    edge: Edge | None = None
    meta: tuple[torch.dtype, torch.device, object] | None = None
    storage: StorageWeakRef | None = None  # held weakly: while held, a freed storage's address is not reused
    handle: RemovableHandle | None = None


def take(held: Held) -> None:
    """Take the parameter's gradient edge now, and what it is valid for."""
    held.edge = gradient_edge(held.param)
    held.meta = (held.param.dtype, held.param.device, tensor_impl(held.param))
    held.storage = storage_ref(held.param)


def valid(held: Held) -> bool:
    """Whether the held edge is still the parameter's accumulator."""
    p = held.param
    if held.edge is None or held.meta != (p.dtype, p.device, tensor_impl(p)):
        return False
    if same_storage(p, held.storage):
        return True
    held.storage = storage_ref(p)  # `p.data` replaced: a cast there and back gave it a new accumulator
    return gradient_edge(p)[0] is held.edge[0]
