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
and device (`reductions.reduce_batch`: a fixed number of ops, however many taps). Else
each statistic is derived from four reductions per gradient (sum, sum of squares, min/max,
non-zero count): norm = sqrt(sum of squares), std from sum and sum of squares (Bessel-corrected,
as `torch.std`), abs_max from min and max, zero_frac from the non-zero count. NaN and Inf counts
are only computed when the sum of squares is not finite (on CPU, where reading it costs nothing)
or always (on an accelerator, where branching would need a sync).

Each record also carries the tapped tensor's own norm (`value_norm`) and, when asked for, per-example norms
and |g| histogram counts (`capturing.extras`; on CPU counted by the C kernel in the same read), reduced in
`add`; `finish(loss, updates)` adds the parameter taps' update norms: all in the step's one transfer.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradrunner.capturing import fused_stats
from gradrunner.capturing.dtensors import PieceNorm, is_dtensor
from gradrunner.capturing.extras import per_example_norms
from gradrunner.capturing.reductions import (
    INT_VIEW,
    N_REDUCTIONS,
    BatchRow,
    Pending,
    Segments,
    derive,
    extra_parts,
    fill_extras,
    reduce_batch,
    reduce_one,
    reduction_blocks,
    segments,
    stack,
)
from gradrunner.config.choices import VALUES_MODES
from gradrunner.records.columns import HIST_BINS, StepRecords, TapKey

if TYPE_CHECKING:
    from gradrunner.capturing.sharded_rows import ShardedRows


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


#: "Small": gradients up to this many elements are not reduced when they arrive but kept, and
#: reduced all together at the end of backward (`Collector.flush`): one batch per dtype and device,
#: a fixed number of ops (about 20 launches on a GPU) whatever the number of taps; for them the cost
#: of one op call, not the reading of elements, is what counts. At most this many elements (64 KiB
#: in float32) per tap are held until then; larger gradients are reduced as they arrive, so memory
#: does not grow with them. The one threshold of the batched path.
DEFER_NUMEL = 1 << 14
#: One CPU output row of the kernel: `N_REDUCTIONS` float64.
_ROW_BYTES = N_REDUCTIONS * 8


