"""Losses the built-in experiments need beyond `torch.nn`'s (config group `loss`)."""

from __future__ import annotations

import torch
from torch import nn


class HalfSumSquaredError(nn.Module):
    """`0.5 * sum((output - target) ** 2)`, summed (not averaged) over every element.

    Example::

        loss = HalfSumSquaredError()(torch.tensor([[0.8], [0.3]]), torch.tensor([[1.0], [0.0]]))
        # 0.5 * (0.04 + 0.09) = 0.065; d loss / d output = output - target
    """

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * (output - target).pow(2).sum()
