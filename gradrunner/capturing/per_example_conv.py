"""A convolution's weight share per row (`ConvShare`): ghost, im2col or one grouped convolution, by the shapes.

Row i's share of a `Conv1d/2d/3d` weight's gradient is S_i = sum over output positions t of
g_i[:, t] (outer) patch_i[:, t] (per group), with `patch` the input patch under the kernel at t. Three
exact ways to its squared norm, the cheapest by the shapes (p = C_out/G, q = C_in/G x kernel size,
T = output positions):

| way | when | cost |
| --- | --- | --- |
| ghost: Gram matrices of g and of the patches (`per_example_math`, float64) | `GRAM_COST` T (p + q) <= p q (few positions, many channels: late layers) | G T^2 (p + q) per row, in float64 |
| S_i of every row by one grouped convolution (`torch.nn.grad.convNd_weight`, groups = B G) | C_in/G >= `GROUPED_MIN_CHANNELS` and T >= `GROUPED_MIN_POSITIONS` | autograd's own weight gradient, batch as groups |
| S_i by im2col (strided views, one copy) and a batched matmul | otherwise (a first layer's 1 to 3 input channels) | G T p q per row, and the im2col copy |

Measured on one CPU thread (2026-11-26, batch 32, 3x3 kernels, ms): C_in 3 -> 16 at 32x32: im2col 1.0,
grouped 2.7; 16 -> 32 at 16x16: im2col 1.9, grouped 1.5 (autograd's weight gradient 1.2); 128 -> 128
at 4x4: ghost 2.1, im2col 9.0, grouped 29. `F.unfold` (the im2col before) cost 2 to 3 ms alone.

The check's projection (`project`): through the patches where they are made anyway (one term per
row, group and position: (u . g_t)(v . patch_t)); on the grouped way from the materialised rows (one
term per row and weight entry, S_ik (u v^T)_k), whose squared norms are kept for `self_sq`. (A
convolution with v as its one-output-channel kernel gives v . patch_t without patches, but took
0.4 ms here against 0.08 ms for the patches' matrix-vector product.)

Example::

    form = ConvShare(conv, x, grad, torch.float32)
    form.self_sq()                 # (B,) squared norms of each row's share of conv.weight's gradient
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import grad as nn_grad

from gradrunner.capturing import per_example_math
from gradrunner.capturing.per_example_math import CHUNK_ELEMENTS, Factors, Lazy, projection, row_sq

#: The grouped convolution materialises S_i when each group has at least this many input channels ...
GROUPED_MIN_CHANNELS = 8
#: ... and at least this many output positions (below, im2col's copy is small and its matmul faster).
GROUPED_MIN_POSITIONS = 128
_WEIGHT_GRAD: dict[int, Callable[..., torch.Tensor]] = {
    1: nn_grad.conv1d_weight, 2: nn_grad.conv2d_weight, 3: nn_grad.conv3d_weight,
}  # fmt: skip


class ConvShare(Lazy):
    """Every row's share of `module.weight`'s gradient from one call: its input `x` and its output's gradient."""

    def __init__(self, module: nn.Conv1d, x: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> None:
        pad = list(module._reversed_padding_repeated_twice)
        if any(pad):  # padded as the module pads (any mode; 'same' may pad one more on the right)
            x = F.pad(x, pad, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)
        self.x, self.g = x.to(dtype), grad.to(dtype)
        self.nd, self.groups = len(module.kernel_size), module.groups
        self.kernel, self.stride, self.dilation = tuple(module.kernel_size), tuple(module.stride), tuple(module.dilation)
        self.batch, self.width, self.dtype = grad.shape[0], module.weight.numel(), dtype
        c_in, c_out = x.shape[1], grad.shape[1]
        self.positions = math.prod(grad.shape[2:])
        self.p, self.q = c_out // self.groups, c_in // self.groups * math.prod(self.kernel)
        self._factors: Factors | None = None
        self._sq: torch.Tensor | None = None

    def factors(self) -> Factors:
        """S_i as `Factors` over (B, G, T, p) x (B, G, T, q): the output gradient and the im2col patches (made once)."""
        if self._factors is None:
            b, groups, t = self.batch, self.groups, self.positions
            g = self.g.reshape(b, groups, self.p, t)
            patches = self.patches().reshape(b, groups, self.q, t)
            self._factors = Factors(g.transpose(-1, -2), patches.transpose(-1, -2), self.p)
        return self._factors

    def patches(self) -> torch.Tensor:
        """The input patch of every output position: (B, C_in K, T), channel-major then kernel offsets, as the weight."""
        x = self.x
        for d, (k, s, dil) in enumerate(zip(self.kernel, self.stride, self.dilation, strict=True)):
            x = x.unfold(2 + d, dil * (k - 1) + 1, s)[..., ::dil]
        nd = self.nd
        spatial, kernel = tuple(range(2, 2 + nd)), tuple(range(2 + nd, 2 + 2 * nd))
        return x.permute(0, 1, *kernel, *spatial).reshape(x.shape[0], -1, self.positions)

    def way(self) -> str:
        """"ghost", "grouped" or "im2col": the rule of the module's docstring."""
        shape = Factors(self.g[:1, :1, :1], self.g.new_empty(1, 1, self.positions, self.q), self.p)
        if per_example_math.ghost_is_cheaper(shape):
            return "ghost"
        channels = self.x.shape[1] // self.groups
        grouped = channels >= GROUPED_MIN_CHANNELS and self.positions >= GROUPED_MIN_POSITIONS
        return "grouped" if grouped else "im2col"

    def self_sq(self) -> torch.Tensor:
        if self._sq is not None:
            return self._sq
        if self.way() != "grouped":
            return row_sq([self.factors()])
        return self._grouped_pass(None)[0]

    def dense(self, i: int, j: int) -> torch.Tensor:
        """Rows i to j of S materialised by one convolution weight gradient with the rows as groups."""
        x, g = self.x[i:j], self.g[i:j]
        n, c_in, c_out = x.shape[0], x.shape[1], g.shape[1]
        size = (n * c_out, c_in // self.groups, *self.kernel)
        grads = _WEIGHT_GRAD[self.nd](x.reshape(1, n * c_in, *x.shape[2:]), size, g.reshape(1, n * c_out, *g.shape[2:]),
                                      stride=self.stride, dilation=self.dilation, groups=n * self.groups)  # fmt: skip
        return grads.reshape(n, self.width)

    def project(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Through the patches (one term per row, group and position) where they are made anyway; on the grouped way
        from the materialised rows (one term per row and weight entry, folded to two numbers), their norms kept."""
        if self.way() != "grouped":
            return projection(self.factors(), u, v, u)
        self._sq, terms = self._grouped_pass(torch.outer(u, v).reshape(-1))
        assert terms is not None
        return terms

    def _grouped_pass(self, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's S_i, chunk by chunk: their squared norms, and (given `w`) the terms S_ik w_k folded as `Projection` does."""
        step = max(1, CHUNK_ELEMENTS // max(1, self.width))
        squares, total, positive = [], [], []
        for i in range(0, self.batch, step):
            rows = self.dense(i, i + step)
            squares.append(torch.linalg.vecdot(rows, rows))
            if w is not None:
                terms = rows.mul_(w)
                total.append(terms.sum())
                positive.append(terms.clamp_(min=0).sum())
        sq = torch.cat(squares) if len(squares) > 1 else squares[0]
        if w is None:
            return sq, None
        pos, tot = sum(positive), sum(total)
        return sq, torch.stack([pos, tot - pos])  # type: ignore[list-item]
