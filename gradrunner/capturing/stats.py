"""Gradient statistics on the gradient's own device, moved to the host once per step.

`Collector.add(key, grad)` reduces one gradient on its device (no host sync on an accelerator);
`Collector.finish()` stacks every reduction of the step and makes the step's one device-to-host
transfer (two when values are captured), returning a columnar `StepRecords`.

Example::

    col = Collector(values="none")
    col.add(TapKey("fc1", "output", 0), grad)
    recs = col.finish()          # recs.norm[0], recs.zero_frac[0], ...

The reductions (sum, sum of squares, min, max, non-zero, NaN and Inf counts) come from one read of
the gradient by `fused_stats` (a C kernel on CPU, Triton on CUDA) where it is available: on CPU
every gradient goes straight to it and its 7 float64 results land in one buffer per step. Off the
CPU (or without the kernel), a small gradient (`DEFER_NUMEL`) is only kept when it arrives; when
backward ends, `Collector.flush` reduces all of them, histograms included, in one batch per dtype
and device (`_reduce_batch`: a fixed number of ops, however many taps). Else
each statistic is derived from four reductions per gradient (sum, sum of squares, min/max,
non-zero count): norm = sqrt(sum of squares), std from sum and sum of squares (Bessel-corrected,
as `torch.std`), abs_max from min and max, zero_frac from the non-zero count. NaN and Inf counts
are only computed when the sum of squares is not finite (on CPU, where reading it costs nothing)
or always (on an accelerator, where branching would need a sync).

Beside the statistics, each record carries the tapped tensor's own norm (`value_norm`, handed to
`add`), and, when asked for, per-example norms and |g| histogram counts (`capturing.extras`; on
CPU the histogram is counted by the C kernel in the same read as the statistics), reduced in `add`; `finish(loss, updates)` adds the parameter taps' update norms. All of them join
the reductions in the step's one transfer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from gradrunner.capturing import fused_stats
from gradrunner.capturing.extras import histogram_batch, histogram_counts, per_example_norms
from gradrunner.config.choices import VALUES_MODES
from gradrunner.records.columns import HIST_BINS, StepRecords, TapKey

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The one place where captured data leaves its device (tests count calls to it)."""
    return t.detach().to("cpu")


def sample_positions(tap: str, numel: int, size: int, seed: int) -> np.ndarray:
    """Fixed element positions for a tap: the same for every step, strategy and device.

    Example::

        sample_positions("fc1:output", numel=1000, size=4, seed=0)  # sorted int64 array of 4
    """
    if numel <= size:
        return np.arange(numel, dtype=np.int64)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(tap.encode())])
    return np.sort(rng.choice(numel, size=size, replace=False)).astype(np.int64)


class _BatchRow(NamedTuple):
    """Where a deferred gradient's reductions are: row `row` of the collector's batch `batch`."""

    batch: int
    row: int


class _Pending(NamedTuple):
    order: int
    key: TapKey
    shape: tuple[int, ...]
    numel: int
    has_grad: bool
    #: [sum, sumsq, min, max] and [nonzero, nan, inf] as 0-d tensors, or all seven in one float64 tensor
    #: from the fused kernel (on CPU: the row number in the collector's buffer), or a row of a batch
    #: (`Collector.flush`); None while deferred or without gradient
    reductions: tuple[list[torch.Tensor], list[torch.Tensor]] | torch.Tensor | int | _BatchRow | None
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


#: "Small": gradients up to this many elements are not reduced when they arrive but kept, and
#: reduced all together at the end of backward (`Collector.flush`): one batch per dtype and device,
#: a fixed number of ops (about 20 launches on a GPU) whatever the number of taps; for them the cost
#: of one op call, not the reading of elements, is what counts. At most this many elements (64 KiB
#: in float32) per tap are held until then; larger gradients are reduced as they arrive, so memory
#: does not grow with them. The one threshold of the batched path.
DEFER_NUMEL = 1 << 14


