"""A step's gradient reductions on their device, and the statistics derived from them on the host.

The seven reductions of a gradient, `[sum, sumsq, min, max, nonzero, nan, inf]` (`N_REDUCTIONS`),
come from `reduce_one` (one large gradient, as it arrives), `reduce_batch` (every small gradient of
a dtype and device at once, a fixed number of ops) or the fused kernel (`fused_stats`).
`reduction_blocks` gathers them into a few (k, 7) blocks for the step's one host transfer;
`derive` turns the host copy into the statistics (norm, mean, std, min, max, abs_max, zero_frac,
NaN/Inf counts), and `extra_parts` / `fill_extras` carry the extra columns (value and update
norms, per-example norms, histograms) through the same transfer. `stats.Collector` drives them.

Example::

    sums, counts = reduce_one(torch.tensor([1.0, -2.0, 0.0]))   # [sum, sumsq, min, max], [nonzero, nan, inf]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from gradrunner.capturing.extras import histogram_batch
from gradrunner.capturing.torch_compat import norms_all
from gradrunner.records.columns import StepRecords, TapKey

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


class BatchRow(NamedTuple):
    """Where a deferred gradient's reductions are: row `row` of the collector's batch `batch`."""

    batch: int
    row: int


class Pending(NamedTuple):
    """One record of the step while it is collected: its key and shape, and where its reductions are."""

    order: int
    key: TapKey
    shape: tuple[int, ...]
    numel: int
    has_grad: bool
    #: [sum, sumsq, min, max] and [nonzero, nan, inf] as 0-d tensors, or all seven in one float64 tensor
    #: from the fused kernel (on CPU: the row number in the collector's buffer), or a row of a batch
    #: (`Collector.flush`); None while deferred or without gradient
    reductions: tuple[list[torch.Tensor], list[torch.Tensor]] | torch.Tensor | int | BatchRow | None
    #: a small gradient (flat, its own dtype) kept until `flush`, to be reduced with every other small
    #: gradient of its dtype and device in a fixed number of ops
    deferred: torch.Tensor | None
    values: torch.Tensor | None  # flat float32, on device
    #: 0-d float64 norm of the tapped tensor itself (taken in the forward pass), on its device
    value_norm: torch.Tensor | None = None
    #: `per_example`: float64 norm per row; `histogram`: int64 counts per bin (both on the device)
    per_example: torch.Tensor | None = None
    hist: torch.Tensor | None = None
    #: a deferred gradient's number of rows (dim 0) when its per-example norms are to come from `flush`
    rows: int | None = None


N_REDUCTIONS = 7
_CPU_ZERO = torch.zeros((), dtype=torch.int64)


def reduction_blocks(
    pending: list[Pending], cpu_rows: torch.Tensor, batches: list[torch.Tensor],
) -> tuple[dict[int, int], list[torch.Tensor]]:  # fmt: skip
    """(k, 7) float64 blocks of reductions (float32 on mps), and which block row each record is.

    `cpu_rows` holds the CPU kernel's output; a record whose `reductions` is an int is that row.
    `batches` are `Collector.flush`'s blocks, which a `BatchRow` points into.
    """
    rows: dict[int, int] = {}
    blocks: list[torch.Tensor] = []
    at = 0
    on_cpu, fused, reduced, batched = [], [], [], []  # one pass over the step's records: which kind is each
    for i, p in enumerate(pending):
        r = p.reductions
        if isinstance(r, int):
            on_cpu.append(i)
        elif isinstance(r, torch.Tensor):
            fused.append(i)
        elif isinstance(r, BatchRow):
            batched.append(i)
        elif isinstance(r, tuple):
            reduced.append(i)
    if on_cpu:
        blocks.append(cpu_rows[[pending[i].reductions for i in on_cpu]])
        rows.update((i, at + j) for j, i in enumerate(on_cpu))
        at += len(on_cpu)
    if fused:
        devices = {pending[i].reductions.device for i in fused}  # type: ignore[union-attr]
        if len(devices) == 1:
            blocks.append(torch.stack([pending[i].reductions for i in fused]))  # type: ignore[misc]
        else:
            blocks.extend(pending[i].reductions.reshape(1, -1) for i in fused)  # type: ignore[union-attr]
        rows.update((i, at + j) for j, i in enumerate(fused))
        at += len(fused)
    if reduced:
        floats = torch.stack([r for i in reduced for r in pending[i].reductions[0]])  # type: ignore[index,union-attr]
        ints = torch.stack([r for i in reduced for r in pending[i].reductions[1]])  # type: ignore[index,union-attr]
        wide = torch.float32 if floats.device.type == "mps" else torch.float64
        blocks.append(torch.cat([floats.to(wide).view(-1, 4), ints.to(wide).view(-1, 3)], dim=1))
        rows.update((i, at + j) for j, i in enumerate(reduced))
        at += len(reduced)
    start = []
    for b in batches:
        start.append(at)
        blocks.append(b)
        at += b.shape[0]
    rows.update((i, start[pending[i].reductions.batch] + pending[i].reductions.row)  # type: ignore[union-attr]
                for i in batched)  # fmt: skip
    return rows, blocks


class Segments(NamedTuple):
    """Where each element of a concatenation of k segments (sizes known on the host) goes, for `reduce_batch`.

    `ids` numbers each element by its segment. For sums in a fixed order, segment i's elements fill their
    own chunks of `width` elements (zero-padded) at `slots`; chunk c's sum goes to `chunk_slots[c]` of a
    (k, `per`) matrix (zero-padded), whose rows are summed. Built by `segments`, copied to the device once.
    """

    ids: torch.Tensor
    slots: torch.Tensor
    chunk_slots: torch.Tensor
    k: int
    width: int
    chunks: int
    per: int

    def to(self, device: torch.device) -> Segments:
        """The same layout on `device`, copied without blocking (from pinned memory on CUDA): no host sync."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

        return self._replace(ids=move(self.ids), slots=move(self.slots), chunk_slots=move(self.chunk_slots))


