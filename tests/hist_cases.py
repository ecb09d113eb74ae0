"""Gradients for the |g| histogram's tests (test_fused_stats on CPU and under Triton's interpreter, test_cuda on a
GPU): the whole float range of a dtype, and every bin edge with the float32 on each side of it."""

from __future__ import annotations

import math

import torch

from gradrunner.records.columns import HIST_EDGES


def wide_gradient(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over the whole float range of `dtype`, zeros, ±0, subnormals, NaN and ±Inf."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-45, 39, (n,), generator=gen).double()
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 10.0**exponent).to(dtype)
    if n >= 8:
        g[:: max(1, n // 5)] = 0.0
        g[1], g[2], g[3] = -0.0, math.nan, -math.inf
        g[n - 1], g[n - 2] = math.inf, torch.finfo(dtype).tiny / 4  # a subnormal (0 in bfloat16 casts too)
        g[n // 2] = torch.finfo(dtype).max
    return g


def edge_neighbours() -> torch.Tensor:
    """Every HIST_EDGES value, the float32 on each side of it, both signs, and the smallest subnormal and normal."""
    edges = torch.tensor(HIST_EDGES, dtype=torch.float32)
    near = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(3e38))])
    tiny = torch.finfo(torch.float32).tiny
    return torch.cat([near, -near, torch.tensor([1e-45, tiny, torch.nextafter(torch.tensor(tiny), torch.tensor(0.0))])])


def float64_beyond_float32() -> torch.Tensor:
    """float64 magnitudes from 1e-300 to 1e300 (most beyond float32's range), both signs, none within 1e-6 of a
    HIST_EDGES edge, with zeros, -0.0, NaN and ±Inf."""
    exponents = torch.arange(-300.0, 300.0, 0.37, dtype=torch.float64)
    mags = 10.0**exponents
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    near = ((mags[:, None] / edges[None, :] - 1).abs() < 1e-6).any(1)
    mags = mags[~near]
    specials = torch.tensor(
        [0.0, -0.0, math.nan, math.inf, -math.inf, 1e39, -1e-50, 1e308, 5e-324], dtype=torch.float64
    )
    return torch.cat([mags, -mags, specials])
