"""Statistics of sharded gradients (FSDP2, HSDP, tensor parallel): local pieces, one packed merge per step.

A gradient that is a `DTensor` lives as one local piece per rank. Every statistic gradrunner records
is made from mergeable pieces: the seven reductions `[sum, sumsq, min, max, nonzero, nan, inf]`, the
|g| histogram counts, the squared value norm. Each rank reduces its own piece (`local_rows`), then
`merge_rows` merges the whole step's rows with one SUM and one MAX all-reduce (min as the max of its
negation), as torchtitan's tensor logging does; a full gradient is never gathered. Which pieces count
is read from the placement (`placement_of`): `Shard` pieces are summed along their mesh dim, a
`Replicate` dim counts only its coordinate 0 (a replica is not counted twice), uneven and empty shards
are what `to_local()` holds (no padding). Captured values (`values="full"` / `"sample"`, at global
positions) ride in the same SUM all-reduce, as float32 bit patterns, only when asked for.

`Collector` adds a DTensor parameter gradient through `capturing.sharded_rows` (`ShardedRows`) and
merges the step's rows in `finish`, before its one host transfer, with the norms of the parameters'
pieces, their updates and their edited gradients. Imported only once a DTensor is met
(`capturing.dtensors` tells).

| name | what it does |
| --- | --- |
| `Piece`, `placement_of(t)` | whether this rank's local piece counts, and the whole tensor's shape |
| `summed(t)` | a `Partial` placement summed (one all-reduce): what every sharded gradient goes through first |
| `local_of(t)` | the rank's local piece (`to_local()` of a DTensor, the tensor itself otherwise) |
| `local_rows(pieces)` | the seven reductions of each local piece (float64), histogram counts |
| `merge_rows(rows, pieces)` | one SUM and one MAX all-reduce: the whole tensors' reductions |
| `mergeable_norm(t)` | a DTensor gradient's norm as a record beside its statistics takes it (edited norms) |
| `piece_norm(t)` | a tapped DTensor's own norm (`value_norm`), merged by its own piece whether a gradient came or not |
| `whole_of(grad)` | where a piece sits in the whole gradient, and a sum over its mesh's ranks (edits) |

`capturing.sharded_hooks` hands each parameter's gradient piece out as FSDP2 completes it.

Example::

    rows, hist = local_rows([local_of(g) for g in grads], histogram=True)
    m = merge_rows(rows, [placement_of(g) for g in grads], counts=[local_of(g).numel() for g in grads], hist=hist)
    m.rows[:, 1].sqrt()                          # the whole gradients' norms, equal on every rank
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from gradrunner.capturing import fused_stats
from gradrunner.capturing.dtensors import Piece, PieceNorm, Whole, local_piece
from gradrunner.capturing.extras import value_norm
from gradrunner.capturing.reductions import N_REDUCTIONS, one_segment, reduce_batch
from gradrunner.capturing.torch_compat import waited
from gradrunner.records.columns import HIST_BINS

#: Columns of a merged row summed over ranks: sum, sumsq, nonzero, nan, inf (in `local_rows`' order), count.
_SUMMED = (0, 1, 4, 5, 6)
_IDENTITY = (0.0, 0.0, math.inf, -math.inf, 0.0, 0.0, 0.0)


def placement_of(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> Piece:
    """Whether this rank's local piece of `t` counts in a merge over `group` (default: the world).

    Example::

        placement_of(fsdp_param.grad)     # Shard(0): every rank counts its rows
        placement_of(torch.ones(3))       # a plain tensor: a replica, counted on rank 0 of `group` only

    A `DTensor` counts on the ranks whose mesh coordinate is 0 along every `Replicate` mesh dim, so
    each distinct piece is counted once (HSDP `(Replicate, Shard(0))`: the first replica group). Its
    mesh must span `group`. A plain tensor is taken as replicated on every rank of `group` (a DDP
    parameter); outside a process group it counts. A `Partial` placement raises `ValueError`: the
    statistics of a sum are not made from the statistics of its terms (`summed` first).
    """
    if not isinstance(t, DTensor):
        alone = not dist.is_available() or not dist.is_initialized()
        return Piece(alone or dist.get_rank(group) == 0, tuple(t.shape))
    mesh, placements = t.device_mesh, t.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"a DTensor with placements {placements} is a sum of pieces whose statistics do not merge (the sum of "
            "squares of a sum is not the sum of the pieces' squares); call t.redistribute(placements=[Replicate()]) "
            "first"
        )
    world = dist.get_world_size(group)
    if mesh.size() != world:
        raise ValueError(f"a DTensor on a mesh of {mesh.size()} ranks cannot be merged over a group of {world}; "
                         "pass the group of its mesh")  # fmt: skip
    return _piece_on_mesh(t)


def _piece_on_mesh(t: DTensor) -> Piece:
    """How this rank's piece counts among the pieces on `t`'s own mesh (all of the world or a sub-mesh): a piece
    on a `Replicate` mesh dim counts at coordinate 0 only."""
    coord = t.device_mesh.get_coordinate()
    assert coord is not None, "this rank holds a piece, so it is in the mesh"
    counted = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))
    return Piece(counted, tuple(t.shape))


def _on_sub_mesh(t: DTensor) -> bool:
    """Whether `t`'s mesh spans fewer ranks than the world (2-D data x tensor parallel: the tensor-parallel mesh)."""
    return dist.is_initialized() and t.device_mesh.size() != dist.get_world_size()


