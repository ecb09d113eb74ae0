"""A step's sharded (DTensor) parameter gradients inside `Collector`: reduced as they arrive, merged once in `finish`.

`Collector.add` hands a DTensor parameter gradient (FSDP2, HSDP, tensor parallel) to `ShardedRows`: this
rank's piece is reduced at once by the collector's own reductions (`sharded.local_rows`), with its |g|
histogram and its asked values (at the unsharded run's positions). `Collector.finish` calls
`merge_pending`: every sharded row of the step, with the pieces' value, update and edited norms, is
merged by one SUM and one MAX all-reduce (`sharded.merge_rows`), and the merged rows replace the pending
records' reductions before the step's one host transfer.

| name | what it does |
| --- | --- |
| `ShardedRows` | a step's sharded gradients, reduced as they arrive, merged once |
| `merge_pending(rows, pending, ...)` | `Collector.finish`'s seam: the merged rows into the pending records |
| `row_squares(t, piece)` | each dim-0 row's sum of squares of the local piece, at its global row (per-example norms) |

Example::

    col = Collector()
    col.add(TapKey("fc1", "weight", 0), fsdp_model.fc1.weight.grad, batched=False)   # a DTensor: to ShardedRows
    col.finish().stats["norm"][0]      # the whole gradient's norm, the same on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from gradrunner.capturing.extras import per_example_norms
from gradrunner.capturing.sharded import (
    Piece,
    ValuesAsked,
    global_positions,
    local_of,
    local_rows,
    merge_rows,
    placement_of,
    summed,
    values_part,
)
from gradrunner.records.columns import TapKey

if TYPE_CHECKING:
    from gradrunner.capturing.reductions import Pending


def row_squares(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """Each dim-0 row's sum of squares of this rank's piece of `t`, float64 (t.shape[0],), zeros elsewhere.

    Example::

        row_squares(out_grad, placement_of(out_grad))     # summed over the ranks (`merge_rows(per_row=...)`): the
                                                         # whole gradient's squared per-example norms

    Dim 0 whole in the piece (tensor parallel shards features or the sequence): the piece's own rows; dim
    0 sharded: each element added to its global row (`global_positions`). A piece not counted (a replica)
    gives zeros, so the SUM over the ranks counts each element once.
    """
    local = local_of(t)
    rows = t.shape[0]
    if not piece.counted or local.numel() == 0:
        return torch.zeros(rows, dtype=torch.float64, device=local.device)
    if local.shape[0] == rows:
        norms = per_example_norms(local)
        assert norms is not None, "a tensor with rows"
        return norms.square()
    at = global_positions(t).to(local.device) // (piece.numel // rows)
    out = torch.zeros(rows, dtype=torch.float64, device=local.device)
    return out.index_add_(0, at, local.detach().reshape(-1).to(torch.float64).square())


class _Row(NamedTuple):
    order: int
    piece: Piece
    local_numel: int
    row: torch.Tensor  # (7,) float64 local reductions (the identity where not counted)
    hist: torch.Tensor | None
    value_norm: torch.Tensor | None  # of the tapped tensor's local piece
    values: torch.Tensor | None  # `values_part`
    positions: np.ndarray | None
    per_row: torch.Tensor | None  # `row_squares`, when per-example norms were asked for


class MergedRow(NamedTuple):
    """One whole tensor's merged reductions and extras (`ShardedRows.merge`), on the rows' device."""

    #: (7,) float64 `[sum, sumsq, min, max, nonzero, nan, inf]` of the whole gradient.
    row: torch.Tensor
    #: Shape and numel of the whole gradient.
    piece: Piece
    hist: torch.Tensor | None
    #: 0-d float64 norms of the whole tapped tensor, its update and its edited gradient (None: not given).
    value_norm: torch.Tensor | None
    update_norm: torch.Tensor | None
    edited_norm: torch.Tensor | None
    #: float32 values at `positions` (None: every element) of the whole gradient, when asked for.
    values: torch.Tensor | None
    positions: np.ndarray | None
    #: float64 norms of the whole gradient's dim-0 rows (per-example norms), when asked for.
    per_example: torch.Tensor | None


class ShardedRows:
    """A step's sharded gradients: each reduced locally as it arrives, all merged once (`merge`).

    Example::

        rows = ShardedRows(values="sample", sample=lambda tap, numel: sample_positions(tap, numel, 8, 0))
        rows.add(0, TapKey("fc1", "weight", 0), fsdp_model.fc1.weight.grad, local_norm)
        merged = rows.merge({}, {})      # one SUM and one MAX all-reduce: merged[0].row, merged[0].values

    What `Collector` does for a DTensor parameter gradient: the seven reductions of this rank's piece
    (`local_rows`, the collector's own reductions), its |g| histogram, its asked values (`values_part`,
    at the unsharded run's sample positions: `sample(tap, whole numel)`), kept on the device;
    `merge` packs every row with the pieces' value, update and edited norms into `merge_rows`.
    """

    def __init__(self, *, values: str = "none", sample: Callable[[str, int], np.ndarray] | None = None,
                 histogram: bool = False, group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        self.values, self.sample = values, sample
        self.histogram, self.group = histogram, group
        self._rows: dict[int, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, order: object) -> bool:
        return order in self._rows

    def discard(self, orders: set[int]) -> None:
        """Forget the rows added at `orders` (a later synchronised backward's read replaces them)."""
        for o in orders:
            self._rows.pop(o, None)

    def add(self, order: int, key: TapKey, grad: torch.Tensor, value_norm: torch.Tensor | None = None, *,
            per_example: bool = False) -> Piece:  # fmt: skip
        """Reduce this rank's piece of `grad` now; returns how it counts (`Piece`: the whole shape).

        A `Partial` gradient (a sequence-parallel LayerNorm's weight) is summed first, into a copy
        (`summed`: one all-reduce; the caller's tensor, maybe `.grad`, is not touched). `per_example`:
        its per-example norms too (`row_squares`, merged with the rest).
        """
        grad = summed(grad)
        piece = placement_of(grad, self.group)
        local = local_of(grad)
        rows, hist = local_rows([local if piece.counted else None], histogram=self.histogram)
        values = positions = None
        if self.values != "none":
            positions = None if self.values == "full" or self.sample is None else self.sample(key.tap, piece.numel)
            values = values_part(ValuesAsked(positions, local, grad), piece, rows.device)
        per_row = row_squares(grad, piece) if per_example and grad.dim() > 0 else None
        self._rows[order] = _Row(order, piece, local.numel(), rows[0], None if hist is None else hist[0], value_norm,
                                 values, positions, per_row)  # fmt: skip
        return piece

    def merge(self, updates: Mapping[int, torch.Tensor], edited: Mapping[int, torch.Tensor]) -> dict[int, MergedRow]:
        """Every row merged over the ranks, by `order`: one SUM and one MAX all-reduce (none without rows).

        `updates` and `edited` give, by order, the local norms of the tapped tensor's update and of the
        edited gradient (pieces split as the gradient is); each rank must give the same orders.
        """
        kept = [self._rows[o] for o in sorted(self._rows)]  # every rank in the same order
        self._rows = {}
        if not kept:
            return {}
        device = kept[0].row.device
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def column(got: Callable[[_Row], torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([zero if (v := got(r)) is None else v.to(device, torch.float64).reshape(())
                                for r in kept])  # fmt: skip

        norms = torch.stack([column(lambda r: r.value_norm), column(lambda r: updates.get(r.order)),
                             column(lambda r: edited.get(r.order))], dim=1)  # fmt: skip
        hist = torch.stack([r.hist for r in kept]) if self.histogram else None  # type: ignore[misc]
        m = merge_rows(torch.stack([r.row for r in kept]), [r.piece for r in kept], counts=[r.local_numel for r in kept],
                       hist=hist, norms=norms, values=[r.values for r in kept], per_row=[r.per_row for r in kept],
                       group=self.group)  # fmt: skip
        assert all(int(c) == r.piece.numel for r, c in zip(kept, m.numel.tolist(), strict=True)), (
            "the counted pieces do not add up to the whole tensors", m.numel.tolist(), [r.piece.numel for r in kept],
        )  # fmt: skip
        assert m.norms is not None
        out = {}
        for i, r in enumerate(kept):
            out[r.order] = MergedRow(
                m.rows[i], r.piece, None if m.hist is None else m.hist[i],
                None if r.value_norm is None else m.norms[i, 0], m.norms[i, 1] if r.order in updates else None,
                m.norms[i, 2] if r.order in edited else None, m.values[i], r.positions, m.per_row[i],
            )  # fmt: skip
        return out


def merge_pending(
    rows: ShardedRows, pending: list[Pending], updates: Mapping[TapKey, torch.Tensor],
    edited: Mapping[int, torch.Tensor], positions: dict[tuple[str, int, torch.device], tuple[np.ndarray, torch.Tensor]],
) -> tuple[list[Pending], dict[TapKey, torch.Tensor], dict[int, torch.Tensor]]:  # fmt: skip
    """`pending` with its sharded records' rows merged over the ranks (`ShardedRows.merge`: one SUM, one MAX).

    Example::

        pending, updates, edited = merge_pending(rows, pending, updates, edited, collector_positions)

    Their reductions, value, update and edited norms, histogram counts and values become the whole
    tensors', and go into the step's one transfer with everything else; the sample positions of the
    whole gradients join `positions` (the collector's, by (tap, numel, device)).
    """
    mine = {p.order: p for p in pending if p.order in rows}
    ups = {o: updates[p.key] for o, p in mine.items() if p.key in updates}
    merged = rows.merge(ups, {o: v for o, v in edited.items() if o in mine})
    updates, edited = dict(updates), dict(edited)
    out = []
    for p in pending:
        m = merged.get(p.order)
        if m is not None:
            if m.values is not None and m.positions is not None:
                positions[(p.key.tap, p.numel, m.values.device)] = (m.positions, torch.from_numpy(m.positions))
            p = p._replace(reductions=m.row if p.numel else None, value_norm=m.value_norm, hist=m.hist,
                           values=m.values, per_example=p.per_example if m.per_example is None else m.per_example)  # fmt: skip
            if m.update_norm is not None:
                updates[p.key] = m.update_norm
            if m.edited_norm is not None:
                edited[p.order] = m.edited_norm
        out.append(p)
    return out, updates, edited
