"""What an autograd node did to dim 0, for `per_example_rows.RowOrigins`' walk: kept it, moved another dim there, or pushed
it to dim 1 under a new one.

- `SELECTS`: selections by an index tensor; `UNARY`: ops of one tensor operand that keep dim 0 where it is (views, casts, activations, slices);
  `keeps_dim0`: a transpose, permute, expand or repeat that leaves dim 0 untouched, or an op along other dims
  (`_ALONG`: a roll or softmax of the features, a cumsum over the sequence); `joins_rows`: a cat along another dim;
- `moves_rows`: a transpose or permute that put in dim 0 a dim of the same size as the one it moved away (B == T);
- `tiles_rows`: a repeat of a dim 0 of several rows;
- `pushes_rows`: a stack along dim 0, or a broadcast of `h.unsqueeze(0)`, over a dim 0 of the same size (k == B);
- `row_operands`: the operands of a product whose dim 0 is its output's (a batched matmul's, a convolution's input);
- `keeps_rows`: whether a selection keeps dim 0's rows as its input's rows;
- `of_parameter`: a parameter's leaf, or a view or cast of one.

Example::

    keeps_dim0(x.transpose(1, 2).grad_fn, "TransposeBackward")     # True
    moves_rows(x.transpose(0, 1).grad_fn, "TransposeBackward")     # True where x.shape[0] == x.shape[1]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradrunner.capturing.node_compat import node_saved, node_shape
from gradrunner.capturing.per_example_tokens import ROWWISE, SLICES, VIEWS, signed

#: Autograd nodes whose output rows are rows of their input picked by an index tensor.
SELECTS = frozenset({"IndexBackward", "IndexSelectBackward", "GatherBackward", "MaskedSelectBackward", "TakeBackward"})
#: Autograd nodes of ops with one tensor operand that keep dim 0 where it is (views, casts, activations; slices and
#: splits, which keep some of its rows: an expert's run of the sorted tokens, `tokens[start:end]`, `split(counts)`).
UNARY = VIEWS | ROWWISE | SLICES | {"UnsqueezeBackward", "SqueezeBackward"}
#: Autograd nodes of ops that move dims: where dim 0 gets another dim of the batch's size, which one is the batch's
#: cannot be told (`moves_rows`).
MOVES = frozenset({"TransposeBackward", "PermuteBackward", "TBackward"})
#: Autograd nodes of ops that can give a tensor a new dim 0, pushing its own to dim 1 (`torch.stack(.., 0)`, a broadcast
#: of `h.unsqueeze(0)` or of `h[None]`): where the new dim has the batch's size, which is the batch's cannot be told
#: (`pushes_rows`).
PUSHES = frozenset({"StackBackward", "ExpandBackward", "RepeatBackward"})
#: Autograd nodes of matrix products whose output's dim 0 is their first operand's (`h @ w` of a 2-D `h`, flattened
#: tokens in a matmul; a batched product's batch dim): the walk follows that operand alone (not the matrix it multiplies).
ROWS_OF_FIRST = frozenset({"MmBackward"})
#: Autograd nodes of ops whose output's dim 0 is that of their operands at these positions (a batched matmul's batch:
#: `bmm`, `baddbmm`, `matmul` and `einsum` of 3-D operands; `addmm`'s rows, `F.linear` with a bias; a convolution's, a
#: pooling's, `F.bilinear`'s, a norm's with a weight; attention's `q, k, v`: `_SDPA`), where the walk ends for its
#: other verdicts (a parameter's or tiled rows may be a factor broadcast over the batch: DeBERTa's relative positions
#: `repeat`ed to B H rows in a `bmm`): `row_operands`.
_CARRY: dict[str, tuple[int, ...]] = {
    "BmmBackward": (0, 1), "BaddbmmBackward": (0, 1, 2), "AddmmBackward": (1,), "LinearBackward": (0,),
    "ConvolutionBackward": (0,), "TrilinearBackward": (0, 2), "CdistBackward": (0,), "NativeLayerNormBackward": (0,),
    "NativeGroupNormBackward": (0,), "PreluKernelBackward": (0,), "GluBackward": (0,), "Im2ColBackward": (0,),
    "Col2ImBackward": (0,),
}  # fmt: skip
#: Name prefixes of nodes of one operand at position 0 that keep its dim 0 (pooling, upsampling), and of attention's.
_POOLS, _SDPA = ("AvgPool", "MaxPool", "AdaptiveAvgPool", "AdaptiveMaxPool", "Upsample"), "ScaledDotProduct"


def row_operands(node: Any, name: str) -> list[Any]:
    """The operands of autograd node `node` (named `name`) whose dim 0 is its output's (`_CARRY`: a batched matmul's two,
    a convolution's input), of the same size where the shapes are known (not `baddbmm`'s `self` broadcast over dim 0,
    not `glu` along dim 0); none for other ops."""
    at = _CARRY.get(name, (0, 1, 2) if name.startswith(_SDPA) else (0,) if name.startswith(_POOLS) else ())
    out, found = node_shape(node, 0), []
    for i in at:
        n, nr = node.next_functions[i] if i < len(node.next_functions) else (None, 0)
        shape = None if n is None else node_shape(n, nr)
        if n is not None and (out is None or shape is None or (len(out) > 0 < len(shape) and shape[0] == out[0])):
            found.append(n)
    return found


#: Autograd nodes of ops of one operand along the dims they save (`_saved_dim` or `_saved_dims`): along others than 0
#: they leave each row of dim 0 its own (a roll or flip of the features, a softmax, a cumsum or sort along the sequence,
#: a sum or mean over it).
_ALONG = frozenset({
    "RollBackward", "FlipBackward", "CumsumBackward", "CumprodBackward", "SortBackward", "TopkBackward",
    "SoftmaxBackward", "LogSoftmaxBackward", "SumBackward", "MeanBackward", "AmaxBackward", "AminBackward",
})  # fmt: skip


def moves_rows(node: Any, name: str) -> bool:
    """Whether transpose or permute `node` put in dim 0 a dim of the same size as the dim 0 it moved elsewhere (B == T:
    which is the batch's cannot be told); True where the shapes are unknown and dim 0 moved."""
    out = node_shape(node, 0)
    if out is not None and len(out) < 2:
        return False  # (a 0-d or 1-d tensor's transpose moves nothing)
    if name == "PermuteBackward":
        dims = [signed(int(d)) for d in node_saved(node, "dims")]
        moved = [d % len(dims) for d in dims]
        return len(dims) > 1 and moved[0] != 0 and (out is None or out[moved.index(0)] == out[0])
    d0, d1 = (0, 1) if name == "TBackward" else (signed(int(node_saved(node, d))) for d in ("dim0", "dim1"))
    if out is None:
        return 0 in (d0, d1) or d0 < 0 or d1 < 0
    d0, d1 = d0 % len(out), d1 % len(out)
    return d0 != d1 and 0 in (d0, d1) and out[d0 + d1] == out[0]


def pushes_rows(node: Any, name: str, rows: int) -> bool:
    """Whether stack, expand or repeat `node` made a dim 0 of `rows` over a tensor (not a parameter's: `latents.unsqueeze(0)
    .expand(B, ...)` is broadcast to the batch's rows) whose own dim 0 of `rows` went to dim 1; True where the shapes
    are unknown and that may be."""
    out = node_shape(node, 0)
    if name == "StackBackward":
        d = signed(int(node_saved(node, "dim")))
        return (d <= 0) if out is None else d % len(out) == 0 and len(out) > 1 and out[1] == rows
    src = node.next_functions[0][0] if node.next_functions else None
    sizes = [int(n) for n in node_saved(node, "self_sym_sizes")]
    if src is None or not sizes or of_parameter(src):
        return False
    if out is not None and len(out) > len(sizes):  # new leading dims (`h.expand(k, *h.shape)`): h's dim 0 went further
        return sizes[0] == rows
    return sizes[0] == 1 and _unsqueezed(src, rows)


def tiles_rows(node: Any, name: str) -> bool:
    """Whether repeat `node` tiled a dim 0 of several rows (`h.repeat(2, 1)`: rows h0, h1, h0, h1, copies that a
    later view may make dim 0 of any size)."""
    if name != "RepeatBackward":
        return False
    sizes, repeats = node_saved(node, "self_sym_sizes"), node_saved(node, "repeats")
    return 0 < len(sizes) == len(repeats) and int(sizes[0]) > 1 and int(repeats[0]) > 1


def _unsqueezed(node: Any, rows: int) -> bool:
    """Whether autograd node `node`, or one below it through a few ops of one operand, put a dim of 1 before a dim 0 of
    `rows` (`h.unsqueeze(0)`, `h[None]`, `h.view(1, *h.shape)`) of a tensor that is not a parameter's."""
    for _ in range(4):
        name = node.name().rstrip("0123456789")
        inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
        if len(inputs) != 1 or name not in UNARY:
            return False
        src, nr = inputs[0]
        shape = node_shape(src, nr)
        if name == "UnsqueezeBackward":
            d = signed(int(node_saved(node, "dim")))
            first = d == 0 or (d < 0 and (shape is None or d % (len(shape) + 1) == 0))
            return first and (shape is None or (len(shape) > 0 and shape[0] == rows)) and not of_parameter(src)
        if name in VIEWS:
            sizes, out = tuple(int(n) for n in node_saved(node, "self_sym_sizes")), node_shape(node, 0)
            if out is not None and sizes and out == (1, *sizes):
                return sizes[0] == rows and not of_parameter(src)
        node = src
    return False


def joins_rows(node: Any, name: str) -> bool:
    """Whether `node` is a cat or stack along another dim than 0: each row of its output is the same row of every
    operand's, as for an elementwise op; True where the shapes are unknown and the dim is not 0."""
    if name not in ("CatBackward", "StackBackward"):
        return False
    out, d = node_shape(node, 0), signed(int(node_saved(node, "dim")))
    return d != 0 if out is None else len(out) > 1 and d % len(out) != 0


def keeps_dim0(node: Any, name: str) -> bool:
    """Whether transpose, permute, expand or repeat `node` left its input's dim 0 as its output's dim 0, untouched (a
    transpose of two other dims, a broadcast of another dim), or a roll or flip kept dim 0 there (reordered along it, as
    `x[perm]` is: not told apart), or an op acted along other dims only: the walk goes on below it."""
    if name == "PermuteBackward":
        return signed(int(node_saved(node, "dims")[0])) == 0
    if name in ("RollBackward", "FlipBackward") and node_saved(node, "dims"):  # (dim 0 too: a reordering, as x[perm])
        return True
    if name == "TransposeBackward":
        out = node_shape(node, 0)
        d0, d1 = signed(int(node_saved(node, "dim0"))), signed(int(node_saved(node, "dim1")))
        return out is not None and len(out) > 0 and 0 not in (d0 % len(out), d1 % len(out))
    if name in _ALONG:
        return _along_other_dims(node)
    if name == "ConstantPadNdBackward":  # (F.pad: pairs for the last dims; fewer pairs than dims leave dim 0 alone)
        out = node_shape(node, 0)
        return out is not None and len(node_saved(node, "pad")) < 2 * len(out)
    if name not in ("ExpandBackward", "RepeatBackward"):
        return _same_shape(node, name)

    sizes, out = [int(n) for n in node_saved(node, "self_sym_sizes")], node_shape(node, 0)
    return out is not None and len(out) == len(sizes) > 0 and out[0] == sizes[0]


#: Autograd nodes of ops whose one differentiable operand is a table or a matrix the rows look up or multiply (the rows
#: come from an operand autograd does not show: ids, an input that needs no grad): never followed by `_same_shape`.
_LOOKUPS = frozenset({
    "EmbeddingBackward", "EmbeddingDenseBackward", "EmbeddingBagBackward", "MmBackward", "AddmmBackward", "BmmBackward",
    "BaddbmmBackward", "MvBackward", "AddmvBackward", "DotBackward", "ConvolutionBackward", "LinearBackward",
})  # fmt: skip


def _same_shape(node: Any, name: str) -> bool:
    """Whether `node`, an op of one tensor operand, gave its output that operand's shape (an elementwise op: `pow`,
    `exp`, `clamp`, `masked_fill`, a norm without weight along the features): the walk goes on below it (until 2026-11-28
    it ended there, and `lin(x.transpose(0, 1).pow(2))` with B == T got a wrong number). Also an op along dim 0 of that
    shape (a cumsum): what the walk finds below it is no less there. Not a lookup (`_LOOKUPS`)."""
    inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
    if name in _LOOKUPS or len(inputs) != 1:
        return False
    out = node_shape(node, 0)
    return out is not None and out == node_shape(*inputs[0])


def _along_other_dims(node: Any) -> bool:
    """Whether `_ALONG` node `node` acted along dims that are all other than 0 (False where it saves none: a sum of every
    element, a roll of the flattened tensor; or where a negative dim cannot be told from 0, the shapes unknown)."""
    saved = node_saved(node, "dims", node_saved(node, "dim", None))
    dims = [signed(int(d)) for d in (saved if isinstance(saved, tuple | list) else () if saved is None else (saved,))]
    sizes = node_saved(node, "self_sym_sizes", None)
    out = node_shape(node, 0)
    ndim = len(sizes) if sizes is not None else len(out) if out is not None else None
    if not dims or not ndim:
        return False
    return all(d != 0 and (d > 0 or (ndim is not None and d % ndim != 0)) for d in dims)


def of_parameter(node: Any) -> bool:
    """Whether autograd node `node` is a parameter's leaf (its `AccumulateGrad`), or a view or cast of one (a few ops of
    one operand: `table.to(dtype)`, `table[:n]`)."""
    for _ in range(4):
        if node is None:
            return False
        if isinstance(getattr(node, "variable", None), nn.Parameter):
            return True
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1 or node.name().rstrip("0123456789") not in UNARY:
            return False
        node = inputs[0]
    return False


#: `keeps_rows`' answer for rows of a parameter picked by a batch-sized index tensor (`table[ids]`): the batch's rows
#: if the ids are the batch's (given to the model, or made in the forward while B equals no other dim of its inputs).
TABLE = "table"


def keeps_rows(node: Any, name: str, rows: int) -> bool | str:
    """Whether a selection keeps dim 0's rows as its input's rows: it picks along another dim, leaving a dim 0 of B
    or B T rows as it is (`gather(-2, ...)`, `index_select(1, ...)`, `h[:, idx]`, `flat_tokens[..., idx]`:
    `_grouped`), or picks `rows` rows out of a batch-sized dim 0 (`h[arange(B), last]`: one row per example; a reordering `x[perm]` is not
    told apart, README). `TABLE` where it picks a parameter's rows by one index tensor of `rows` rows (`table[ids]`,
    learned positions indexed by (B, T) position ids). Rows picked out of another dim 0 (a mixture of experts'
    flattened tokens), by a mask over several dims, or by advanced indices apart after dim 0 (`h[:, i, :, j]`: numpy's
    rule puts the index dims first, so dim 0 is the index's, whatever its size) are not the batch's; apart from dim 0
    on (`h[arange(B), :, j]`) dim 0 is the first index's as when they are together (`h[arange(B), j]`)."""
    if name == "GatherBackward":
        saved, index = node_saved(node, "self", None), node_saved(node, "index", None)
        if saved is None or index is None or saved.dim() == 0:
            return False
        along = signed(int(node_saved(node, "dim"))) % saved.dim() != 0  # (a shorter index would pick the first rows)
        return along and index.shape[0] == saved.shape[0] and _grouped(node, saved.shape[0], rows)
    if name == "IndexSelectBackward":
        sizes = node_saved(node, "self_sym_sizes")
        along = bool(sizes) and signed(int(node_saved(node, "dim"))) % len(sizes) != 0
        return along and _grouped(node, int(sizes[0]), rows)
    if name == "IndexBackward":
        indices, sizes = node_saved(node, "indices"), node_saved(node, "self_sym_sizes")
        at = [i for i, index in enumerate(indices) if index is not None]
        if not at:
            return False
        if at[0] > 0:  # dim 0 left as it is, unless the indices are apart (`h[:, i, :, j]`: their dims come first)
            return at == list(range(at[0], at[-1] + 1)) and _grouped(node, int(sizes[0]), rows)
        first = indices[0]
        if first.dtype in (torch.bool, torch.uint8):
            return bool(sizes) and int(sizes[0]) == rows and first.dim() == 1
        if not _first_leads(indices):
            return False  # dim 0 is another index's (`h[arange(B), j]` with j (B, 1): row a is h[b, j[a]] for every b)
        if len(at) == 1 and first.dim() > 0 and first.shape[0] == rows and of_parameter(node.next_functions[0][0]):
            return TABLE
        return bool(sizes) and int(sizes[0]) == rows  # else picked out of a dim 0 of another size (`h[None, idx]`)
    return False


def _first_leads(indices: Any) -> bool:
    """Whether the first index (on dim 0) gives the indices' broadcast shape, which leads the result, its dim 0:
    broadcasting right-aligns shapes, so an index with more dims, or a longer dim 0 where it has as many, leads."""
    first = indices[0]
    return first.dim() > 0 and all(
        i.dim() < first.dim() or (i.dim() == first.dim() and i.shape[0] in (1, first.shape[0]))
        for i in indices[1:]
        if i is not None
    )


def _grouped(node: Any, size: int, rows: int) -> bool:
    """Whether a dim 0 of `size` that selection `node` leaves as it is (picking along another dim) holds the batch's
    rows: `rows` of them, or the batch's tokens flattened (a view of a tensor whose dim 0 has `rows`: a later view back
    to (B, ...) keeps each example's together); not a dim of another size (`h[None, idx]`'s 1, whose picked tokens a
    reshape then makes rows; two batches concatenated)."""
    if size == rows:
        return True
    src = node.next_functions[0][0] if node.next_functions else None
    view = src is not None and src.name().rstrip("0123456789") in VIEWS
    sizes: Any = node_saved(src, "self_sym_sizes", None) if view else None
    return bool(sizes) and rows > 0 and int(sizes[0]) == rows and size % rows == 0
