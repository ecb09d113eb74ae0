"""The one-pass statistics and histogram kernels on CUDA, in Triton: imported only for a CUDA gradient.

Statistics: two launches per gradient, no host synchronisation and no float64 copy: each program
reads strided blocks of the gradient and accumulates sum and sum of squares in float64 (min, max
and counts alongside) into a partials buffer; a second program folds the partials into the
7-element float64 output row `[sum, sumsq, min, max, nonzero, nan, inf]`. Where Triton is not
importable, `reduce_into` returns False and `stats` takes the torch path.

Histogram (`histogram`): one launch after the counts' zeroing, the |g| counts of
`extras.histogram_counts` from the C kernel's tables (`extras.hist_tables`): an element's raw
bin is `cell[bits >> 20]`, moved up by one comparison with that bin's upper edge (bits compared as
integers, so no flush-to-zero or NaN rule of the GPU's float compare can move a value), then folded
(`fold`); a zero or subnormal |g| (exponent 0) is the zeros' bin or the bin below the first edge
(1e-30) directly. Each program counts its blocks in registers (`tl.histogram`) and adds its counts to
the output with one atomic add per bin. The torch-ops path it replaces launched about 15 kernels per
gradient and scattered every element into a few contended bins: 0.47 ms of an H100 step per tap.

Example::

    out = torch.empty(7, dtype=torch.float64, device="cuda")
    reduce_into(torch.randn(1 << 20, device="cuda"), out)
    counts = histogram(torch.randn(1 << 20, device="cuda"))   # HIST_BINS int64 counts, or None
"""

from __future__ import annotations

from typing import Any

import torch

from gradrunner.records.columns import HIST_BINS

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