#: This rank's piece of a tensor (`to_local()` of a DTensor, else the tensor): `dtensors.local_piece`.
local_of = local_piece


def summed(t: torch.Tensor) -> torch.Tensor:
    """`t` with each `Partial` placement summed into `Replicate` (a new DTensor: one all-reduce over its mesh), else `t`.

    Example::

        summed(sp_norm_weight.grad).placements     # (Partial(sum),) -> (Replicate(),); `.grad` itself unchanged

    The one rule for a sum of pieces (a sequence-parallel LayerNorm's weight gradient, a column-parallel
    layer's input gradient): the statistics of a sum are not made from its terms', so the sum is taken
    first. Every rank of the mesh calls it for the same tensor in the same order.
    """
    if isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements):
        return t.redistribute(t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements])
    return t


def mergeable(t: torch.Tensor) -> torch.Tensor:
    """An activation's `DTensor` gradient as the records can take it: a `Partial` placement summed (one all-reduce
    over its mesh: tensor parallel's gradient of a colwise layer's input), and one on a mesh that is not the whole
    world (2-D data x tensor parallel) gathered whole on each rank of its mesh: a plain tensor, recorded per rank
    as activations are. Every rank of the mesh calls it for the same gradient in the same order (one backward).

    Example::

        mergeable(x_grad)     # DTensor (Partial(sum),) -> (Replicate(),)
    """
    if not isinstance(t, DTensor):
        return t
    t = summed(t)
    assert isinstance(t, DTensor), "summed keeps a DTensor one"
    if _on_sub_mesh(t):
        return t.full_tensor()
    return t