def segments(sizes: tuple[int, ...]) -> Segments:
    """The host-side layout of segments of `sizes` elements (`Segments`).

    Example::

        segments((3, 1)).ids   # tensor([0, 0, 0, 1])
    """
    n = torch.tensor(sizes, dtype=torch.int64)
    k, big = len(sizes), max(sizes, default=0)
    width = min(256, 1 << max(big - 1, 0).bit_length())  # the largest segment rounded up to a power of two, <= 256
    per_seg = (n + width - 1) // width
    first = torch.cumsum(per_seg, 0) - per_seg  # each segment's first chunk
    ids = torch.repeat_interleave(torch.arange(k), n)
    start = torch.cumsum(n, 0) - n
    slots = first[ids] * width + torch.arange(ids.numel()) - start[ids]
    chunk_ids = torch.repeat_interleave(torch.arange(k), per_seg)
    chunks, per = int(per_seg.sum()), int(per_seg.max()) if k else 0
    chunk_slots = chunk_ids * per + torch.arange(chunks) - first[chunk_ids]
    return Segments(ids, slots, chunk_slots, k, width, chunks, per)


def one_segment(n: int, device: torch.device) -> Segments:
    """The layout of a single segment of `n` elements, made on `device` (no host copy: n may be large)."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return Segments(torch.zeros(n, dtype=torch.int64, device=device), empty, empty, 1, n, 1, 1)


def segment_sums(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Each segment's sum along the last dim of `x` (..., N): (..., k), the same bits on every run.

    `index_add_` on CUDA adds in the order its atomics land, so float sums differ in their last bits from
    run to run; here every sum is taken in a fixed order (chunk sums, then each segment's chunks), by a
    fixed number of ops whatever k. Places are written once each (no accumulation), then summed.

    Example::

        segment_sums(torch.tensor([1.0, 2.0, 4.0]), segments((2, 1)))   # tensor([3., 4.])
    """
    if seg.k == 1:
        return x.sum(-1, keepdim=True)
    lead = x.shape[:-1]
    padded = x.new_zeros(*lead, seg.chunks * seg.width)
    padded[..., seg.slots] = x
    parts = padded.view(*lead, seg.chunks, seg.width).sum(-1)
    if seg.per == 1 and seg.chunks == seg.k:  # every segment one chunk (none wider than `width`): parts are the sums
        return parts
    table = x.new_zeros(*lead, seg.k * seg.per)
    table[..., seg.chunk_slots] = parts
    return table.view(*lead, seg.k, seg.per).sum(-1)


