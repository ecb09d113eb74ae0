"""A tiny pre-norm transformer block built from torch.nn parts, with a linear head."""

from __future__ import annotations

import torch
from torch import nn


class TinyTransformerBlock(nn.Module):
    """LayerNorm -> MultiheadAttention -> residual -> LayerNorm -> MLP -> residual -> head.

    Example::

        model = TinyTransformerBlock(d_model=16, n_heads=2, d_ff=32, out_features=4)
        y = model(torch.randn(2, 5, 16))  # shape (2, 5, 4)

    `attn` returns a tuple `(output, weights)`: tap `attn:output.0` and `attn:output.1`
    (the weights take no part in the loss, so they get no gradient). `act` is called
    twice per forward when `reuse_act=True` (two calls per step on `act:output`).
    Locals of `forward()`: `attn_out`, `h`, `ff`.
    """

    def __init__(
        self,
        d_model: int = 16,
        n_heads: int = 2,
        d_ff: int = 32,
        out_features: int = 4,
        reuse_act: bool = False,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(d_ff, d_model)
        self.head = nn.Linear(d_model, out_features)
        self.reuse_act = reuse_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.ln1(x)
        attn_out, _weights = self.attn(q, q, q)
        h = x + attn_out
        ff = self.ff2(self.act(self.ff1(self.ln2(h))))
        h = h + ff
        if self.reuse_act:
            h = self.act(h)
        return self.head(h)
