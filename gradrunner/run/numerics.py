"""What a training step does to the numbers besides the optimiser: autocast, the total gradient norm, clipping.

Example::

    with autocast(device, "bf16"):
        loss = loss_fn(model(x), y)
    norm = total_norm(params)                       # before clipping, on the device, float64
    clipped = clip(params, max_norm=1.0, max_value=None)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradrunner.capturing.dtensors import is_dtensor, local_piece
from gradrunner.capturing.torch_compat import norms_all

#: Gradient dtypes whose norm in their own dtype is rounded to their few bits: always taken in float64.
_NARROW = (torch.float16, torch.bfloat16)


def autocast(device: torch.device, mode: str) -> torch.autocast:
    """`torch.autocast` for `train.autocast` (`bf16`, `fp16`; `off`: a disabled one)."""
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=mode != "off")


def total_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all parameters' `.grad` together (0 without any): `grad_norm`, on their device, no host sync.

    Example::

        total_norm([p])     # p.grad = torch.full((4,), 1e20): tensor(2.0000e+20, dtype=torch.float64), not inf

    Accumulated in float64 (float32 on MPS, which has none), so finite gradients of a 32-bit or smaller
    dtype give a finite norm: NaN or inf here means a gradient holds NaN or inf (or, for float64
    gradients only, a norm beyond float64's range). `torch.nn.utils.get_total_norm` works in the
    gradients' dtype, where the square of an element above ~1.8e19 is inf in float32: it said inf for
    gradients that hold none. Off the CPU (and for DTensors) one multi-tensor op per (device, dtype),
    `torch_compat.norms_all(..., dtype=float64)`, which CUDA's kernel accumulates in float64 without
    copying the gradients; so does a 16-bit gradient on the CPU (its norm in its own dtype keeps 8 or 11
    bits: 2.3178 for 2.3196 under bf16-true; the copy costs about 4 ms for 17 bf16 gradients of 256x512).
    A 32- or 64-bit one on the CPU, where that op copies every gradient to float64 (15 ms against 0.3 ms
    for 17 float32 gradients of 256x512), has its norm taken in its dtype, as torch does, and only one
    that overflowed is taken again wide (the host has the values there: no sync); the parameters' norms
    are combined in float64. Clipping keeps torch's own norm (`clip`).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    first = grads[0].device
    wide = torch.float32 if first.type == "mps" else torch.float64
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g.detach())
    norms: list[torch.Tensor] = []
    for (device, dtype), group in groups.items():
        host = device.type == "cpu" and dtype not in _NARROW and not any(is_dtensor(g) for g in group)
        norms += _host_norms(group, wide) if host else norms_all(group, dtype=wide)
    norm = torch.linalg.vector_norm(torch.stack([n.to(first, wide) for n in norms]))
    # FSDP2/HSDP/TP gradients (DTensors): the norm of the whole gradients, as a plain tensor
    return _whole(norm)


def _host_norms(grads: list[torch.Tensor], wide: torch.dtype) -> list[torch.Tensor]:
    """Each CPU gradient's norm: in its dtype (one multi-tensor op), again in `wide` where that overflowed."""
    norms = norms_all(grads)
    finite = torch.stack(norms).isfinite()
    if bool(finite.all()):
        return norms
    again = zip(norms, finite.tolist(), grads, strict=True)
    return [n if ok or g.is_complex() else _wide_norm(g, wide) for n, ok, g in again]


def _wide_norm(g: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """`g`'s norm from a `wide` copy: `dot` (2 ms for 131k float32 elements here) beats `vector_norm(dtype=)` (9 ms)."""
    flat = g.reshape(-1).to(wide)
    return torch.dot(flat, flat).sqrt()


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm of DTensor gradients (`Replicate`) as a plain tensor; any other tensor as it is."""
    whole = getattr(norm, "full_tensor", None)
    return whole() if callable(whole) else norm


def clip(params: list[torch.nn.Parameter], max_norm: float | None, max_value: float | None) -> torch.Tensor:
    """Clip `.grad` in place with `clip_grad_norm_` then `clip_grad_value_`; whether it changed them (0-d bool).

    Example::

        clipped = clip(params, max_norm=1.0, max_value=None)      # the step's `clipped`

    torch's own calls, so the clipped gradients are the standard recipe's to the bit: `clip_grad_norm_`
    takes the norm in the gradients' dtype, which for float32 gradients with elements above ~1e19 is inf
    (they are then scaled by 0) where `total_norm` (the recorded `grad_norm`) is finite. With
    `max_norm` set the gradients are read once more for that norm.
    """
    with_grad = [p for p in params if p.grad is not None]
    device = with_grad[0].grad.device if with_grad and with_grad[0].grad is not None else torch.device("cpu")
    clipped = torch.zeros((), dtype=torch.bool, device=device)
    if max_norm is not None and with_grad:
        norm = _whole(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
        clipped = clipped | (norm.to(device) > max_norm)
    if max_value is not None and with_grad:
        clipped = clipped | _beyond([p.grad for p in with_grad if p.grad is not None], max_value).to(device)
        torch.nn.utils.clip_grad_value_(with_grad, max_value)
    return clipped


def _beyond(grads: list[torch.Tensor], max_value: float) -> torch.Tensor:
    """Whether `clip_grad_value_(max_value)` changes `grads`: an element beyond it, and none NaN (0-d bool).

    Each gradient's largest |element| is compared in its own dtype, as torch compares. A DTensor gradient
    (FSDP2, HSDP) is read from this rank's piece, maybe empty (a 1-row weight over 2 ranks), and the ranks'
    answers are merged with one MAX all-reduce: `abs().max()` of a DTensor runs on each piece, fails on an
    empty one and is itself a DTensor. A NaN makes the answer false, as the max over the gradients is NaN then.
    """
    pieces = [p for p in (local_piece(g).detach() for g in grads) if p.numel()]
    device = grads[0].device if not pieces else pieces[0].device
    peaks = [p.abs().amax() for p in pieces]
    flags = torch.zeros(2, dtype=torch.float32, device=device)  # [some element beyond, some element NaN]
    if peaks:
        flags[0] = torch.stack([(q > max_value).reshape(()) for q in peaks]).any()
        flags[1] = torch.stack([q.isnan().reshape(()) for q in peaks]).any()
    if any(is_dtensor(g) for g in grads) and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return (flags[0] > 0) & (flags[1] == 0)
