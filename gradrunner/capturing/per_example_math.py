"""Per-row squared norms of a parameter's gradient shares, from the factors a layer gives: ghost or materialised.

One call of a module that uses a parameter gives each batch row i a share S_i of the parameter's
`.grad` (the shares of all rows and all calls sum to `.grad`), in one of three forms:

| form | share of row i | layers |
| --- | --- | --- |
| `Factors(left, right)` | S_i = sum over groups g and positions t of left[i,g,t] (outer) right[i,g,t] | Linear, HF Conv1D, Conv1d/2d/3d (weights), Embedding (left: token ids, one-hot) |
| `Dense(rows)` | S_i = rows[i], flattened in the parameter's layout | biases, LayerNorm, RMSNorm, GroupNorm, BatchNorm (eval) |
| `Lazy` | computed by the layer on demand: its own squared rows, rows materialised, the check's terms | Conv1d/2d/3d weights (`per_example_conv`) |

`row_sq(forms)` gives ||sum over calls of S_i||^2 per row. For one `Factors` call it takes the
cheaper of two exact forms, by the shapes alone (`ghost_is_cheaper`):

- ghost norm (Goodfellow 2015; Li et al. 2022, "Large language models can be strong differentially
  private learners", ghost clipping): ||S_i||^2 = sum_{s,t} (left_s . left_t)(right_s . right_t), two
  T x T Gram matrices per row and group, never forming S_i: cost G T^2 (p + q);
- materialised: S_i = left_i^T right_i (a batched matmul, p x q per row and group), then its squared
  sum: cost G T p q.

Ghost when `GRAM_COST` T (p + q) <= p q (the time form of Bu et al.'s mixed ghost clipping rule, whose
space form is 2 T^2 <= p q, with the ghost form's Gram matrices in float64 costing `GRAM_COST` times
float32's: see below). T = 1 (a Linear on 2-D input) is always ghost and costs B (p + q). Embeddings
(left = token ids, p = vocabulary): the ghost Gram of the ids is an equality test; it is used for
T <= `INDEX_GHOST_MAX_T`, past that the materialised form groups equal tokens of a row by sorting
(cost B T q + a sort), never a B x V x q tensor.
Several calls of one parameter in a micro-batch (tied weights, a module called twice) add the
cross terms 2 <S_i^(a), S_i^(b)>: ghost inner products between every pair of calls when all are
`Factors` of one layout and that is cheaper, else every call materialised and summed.

Everything is computed in float32 (float64 when the tensors are float64) on the tensors' device, with
no host synchronisation (no data-dependent shapes: the embedding's sort uses fixed sizes), except the
ghost form's Gram matrices, always float64: their inner product squares the cancellation within a
row (positions whose terms nearly cancel, |S_i| much smaller than sum_t |left_t| |right_t|), so that
its float32 rounding error is eps times the square of that ratio where the materialised form's (and
autograd's own) is eps times the ratio: 3% to 11% against 1e-6 on a Linear(64, 64) over 16 positions.
`GRAM_COST` 2 is a CPU's ratio (an H100's float64 matmul is about as fast as float32's; a consumer
GPU's is far slower, where the ghost form then costs more than the rule assumes).

Example::

    f = Factors(left=g.reshape(B, 1, T, d_out), right=x.reshape(B, 1, T, d_in), size=d_out)
    row_sq([f])          # (B,) squared norms of each row's share of a Linear's weight gradient
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

#: Up to this many positions an embedding's rows take the ghost form (an ids equality Gram); past it, sorting.
INDEX_GHOST_MAX_T = 32
#: A float64 Gram matrix's cost against a float32 matmul of the same size (CPU: about 2).
GRAM_COST = 2
#: Materialised shares are formed this many elements at a time at most (rows are chunked), bounding memory.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class Factors:
    """S_i = sum_{g,t} left[i,g,t] (outer) right[i,g,t]; `left` (B, G, T, p) float, or (B, 1, T) int64 ids (one-hot of width `size`).

    `sq`: the squared row norms where the layer computed them with the form (a 2-D Linear's, sharing
    ||g_i||^2 with its bias); used when this is the parameter's only call.
    """

    left: torch.Tensor
    right: torch.Tensor
    size: int
    sq: torch.Tensor | None = None

    @property
    def index(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(B, G, T, p, q)."""
        b, g, t, q = self.right.shape
        return b, g, t, self.size, q


@dataclass
class Dense:
    """S_i = rows[i]: (B, P), the parameter's layout flattened.

    `terms` (B, T, P): what `rows` sums over positions (None where T = 1), so that the check measures
    rounding against each position's term, not against a sum that cancels. `sq`: the squared row
    norms where already known.
    """

    rows: torch.Tensor
    terms: torch.Tensor | None = None
    sq: torch.Tensor | None = None


