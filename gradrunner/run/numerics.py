"""What a training step does to the numbers besides the optimiser: autocast, the total gradient norm, clipping.

Example::

    with autocast(device, "bf16"):
        loss = loss_fn(model(x), y)
    norm = total_norm(params)                       # before clipping, on the device
    clipped = clip(params, norm, max_norm=1.0, max_value=None)
"""

from __future__ import annotations

import torch


def autocast(device: torch.device, mode: str) -> torch.autocast:
    """`torch.autocast` for `train.autocast` (`bf16`, `fp16`; `off`: a disabled one)."""
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=mode != "off")


def total_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all parameters' `.grad` together (0 without any), on their device, no host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, 2.0)


def clip(
    params: list[torch.nn.Parameter], norm: torch.Tensor, max_norm: float | None, max_value: float | None
) -> torch.Tensor:
    """Clip `.grad` in place as `clip_grad_norm_` (given the total `norm`) then `clip_grad_value_` do; whether it changed them."""
    clipped = torch.zeros((), dtype=torch.bool, device=norm.device)
    with_grad = [p for p in params if p.grad is not None]
    if max_norm is not None and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
        clipped = clipped | (norm > max_norm)
    if max_value is not None and with_grad:
        peak = torch.stack([p.grad.detach().abs().max() for p in with_grad if p.grad is not None and p.grad.numel()])
        clipped = clipped | (peak.max().to(clipped.device) > max_value)
        torch.nn.utils.clip_grad_value_(with_grad, max_value)
    return clipped
