"""Statistics beyond the nine: per-example norms, |g| histograms and value norms, on the tensor's device.

Each function returns device tensors and never reads a value on the host (no sync): the collector
stacks them into the step's one transfer. Off unless asked for (`capture.per_example`,
`capture.histogram`); `value_norm` is on every record.

Example::

    per_example_norms(torch.ones(4, 3))     # tensor([1.7321, 1.7321, 1.7321, 1.7321], dtype=torch.float64)
    histogram_counts(torch.tensor([0.0, 1e-3, float("nan")]))   # counts per HIST_EDGES bin, int64
"""

from __future__ import annotations

import torch

from gradrunner.records.columns import HIST_BINS, HIST_EDGES

_EDGES: dict[torch.device, torch.Tensor] = {}


def per_example_norms(grad: torch.Tensor) -> torch.Tensor | None:
    """The L2 norm of each row along dim 0 (one per example), float64; None for a 0-d gradient.

    Example::

        per_example_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))   # tensor([5., 1.], dtype=torch.float64)

    Accumulated in float64 one row at a time by `linalg.vector_norm(..., dtype=float64)`, which
    reads the gradient once and makes no float64 copy of it.
    """
    if grad.dim() == 0:
        return None
    rows = grad.detach().reshape(grad.shape[0], -1)
    if rows.shape[1] == 0:
        return torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)


def _edges(device: torch.device) -> torch.Tensor:
    edges = _EDGES.get(device)
    if edges is None:
        edges = _EDGES[device] = torch.tensor(HIST_EDGES, dtype=torch.float32, device=device)
    return edges


def histogram_counts(grad: torch.Tensor) -> torch.Tensor:
    """Counts of `|g|` in the fixed bins of `HIST_EDGES` (`HIST_BINS` counts, int64, on the device).

    Example::

        histogram_counts(torch.tensor([0.0, 2e-3, 5.0, float("inf")]))[0]   # 1: the exact zero

    Bin 0 counts exact zeros, bin 1 values in (0, edges[0]), bin i+2 values in [edges[i], edges[i+1]),
    the second-last values at or above edges[-1], the last NaN and ±Inf. Magnitudes are compared in
    float32 (float64 gradients are rounded to float32 for binning only).
    """
    a = grad.detach().reshape(-1).abs()
    if a.dtype != torch.float32:
        a = a.float()
    idx = torch.bucketize(a, _edges(a.device), right=True) + 1  # (0, e0) -> 1, [e_i, e_i+1) -> i + 2
    idx = torch.where(a == 0, torch.zeros_like(idx), idx)
    idx = torch.where(torch.isfinite(a), idx, torch.full_like(idx, HIST_BINS - 1))
    return torch.bincount(idx, minlength=HIST_BINS)


def value_norm(value: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the tapped tensor itself (an activation or a parameter), float64, 0-d, on its device.

    Example::

        value_norm(torch.tensor([3.0, 4.0]))     # tensor(5., dtype=torch.float64)
    """
    v = value.detach()
    if v.is_complex():
        v = v.abs()
    if not v.is_floating_point():
        v = v.double()
    return torch.linalg.vector_norm(v.reshape(-1), dtype=torch.float64)
