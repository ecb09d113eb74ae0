"""Statistics beyond the nine: per-example norms, |g| histograms and value norms, on the tensor's device.

Each function returns device tensors and never reads a value on the host (no sync): the collector
stacks them into the step's one transfer. Off unless asked for (`capture.per_example`,
`capture.histogram`); `value_norm` is on every record.

Example::

    per_example_norms(torch.ones(4, 3))     # tensor([1.7321, 1.7321, 1.7321, 1.7321], dtype=torch.float64)
    histogram_counts(torch.tensor([0.0, 1e-3, float("nan")]))   # counts per HIST_EDGES bin, int64
"""

from __future__ import annotations

import math

import torch

from gradrunner.capturing.dtensors import local_piece
from gradrunner.capturing.torch_compat import norms_all
from gradrunner.records.columns import HIST_EDGES


def per_example_norms(grad: torch.Tensor) -> torch.Tensor | None:
    """The L2 norm of each row along dim 0 (one per example), float64; None for a 0-d gradient.

    Example::

        per_example_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))   # tensor([5., 1.], dtype=torch.float64)

    Accumulated in float64 one row at a time by `linalg.vector_norm(..., dtype=float64)`, which
    reads the gradient once and makes no float64 copy of it.
    """
    if grad.dim() == 0:
        return None
    # the width, not -1: a gradient without rows (an expert given no tokens) has no -1 to infer
    rows = grad.detach().reshape(grad.shape[0], math.prod(grad.shape[1:]))
    if rows.shape[1] == 0:
        return torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)


#: Raw bins of `histogram_counts`: r = floor(4 log10 |g|) + _OFFSET puts every positive float32
#: (down to the smallest subnormal, 1.4e-45) at r >= 1; r = 0 holds zeros, r = _RAW - 1 NaN and Inf.
_OFFSET = 181
_RAW = _OFFSET + 157
_FIRST = _OFFSET - 120  # the raw bin of HIST_EDGES[0] = 1e-30
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
#: float32's largest finite and smallest nonzero magnitude: a float64 |g| is clamped into them before it is
#: rounded to float32 for binning (the C and Triton kernels do the same)
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = 2.0**-149