def mergeable_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a `DTensor` gradient `t` (float64, 0-d) as a record beside its `mergeable` statistics takes it.

    Example::

        mergeable_norm(edited_grad)     # Shard on the world mesh: this rank's piece's norm (the records merge it)

    On a mesh spanning the world, the norm of this rank's piece (a `Partial` summed first, one all-reduce),
    merged with the step's rows by the gradient's placement; on a sub-mesh, where the gradient is gathered
    and recorded per rank, the whole tensor's norm (one all-reduce of a number over the sub-mesh). Every
    rank of the mesh calls it for the same tensor in the same order. The norm of an edited gradient
    (`edited_norm`) is taken with it; a tapped value's own norm with `piece_norm`.
    """
    t = summed(t)
    local = local_piece(t)
    norm = torch.linalg.vector_norm(local.abs() if local.is_complex() else local, dtype=torch.float64)
    if not isinstance(t, DTensor) or not _on_sub_mesh(t):
        return norm
    return _mesh_sum(norm.square(), t).sqrt()


def piece_norm(
    t: torch.Tensor, norm: torch.Tensor | None = None, local: torch.Tensor | None = None
) -> torch.Tensor | PieceNorm:
    """A tapped `DTensor`'s own norm (`value_norm`) as its record merges it, whether its tap gets a gradient or not.

    Example::

        piece_norm(tp_activation)     # PieceNorm(this rank's piece's norm, its Piece, its numel): merged in `finish`

    On a mesh spanning the world, a `PieceNorm`: this rank's piece's norm (`norm` and the piece `local` where
    the caller has them already: a batch of parameters'), merged over the ranks by the value's own placement (a replica
    once) with the step's rows (`ShardedRows`), taken as a plain tensor's (`extras.value_norm`); on a sub-mesh, the whole tensor's (`mergeable_norm`: the
    gradient is recorded per rank there). A `Partial` value is summed first (one all-reduce over its mesh).
    """
    t = summed(t)
    assert isinstance(t, DTensor), "a DTensor's norm"
    if _on_sub_mesh(t):
        return mergeable_norm(t)
    local = local_piece(t) if local is None else local
    if norm is None:
        norm = value_norm(local)
    return PieceNorm(norm, _piece_on_mesh(t), local.numel())


def local_rows(
    pieces: Sequence[torch.Tensor | None], *, histogram: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The seven reductions `[sum, sumsq, min, max, nonzero, nan, inf]` of each local piece, float64 (k, 7).

    Example::

        rows, hist = local_rows([torch.tensor([1.0, -2.0]), None], histogram=True)
        rows[0].tolist()     # [-1.0, 5.0, -2.0, 1.0, 2.0, 0.0, 0.0]; row 1 is the merge's identity

    A missing or empty piece gets the merge's identity `[0, 0, inf, -inf, 0, 0, 0]`. Each piece is
    read once by the collector's own reductions (`fused_stats`, else `reductions.reduce_batch`), so the
    statistics follow the same rules as `Collector` (-0.0 is a zero, sums in float64). With
    `histogram`, (k, HIST_BINS) int64 counts (`fused_stats.histogram_counts`), zeros for a missing piece.
    """
    k = len(pieces)
    device = next((p.device for p in pieces if p is not None), torch.device("cpu"))
    rows = torch.tensor([_IDENTITY] * k, dtype=torch.float64, device=device).reshape(k, N_REDUCTIONS)
    hist = torch.zeros((k, HIST_BINS), dtype=torch.int64, device=device) if histogram else None
    for i, piece in enumerate(pieces):
        if piece is None or piece.numel() == 0:
            continue
        flat = piece.detach().reshape(-1)
        if not (flat.is_contiguous() and fused_stats.reduce_into(flat, rows[i])):
            block, _, _ = reduce_batch([flat], one_segment(flat.numel(), flat.device), False)
            rows[i] = block[0].to(torch.float64)
        if hist is not None:
            hist[i] = fused_stats.histogram_counts(flat)
    return rows, hist


class Merged(NamedTuple):
    """The whole tensors' reductions, the same on every rank (`merge_rows`' result)."""

    #: (k, 7) float64 `[sum, sumsq, min, max, nonzero, nan, inf]` of each whole tensor.
    rows: torch.Tensor
    #: (k,) float64: how many elements the counted pieces held (equal to the whole tensor's numel).
    numel: torch.Tensor
    #: (k, HIST_BINS) int64 counts, when histograms were merged.
    hist: torch.Tensor | None
    #: (k, m) float64 norms of whole tensors (value, update, edited norms ...), when norms were merged.
    norms: torch.Tensor | None
    #: Per row: float32 values at the asked positions (row-major), or None where none were asked for.
    values: list[torch.Tensor | None]
    #: Per row: float64 norms of the whole tensor's dim-0 rows (per-example norms), or None where not asked for.
    per_row: list[torch.Tensor | None]


