"""Telling sharded tensors (`DTensor`: FSDP2, HSDP, tensor parallel) apart, without importing DTensor's machinery.

`import torch.distributed.tensor` costs about a second; a model holds `DTensor`s only if that module was
imported already (by `fully_shard` or `parallelize_module`), so asking `sys.modules` answers without it.
The placement-aware statistics themselves are in `capturing.sharded` (imported only where a DTensor is).

| name | what it does |
| --- | --- |
| `is_dtensor(t)` | whether `t` is a `DTensor` |
| `any_dtensor(ts)` | whether any of `ts` is (a model's parameters: the capture's sharded mode) |
| `local_piece(t)` | this rank's piece: `t.to_local()` of a DTensor (unpadded, maybe empty; its collective waited for), else `t` |
| `like(t, local)` | `local` as a DTensor placed as `t` (no collective), or `local` when `t` is plain |
| `Piece` | how this rank's piece counts in a merge over the ranks, and the whole tensor's shape (`sharded.placement_of`) |
| `PieceNorm` | a tapped DTensor's own norm still to be merged by its own piece (`sharded.piece_norm`) |
| `Whole` | where a piece sits in the whole tensor (`sharded.whole_of`): for edits that look past an element |

Example::

    is_dtensor(fsdp_model.fc1.weight)            # True after fully_shard
    local_piece(fsdp_model.fc1.weight.grad)      # this rank's rows of the gradient
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from gradrunner.capturing.torch_compat import waited

_found: list[Any] = []  # DTensor's class, once it was imported


def _dtensor_class() -> Any:
    if _found:
        return _found[0]
    module = sys.modules.get("torch.distributed.tensor")
    cls = None if module is None else getattr(module, "DTensor", None)
    if cls is not None:
        _found.append(cls)
    return cls


_PLAIN = torch.Tensor


def is_dtensor(t: object) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (False whenever DTensor was never imported).

    Example::

        is_dtensor(torch.ones(2))     # False
    """
    if type(t) is _PLAIN:  # a plain tensor (every gradient of an unsharded model): no lookup
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def any_dtensor(ts: Iterable[object]) -> bool:
    """Whether any of `ts` is a DTensor (e.g. a model's parameters after `fully_shard` or `parallelize_module`).

    Example::

        any_dtensor(model.parameters())
    """
    cls = _dtensor_class()
    return cls is not None and any(isinstance(t, cls) for t in ts)


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t`: `to_local()` of a DTensor (uneven shards unpadded, maybe empty), else `t` itself.

    Example::

        local_piece(fsdp_param.grad).shape     # (2, 4) on rank 0, (1, 4) on rank 1 for a (3, 4) weight

    A piece still waiting for its collective (a sequence-parallel gradient's reduce-scatter) is waited for:
    the plain tensor comes back (`torch_compat.waited`).
    """
    return waited(t.to_local()) if is_dtensor(t) else t  # type: ignore[attr-defined]


def like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a piece shaped as `t`'s own) as a DTensor with `t`'s mesh, placements, shape and stride; no collective.

    Example::

        like(p.grad, local_piece(p.grad).clone())     # a copy of a sharded gradient, still sharded

    A plain `t` gives `local` back.
    """
    if not is_dtensor(t):
        return local
    cls = _dtensor_class()
    return cls.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,  # type: ignore[attr-defined]
                          stride=t.stride())  # fmt: skip


class Piece(NamedTuple):
    """How one rank's local piece of a tensor relates to the whole tensor.

    Example::

        placement_of(p.grad)    # Piece(counted=True, shape=(3, 4)) on a rank holding rows of a Shard(0) grad
    """

    #: Whether this rank's piece is counted in the merge (False: a replica that another rank counts).
    counted: bool
    #: Shape of the whole tensor (its global shape); its number of elements is checked against the merge.
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PieceNorm(NamedTuple):
    """A tapped `DTensor`'s own norm (`value_norm`) as this rank holds it: its piece's, to be merged over the ranks by
    the piece's own placement with the step's rows (`sharded_rows.ShardedRows`), whether a gradient came or not.

    Example::

        piece_norm(tp_activation)     # PieceNorm(norm=tensor(2.9000), piece=Piece(True, (4, 16)), local_numel=32)
    """

    #: 0-d float64 norm of this rank's piece.
    norm: torch.Tensor
    #: How the piece counts (a replica once) and the whole tensor's shape.
    piece: Piece
    #: The number of elements in this rank's piece.
    local_numel: int


class Whole(NamedTuple):
    """Where a sharded gradient's local piece sits in the whole gradient (`sharded.whole_of`), for the edits that
    look past an element: the random draws, a mask's indices, the norm."""

    #: The whole gradient's shape.
    shape: torch.Size
    #: The flat (row-major) position in the whole gradient of each element of the piece, int64.
    positions: torch.Tensor
    #: A 0-d sum of squares of this rank's piece -> the whole gradient's (a collective: every rank calls it).
    total: Callable[[torch.Tensor], torch.Tensor]