_BLOCK = 2048
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_kernels: tuple[Any, Any] | None = None
_sms: dict[int, int] = {}
#: Histogram bins in registers: a power of two above HIST_BINS; the last one takes a block's masked-off lanes.
_HIST_P2 = 256
_hist_kernel: Any = None
#: The histogram's tables on each device: (cell int32, upper edges' bits int32, fold int32).
_device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _build() -> tuple[Any, Any]:
    @triton.jit
    def partials(x_ptr, part_ptr, n, splits, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        s = tl.zeros([BLOCK], dtype=tl.float64)
        ss = tl.zeros([BLOCK], dtype=tl.float64)
        mn = tl.full([BLOCK], float("inf"), dtype=tl.float64)
        mx = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
        nz = tl.zeros([BLOCK], dtype=tl.int64)
        nan = tl.zeros([BLOCK], dtype=tl.int64)
        inf = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(pid * BLOCK, n, splits * BLOCK):
            idx = start + offs
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0)
            d = x.to(tl.float64)
            s += d
            ss += d * d
            is_nan = d != d  # min and max skip NaN here; `stats` makes them NaN from the NaN count
            mn = tl.where(mask & ~is_nan, tl.minimum(mn, d), mn)
            mx = tl.where(mask & ~is_nan, tl.maximum(mx, d), mx)
            nz += (mask & (d != 0.0)).to(tl.int64)
            nan += (mask & is_nan).to(tl.int64)
            inf += (mask & (tl.abs(d) == float("inf"))).to(tl.int64)
        base = part_ptr + pid * 7
        tl.store(base + 0, tl.sum(s, axis=0))
        tl.store(base + 1, tl.sum(ss, axis=0))
        tl.store(base + 2, tl.min(mn, axis=0))
        tl.store(base + 3, tl.max(mx, axis=0))
        tl.store(base + 4, tl.sum(nz, axis=0).to(tl.float64))
        tl.store(base + 5, tl.sum(nan, axis=0).to(tl.float64))
        tl.store(base + 6, tl.sum(inf, axis=0).to(tl.float64))

    @triton.jit
    def fold(part_ptr, out_ptr, splits, P: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.arange(0, P)
        mask = offs < splits
        row = part_ptr + offs * 7
        tl.store(out_ptr + 0, tl.sum(tl.load(row + 0, mask=mask, other=0.0), axis=0))
        tl.store(out_ptr + 1, tl.sum(tl.load(row + 1, mask=mask, other=0.0), axis=0))
        tl.store(out_ptr + 2, tl.min(tl.load(row + 2, mask=mask, other=float("inf")), axis=0))
        tl.store(out_ptr + 3, tl.max(tl.load(row + 3, mask=mask, other=float("-inf")), axis=0))
        tl.store(out_ptr + 4, tl.sum(tl.load(row + 4, mask=mask, other=0.0), axis=0))
        tl.store(out_ptr + 5, tl.sum(tl.load(row + 5, mask=mask, other=0.0), axis=0))
        tl.store(out_ptr + 6, tl.sum(tl.load(row + 6, mask=mask, other=0.0), axis=0))

    return partials, fold


def _build_hist() -> Any:
    @triton.jit
    def hist(x_ptr, cell_ptr, upper_ptr, fold_ptr, counts_ptr, n, splits, n_raw, n_bins,  # type: ignore[no-untyped-def]
             BLOCK: tl.constexpr, P2: tl.constexpr, WIDE: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([P2], dtype=tl.int32)
        for start in range(pid * BLOCK, n, splits * BLOCK):
            idx = start + offs
            mask = idx < n
            x = tl.load(x_ptr + idx, mask=mask, other=0.0)
            if WIDE:  # a float64 is binned as float32, its magnitude first clamped into float32's (as extras._raw_bins)
                a = tl.abs(x)
                a = tl.where((a > 3.4028234663852886e38) & (a <= 1.7976931348623157e308), 3.4028234663852886e38, a)
                x = tl.where((a > 0) & (a < 1.401298464324817e-45), 1.401298464324817e-45, a)
            x = x.to(tl.float32)
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            top = bits >> 20
            raw = tl.load(cell_ptr + top, mask=mask, other=0)
            up = tl.load(upper_ptr + raw, mask=mask, other=0)
            raw += ((bits >= up) & (raw < n_raw - 1)).to(tl.int32)  # NaN and Inf stay in the last raw bin
            b = tl.load(fold_ptr + raw, mask=mask, other=0)
            b = tl.where(top < 8, (bits != 0).to(tl.int32), b)  # exponent 0: zero, or below 1e-30
            b = tl.where(mask, b, P2 - 1)
            acc += tl.histogram(b, P2)
        bins = tl.arange(0, P2)
        tl.atomic_add(counts_ptr + bins, acc.to(tl.int64), mask=bins < n_bins)

    return hist


def reduce_into(flat: torch.Tensor, out: torch.Tensor) -> bool:
    """`fused_stats.reduce_into` for a contiguous CUDA gradient; False without Triton or for other dtypes.

    Example::

        reduce_into(torch.ones(3, device="cuda"), torch.empty(7, dtype=torch.float64, device="cuda"))
    """
    if triton is None or flat.dtype not in _DTYPES or not flat.is_contiguous():
        return False
    dev, sms = _device_of(flat)
    with torch.cuda.device(dev):
        launch(flat, out, sms)
    return True


def _device_of(flat: torch.Tensor) -> tuple[int, int]:
    """`flat`'s CUDA device index and its number of multiprocessors (asked once per device)."""
    dev = flat.device.index if flat.device.index is not None else torch.cuda.current_device()
    if dev not in _sms:
        _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return dev, _sms[dev]


def launch(flat: torch.Tensor, out: torch.Tensor, sms: int) -> None:
    """Both kernels on `flat` into `out`, with enough programs for `sms` multiprocessors.

    Example (runs on CPU tensors under `TRITON_INTERPRET=1`, as the tests do)::

        launch(torch.randn(10_000), torch.empty(7, dtype=torch.float64), sms=4)
    """
    global _kernels
    if _kernels is None:
        _kernels = _build()
    partials, fold = _kernels
    n = flat.numel()
    # A power of two (few compiled variants of `fold`), enough programs to fill the GPU.
    splits = min(triton.next_power_of_2(max(1, triton.cdiv(n, _BLOCK))), triton.next_power_of_2(4 * sms))
    part = torch.empty((splits, 7), dtype=torch.float64, device=flat.device)
    partials[(splits,)](flat, part, n, splits, BLOCK=_BLOCK)
    fold[(1,)](part, out, splits, P=splits)


def histogram(flat: torch.Tensor) -> torch.Tensor | None:
    """`extras.histogram_counts` of a contiguous CUDA gradient in one launch (HIST_BINS int64 counts on its
    device, no host synchronisation); None without Triton or for another dtype (the torch path counts it).

    Example::

        histogram(torch.tensor([0.0, 2e-3, float("inf")], device="cuda"))[0]   # 1: the exact zero
    """
    if triton is None or flat.dtype not in _DTYPES or not flat.is_contiguous():
        return None
    dev, sms = _device_of(flat)
    with torch.cuda.device(dev):
        return launch_hist(flat, sms)


def launch_hist(flat: torch.Tensor, sms: int) -> torch.Tensor:
    """The histogram kernel on `flat` (1-D), with enough programs for `sms` multiprocessors: its counts.

    Example (runs on CPU tensors under `TRITON_INTERPRET=1`, as the tests do)::

        launch_hist(torch.randn(10_000), sms=4)
    """
    global _hist_kernel
    if _hist_kernel is None:
        _hist_kernel = _build_hist()
    tables = _device_tables.get(flat.device)
    if tables is None:
        from gradrunner.capturing.extras import hist_tables

        cell, upper, fold = hist_tables()
        upper_bits = upper.view(torch.int32)  # the edges are positive (or NaN): their bits order as they do
        tables = _device_tables[flat.device] = (cell.to(flat.device), upper_bits.to(flat.device), fold.to(flat.device))
    cell, upper_bits, fold = tables
    n = flat.numel()
    splits = min(triton.next_power_of_2(max(1, triton.cdiv(n, _BLOCK))), triton.next_power_of_2(4 * sms))
    counts = torch.zeros(HIST_BINS, dtype=torch.int64, device=flat.device)
    _hist_kernel[(splits,)](flat, cell, upper_bits, fold, counts, n, splits, upper_bits.numel(), HIST_BINS,
                            BLOCK=_BLOCK, P2=_HIST_P2, WIDE=flat.dtype == torch.float64)  # fmt: skip
    return counts