class Lazy:
    """A share a layer computes on demand (a convolution's weight, `per_example_conv`): never formed unless asked."""

    #: (B, width of the parameter's layout, dtype)
    batch: int
    width: int
    dtype: torch.dtype

    def self_sq(self) -> torch.Tensor:
        """(B,) squared norms of the rows' shares, by the layer's cheapest exact way."""
        raise NotImplementedError

    def dense(self, i: int, j: int) -> torch.Tensor:
        """Rows i to j of the shares materialised: (j - i, width), in the parameter's layout."""
        raise NotImplementedError

    def project(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The check's terms (1-D, summing to sum_i <S_i, u v^T>), as `projection`."""
        raise NotImplementedError


Form = Factors | Dense | Lazy


def ghost_is_cheaper(f: Factors) -> bool:
    """The per-layer rule: the ghost form when its cost `GRAM_COST` G T^2 (p + q) is at most the materialised G T p q
    (T = 1: no Gram matrix, B (p + q) against B p q)."""
    _, _, t, p, q = f.shape
    if f.index:
        return t <= INDEX_GHOST_MAX_T
    return t == 1 or GRAM_COST * t * (p + q) <= p * q


def row_sq(forms: list[Form]) -> torch.Tensor:
    """||sum of the forms' shares of row i||^2 for every row i: (B,), in the forms' dtype (float64 where ghost)."""
    if len(forms) == 1:
        f = forms[0]
        if isinstance(f, Lazy):
            return f.self_sq()
        if f.sq is not None:
            return f.sq
        return _dense_sq(f.rows) if isinstance(f, Dense) else _self_sq(f)
    facs = [f for f in forms if isinstance(f, Factors)]
    if len(facs) == len(forms) and _compatible(facs) and _pairs_ghost_cheaper(facs):
        total = sum(_self_sq(f) for f in facs)
        for fa, fb in itertools.combinations(facs, 2):
            total = total + 2 * _cross(fa, fb)
        return total  # type: ignore[return-value]
    rows, width = _rows(forms[0]), _width(forms[0])
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    parts = []
    for i in range(0, rows, step):
        dense = _dense_rows(forms[0], i, i + step)
        for f in forms[1:]:
            dense = dense + _dense_rows(f, i, i + step)
        parts.append(_dense_sq(dense))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _rows(f: Form) -> int:
    if isinstance(f, Lazy):
        return f.batch
    return f.rows.shape[0] if isinstance(f, Dense) else f.right.shape[0]


def _width(f: Form) -> int:
    if isinstance(f, Lazy):
        return f.width
    if isinstance(f, Dense):
        return f.rows.shape[1]
    _, g, _, p, q = f.shape
    return g * p * q


def _dense_rows(f: Form, i: int, j: int) -> torch.Tensor:
    """Rows i to j of the shares materialised."""
    if isinstance(f, Lazy):
        return f.dense(i, j)
    return to_dense(Dense(f.rows[i:j]) if isinstance(f, Dense) else Factors(f.left[i:j], f.right[i:j], f.size))


def to_dense(f: Form) -> torch.Tensor:
    """The per-row shares materialised: (B, P) in the parameter's layout (G p rows of q, group-major)."""
    if isinstance(f, Lazy):
        return f.dense(0, f.batch)
    if isinstance(f, Dense):
        return f.rows
    b, g, t, p, q = f.shape
    if f.index:
        flat = (torch.arange(b, device=f.left.device).view(b, 1) * p + f.left.reshape(b, t)).reshape(-1)
        out = torch.zeros(b * p, q, dtype=f.right.dtype, device=f.right.device)
        return out.index_add_(0, flat, f.right.reshape(b * t, q)).view(b, p * q)
    return torch.matmul(f.left.transpose(-1, -2), f.right).reshape(b, g * p * q)


def projection(f: Form, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One call's part of the check: terms (1-D) whose sum is sum_i <S_i, u v^T> and whose |.| sum is their magnitude.

    A term per row and position (and group): (u . left_t)(v . right_t), or a position's term of a
    `Dense` share against `w` = u v^T flattened. `u` spans the parameter's first dimension (G p), `v`
    the rest (q), all in the form's dtype. Costs matrix-vector products over the factors (one read of
    each), nothing of the parameter's size per row.
    """
    if isinstance(f, Lazy):
        return f.project(u, v)
    if isinstance(f, Dense):
        src = f.rows if f.terms is None else f.terms
        if src.stride(-1) == 1:
            return torch.matmul(src, w).reshape(-1)
        return torch.matmul(w, src.transpose(-1, -2)).reshape(-1)  # a transposed view: read in its own layout
    b, g, t, p, q = f.shape
    if f.index:
        lu = u[f.left]
    elif g == 1 and f.left.is_contiguous():
        lu = torch.mv(f.left.view(b * t, p), u)
    else:
        lu = _contract(f.left, u.view(g, 1, p))
    rv = torch.mv(f.right.view(b * g * t, q), v) if f.right.is_contiguous() else _contract(f.right, v.view(1, 1, q))
    return lu.reshape(-1) * rv.reshape(-1)


def _contract(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, G, T, k) x (G or 1, 1, k) -> (B, G, T) summed over k, reading x in its own layout (no copy of a transposed view)."""
    if x.stride(-1) == 1:
        return torch.matmul(x, w.transpose(-1, -2)).squeeze(-1)
    return torch.matmul(w, x.transpose(-1, -2)).squeeze(-2)


def _dense_sq(rows: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vecdot(rows, rows)


def _self_sq(f: Factors) -> torch.Tensor:
    b, g, t, p, q = f.shape
    if f.index:
        if t == 1:
            return torch.linalg.vecdot(f.right, f.right).sum((1, 2))
        if ghost_is_cheaper(f):
            return (_ids_gram(f.left, f.left, f.right.dtype) * _gram(f.right, f.right)).sum((1, 2, 3))
        return _segment_sq(f.left.reshape(b, t), f.right.reshape(b, t, q), p)
    if t == 1:
        left, right = f.left.reshape(b, g, p), f.right.reshape(b, g, q)
        prod = torch.linalg.vecdot(left, left) * torch.linalg.vecdot(right, right)
        return prod[:, 0] if g == 1 else prod.sum(1)
    if ghost_is_cheaper(f):
        return _ghost_sq(f.left, f.right)
    step = max(1, CHUNK_ELEMENTS // max(1, g * p * q))
    parts = [torch.matmul(f.left[i : i + step].transpose(-1, -2), f.right[i : i + step]).square().sum((1, 2, 3))
             for i in range(0, b, step)]  # fmt: skip
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _ghost_sq(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """sum_{s,t} (left_s . left_t)(right_s . right_t) per row: the two Gram matrices' inner product."""
    b = left.shape[0]
    return torch.linalg.vecdot(_gram(left, left).reshape(b, -1), _gram(right, right).reshape(b, -1))


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, G, Ta, Tb) inner products of the positions of a and b, in float64 (the module's docstring says why)."""
    return torch.matmul(a.double(), b.double().transpose(-1, -2))


def _ids_gram(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, Ta, Tb): 1 where the one-hot rows meet (the same token), else 0."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).to(dtype)


def _left_gram(a: Factors, b: Factors) -> torch.Tensor:
    """<left_a[s], left_b[t]> for every pair of positions, whichever of the two is one-hot."""
    if a.index and b.index:
        return _ids_gram(a.left, b.left, a.right.dtype)
    if a.index:
        return _left_gram(b, a).transpose(-1, -2)
    if b.index:
        bb, _, ta, _ = a.left.shape
        tb = b.left.shape[-1]
        return a.left.gather(-1, b.left.unsqueeze(2).expand(bb, 1, ta, tb))  # left_a[s][id_t]
    return _gram(a.left, b.left)


def _cross(a: Factors, b: Factors) -> torch.Tensor:
    """<S_i^(a), S_i^(b)> per row: the ghost inner product of two calls' shares."""
    return (_left_gram(a, b) * _gram(a.right, b.right)).sum((1, 2, 3))


def _compatible(facs: list[Factors]) -> bool:
    """One layout (groups, p, q) for all, so that their factors meet position by position."""
    first = facs[0].shape
    return all(f.shape[0] == first[0] and f.shape[1] == first[1] and f.shape[3:] == first[3:] for f in facs)


def _pairs_ghost_cheaper(facs: list[Factors]) -> bool:
    """Cross terms included: all pairs' Gram matrices against every call materialised (the same rule as one call).

    A pair's left Gram costs p per entry between two float factors, about 1 where one is token ids
    (an equality test or a gather): a tied embedding and LM head meet at T^2 (q + 1), not T^2 (p + q).
    """
    _, g, _, p, q = facs[0].shape
    ghost = sum(a.shape[2] * b.shape[2] * (q + (1 if a.index or b.index else p)) for a in facs for b in facs)
    dense = sum(f.shape[2] * q + p * q if f.index else f.shape[2] * p * q + p * q for f in facs)
    return GRAM_COST * g * ghost <= g * dense


def _segment_sq(ids: torch.Tensor, right: torch.Tensor, size: int) -> torch.Tensor:
    """Per row: sum over its distinct tokens of ||sum of `right` at that token's positions||^2, by sorting.

    Fixed sizes throughout (no `unique`, which would wait for the device): the (row, token) keys are
    sorted, each position is added into the slot of its run of equal keys, and the slots' squared
    norms are added per row.
    """
    b, t, q = right.shape
    n = b * t
    rows = torch.arange(b, device=ids.device).repeat_interleave(t)
    key = rows * size + ids.reshape(-1)
    order = torch.argsort(key)
    sorted_key = key[order]
    starts = torch.ones(n, dtype=torch.bool, device=ids.device)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    slot = torch.cumsum(starts, 0) - 1
    sums = torch.zeros(n, q, dtype=right.dtype, device=right.device).index_add_(0, slot, right.reshape(n, q)[order])
    slot_row = torch.zeros(n, dtype=torch.long, device=ids.device).scatter_(0, slot, rows[order])
    return torch.zeros(b, dtype=right.dtype, device=right.device).index_add_(0, slot_row, sums.square().sum(1))
