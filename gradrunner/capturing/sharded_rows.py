"""A step's sharded (DTensor) gradients and value norms in `Collector`: reduced as they arrive, merged once in `finish`.

`Collector.add` hands a DTensor gradient (FSDP2, HSDP, tensor parallel) to `ShardedRows`: this
rank's piece is reduced at once by the collector's own reductions (`sharded.local_rows`), with its |g|
histogram and its asked values (at the unsharded run's positions); and a tapped DTensor's own norm (a
`PieceNorm`: `sharded.piece_norm`), whether its tap got a gradient or not. `Collector.finish` calls
`merge_pending`: every sharded row of the step, with the pieces' edited norms, and every tapped DTensor's
own and update norms, by the value's own placement, are merged by one SUM and one MAX all-reduce
(`sharded.merge_rows`), and the merged rows replace the pending records' reductions before the step's one
host transfer.

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
    PieceNorm,
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
    values: torch.Tensor | None  # `values_part`
    positions: np.ndarray | None
    per_row: torch.Tensor | None  # `row_squares`, when per-example norms were asked for


class MergedRow(NamedTuple):
    """One whole tensor's merged reductions and extras (`ShardedRows.merge`), on the rows' device."""

    #: (7,) float64 `[sum, sumsq, min, max, nonzero, nan, inf]` of the whole gradient (None: no DTensor gradient, the
    #: tapped DTensor's own norms alone).
    row: torch.Tensor | None
    #: Shape and numel of the whole gradient (of the tapped tensor where `row` is None).
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
    `merge` packs every row with the pieces' edited norms, and each tapped DTensor's own norm and update norm
    (`add_value_norm`: a row of their own, merged by the value's placement), into `merge_rows`.
    """

    def __init__(self, *, values: str = "none", sample: Callable[[str, int], np.ndarray] | None = None,
                 histogram: bool = False, group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        self.values, self.sample = values, sample
        self.histogram, self.group = histogram, group
        self._rows: dict[int, _Row] = {}
        self._own: dict[int, PieceNorm] = {}  # tapped DTensors' own norms, by order

    def __len__(self) -> int:
        return len(self._rows.keys() | self._own.keys())

    def __contains__(self, order: object) -> bool:
        return order in self._rows or order in self._own

    def discard(self, orders: set[int]) -> None:
        """Forget the rows added at `orders` (a later synchronised backward's read replaces them)."""
        for o in orders:
            self._rows.pop(o, None)
            self._own.pop(o, None)

    def add_value_norm(self, order: int, norm: PieceNorm) -> None:
        """The tapped DTensor's own norm of the record at `order` (`sharded.piece_norm`), merged by its own piece in
        `merge` with its update norm, whether a gradient is added at `order` or not.

        Example::

            rows.add_value_norm(3, piece_norm(tp_activation))     # merge()[3].value_norm: the whole activation's
        """
        self._own[order] = norm

    def add(self, order: int, key: TapKey, grad: torch.Tensor, *, per_example: bool = False) -> Piece:
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
        self._rows[order] = _Row(order, piece, local.numel(), rows[0], None if hist is None else hist[0], values,
                                 positions, per_row)  # fmt: skip
        return piece

    def merge(self, updates: Mapping[int, torch.Tensor], edited: Mapping[int, torch.Tensor]) -> dict[int, MergedRow]:
        """Every row merged over the ranks, by `order`: one SUM and one MAX all-reduce (none without rows).

        `updates` gives, by order, the local norms of a tapped DTensor's update (split as the tapped tensor is:
        merged with its own norm; without one, as its gradient), `edited` those of the edited gradient (pieces
        split as the gradient is); each rank must give the same orders. A tapped DTensor's own norm and update
        norm ride on a row of their own whose piece is the value's (an identity row of statistics), so they are
        merged by the value's placement whether a gradient came or not.
        """
        kept = [self._rows[o] for o in sorted(self._rows)]  # every rank in the same order
        own = sorted(self._own.items())
        self._rows, self._own = {}, {}
        if not kept and not own:
            return {}
        device = kept[0].row.device if kept else own[0][1].norm.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        entries = [(r.order, False) for r in kept] + [(o, True) for o, _ in own]  # (order, a tapped DTensor's own)
        own_norm = dict(own)

        def column(got: Callable[[int, bool], torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([zero if (v := got(o, mine)) is None else v.to(device, torch.float64).reshape(())
                                for o, mine in entries])  # fmt: skip

        norms = torch.stack([column(lambda o, mine: own_norm[o].norm if mine else None),
                             column(lambda o, mine: updates.get(o) if mine or o not in own_norm else None),
                             column(lambda o, mine: None if mine else edited.get(o))], dim=1)  # fmt: skip
        # a tapped DTensor's own norms ride on a row of the merge's identity (an empty piece's), counted by its piece
        empty = torch.zeros(0, dtype=torch.float64, device=device)
        blank, blank_hist = local_rows([empty] * len(own), histogram=self.histogram) if own else (None, None)
        rows = [r.row[None] for r in kept] + ([] if blank is None else [blank])
        hists = [r.hist[None] for r in kept if r.hist is not None] + ([] if blank_hist is None else [blank_hist])
        m = merge_rows(torch.cat(rows), [r.piece for r in kept] + [n.piece for _, n in own],
                       counts=[r.local_numel for r in kept] + [n.local_numel for _, n in own],
                       hist=torch.cat(hists) if self.histogram else None, norms=norms,
                       values=[r.values for r in kept] + [None] * len(own),
                       per_row=[r.per_row for r in kept] + [None] * len(own), group=self.group)  # fmt: skip
        wholes = [r.piece for r in kept] + [n.piece for _, n in own]
        assert all(int(c) == w.numel for w, c in zip(wholes, m.numel.tolist(), strict=True)), (
            "the counted pieces do not add up to the whole tensors", m.numel.tolist(), [w.numel for w in wholes],
        )  # fmt: skip
        assert m.norms is not None
        out = {}
        for i, r in enumerate(kept):
            out[r.order] = MergedRow(
                m.rows[i], r.piece, None if m.hist is None else m.hist[i], None,
                m.norms[i, 1] if r.order in updates and r.order not in own_norm else None,  # no own norm: the gradient's
                m.norms[i, 2] if r.order in edited else None, m.values[i], r.positions, m.per_row[i],
            )  # fmt: skip
        for j, (o, n) in enumerate(own, start=len(kept)):
            got = out.get(o) or MergedRow(None, n.piece, None, None, None, None, None, None, None)
            out[o] = got._replace(value_norm=m.norms[j, 0], update_norm=m.norms[j, 1] if o in updates else None)
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
            if m.row is not None:  # a DTensor gradient's row
                if m.values is not None and m.positions is not None:
                    positions[(p.key.tap, p.numel, m.values.device)] = (m.positions, torch.from_numpy(m.positions))
                p = p._replace(reductions=m.row if p.numel else None, hist=m.hist, values=m.values,
                               per_example=p.per_example if m.per_example is None else m.per_example)  # fmt: skip
            if m.value_norm is not None:  # a tapped DTensor's own norm, with or without a gradient
                p = p._replace(value_norm=m.value_norm)
            if m.update_norm is not None:
                updates[p.key] = m.update_norm
            if m.edited_norm is not None:
                edited[p.order] = m.edited_norm
        out.append(p)
    return out, updates, edited
