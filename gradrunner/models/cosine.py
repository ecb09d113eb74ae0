"""The cosine regression `cos(a * x) - b`, with scalar parameters `a` and `b`."""

from __future__ import annotations

import torch
from torch import nn


class CosineRegression(nn.Module):
    """`forward(x) = cos(a * x) - b`, elementwise.

    Example::

        model = CosineRegression(a=2.0, b=0.5)
        model(torch.tensor([0.0]))  # tensor([0.5], grad_fn=...)

    Locals of `forward()`: `mul_x = a * x` and `sum_x = cos(mul_x) - b`.
    """

    def __init__(self, a: float = 1.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mul_x = self.a * x
        sum_x = torch.cos(mul_x) - self.b
        return sum_x