def merge_rows(
    rows: torch.Tensor, pieces: Sequence[Piece | None], *, counts: Sequence[int], hist: torch.Tensor | None = None,
    norms: torch.Tensor | None = None, values: Sequence[torch.Tensor | None] | None = None,
    per_row: Sequence[torch.Tensor | None] | None = None, group: dist.ProcessGroup | None = None,
) -> Merged:  # fmt: skip
    """Merge each rank's local rows into the whole tensors' rows: one SUM and one MAX all-reduce in all.

    Example::

        rows, hist = local_rows([local_of(g) for g in grads], histogram=True)
        m = merge_rows(rows, [placement_of(g) for g in grads], counts=[local_of(g).numel() for g in grads], hist=hist)
        m.rows[:, 1].sqrt()      # the whole gradients' norms

    Every rank of `group` must call it with the same rows in the same order (one per tap). `counts`
    are the local pieces' element counts, `norms` (k, m) norms of the local pieces of tensors that
    are split as the rows' (the tapped parameter itself, its update, its edited gradient: merged as
    the square root of the summed squares), `values` each row's asked values packed by
    `values_part` (None: none asked), `per_row` each row's `sharded_rows.row_squares` (None: no per-example norms;
    merged as the square root of their sums). A row whose piece is None, or not counted on this rank, adds
    nothing. Sums, counts, histogram bins, squared norms and value bit patterns are packed into one
    float64 tensor for the SUM all-reduce; max and -min into one for the MAX all-reduce (NaN taken
    out first: the NaN count says it). No collective outside a process group of more than one rank.
    """
    k = rows.shape[0]
    device = rows.device
    use = torch.tensor([p is not None and p.counted for p in pieces], dtype=torch.bool, device=device)
    local = torch.where(
        use[:, None], rows.to(torch.float64), torch.tensor(_IDENTITY, dtype=torch.float64, device=device)
    )
    summed = [local[:, _SUMMED], torch.tensor(counts, dtype=torch.float64, device=device)[:, None] * use[:, None]]
    if hist is not None:
        summed.append(hist.to(device, torch.float64) * use[:, None])
    m = 0 if norms is None else norms.shape[1]
    if norms is not None:
        summed.append(torch.nan_to_num(norms.to(device, torch.float64)).square() * use[:, None])
    parts = [v.to(device, torch.float64) for v in [*(values or []), *(per_row or [])] if v is not None]
    flat_values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    packed = torch.cat([torch.cat(summed, dim=1).reshape(-1), flat_values])
    extremes = torch.nan_to_num(torch.stack([local[:, 3], -local[:, 2]], dim=1), nan=-math.inf)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    width = len(_SUMMED) + 1 + (HIST_BINS if hist is not None else 0) + m
    table = packed[: k * width].view(k, width)
    s, ss, nonzero, nan, inf, count = table[:, :6].unbind(1)
    merged = torch.stack([s, ss, -extremes[:, 1], extremes[:, 0], nonzero, nan, inf], dim=1)
    at = 6
    out_hist = None
    if hist is not None:
        out_hist = table[:, at : at + HIST_BINS].round().to(torch.int64)
        at += HIST_BINS
    out_norms = table[:, at : at + m].sqrt() if norms is not None else None
    sizes = [None if v is None else v.numel() for v in values or [None] * k]
    out_values = _unpack_values(packed[k * width :], sizes)
    at = k * width + sum(n or 0 for n in sizes)
    out_rows: list[torch.Tensor | None] = []
    for r in per_row or [None] * k:
        out_rows.append(None if r is None else packed[at : at + r.numel()].sqrt())
        at += 0 if r is None else r.numel()
    return Merged(merged, count, out_hist, out_norms, out_values, out_rows)


class ValuesAsked(NamedTuple):
    """Which elements of a row's whole tensor to bring back: global flat positions, and the local piece."""

    #: Sorted global positions (row-major) of the whole tensor; `None`: every element.
    positions: np.ndarray | None
    #: The rank's local piece (its elements are sent as float32), and the tensor it is a piece of.
    piece: torch.Tensor
    whole: torch.Tensor


