"""Post-accumulate-grad hooks handing each sharded parameter's gradient piece out once it is complete (FSDP2: after
its reduce-scatter), with how the piece counts in a merge (`sharded.placement_of`).

| name | what it does |
| --- | --- |
| `ShardedGrad` | one parameter's gradient as a hook hands it out: the whole `DTensor`, its local piece, how it counts |
| `on_sharded_grads(params, fn)` | the hooks, in a `HookSet` that removes them |

Example::

    with on_sharded_grads(model.named_parameters(), lambda g: got.append(g)):
        loss.backward()                          # FSDP2 reduce-scatters; each hook hands its piece out
    [g.piece.counted for g in got]               # whether each rank's piece counts in a merge
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.sharded import Piece, local_of, placement_of


class ShardedGrad(NamedTuple):
    """One parameter's gradient as a post-accumulate-grad hook hands it out (`on_sharded_grads`)."""

    #: The parameter's name, as `named_parameters()` gives it.
    name: str
    #: The whole gradient: a `DTensor` under FSDP2/HSDP/TP (its `placements` say how it is split), else a tensor.
    grad: torch.Tensor
    #: This rank's piece (`local_of(grad)`): what is reduced locally.
    local: torch.Tensor
    #: How the piece counts in a merge (`placement_of(grad)`).
    piece: Piece


class HookSet:
    """The post-accumulate-grad hooks `on_sharded_grads` registered; `remove()` (or leaving `with`) takes them off."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        """Remove every hook, last registered first (idempotent, as `RemovableHandle.remove`)."""
        for h in reversed(self.handles):
            h.remove()

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def on_sharded_grads(
    params: Iterable[tuple[str, nn.Parameter]], fn: Callable[[ShardedGrad], None],
    group: dist.ProcessGroup | None = None,
) -> HookSet:  # fmt: skip
    """Call `fn(ShardedGrad(...))` with each parameter's gradient once it is complete: after FSDP2's reduce-scatter.

    Example::

        got = []
        with on_sharded_grads(model.named_parameters(), got.append):
            loss.backward()
        [g.name for g in got]       # in the order gradients became final (FSDP2: the root's params last)

    `register_hook` on a sharded parameter never fires (FSDP2 computes with a fresh unsharded tensor);
    `register_post_accumulate_grad_hook` fires once per parameter when FSDP2 has assigned the reduced
    shard to `.grad`, also for the root's parameters at the very end of backward. Under
    `set_requires_gradient_sync(False)` nothing fires until the syncing backward, which hands out the
    accumulated sum. Under tensor parallel (and for plain parameters) it fires after autograd's
    accumulation into `.grad`. A parameter whose `.grad` is None then is not handed out.
    """
    cached: dict[int, Piece] = {}

    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def handed(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            piece = cached.get(id(param))
            if piece is None or piece.shape != tuple(grad.shape):
                piece = cached[id(param)] = placement_of(grad, group)
            fn(ShardedGrad(name, grad, local_of(grad), piece))

        return handed

    handles = []
    try:
        for name, p in params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(hook(name)))
    except BaseException:
        HookSet(handles).remove()
        raise
    return HookSet(handles)