def reduce_batch(
    xs: list[torch.Tensor], seg: Segments, histogram: bool, rows: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reductions of each flat tensor of `xs` (one dtype, one device, none empty), all at once.

    Returns the (k, 7) wide-float reductions `[sum, sumsq, min, max, nonzero, nan, inf]` per tensor
    and, with `histogram`, their (k, HIST_BINS) int64 counts; with `rows` (the layout of every tensor's
    rows in the concatenation) the L2 norm of every row (per-example norms, float64). `seg` is the layout
    of the tensors in their concatenation (`segments`, on their device). One `cat`, a widening, and a
    fixed number of segmented reductions: the number of ops does not depend on k, and nothing is read
    on the host. The sums are accumulated in float64 (float32 on mps) from widened elements, in a fixed
    order (`segment_sums`); the counts, exact integers, and min and max do not depend on the order.

    Example::

        reduce_batch([torch.tensor([1.0, -2.0]), torch.tensor([0.0])], segments((2, 1)), False)[0][:, 0]  # [-1, 0]
    """
    k = len(xs)
    x = torch.cat(xs) if k > 1 else xs[0]
    wide = torch.float32 if x.device.type == "mps" else torch.float64
    pair = torch.empty((2, x.numel()), dtype=wide, device=x.device)  # the elements widened, and their squares
    w = pair[0].copy_(x)
    squares = torch.mul(w, w, out=pair[1])
    sums = segment_sums(pair, seg)
    counts = torch.zeros((3, k), dtype=torch.int64, device=x.device)  # integers: any order adds them exactly
    counts[0].index_add_(0, seg.ids, (x != 0).long())  # -0.0 is a zero; NaN is not (as count_nonzero)
    counts[1].index_add_(0, seg.ids, torch.isnan(x).long())
    counts[2].index_add_(0, seg.ids, torch.isinf(x).long())
    counts = counts.to(wide)
    # min and max with NaN are set to NaN from the NaN count when the statistics are derived
    mn = torch.full((k,), math.inf, dtype=wide, device=x.device).scatter_reduce_(0, seg.ids, w, "amin")
    mx = torch.full((k,), -math.inf, dtype=wide, device=x.device).scatter_reduce_(0, seg.ids, w, "amax")
    block = torch.stack([sums[0], sums[1], mn, mx, counts[0], counts[1], counts[2]], dim=1)
    norms = None if rows is None else segment_sums(squares, rows).sqrt_()
    return block, histogram_batch(x, seg.ids, k) if histogram else None, norms


def reduce_one(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-gradient device work: four reductions, plus NaN/Inf counts when they can be non-zero.

    Sum and sum of squares are accumulated in float64 without a float64 copy of the gradient: on CPU by
    `_cpu_wide_sums` (a float64 gradient: torch's own), on an accelerator by `_device_sums`.

    Returns 0-d tensors `[sum, sum of squares, min, max]` and `[non-zero count, nan count, inf count]`.
    `scratch` (same size and dtype as `flat`) takes the one elementwise temporary: a fresh large
    allocation in the middle of a training step costs more than the reduction itself (page faults).
    """
    mn, mx = torch.aminmax(flat)
    # abs() folds -0.0 into +0.0, so a zero is exactly an all-zero bit pattern; counting non-zero
    # integers is several times faster than comparing floats with 0 on CPU.
    magnitude = flat.abs() if scratch is None else torch.abs(flat, out=scratch)
    nonzero = torch.count_nonzero(magnitude.view(INT_VIEW[flat.dtype]))
    if flat.device.type != "cpu":
        # No branching on values here (it would sync per tap): sums wide, counts always.
        s, ss = _device_sums(flat)
        return [s, ss, mn, mx], [nonzero, torch.isnan(flat).sum(), torch.isinf(flat).sum()]
    s, ss = (flat.sum(), torch.dot(flat, flat)) if flat.dtype == torch.float64 else _cpu_wide_sums(flat)
    nan = inf = _CPU_ZERO
    # On CPU the sum of squares is already in host memory (numpy() cannot cross devices): branch for free.
    if not math.isfinite(float(ss.numpy())):
        nan, inf = torch.isnan(flat).sum(), torch.isinf(flat).sum()
    return [s, ss, mn, mx], [nonzero, nan, inf]


_WIDE_CHUNK = 1 << 16


def _cpu_wide_sums(flat: torch.Tensor, chunk: int = _WIDE_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 sum and sum of squares of a CPU gradient of a narrower dtype, without a float64 copy of it.

    torch's `sum(dtype=float64)` and `vector_norm(dtype=float64)` convert the whole gradient to float64 first
    on CPU; here `chunk` elements at a time are widened into one reused float64 buffer (512 KiB, in cache)
    and reduced there, and the chunks' sums added in float64: float64 rounding whatever the size, as the C
    kernel's. Used where that kernel is not (`GRADRUNNER_FUSED=0`, no C compiler).

    Example::

        _cpu_wide_sums(torch.tensor([1.0, -2.0]))   # (tensor(-1., dtype=torch.float64), tensor(5., ...))
    """
    n = flat.numel()
    buf = torch.empty(min(n, chunk), dtype=torch.float64)
    parts = torch.empty((2, -(-n // chunk)), dtype=torch.float64)
    for j, start in enumerate(range(0, n, chunk)):
        w = buf[: min(chunk, n - start)].copy_(flat[start : start + chunk])
        torch.sum(w, dim=0, out=parts[0, j])
        torch.dot(w, w, out=parts[1, j])
    s, ss = parts.sum(1)
    return s, ss


def _device_sums(flat: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and sum of squares on an accelerator without a float64 copy of the gradient.

    The sum: chunks of `chunk` elements are reduced in the gradient's dtype (on CUDA in a tree, so
    their error stays near the dtype's rounding), the chunk results are added in float64. The sum of
    squares is accumulated in float64 from the first element (`torch_compat.norms_all`, on CUDA one
    multi-tensor kernel reading the float32 elements): a float32 chunk's sum of squares is inf once
    its elements pass ~1e17, for a gradient that holds no inf.
    """
    if flat.dtype == torch.float64 or flat.device.type == "mps":
        return flat.sum(), torch.dot(flat, flat)
    k = flat.numel() // chunk
    head, tail = flat[: k * chunk].view(k, chunk), flat[k * chunk :].double()  # the tail is under `chunk`
    s = head.sum(1).double().sum() + tail.sum()
    return s, norms_all([flat], dtype=torch.float64)[0].square()


def derive(pending: list[Pending], rows: dict[int, int], host: np.ndarray) -> StepRecords:
    """The records' statistics and NaN/Inf counts from the host copy `host` of the (k, 7) reductions (`rows`: whose row)."""
    n = len(pending)
    recs = StepRecords(
        keys=[p.key for p in pending],
        shape=[p.shape for p in pending],
        numel=np.array([p.numel for p in pending], dtype=np.int64),
        has_grad=np.array([p.has_grad for p in pending], dtype=bool),
    )
    raw = np.full((n, N_REDUCTIONS), np.nan)
    if rows:
        mine = np.fromiter(rows.keys(), dtype=np.int64, count=len(rows))
        raw[mine] = host[np.fromiter(rows.values(), dtype=np.int64, count=len(rows))]
    s, ss, mn, mx, nonzero, nan, inf = raw.T
    numel = recs.numel.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s / numel
        # one pass, from mergeable sums: cancels where the spread is small next to the mean (README, Statistics)
        var = (ss - s * mean) / (numel - 1)
        recs.stats = {
            "norm": np.where(recs.has_grad & (numel == 0), 0.0, np.sqrt(ss)),
            "mean": mean,
            "std": np.where(numel > 1, np.sqrt(np.maximum(var, 0.0)), np.nan),
            # NaN makes min and max NaN, as torch.aminmax (a kernel's own min/max may skip NaN)
            "min": np.where(nan > 0, np.nan, mn),
            "max": np.where(nan > 0, np.nan, mx),
            "abs_max": np.where(nan > 0, np.nan, np.maximum(np.abs(mn), np.abs(mx))),
            "zero_frac": 1.0 - nonzero / numel,
        }
    recs.counts = {
        "nan_count": np.nan_to_num(nan).astype(np.int64),
        "inf_count": np.nan_to_num(inf).astype(np.int64),
    }
    return recs


def stack(ts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack` of 0-d tensors on the first one's device (a model spread over devices)."""
    try:
        return torch.stack(ts)  # all on one device: the usual case, without a look at each
    except RuntimeError:
        device = ts[0].device
        return torch.stack([t if t.device == device else t.to(device) for t in ts])


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    device = ts[0].device
    return torch.cat([t.reshape(-1) if t.device == device else t.reshape(-1).to(device) for t in ts])


def extra_parts(pending: list[Pending], updates: Mapping[TapKey, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The step's extras as a few flat device tensors, named: value norms, update norms, per-example, counts."""
    parts: list[tuple[str, torch.Tensor]] = []
    norms = [p.value_norm for p in pending if p.value_norm is not None]
    if norms:
        parts.append(("value_norm", stack(norms)))
    ups = [updates[p.key] for p in pending if p.key in updates]
    if ups:
        parts.append(("update_norm", stack(ups)))
    rows = [p.per_example for p in pending if p.per_example is not None]
    if rows:
        parts.append(("per_example", _cat(rows)))
    hists = [p.hist for p in pending if p.hist is not None]
    if hists:
        parts.append(("hist", _cat(hists)))
    return parts


def fill_extras(
    recs: StepRecords, pending: list[Pending], parts: list[tuple[str, torch.Tensor]], host: np.ndarray,
    updates: Mapping[TapKey, torch.Tensor], per_example: bool, histogram: bool,
) -> None:  # fmt: skip
    """Split the host copy of `extra_parts` back into the records' extra columns."""
    n = len(pending)
    at, chunk = 0, {}
    for name, t in parts:
        chunk[name] = host[at : at + t.numel()]
        at += t.numel()
    recs.value_norm, recs.update_norm = np.full(n, np.nan), np.full(n, np.nan)
    if "value_norm" in chunk:
        recs.value_norm[[i for i, p in enumerate(pending) if p.value_norm is not None]] = chunk["value_norm"]
    if "update_norm" in chunk:
        recs.update_norm[[i for i, p in enumerate(pending) if p.key in updates]] = chunk["update_norm"]
    with np.errstate(invalid="ignore", divide="ignore"):
        recs.update_ratio = recs.update_norm / recs.value_norm
    if per_example:
        recs.per_example_norm = _split(pending, chunk.get("per_example"), "per_example", np.float64)
    if histogram:
        recs.hist_counts = _split(pending, chunk.get("hist"), "hist", np.int64)


def _split(pending: list[Pending], flat: np.ndarray | None, field: str, dtype: type[np.generic]) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    at = 0
    for p in pending:
        t = getattr(p, field)
        if t is None or flat is None:
            out.append(None)
        else:
            out.append(flat[at : at + t.numel()].astype(dtype))
            at += t.numel()
    return out