def values_part(asked: ValuesAsked, piece: Piece, device: torch.device) -> torch.Tensor:
    """The asked values as float32 bit patterns in float64 (exact), each at its global position; zeros elsewhere.

    Example::

        part = values_part(ValuesAsked(None, local_of(g), g), placement_of(g), g.device)   # merge_rows(values=[part])

    One rank owns each element (a replica counts once), so the SUM all-reduce adds zeros to each bit
    pattern: the values come back exactly, -0.0 and NaN payloads included. Taken when the gradient is
    reduced: a later in-place change (clipping, the optimiser's zero_grad) does not reach it.
    """
    n = piece.numel if asked.positions is None else len(asked.positions)
    part = torch.zeros(n, dtype=torch.float64, device=device)
    if piece.counted and asked.piece.numel():
        where = global_positions(asked.whole).to(device)
        bits = asked.piece.detach().reshape(-1).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        if asked.positions is None:
            part[where] = bits.to(torch.float64)
        else:
            wanted = torch.from_numpy(np.asarray(asked.positions, dtype=np.int64)).to(device)
            slot = torch.searchsorted(wanted, where).clamp_(max=max(n - 1, 0))
            hit = wanted[slot] == where if n else torch.zeros_like(where, dtype=torch.bool)
            part[slot[hit]] = bits[hit].to(torch.float64)
    return part


def _unpack_values(flat: torch.Tensor, sizes: Sequence[int | None]) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    at = 0
    for n in sizes:
        if n is None:
            out.append(None)
            continue
        bits = flat[at : at + n].to(torch.int64)
        out.append(torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32))
        at += n
    return out


#: How many position tables (one per shape, mesh and placements) are kept, the least recently used let go first:
#: a training step repeats a few, and shapes that vary (sequence lengths) must not grow it without end.
POSITIONS_KEPT = 32
_POSITIONS: OrderedDict[tuple[object, ...], torch.Tensor] = OrderedDict()


def global_positions(t: torch.Tensor) -> torch.Tensor:
    """The global row-major position of each element of `t`'s local piece, int64, flat.

    Example::

        global_positions(fc2_weight_grad)     # Shard(1) of a (3, 6) weight on rank 1: [3, 4, 5, 9, 10, 11, ...]

    From `distribute_tensor(..., src_data_rank=None)` of the positions: each rank takes its own chunk,
    no collective, and the chunks follow DTensor's own rule (`torch.chunk`, uneven shards unpadded).
    Kept per shape, mesh and placements (a training step repeats them), the last `POSITIONS_KEPT` of them.
    """
    if not isinstance(t, DTensor):
        return torch.arange(t.numel(), device=t.device)
    key = (tuple(t.shape), t.device_mesh, t.placements, tuple(t.device_mesh.get_coordinate() or ()))
    found = _POSITIONS.get(key)
    if found is not None:
        _POSITIONS.move_to_end(key)
        return found
    whole = torch.arange(t.numel(), device=t.to_local().device).reshape(t.shape)
    found = _POSITIONS[key] = (
        distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local().reshape(-1)
    )
    while len(_POSITIONS) > POSITIONS_KEPT:
        _POSITIONS.popitem(last=False)
    return found


def whole_of(grad: torch.Tensor) -> Whole | None:
    """Where this rank's piece of a DTensor gradient sits in the whole one (None for a plain tensor): for edits.

    Example::

        w = whole_of(fsdp_param.grad)
        w.shape, w.positions             # the whole shape; the flat position of each local element
        w.total(local_sumsq)             # the whole gradient's sum of squares (an all-reduce on every rank)

    `total` sums the counted pieces' values over the gradient's mesh (a replica counts once; the world, or a
    sub-mesh: an activation's under 2-D data x tensor parallel), so every rank gets the whole gradient's value.
    `grad` holds no `Partial` placement (`summed` first).
    """
    if not isinstance(grad, DTensor):
        return None
    piece = _piece_on_mesh(grad)
    return Whole(torch.Size(piece.shape), global_positions(grad), lambda part: _mesh_sum(part, grad))


def _mesh_sum(part: torch.Tensor, t: DTensor) -> torch.Tensor:
    """`part` (0-d, this rank's piece's share of `t`) summed over the counted pieces of `t`'s mesh, float64."""
    out = part.detach().to(torch.float64) * float(_piece_on_mesh(t).counted)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return out
    if not _on_sub_mesh(t):
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out
    # a sub-mesh has no process group of its own when it has several dims: DTensor's own sum over every mesh dim
    mesh = t.device_mesh
    return waited(DTensor.from_local(out, mesh, [Partial()] * mesh.ndim, run_check=False).full_tensor())