class Collector:
    """Reduces gradients on their device as they arrive; one host transfer per step in `finish`.

    Example::

        col = Collector(values="sample", sample_size=16, seed=0)
        col.add(TapKey("", "output", 0), grad)
        col.add(TapKey("fc2", "output", 0), None)   # a tap that got no gradient
        recs = col.finish(loss)
    """

    def __init__(
        self, values: str = "none", sample_size: int = 64, seed: int = 0, *, per_example: bool = False,
        histogram: bool = False,
    ) -> None:  # fmt: skip
        if values not in VALUES_MODES:
            raise ValueError(f"values={values!r}; allowed: {', '.join(VALUES_MODES)}")
        self.values = values
        self.sample_size = sample_size
        self.seed = seed
        self.per_example, self.histogram = per_example, histogram
        self._pending: list[_Pending] = []
        self._positions: dict[tuple[str, int, torch.device], tuple[np.ndarray, torch.Tensor]] = {}
        self._scratch: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        #: whether to try the one-pass kernels (`fused_stats`); tests turn them off to compare paths
        self._fused = fused_stats.enabled()
        self._values_none = values == "none"
        self._cpu_kernels: dict[torch.dtype, fused_stats.Kernel] | None = None  # loaded on first use
        self._cpu_hist: dict[torch.dtype, fused_stats.HistKernel] = {}
        #: the CPU kernel's output rows, 7 float64 each; a record's `reductions` is its row number
        self._rows = torch.empty((64, _N_REDUCTIONS), dtype=torch.float64)
        self._n_rows = 0
        #: (k, 7) reductions of each batch of small gradients reduced by `flush` (on their device)
        self._batches: list[torch.Tensor] = []
        #: per-element segment numbers of a batch, by the batch's gradient sizes and device (`_segment_ids`)
        self._ids: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self, key: TapKey, grad: torch.Tensor | None, order: int | None = None, mutable: bool = True, *,
        value_norm: torch.Tensor | None = None, batched: bool = True, settled: bool = False,
    ) -> None:  # fmt: skip
        """Reduce `grad` (or record that the tap got none) without leaving its device.

        `order` places the record among the step's records (default: after those added so far);
        gradients arrive in backward order, records are kept in forward (firing) order.
        `mutable=False` promises that nothing changes `grad` in place before `finish` (true of an
        intermediate's gradient; a leaf's may become its `.grad`): what is kept is then not copied.
        `value_norm` (0-d, on any device) is the tapped tensor's own norm; `batched=False` (a
        parameter) means dim 0 is no batch: no per-example norms. The extras are reduced here, so
        a gradient changed in place after `add` cannot change them. `settled=True` promises that
        nothing changes `grad` in place before the next `flush` (a gradient handed over after
        autograd's backward returned, the session flushing before it returns): a small gradient kept
        for the batch is then not copied either.
        """
        order = len(self._pending) if order is None else order
        if grad is None:
            self._pending.append(_Pending(order, key, (), 0, False, None, None, None, value_norm))
            return
        if grad.layout != torch.strided:
            if grad.layout == torch.sparse_coo and self._values_none and not self.histogram and not (
                self.per_example and batched
            ):
                self._add_sparse(key, grad, order, value_norm)
                return
            grad = grad.to_dense()  # every element was asked for (values, histogram, per-example norms)
        n = grad.numel()
        want_rows = self.per_example and batched and grad.dim() > 0
        if 0 < n <= DEFER_NUMEL and not (grad.is_cpu and self._cpu_kernel_for(grad.dtype)):
            # Small: kept as it is (copied only if it may change before `flush`) and reduced with the rest,
            # histogram and per-example norms too. No op on it now.
            flat = grad.detach().reshape(-1)
            kept = flat.clone() if mutable and not settled else flat
            self._pending.append(_Pending(
                order, key, tuple(grad.shape), n, True, None, kept, self._keep_values(key, flat, mutable), value_norm,
                rows=grad.shape[0] if want_rows else None,
            ))  # fmt: skip
            return
        per_example = per_example_norms(grad) if want_rows else None
        if grad.is_cpu and self._fused and self._values_none and grad.is_contiguous():
            # The hot path: one read of the gradient where it lies, no copy, no view; small ones
            # too, as a kernel call costs about 2 µs. With `histogram`, its counts in the same read.
            n = grad.numel()
            if n:
                done = self._cpu_reduce(grad, n)
                if done is not None:
                    row, hist = done
                    self._pending.append(_Pending(
                        order, key, tuple(grad.shape), n, True, row, None, None, value_norm, per_example, hist,
                    ))  # fmt: skip
                    return
        g = grad.detach()
        flat = g.reshape(-1)
        n = flat.numel()
        if n and self._fused:
            if flat.device.type == "cpu":
                done = self._cpu_reduce(flat, n) if flat.is_contiguous() else None
                if done is not None:
                    row, hist = done
                    values = self._keep_values(key, flat, mutable)
                    self._pending.append(_Pending(
                        order, key, tuple(g.shape), n, True, row, None, values, value_norm, per_example, hist,
                    ))  # fmt: skip
                    return
            elif n > DEFER_NUMEL:
                out = torch.empty(_N_REDUCTIONS, dtype=torch.float64, device=flat.device)
                extra = (value_norm, per_example, histogram_counts(grad) if self.histogram else None)
                if fused_stats.reduce_into(flat, out):
                    values = self._keep_values(key, flat, mutable)
                    self._pending.append(_Pending(order, key, tuple(g.shape), n, True, out, None, values, *extra))
                    return
        extra = (value_norm, per_example, histogram_counts(grad) if self.histogram else None)
        if flat.dtype not in _INT_VIEW:  # float16, bfloat16: statistics in float32
            flat = flat.float()
        self._pending.append(_Pending(
            order, key, tuple(g.shape), n, True, None if n == 0 else _reduce(flat, self._scratch_for(flat)),
            None, self._keep_values(key, flat, mutable), *extra,
        ))  # fmt: skip

    def flush(self) -> None:
        """Reduce every small gradient kept so far: one batch per dtype and device, no host sync.

        Example::

            col.add(key, small_grad)
            col.flush()          # the session calls this when backward ends; `finish` calls it too

        Each batch is one concatenation and a fixed number of segmented reductions (`_reduce_batch`),
        so a step's small gradients cost the same few launches whether there are 3 or 300 of them;
        the kept gradients are let go here.
        """
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(self._pending):
            if p.deferred is not None:
                groups.setdefault((p.deferred.dtype, p.deferred.device), []).append(i)
        for idx in groups.values():
            xs: list[torch.Tensor] = [self._pending[i].deferred for i in idx]  # type: ignore[misc]
            sizes = tuple(x.numel() for x in xs)
            ids = self._segment_ids(sizes, xs[0].device)
            # per-example norms: every tensor's rows (one row for a tensor without them), numbered
            n_rows = [self._pending[i].rows or 1 for i in idx]
            row_ids = None
            if any(self._pending[i].rows is not None for i in idx):
                row_sizes = tuple(n // r for n, r in zip(sizes, n_rows, strict=True) for _ in range(r))
                row_ids = self._segment_ids(row_sizes, xs[0].device)
            block, hist, row_norms = _reduce_batch(xs, ids, self.histogram, row_ids, sum(n_rows))
            self._batches.append(block)
            at = 0
            for j, (i, r) in enumerate(zip(idx, n_rows, strict=True)):
                p = self._pending[i]
                self._pending[i] = p._replace(
                    reductions=_BatchRow(len(self._batches) - 1, j), deferred=None, rows=None,
                    hist=None if hist is None else hist[j],
                    per_example=row_norms[at : at + r] if row_norms is not None and p.rows is not None else p.per_example,
                )  # fmt: skip
                at += r

    def _segment_ids(self, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int64 segment number of each element of the concatenated batch, on `device`; kept per sizes.

        Built on the host and copied without blocking (from pinned memory on CUDA): no host sync, and
        once per set of sizes (a training step repeats its sizes).
        """
        key = (sizes, device)
        ids = self._ids.get(key)
        if ids is None:
            if len(self._ids) >= 8:
                self._ids.clear()  # sizes change from step to step (variable-length batches): keep a few
            host = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))
            if device.type == "cuda":
                host = host.pin_memory()
            ids = self._ids[key] = host.to(device, non_blocking=True) if device.type != "cpu" else host
        return ids

    def _add_sparse(self, key: TapKey, grad: torch.Tensor, order: int, value_norm: torch.Tensor | None) -> None:
        """A sparse COO gradient (`nn.Embedding(sparse=True)`): statistics over the dense gradient's
        elements, zeros included, from its stored values alone (a huge table is never made dense).

        Sums, the non-zero and NaN/Inf counts are those of the stored values; where some elements are
        not stored they are zeros, so the minimum is at most 0 and the maximum at least 0.
        """
        vals = grad.detach().coalesce().values().reshape(-1)  # coalesce sums repeated indices, as to_dense
        if vals.dtype not in _INT_VIEW:
            vals = vals.float()
        n = grad.numel()
        if vals.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=vals.device)
            floats, ints = [zero, zero, zero, zero], [zero, zero, zero]
        else:
            (s, ss, mn, mx), ints = _reduce(vals)
            if vals.numel() < n:
                mn, mx = torch.clamp(mn, max=0), torch.clamp(mx, min=0)
            floats = [s, ss, mn, mx]
        self._pending.append(_Pending(order, key, tuple(grad.shape), n, True, (floats, ints), None, None, value_norm))

    def _cpu_kernel_for(self, dtype: torch.dtype) -> bool:
        """Whether the C kernel takes a CPU gradient of `dtype` (its histogram variant with `histogram`)."""
        if not self._fused:
            return False
        if self._cpu_kernels is None:
            self._cpu_kernels = fused_stats.cpu_kernels()
            self._cpu_hist = fused_stats.cpu_hist_kernels() if self.histogram else {}
        return dtype in (self._cpu_hist if self.histogram else self._cpu_kernels)

    def _cpu_reduce(self, flat: torch.Tensor, n: int) -> tuple[int, torch.Tensor | None] | None:
        """The C kernel on contiguous CPU `flat` into a fresh row: (row, histogram counts or None).

        None where no kernel fits (no compiler, another dtype): the caller takes the torch path.
        """
        if self._cpu_kernels is None:
            self._cpu_kernels = fused_stats.cpu_kernels()
            self._cpu_hist = fused_stats.cpu_hist_kernels() if self.histogram else {}
        if self.histogram:
            fh = self._cpu_hist.get(flat.dtype)
            if fh is None:
                return None
            row = self._next_row()
            counts = torch.zeros(HIST_BINS, dtype=torch.int64)
            fh(flat.data_ptr(), n, self._rows.data_ptr() + row * _N_REDUCTIONS * 8, counts.data_ptr())
            return row, counts
        fn = self._cpu_kernels.get(flat.dtype)
        if fn is None:
            return None
        row = self._next_row()
        fn(flat.data_ptr(), n, self._rows.data_ptr() + row * _N_REDUCTIONS * 8)
        return row, None

    def _next_row(self) -> int:
        """The number of a fresh output row for the CPU kernel (the buffer doubles when full)."""
        if self._n_rows == self._rows.shape[0]:
            grown = torch.empty((2 * self._n_rows, _N_REDUCTIONS), dtype=torch.float64)
            grown[: self._n_rows] = self._rows
            self._rows = grown
        self._n_rows += 1
        return self._n_rows - 1

    def _scratch_for(self, flat: torch.Tensor) -> torch.Tensor:
        """One reusable buffer per gradient size: the reductions' temporary, allocated once."""
        k = (flat.numel(), flat.dtype, flat.device)
        buf = self._scratch.get(k)
        if buf is None:
            buf = self._scratch[k] = torch.empty_like(flat)
        return buf

    def _keep_values(self, key: TapKey, flat: torch.Tensor, mutable: bool) -> torch.Tensor | None:
        if self.values == "none":
            return None
        if self.values == "full":
            return flat.float().clone() if flat.dtype == torch.float32 and mutable else flat.float()
        cache_key = (key.tap, flat.numel(), flat.device)
        if cache_key not in self._positions:
            pos = sample_positions(key.tap, flat.numel(), self.sample_size, self.seed)
            self._positions[cache_key] = (pos, torch.from_numpy(pos).to(flat.device))
        return flat.index_select(0, self._positions[cache_key][1]).float()

    def finish(
        self, loss: torch.Tensor | None = None, updates: Mapping[TapKey, torch.Tensor] | None = None,
        edited: Mapping[TapKey, torch.Tensor] | None = None,
    ) -> StepRecords:  # fmt: skip
        """Reduce what was deferred, move all reductions to the host in one transfer, derive statistics.

        `updates` maps parameter taps to the 0-d norm of the optimiser step's change (`update_norm`),
        `edited` edited records to the 0-d norm of their gradient after the edit (`edited_norm`):
        they ride in the same transfer as everything else.
        """
        self.flush()
        pending, self._pending = sorted(self._pending, key=lambda p: p.order), []
        rows, blocks = _reduction_blocks(pending, self._rows, self._batches)
        self._n_rows, self._batches = 0, []
        parts = [b.reshape(-1) for b in blocks]
        n_red = sum(p.numel() for p in parts)
        extras = _extra_parts(pending, updates or {})
        edited_at = n_red + sum(t.numel() for _, t in extras)
        edited = {p.key: edited[p.key] for p in pending if p.key in edited} if edited else {}
        if edited:
            extras.append(("edited_norm", _stack(list(edited.values()))))
        parts += [t for _, t in extras]
        if loss is not None:
            parts.append(loss.detach().reshape(1))
        flat = np.zeros(0)
        if parts:
            device = parts[0].device
            wide = torch.float32 if device.type == "mps" else torch.float64
            if any(p.device != device or p.dtype != wide for p in parts):  # a model spread over devices; counts
                parts = [p.to(device, wide) for p in parts]
            flat = to_host(torch.cat(parts) if len(parts) > 1 else parts[0]).double().numpy()
        recs = _derive(pending, rows, flat[:n_red].reshape(-1, _N_REDUCTIONS))
        recs.loss = float(flat[-1]) if loss is not None else None
        _fill_extras(recs, pending, extras, flat[n_red:], updates or {}, self.per_example, self.histogram)
        recs.edited = np.array([p.key in edited for p in pending], dtype=bool)
        recs.edited_norm = np.full(len(pending), np.nan)
        recs.edited_norm[recs.edited] = flat[edited_at : edited_at + len(edited)]
        if self.values != "none":
            recs.values = _values_to_host(pending)
            if self.values == "sample":
                recs.positions = [
                    None if p.values is None else self._positions[(p.key.tap, p.numel, p.values.device)][0]
                    for p in pending
                ]
        return recs


_N_REDUCTIONS = 7
_CPU_ZERO = torch.zeros((), dtype=torch.int64)


def _reduction_blocks(
    pending: list[_Pending], cpu_rows: torch.Tensor, batches: list[torch.Tensor],
) -> tuple[dict[int, int], list[torch.Tensor]]:  # fmt: skip
    """(k, 7) float64 blocks of reductions (float32 on mps), and which block row each record is.

    `cpu_rows` holds the CPU kernel's output; a record whose `reductions` is an int is that row.
    `batches` are `Collector.flush`'s blocks, which a `_BatchRow` points into.
    """
    rows: dict[int, int] = {}
    blocks: list[torch.Tensor] = []
    at = 0
    on_cpu = [i for i, p in enumerate(pending) if isinstance(p.reductions, int)]
    if on_cpu:
        blocks.append(cpu_rows[[pending[i].reductions for i in on_cpu]])
        rows.update((i, at + j) for j, i in enumerate(on_cpu))
        at += len(on_cpu)
    fused = [i for i, p in enumerate(pending) if isinstance(p.reductions, torch.Tensor)]
    if fused:
        devices = {pending[i].reductions.device for i in fused}  # type: ignore[union-attr]
        if len(devices) == 1:
            blocks.append(torch.stack([pending[i].reductions for i in fused]))  # type: ignore[misc]
        else:
            blocks.extend(pending[i].reductions.reshape(1, -1) for i in fused)  # type: ignore[union-attr]
        rows.update((i, at + j) for j, i in enumerate(fused))
        at += len(fused)
    reduced = [i for i, p in enumerate(pending)
               if isinstance(p.reductions, tuple) and not isinstance(p.reductions, _BatchRow)]  # fmt: skip
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
    rows.update((i, start[p.reductions.batch] + p.reductions.row)
                for i, p in enumerate(pending) if isinstance(p.reductions, _BatchRow))  # fmt: skip
    return rows, blocks


def _reduce_batch(
    xs: list[torch.Tensor], ids: torch.Tensor, histogram: bool, row_ids: torch.Tensor | None = None, n_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reductions of each flat tensor of `xs` (one dtype, one device, none empty), all at once.

    Returns the (k, 7) wide-float reductions `[sum, sumsq, min, max, nonzero, nan, inf]` per tensor
    and, with `histogram`, their (k, HIST_BINS) int64 counts; with `row_ids` (each element's row,
    of `n_rows`) the L2 norm of every row (per-example norms, float64). `ids` numbers each element
    of the concatenation by its tensor (`Collector._segment_ids`). One `cat`, a widening, and a fixed
    number of segmented reductions (`index_add_`, `scatter_reduce_`): the number of ops does not
    depend on k, and nothing is read on the host. The sums are accumulated in float64 (float32 on
    mps) from widened elements: small tensors, so the widened copy is small.

    Example::

        ids = torch.tensor([0, 0, 1])
        _reduce_batch([torch.tensor([1.0, -2.0]), torch.tensor([0.0])], ids, False)[0][:, 0]  # sums: [-1, 0]
    """
    k = len(xs)
    x = torch.cat(xs) if k > 1 else xs[0]
    wide = torch.float32 if x.device.type == "mps" else torch.float64
    w = x.to(wide)
    acc = torch.zeros((5, k), dtype=wide, device=x.device)
    acc[0].index_add_(0, ids, w)
    squares = w * w
    acc[1].index_add_(0, ids, squares)
    acc[2].index_add_(0, ids, (x != 0).to(wide))  # -0.0 is a zero; NaN is not (as count_nonzero)
    acc[3].index_add_(0, ids, torch.isnan(x).to(wide))
    acc[4].index_add_(0, ids, torch.isinf(x).to(wide))
    # min and max with NaN are set to NaN from the NaN count when the statistics are derived
    mn = torch.full((k,), math.inf, dtype=wide, device=x.device).scatter_reduce_(0, ids, w, "amin")
    mx = torch.full((k,), -math.inf, dtype=wide, device=x.device).scatter_reduce_(0, ids, w, "amax")
    block = torch.stack([acc[0], acc[1], mn, mx, acc[2], acc[3], acc[4]], dim=1)
    rows = None
    if row_ids is not None:
        rows = torch.zeros(n_rows, dtype=wide, device=x.device).index_add_(0, row_ids, squares).sqrt_()
    return block, histogram_batch(x, ids, k) if histogram else None, rows


def _reduce(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-gradient device work: four reductions, plus NaN/Inf counts when they can be non-zero.

    Returns 0-d tensors `[sum, sum of squares, min, max]` and `[non-zero count, nan count, inf count]`.
    `scratch` (same size and dtype as `flat`) takes the one elementwise temporary: a fresh large
    allocation in the middle of a training step costs more than the reduction itself (page faults).
    """
    mn, mx = torch.aminmax(flat)
    # abs() folds -0.0 into +0.0, so a zero is exactly an all-zero bit pattern; counting non-zero
    # integers is several times faster than comparing floats with 0 on CPU.
    magnitude = flat.abs() if scratch is None else torch.abs(flat, out=scratch)
    nonzero = torch.count_nonzero(magnitude.view(_INT_VIEW[flat.dtype]))
    if flat.device.type != "cpu":
        # No branching on values here (it would sync per tap): sums wide, counts always.
        s, ss = _device_sums(flat)
        return [s, ss, mn, mx], [nonzero, torch.isnan(flat).sum(), torch.isinf(flat).sum()]
    s, ss = flat.sum(), torch.dot(flat, flat)
    # On CPU the sums are already in host memory (numpy() cannot cross devices): branch for free.
    s_host, ss_host = float(s.numpy()), float(ss.numpy())
    nan = inf = _CPU_ZERO
    if not math.isfinite(ss_host):
        nan, inf = torch.isnan(flat).sum(), torch.isinf(flat).sum()
    n = flat.numel()
    if flat.dtype != torch.float64 and (
        not math.isfinite(ss_host) or (n > 1 and ss_host - s_host * s_host / n < 1e-3 * ss_host)
    ):
        # float32 sum of squares overflowed, or most of its digits cancel in the variance: redo wide.
        wide = flat.double()
        s, ss = wide.sum(), torch.dot(wide, wide)
    return [s, ss, mn, mx], [nonzero, nan, inf]


def _device_sums(flat: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and sum of squares on an accelerator without a float64 copy of the gradient.

    Chunks of `chunk` elements are reduced in the gradient's dtype (on CUDA in a tree, so their
    error stays near the dtype's rounding), the chunk results are added in float64.
    """
    if flat.dtype == torch.float64 or flat.device.type == "mps":
        return flat.sum(), torch.dot(flat, flat)
    k = flat.numel() // chunk
    head, tail = flat[: k * chunk].view(k, chunk), flat[k * chunk :].double()  # the tail is under `chunk`
    s = head.sum(1).double().sum() + tail.sum()
    ss = torch.linalg.vector_norm(head, dim=1).double().square().sum() + torch.dot(tail, tail)
    return s, ss


def _derive(pending: list[_Pending], rows: dict[int, int], host: np.ndarray) -> StepRecords:
    n = len(pending)
    recs = StepRecords(
        keys=[p.key for p in pending],
        shape=[p.shape for p in pending],
        numel=np.array([p.numel for p in pending], dtype=np.int64),
        has_grad=np.array([p.has_grad for p in pending], dtype=bool),
    )
    raw = np.full((n, _N_REDUCTIONS), np.nan)
    if rows:
        mine = np.fromiter(rows.keys(), dtype=np.int64, count=len(rows))
        raw[mine] = host[np.fromiter(rows.values(), dtype=np.int64, count=len(rows))]
    s, ss, mn, mx, nonzero, nan, inf = raw.T
    numel = recs.numel.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s / numel
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


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    device = ts[0].device
    return torch.stack([t if t.device == device else t.to(device) for t in ts])


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    device = ts[0].device
    return torch.cat([t.reshape(-1) if t.device == device else t.reshape(-1).to(device) for t in ts])


def _extra_parts(pending: list[_Pending], updates: Mapping[TapKey, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The step's extras as a few flat device tensors, named: value norms, update norms, per-example, counts."""
    parts: list[tuple[str, torch.Tensor]] = []
    norms = [p.value_norm for p in pending if p.value_norm is not None]
    if norms:
        parts.append(("value_norm", _stack(norms)))
    ups = [updates[p.key] for p in pending if p.key in updates]
    if ups:
        parts.append(("update_norm", _stack(ups)))
    rows = [p.per_example for p in pending if p.per_example is not None]
    if rows:
        parts.append(("per_example", _cat(rows)))
    hists = [p.hist for p in pending if p.hist is not None]
    if hists:
        parts.append(("hist", _cat(hists)))
    return parts


def _fill_extras(
    recs: StepRecords, pending: list[_Pending], parts: list[tuple[str, torch.Tensor]], host: np.ndarray,
    updates: Mapping[TapKey, torch.Tensor], per_example: bool, histogram: bool,
) -> None:  # fmt: skip
    """Split the host copy of `_extra_parts` back into the records' extra columns."""
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


def _split(pending: list[_Pending], flat: np.ndarray | None, field: str, dtype: type[np.generic]) -> list[np.ndarray | None]:
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


def _values_to_host(pending: list[_Pending]) -> list[np.ndarray | None]:
    kept = [p.values for p in pending if p.values is not None]
    if not kept:
        return [None] * len(pending)
    flat = to_host(torch.cat([v.to(kept[0].device) for v in kept])).numpy()
    out: list[np.ndarray | None] = []
    at = 0
    for p in pending:
        if p.values is None:
            out.append(None)
        else:
            out.append(flat[at : at + p.values.numel()])
            at += p.values.numel()
    return out
