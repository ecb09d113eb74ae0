"""The two-layer sigmoid network `y_2 = sigmoid(W2 @ sigmoid(W1 @ x))`, column-vector convention."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class TwoLayerSigmoid(nn.Module):
    """`z_1 = w1 @ x`, `y_1 = sigmoid(z_1)`, `z_2 = w2 @ y_1`, `y_2 = sigmoid(z_2)`.

    Example::

        model = TwoLayerSigmoid(w1=[[1.0], [2.0]], w2=[[3.0, 4.0], [5.0, 6.0]])
        model(torch.tensor([[1.0]]))  # shape (2, 1): one column per example

    `x` holds one example per column (shape `(in_features, batch)`). Weights given as nested
    lists are used as they are; otherwise they are drawn at random with the given sizes.
    Parameters: `w1`, `w2`. Locals of `forward()`: `z_1`, `y_1`, `z_2`, `y_2`.
    """

    def __init__(
        self,
        w1: Sequence[Sequence[float]] | None = None,
        w2: Sequence[Sequence[float]] | None = None,
        in_features: int = 1,
        hidden: int = 2,
        out_features: int = 2,
    ) -> None:
        super().__init__()
        first = torch.tensor(w1, dtype=torch.float32) if w1 is not None else torch.randn(hidden, in_features)
        second = torch.tensor(w2, dtype=torch.float32) if w2 is not None else torch.randn(out_features, first.shape[0])
        if first.dim() != 2 or second.dim() != 2 or second.shape[1] != first.shape[0]:
            raise ValueError(
                f"w1 must be (hidden, in) and w2 (out, hidden); got w1 {tuple(first.shape)}, w2 {tuple(second.shape)}"
            )
        self.w1 = nn.Parameter(first)
        self.w2 = nn.Parameter(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z_1 = self.w1 @ x
        y_1 = torch.sigmoid(z_1)
        z_2 = self.w2 @ y_1
        y_2 = torch.sigmoid(z_2)
        return y_2