def _lower_edges(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 lower and upper edge of every raw bin (10^((r - _OFFSET) / 4), exactly HIST_EDGES where
    they meet); 0 below the zeros' bin, NaN past the end (so no comparison moves NaN or Inf)."""
    tables = _TABLES.get(device)
    if tables is None:
        edges = [0.0] + [10.0 ** ((r - _OFFSET) / 4) for r in range(1, _RAW - 1)] + [float("nan")] * 2
        assert edges[_FIRST] == HIST_EDGES[0] and edges[_FIRST + len(HIST_EDGES) - 1] == HIST_EDGES[-1]
        table = torch.tensor(edges, dtype=torch.float32, device=device)
        tables = _TABLES[device] = (table[:-1].contiguous(), table[1:].contiguous())
    return tables


def histogram_counts(grad: torch.Tensor) -> torch.Tensor:
    """Counts of `|g|` in the fixed bins of `HIST_EDGES` (`HIST_BINS` counts, int64, on the device).

    Example::

        histogram_counts(torch.tensor([0.0, 2e-3, 5.0, float("inf")]))[0]   # 1: the exact zero

    Bin 0 counts exact zeros, bin 1 values in (0, edges[0]), bin i+2 values in [edges[i], edges[i+1]),
    the second-last values at or above edges[-1], the last NaN and ±Inf. Magnitudes are compared in
    float32 (float64 gradients are rounded to float32 for binning only, after their magnitudes are clamped
    into float32's range: a finite value past float32's max is counted at or above edges[-1], a nonzero
    one below its smallest subnormal in (0, edges[0]), as their float64 values would be).

    The bin comes from `log10` (a handful of elementwise passes, several times faster than a binary
    search per element), then is corrected by one comparison with each neighbouring float32 edge,
    since float32 `log10` may round a value next to an edge into the neighbouring bin. The C kernel
    (CPU) and the Triton kernel (CUDA, `fused_stats.histogram_counts`) count the same bins from
    `hist_tables`.
    """
    raw = _raw_bins(grad.detach().reshape(-1))
    if raw.device.type == "cpu":
        counts = torch.bincount(raw, minlength=_RAW)
    else:  # bincount sizes its output from the data, which syncs with the host on CUDA (seen on an H100)
        counts = torch.zeros(_RAW, dtype=torch.int64, device=raw.device).scatter_add_(0, raw, torch.ones_like(raw))
    return _fold(counts)


def histogram_batch(flat: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """`histogram_counts` of k tensors concatenated in `flat` at once: (k, HIST_BINS) int64.

    `ids` (int64, like `flat`) is the number of the tensor each element belongs to. The same ops as
    one tensor's counts, whatever k: the bins are counted into k * raw-bin cells in one scatter.

    Example::

        histogram_batch(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 0, 1]), 2)[:, 0]   # zeros: [1, 0]
    """
    cell = _raw_bins(flat).add_(ids * _RAW)
    if cell.device.type == "cpu":
        counts = torch.bincount(cell, minlength=k * _RAW)
    else:  # no bincount on CUDA: it syncs (see histogram_counts)
        counts = torch.zeros(k * _RAW, dtype=torch.int64, device=cell.device).scatter_add_(0, cell, torch.ones_like(cell))
    return _fold(counts.view(k, _RAW))


_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def hist_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cell int32 [2048], upper float32 [raw bins], fold int32 [raw bins]).

    Built from this module's own float32 edge tables, so the C and Triton kernels' bins are those of
    `histogram_counts` by construction: `cell[i]` is the raw bin of the float32 with bits `i << 20`,
    found by comparing with the lower edges.
    """
    global _tables
    if _tables is None:
        from gradrunner.records.columns import HIST_BINS

        lower, upper = _lower_edges(torch.device("cpu"))
        raw = _RAW
        finite_lower = lower[: raw - 1]  # the last raw bin (NaN/Inf) has a NaN edge
        starts = (torch.arange(2048, dtype=torch.int32) << 20).view(torch.float32)
        cell = (torch.searchsorted(finite_lower, starts, right=True) - 1).clamp_(0, raw - 2).to(torch.int32)
        cell[255 << 3 :] = raw - 1  # exponent 255: Inf and NaN, the last raw bin (its upper edge is NaN)
        assert bool(upper[raw - 1].isnan())
        n_inner = len(HIST_EDGES) - 1
        fold = torch.empty(raw, dtype=torch.int32)
        fold[0] = 0
        fold[1 : _FIRST] = 1
        fold[_FIRST : _FIRST + n_inner] = torch.arange(2, 2 + n_inner, dtype=torch.int32)
        fold[_FIRST + n_inner : raw - 1] = 2 + n_inner
        fold[raw - 1] = 3 + n_inner
        assert int(fold.max()) == HIST_BINS - 1
        _tables = (cell.contiguous(), upper.contiguous(), fold)
    return _tables


def _raw_bins(flat: torch.Tensor) -> torch.Tensor:
    """The raw bin (int64, 0 to _RAW - 1) of each element's |g|, compared in float32."""
    a = flat.abs()
    if a.dtype == torch.float64:
        # Rounded as is, a finite |g| past float32's max would become Inf (the NaN/Inf bin) and a nonzero
        # one below its smallest subnormal 0 (the zeros' bin): clamp both into float32's finite nonzero range.
        a = torch.where((a == 0) | (a == math.inf), a, a.clamp(_F32_TINY, _F32_MAX))
    if a.dtype != torch.float32:
        a = a.float()
    lower, upper = _lower_edges(a.device)
    raw = torch.log10(a).mul_(4).floor_().add_(_OFFSET)
    raw = torch.nan_to_num_(raw, nan=_RAW - 1, posinf=_RAW - 1, neginf=0).clamp_(0, _RAW - 1).long()
    raw += a >= upper.index_select(0, raw)  # index_select: several times faster than indexing on CPU
    raw -= (a < lower.index_select(0, raw)).long()
    return raw


def _fold(raw: torch.Tensor) -> torch.Tensor:
    """Raw-bin counts (last dim _RAW) folded into the HIST_BINS bins of `HIST_EDGES` (last dim)."""
    n_inner = len(HIST_EDGES) - 1
    return torch.cat([
        raw[..., :1], raw[..., 1:_FIRST].sum(-1, keepdim=True), raw[..., _FIRST : _FIRST + n_inner],
        raw[..., _FIRST + n_inner : _RAW - 1].sum(-1, keepdim=True), raw[..., _RAW - 1 :],
    ], dim=-1)  # fmt: skip


def value_norm(value: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the tapped tensor itself (an activation or a parameter), 0-d, on its device.

    float64, except for a float32 tensor on an accelerator: float32 there (one launch), widened with
    the rest of the step's values when they are stacked for the step's one transfer.

    Example::

        value_norm(torch.tensor([3.0, 4.0]))     # tensor(5., dtype=torch.float64)
    """
    v = value.detach()
    if type(v) is not torch.Tensor:  # a subclass, maybe a DTensor (sharded): this rank's piece; the records merge it
        v = local_piece(v)
    if v.is_cpu and v.is_floating_point() and v.is_contiguous() and (v.dtype != torch.float32 or v.numel() < 2 * _CHUNK):
        # the common case below without its flattening view (a contiguous tensor is reduced in the same order)
        return torch.linalg.vector_norm(v, dtype=torch.float64)
    if v.is_complex():
        v = v.abs()
    if not v.is_floating_point():
        v = v.double()
    flat = v.reshape(-1)
    if flat.device.type != "cpu" and flat.dtype == torch.float32:
        # One launch: the device's reduction accumulates float32 in a tree (relative error ~1e-6);
        # the step's norms are widened to float64 together when stacked. The chunked float64 sum
        # below takes eight launches per tap, which on an H100 made a 26-tap MLP step 4.9x the bare
        # step against 3.0x without value norms.
        return torch.linalg.vector_norm(flat)
    k = flat.numel() // _CHUNK
    if flat.dtype != torch.float32 or k < 2:
        return torch.linalg.vector_norm(flat, dtype=torch.float64)
    # On every captured step, for every tap: norms of float32 chunks widened and added in float64
    # cost about half of one float64 norm (which converts every element); relative error below 1e-5.
    head, tail = flat[: k * _CHUNK].view(k, _CHUNK), flat[k * _CHUNK :]
    squares = torch.linalg.vector_norm(head, dim=1).double().square().sum()
    return (squares + torch.linalg.vector_norm(tail, dtype=torch.float64).square()).sqrt()


_CHUNK = 4096


def value_norms(values: list[torch.Tensor], *, batch: bool | None = None) -> list[torch.Tensor]:
    """`value_norm` of each tensor, the float32 ones on an accelerator in one multi-tensor op per device.

    Example::

        value_norms([torch.tensor([3.0, 4.0]), torch.ones(4)])   # [tensor(5., dtype=float64), tensor(2., ...)]

    A multi-tensor norm (`torch_compat.norms_all`) reduces every tensor of a list in a launch or two on CUDA, where one
    `value_norm` per tensor is one launch each (a model's parameters: hundreds). Its results are
    those of `value_norm` there: float32 accumulation, widened with the step's values. `batch`
    forces the batched path on (tests, on CPU) or off; by default it is taken off the CPU only.
    """
    out: list[torch.Tensor | None] = [None] * len(values)
    groups: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        usable = v.dtype == torch.float32 and v.numel() > 0 and v.layout == torch.strided
        if usable and (batch if batch is not None else not v.is_cpu):
            groups.setdefault(v.device, []).append(i)
        else:
            out[i] = value_norm(v)
    for idx in groups.values():
        for i, norm in zip(idx, norms_all([values[i].detach() for i in idx]), strict=True):
            out[i] = norm
    return out  # type: ignore[return-value]
