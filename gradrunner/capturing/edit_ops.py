"""How each gradient edit operation changes a gradient (`APPLY`), and the seeds random ones draw from.

`edits` applies them where a gradient flows (an edit node, a parameter's hook); these functions only compute.

Example::

    apply_edit(Edit("fc1:output", "scale", -1.0), g)    # -g
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

from gradrunner.capturing.dtensors import Whole, like, local_piece
from gradrunner.config.edits import OPERATIONS, Edit, Mask


def generator_seed(seed: int, step: int, tap: str, call: int) -> int:
    """The seed of the random numbers an edit draws at (seed, step, tap, call): the same everywhere.

    Example::

        generator_seed(0, 3, "fc1:output", 0)    # a fixed 63-bit integer
    """
    digest = hashlib.blake2b(f"{seed}|{step}|{tap}|{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _random(g: torch.Tensor, seed: int, normal: bool, whole: Whole | None = None) -> torch.Tensor:
    """float32 uniform or normal numbers of `g`'s shape on its device, from a generator seeded with `seed`.

    A piece of a sharded gradient (`whole`) gets its elements' numbers of the whole gradient's draw: the
    numbers the unsharded run draws for them.
    """
    gen = torch.Generator(device=g.device)
    gen.manual_seed(seed)
    draw = torch.randn if normal else torch.rand
    if whole is not None:
        return (
            draw(whole.shape, generator=gen, device=g.device, dtype=torch.float32)
            .reshape(-1)[whole.positions.to(g.device)]
            .view(g.shape)
        )
    return draw(g.shape, generator=gen, device=g.device, dtype=torch.float32)


def _scale(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, float)
    return torch.zeros_like(g) if v == 0.0 else g * v


def _clip_norm(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, float)
    wide = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None
    if whole is not None:  # the whole gradient's norm: this piece's sum of squares, summed over the ranks
        norm = whole.total(torch.linalg.vector_norm(g, dtype=torch.float64).square()).sqrt().to(wide or g.dtype)
    else:
        norm = torch.linalg.vector_norm(g, dtype=wide)
    return g * torch.clamp(v / (norm + 1e-6), max=1.0).to(g.dtype)


def _clip_value(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, float)
    return g.clamp(-v, v)


def _mask(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, Mask)
    shape = g.shape if whole is None else whole.shape
    dim = v.dim % len(shape)
    keep = _keep_mask(v.keep, shape[dim], g.device)
    if whole is not None:  # each element's index along `dim` in the whole gradient
        inner = math.prod(shape[dim + 1 :])
        return torch.where(keep[(whole.positions.to(g.device) // inner) % shape[dim]].view(g.shape), g,
                           torch.zeros((), dtype=g.dtype, device=g.device))  # fmt: skip
    view = [1] * g.dim()
    view[dim] = -1
    return torch.where(keep.view(view), g, torch.zeros((), dtype=g.dtype, device=g.device))


def _dropout(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, float)
    if v >= 1.0:
        return torch.zeros_like(g)
    kept = _random(g, seed, False, whole) >= v
    return torch.where(kept, g * (1.0 / (1.0 - v)), torch.zeros((), dtype=g.dtype, device=g.device))


def _noise_std(v: float | Mask, g: torch.Tensor, seed: int, whole: Whole | None = None) -> torch.Tensor:
    assert isinstance(v, float)
    return g + v * _random(g, seed, True, whole).to(g.dtype)


#: How each operation of `config.edits.OPERATIONS` (the one list of names and checks) changes a gradient.
APPLY: dict[str, Callable[[float | Mask, torch.Tensor, int, Whole | None], torch.Tensor]] = {
    "scale": _scale, "clip_norm": _clip_norm, "clip_value": _clip_value, "mask": _mask, "dropout": _dropout,
    "noise_std": _noise_std,
}  # fmt: skip
if APPLY.keys() != OPERATIONS.keys():  # a name added to one list and not the other fails at import, not at use
    raise ImportError(f"edit operations out of step: checked {sorted(OPERATIONS)}, applied {sorted(APPLY)}")


def apply_edit(edit: Edit, g: torch.Tensor, seed: int = 0, whole: Whole | None = None) -> torch.Tensor:
    """`g` with `edit` applied (a new tensor; `g` is not changed). `seed`: for dropout and noise_std.

    Example::

        apply_edit(Edit("fc1:output", "clip_value", 0.5), torch.tensor([-2.0, 0.1]))   # tensor([-0.5, 0.1])

    No host sync: every operation stays on `g`'s device. With `whole`, `g` is this rank's piece of a
    sharded gradient: it gets what the edit of the whole gradient gives its elements (the whole norm,
    the whole draw; `clip_norm` is then a collective).
    """
    return APPLY[edit.op](edit.value, g, seed, whole)


#: `mask`'s boolean vectors, made once per (indices, size, device): a copy to an accelerator from host
#: memory waits for the device, which must not happen at every backward.
_KEEP_MASKS: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}


def _keep_mask(keep: tuple[int, ...], size: int, device: torch.device) -> torch.Tensor:
    key = (keep, size, device)
    mask = _KEEP_MASKS.get(key)
    if mask is None:
        host = torch.zeros(size, dtype=torch.bool)
        host[list(keep)] = True
        mask = _KEEP_MASKS[key] = host.to(device)
    return mask


def apply_all(
    edits: Sequence[Edit], g: torch.Tensor, seed: int, step: int, tap: str, call: int, whole: Whole | None = None
) -> torch.Tensor:
    """`edits` applied to `g` one after the other (config order); random ones seeded per (seed, step, tap, call)."""
    for k, edit in enumerate(edits):
        # Two random edits on one tap draw different numbers: the entry's index is part of the seed.
        g = apply_edit(edit, g, generator_seed(seed, step, f"{tap}#{edit.index}" if k else tap, call), whole)
    return g


def apply_sharded(edits: Sequence[Edit], g: torch.Tensor, seed: int, step: int, tap: str, call: int) -> torch.Tensor:
    """`apply_all` of a `DTensor` gradient (tensor parallel): each rank edits its piece as the edit of the whole gradient.

    Example::

        apply_sharded(edits, colwise_output_grad, 0, 3, "fc1:output", 0)    # a DTensor placed as the gradient

    A `Partial` gradient (a column-parallel layer's input, a sequence-parallel LayerNorm's weight) is summed first
    (`sharded.summed`: one all-reduce) and comes back summed; the random draws are the unsharded run's, `clip_norm`
    uses the whole gradient's norm (one all-reduce over its mesh, a sub-mesh's too).
    """
    from gradrunner.capturing.sharded import summed, whole_of  # DTensor's machinery: only where one is

    g = summed(g)
    return like(g, apply_all(edits, local_piece(g), seed, step, tap, call, whole_of(g)))