class Collector:
    """Reduces gradients on their device as they arrive; one host transfer per step in `finish`.

    Example::

        col = Collector(values="sample", sample_size=16, seed=0)
        col.add(TapKey("", "output", 0), grad)
        col.add(TapKey("fc2", "output", 0), None)   # a tap that got no gradient
        recs = col.finish(loss)
    """

    def __init__(self, values: str = "none", sample_size: int = 64, seed: int = 0, *, per_example: bool = False,
                 histogram: bool = False) -> None:  # fmt: skip
        if values not in VALUES_MODES:
            raise ValueError(f"values={values!r}; allowed: {', '.join(VALUES_MODES)}")
        self.values, self.sample_size, self.seed = values, sample_size, seed
        self.per_example, self.histogram = per_example, histogram
        self._pending: list[Pending] = []
        self._positions: dict[tuple[str, int, torch.device], tuple[np.ndarray, torch.Tensor]] = {}
        self._scratch: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        #: whether to try the one-pass kernels (`fused_stats`); tests turn them off to compare paths
        self._fused = fused_stats.enabled()
        self._values_none = values == "none"
        self._cpu_kernels: dict[torch.dtype, fused_stats.Kernel] | None = None  # loaded on first use
        self._cpu_hist: dict[torch.dtype, fused_stats.HistKernel] = {}
        #: the kernels once loaded, where nothing but the nine statistics is asked for: `add`'s first path
        self._plain_kernels: dict[torch.dtype, fused_stats.Kernel] | None = None
        #: the CPU kernel's output rows, 7 float64 each; a record's `reductions` is its row number
        self._rows = torch.empty((64, N_REDUCTIONS), dtype=torch.float64)
        self._n_rows = 0
        #: `_rows`' capacity and the address of its first element (read per gradient: kept as ints)
        self._capacity, self._rows_at = 64, self._rows.data_ptr()
        #: (k, 7) reductions of each batch of small gradients reduced by `flush` (on their device)
        self._batches: list[torch.Tensor] = []
        #: the layout of a batch's gradients in their concatenation, by their sizes and device (`_segments`)
        self._layouts: dict[tuple[tuple[int, ...], torch.device], Segments] = {}
        #: per record (by `order`): its backward's number in the step (`micro_step`) and why it has no gradient
        self._micro: dict[int, int] = {}  # (ints, no tuple per record: nothing new for the cyclic GC to track)
        self._why: dict[int, str] = {}
        self._sharded: ShardedRows | None = None  # the step's DTensor pieces, merged in `finish` (`_sharded_rows`)

    def __len__(self) -> int:
        return len(self._pending)

    def discard(self, orders: set[int]) -> None:
        """Forget the records added at `orders` (a value read again later in the step replaces them)."""
        if orders:
            self._pending = [p for p in self._pending if p.order not in orders]
            for o in orders:
                self._micro.pop(o, None)
                self._why.pop(o, None)
            if self._sharded is not None:
                self._sharded.discard(orders)

    def rekey(self, keys: Mapping[int, TapKey]) -> None:
        """The records at `keys`' orders under those keys instead (a call numbered again once its backward is known)."""
        self._pending = [p._replace(key=keys[p.order]) if p.order in keys else p for p in self._pending]

    def _sharded_rows(self) -> ShardedRows:
        """The step's DTensor pieces (FSDP2, HSDP, TP), merged over the ranks in `finish`; made when the first comes."""
        if self._sharded is None:
            from gradrunner.capturing.sharded_rows import ShardedRows  # DTensor's machinery: only where one is met

            self._sharded = ShardedRows(values=self.values, histogram=self.histogram,
                                        sample=lambda tap, n: sample_positions(tap, n, self.sample_size, self.seed))
        return self._sharded

    def add(
        self, key: TapKey, grad: torch.Tensor | None, order: int | None = None, mutable: bool = True, *,
        value_norm: torch.Tensor | PieceNorm | None = None, batched: bool = True, settled: bool = False,
        micro: int | None = None, reason: str | None = None, per_example: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Reduce `grad` (or record that the tap got none) without leaving its device.

        `order` places the record among the step's records (default: after those added so far); gradients arrive in
        backward order, records are kept in forward (firing) order. `mutable=False` promises that nothing changes `grad`
        in place before `flush` (an intermediate's gradient; a leaf's may become its `.grad`): what is kept until then
        is not copied (values are). `value_norm` (0-d, on any device) is the tapped tensor's own norm (a DTensor's
        `PieceNorm`: merged by its own placement in `finish`, gradient or not); `batched=False` (a parameter) means
        dim 0 is no batch: no per-example norms of its own, but `per_example` (float64 norms on the device, a
        parameter's from `capturing.per_example`) may be given. The extras are reduced here, so a gradient changed in
        place after `add` cannot change them. `settled=True` promises that nothing changes `grad` in place before the
        next `flush` (a gradient handed over after autograd's backward returned, the session flushing before it
        returns): a small gradient kept for the batch is then not copied either. `micro` (the backward's number within
        the step) and `reason` (why there is no gradient) go into the records' `micro_step` and `reason`.
        """
        order = len(self._pending) if order is None else order
        if isinstance(value_norm, PieceNorm):  # a DTensor value's: `finish` merges it, gradient or not
            self._sharded_rows().add_value_norm(order, value_norm)
            value_norm = None
        if micro is not None:
            self._micro[order] = micro
        if reason is not None:
            self._why[order] = reason
        kernels = self._plain_kernels
        if kernels is not None and grad is not None and grad.is_cpu and fused_stats.readable(grad):
            # The hot path: a plain dense CPU gradient (never a DTensor, a subclass, nor sparse, not contiguous),
            # nothing but the statistics: one read where it lies, no copy, no view; small ones too (a call: ~1 µs).
            fn, n = kernels.get(grad.dtype), grad.numel()
            if fn is not None and n:
                row = self._next_row()
                fn(grad.data_ptr(), n, self._rows_at + row * _ROW_BYTES)
                self._pending.append(Pending(order, key, tuple(grad.shape), n, True, row, None, None, value_norm, per_example))
                return
        if grad is None:
            self._pending.append(Pending(order, key, (), 0, False, None, None, None, value_norm))
            return
        if is_dtensor(grad):  # sharded (a parameter's, or an activation's under TP): one tensor, merged in `finish`
            piece = self._sharded_rows().add(order, key, grad, per_example=self.per_example and batched)
            self._pending.append(Pending(order, key, piece.shape, piece.numel, True, None, None, None, value_norm))
            return
        if grad.layout != torch.strided:
            if grad.layout == torch.sparse_coo and self._values_none and not self.histogram and not (self.per_example and batched):
                self._add_sparse(key, grad, order, value_norm, per_example)
                return
            grad = grad.to_dense()  # every element was asked for (values, histogram, per-example norms)
        n = grad.numel()
        want_rows = self.per_example and batched and grad.dim() > 0
        if 0 < n <= DEFER_NUMEL and not (grad.is_cpu and self._cpu_kernel_for(grad.dtype)):
            # Small: kept as it is (copied only if it may change before `flush`) and reduced with the rest,
            # histogram and per-example norms too. No op on it now.
            flat = grad.detach().reshape(-1)
            kept = flat.clone() if mutable and not settled else flat
            self._pending.append(Pending(
                order, key, tuple(grad.shape), n, True, None, kept, self._keep_values(key, flat), value_norm,
                per_example, rows=grad.shape[0] if want_rows else None,
            ))  # fmt: skip
            return
        if want_rows:
            per_example = per_example_norms(grad)
        g = grad.detach()
        flat = g.reshape(-1)
        n = flat.numel()
        if n and self._fused:
            if flat.device.type == "cpu":
                done = self._cpu_reduce(flat, n) if fused_stats.readable(flat) else None
                if done is not None:
                    row, hist = done
                    values = self._keep_values(key, flat)
                    self._pending.append(Pending(
                        order, key, tuple(g.shape), n, True, row, None, values, value_norm, per_example, hist,
                    ))  # fmt: skip
                    return
            elif n > DEFER_NUMEL:
                out = torch.empty(N_REDUCTIONS, dtype=torch.float64, device=flat.device)
                extra = (value_norm, per_example, fused_stats.histogram_counts(grad) if self.histogram else None)
                if fused_stats.reduce_into(flat, out):
                    values = self._keep_values(key, flat)
                    self._pending.append(Pending(order, key, tuple(g.shape), n, True, out, None, values, *extra))
                    return
        extra = (value_norm, per_example, fused_stats.histogram_counts(grad) if self.histogram else None)
        if flat.dtype not in INT_VIEW:  # float16, bfloat16: statistics in float32
            flat = flat.float()
        self._pending.append(Pending(
            order, key, tuple(g.shape), n, True, None if n == 0 else reduce_one(flat, self._scratch_for(flat)),
            None, self._keep_values(key, flat), *extra,
        ))  # fmt: skip

    def flush(self) -> None:
        """Reduce every small gradient kept so far: one batch per dtype and device, no host sync.

        Example::

            col.add(key, small_grad)
            col.flush()          # the session calls this when backward ends; `finish` calls it too

        Each batch is one concatenation and a fixed number of segmented reductions (`reduce_batch`),
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
            seg = self._segments(sizes, xs[0].device)
            # per-example norms: every tensor's rows (one row for a tensor without them)
            n_rows = [self._pending[i].rows or 1 for i in idx]
            rows = None
            if any(self._pending[i].rows is not None for i in idx):
                row_sizes = tuple(n // r for n, r in zip(sizes, n_rows, strict=True) for _ in range(r))
                rows = self._segments(row_sizes, xs[0].device)
            block, hist, row_norms = reduce_batch(xs, seg, self.histogram, rows)
            self._batches.append(block)
            at = 0
            for j, (i, r) in enumerate(zip(idx, n_rows, strict=True)):
                p = self._pending[i]
                self._pending[i] = p._replace(
                    reductions=BatchRow(len(self._batches) - 1, j), deferred=None, rows=None,
                    hist=None if hist is None else hist[j],
                    per_example=row_norms[at : at + r] if row_norms is not None and p.rows is not None else p.per_example,
                )  # fmt: skip
                at += r

    def _segments(self, sizes: tuple[int, ...], device: torch.device) -> Segments:
        """The layout of a batch of segments of `sizes` elements on `device` (`reductions.segments`), kept per sizes:
        built on the host once per set of sizes (a training step repeats its sizes), copied without a host sync.
        """
        key = (sizes, device)
        seg = self._layouts.get(key)
        if seg is None:
            if len(self._layouts) >= 8:
                self._layouts.clear()  # sizes change from step to step (variable-length batches): keep a few
            seg = self._layouts[key] = segments(sizes).to(device)
        return seg

    def _add_sparse(
        self, key: TapKey, grad: torch.Tensor, order: int, value_norm: torch.Tensor | None, per_example: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """A sparse COO gradient (`nn.Embedding(sparse=True)`): statistics over the dense gradient's
        elements, zeros included, from its stored values alone (a huge table is never made dense).

        Sums, the non-zero and NaN/Inf counts are those of the stored values; where some elements are
        not stored they are zeros, so the minimum is at most 0 and the maximum at least 0.
        """
        vals = grad.detach().coalesce().values().reshape(-1)  # coalesce sums repeated indices, as to_dense
        if vals.dtype not in INT_VIEW:
            vals = vals.float()
        n = grad.numel()
        if vals.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=vals.device)
            floats, ints = [zero, zero, zero, zero], [zero, zero, zero]
        else:
            (s, ss, mn, mx), ints = reduce_one(vals)
            if vals.numel() < n:
                mn, mx = torch.clamp(mn, max=0), torch.clamp(mx, min=0)
            floats = [s, ss, mn, mx]
        self._pending.append(Pending(order, key, tuple(grad.shape), n, True, (floats, ints), None, None, value_norm,
                                     per_example))  # fmt: skip

    def _load_kernels(self) -> dict[torch.dtype, fused_stats.Kernel]:
        if self._cpu_kernels is None:
            self._cpu_kernels = fused_stats.cpu_kernels()
            self._cpu_hist = fused_stats.cpu_hist_kernels() if self.histogram else {}
            if self._fused and self._values_none and not self.histogram and not self.per_example:
                self._plain_kernels = self._cpu_kernels
        return self._cpu_kernels

    def _cpu_kernel_for(self, dtype: torch.dtype) -> bool:
        """Whether the C kernel takes a CPU gradient of `dtype` (its histogram variant with `histogram`)."""
        kernels = self._load_kernels() if self._fused else None
        return kernels is not None and dtype in (self._cpu_hist if self.histogram else kernels)

    def _cpu_reduce(self, flat: torch.Tensor, n: int) -> tuple[int, torch.Tensor | None] | None:
        """The C kernel on contiguous CPU `flat` into a fresh row: (row, histogram counts or None); None where no kernel
        fits (no compiler, another dtype): the caller takes the torch path."""
        kernels = self._load_kernels()
        if self.histogram:
            if (fh := self._cpu_hist.get(flat.dtype)) is None:
                return None
            row = self._next_row()
            counts = torch.zeros(HIST_BINS, dtype=torch.int64)
            fh(flat.data_ptr(), n, self._rows_at + row * _ROW_BYTES, counts.data_ptr())
            return row, counts
        if (fn := kernels.get(flat.dtype)) is None:
            return None
        row = self._next_row()
        fn(flat.data_ptr(), n, self._rows_at + row * _ROW_BYTES)
        return row, None

    def _next_row(self) -> int:
        """The number of a fresh output row for the CPU kernel (the buffer doubles when full)."""
        if self._n_rows == self._capacity:
            grown = torch.empty((2 * self._n_rows, N_REDUCTIONS), dtype=torch.float64)
            grown[: self._n_rows] = self._rows
            self._rows, self._capacity, self._rows_at = grown, 2 * self._n_rows, grown.data_ptr()
        self._n_rows += 1
        return self._n_rows - 1

    def _scratch_for(self, flat: torch.Tensor) -> torch.Tensor:
        """One reusable buffer per gradient size: the reductions' temporary, allocated once."""
        k = (flat.numel(), flat.dtype, flat.device)
        if (buf := self._scratch.get(k)) is None:
            buf = self._scratch[k] = torch.empty_like(flat)
        return buf

    def _keep_values(self, key: TapKey, flat: torch.Tensor) -> torch.Tensor | None:
        if self.values == "none":
            return None
        if self.values == "full":  # a copy: a leaf's `.grad` may be a view of it (after `nn.Flatten`), changed in place
            return flat.float().clone() if flat.dtype == torch.float32 else flat.float()
        cache_key = (key.tap, flat.numel(), flat.device)
        if cache_key not in self._positions:
            pos = sample_positions(key.tap, flat.numel(), self.sample_size, self.seed)
            self._positions[cache_key] = (pos, torch.from_numpy(pos).to(flat.device))
        return flat.index_select(0, self._positions[cache_key][1]).float()

    def finish(self, loss: torch.Tensor | None = None, updates: Mapping[TapKey, torch.Tensor] | None = None,
               edited: Mapping[int, torch.Tensor] | None = None, micro_steps: bool = True) -> StepRecords:  # fmt: skip
        """Reduce what was deferred, move all reductions to the host in one transfer, derive statistics.

        `updates` maps parameter taps to the 0-d norm of the optimiser step's change (`update_norm`),
        `edited` edited records (by `order`) to the 0-d norm of their gradient after the edit
        (`edited_norm`): they ride in the same transfer as everything else. `micro_steps=False`: the
        caller drops `micro_step` (one backward in the step), and takes a None `reason` for all None.
        """
        self.flush()
        pending, self._pending = sorted(self._pending, key=itemgetter(0)), []  # by `order`, a Pending's first field
        if self._sharded is not None and len(self._sharded):
            from gradrunner.capturing.sharded_rows import merge_pending

            pending, updates, edited = merge_pending(self._sharded, pending, updates or {}, edited or {}, self._positions)
        micro, why, self._micro, self._why = self._micro, self._why, {}, {}
        rows, blocks = reduction_blocks(pending, self._rows, self._batches)
        self._n_rows, self._batches = 0, []
        parts = [b.reshape(-1) for b in blocks]
        n_red = sum(p.numel() for p in parts)
        extras = extra_parts(pending, updates or {})
        edited_at = n_red + sum(t.numel() for _, t in extras)
        edited = {p.order: edited[p.order] for p in pending if p.order in edited} if edited else {}
        if edited:
            extras.append(("edited_norm", stack(list(edited.values()))))
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
        recs = derive(pending, rows, flat[:n_red].reshape(-1, N_REDUCTIONS))
        recs.loss = float(flat[-1]) if loss is not None else None
        fill_extras(recs, pending, extras, flat[n_red:], updates or {}, self.per_example, self.histogram)
        recs.edited = np.array([p.order in edited for p in pending], dtype=bool) if edited else np.zeros(len(pending), bool)
        recs.edited_norm = np.full(len(pending), np.nan)
        recs.edited_norm[recs.edited] = flat[edited_at : edited_at + len(edited)]
        if (micro and micro_steps) or why:
            recs.micro_step = [micro.get(p.order) for p in pending] if micro_steps else None
            recs.reason = [None if g else why.get(p.order) for p, g in zip(pending, recs.has_grad, strict=True)]
        if self.values != "none":
            recs.values = _values_to_host(pending)
            if self.values == "sample":
                recs.positions = [
                    None if p.values is None else self._positions[(p.key.tap, p.numel, p.values.device)][0]
                    for p in pending
                ]
        return recs


def _values_to_host(pending: list[Pending]) -> list[np.ndarray | None]:
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
