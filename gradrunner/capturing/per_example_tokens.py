"""Whether a layer call's dim 0 holds the batch's tokens flattened: B rows of k tokens each, row i's tokens together.

A layer called on `x.view(-1, d)` of a (B, T, d) batch (a Linear before an MLP, Qwen2-MoE's `shared_expert`, an
experts module) sees B T rows in row-major order: token n is row n // T's. Where that is proven, row i's share is
the sum over its T tokens, as for the layer called on (B, T, d) (`per_example_layers.share` takes the batch's rows
from the call, not from dim 0). Proven, here, from what the call's input is made of (`flat_sources`):

- a row-major view of a whole tensor whose dim 0 has B rows (`token_rows`: itself a tensor, the same memory), or a
  view or reshape of a tensor whose dim 0 is B (its autograd node: any reshape keeps the elements' order, so each
  row's elements stay together) or a multiple of B already proven so;
- the output of a call proven to be on such tokens (a layer acts on each token alone: `RowOrigins.tokens`);
- an op that acts on each token alone (`ROWWISE`: casts, activations, dropout; slices and splits along another dim)
  or an elementwise op (`ELEMENTWISE`) of such operands, every operand that gives the output its dim 0 proven.

Any other op (a transpose or permute of dim 0, a slice of the tokens, an index, a `cat`, a matmul) is no proof: the
call is null with the reason. The tensors with B rows reached are then judged as the batch's rows like any call's
input (`RowOrigins.reason`: a parameter, rows picked by indexing, dim 0 transposed with another dim of B's size).

Example::

    token_rows(h.view(-1, 16), 4)      # h (4, 5, 16): h; a copy of h.transpose(0, 1): None
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.node_compat import node_saved, node_shape, view_base
from gradrunner.capturing.per_example_hfnorms import KINDS

#: The kinds (`per_example_layers.kind_of`) whose share takes a call on the batch's tokens flattened.
FLAT_KINDS = frozenset({"linear", "conv1d_hf", "embedding", "layer_norm", "rms_norm", "experts", *KINDS})
#: Autograd nodes of a view or reshape of a whole tensor (which saves its input's sizes).
VIEWS = frozenset({"ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward"})
#: Autograd nodes of ops of one tensor operand acting on each element alone (casts, copies, activations, dropout).
ROWWISE = frozenset({
    "AliasBackward", "ToCopyBackward", "CloneBackward", "ReluBackward", "GeluBackward", "SiluBackward", "TanhBackward",
    "SigmoidBackward", "EluBackward", "LeakyReluBackward", "NativeDropoutBackward",
})  # fmt: skip
#: Autograd nodes of ops that keep some of a dim's entries (a slice, a split): along dim 0 they keep some rows.
SLICES = frozenset({"SliceBackward", "SplitBackward", "SplitWithSizesBackward", "UnsafeSplitBackward"})
#: Autograd nodes of elementwise ops of one or several tensor operands (dropout's CPU mask `x * mask`, a gated
#: expert's `act(w1 x) * w3 x`, a residual add).
ELEMENTWISE = frozenset({
    "MulBackward", "DivBackward", "AddBackward", "SubBackward", "WhereBackward", "MaximumBackward", "MinimumBackward",
    "AddcmulBackward", "AddcdivBackward", "LerpBackward",
})  # fmt: skip
#: The most autograd nodes walked back from a call's input, all operands' branches together.
WALK = 16


def token_rows(x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The tensor whose dim 0 holds the batch's rows that `x` flattens (itself where its dim 0 has `rows`), or None
    where `x` is not such a flattening (row-major, whole, the same memory: a view of its base)."""
    if x.dim() == 0:
        return None
    if x.shape[0] == rows:
        return x
    base = view_base(x)
    if base is None or base.dim() < 1 or base.shape[0] != rows or base.numel() != x.numel() or x.shape[0] % rows:
        return None  # (a token of x straddling two rows: x.shape[0] not a multiple of rows)
    same = x.is_contiguous() and base.is_contiguous() and x.storage_offset() == base.storage_offset()
    return base if same else None


def signed(dim: int) -> int:
    """A dim autograd saved as an unsigned 64-bit number (-2 reads 2**64 - 2)."""
    return dim - 2**64 if dim >= 2**63 else dim


def same_rows(product: Any, operand: Any, nr: int) -> bool:
    """Whether the output `nr` of autograd node `operand`, an operand of elementwise `product`, gives the product its
    dim 0, not broadcast over it (a bias, 1-D position embeddings, a (1, ...) mask); True where a shape is unknown."""
    out, shape = node_shape(product, 0), node_shape(operand, nr)
    return shape is None or out is None or (len(shape) == len(out) and shape[:1] == out[:1])


#: A tensor of the batch's rows that flattened tokens come from: an autograd node and its output's shape.
Source = tuple[Any, tuple[int, ...]]


def flat_sources(x: torch.Tensor, rows: int, flat: Container[Any]) -> list[Source] | str:
    """The autograd nodes with `rows` rows whose flattening `x` (dim 0 a multiple of `rows`) is, every branch walked
    back (at most `WALK` nodes) reaching one or the output of a call on flattened tokens (a node in `flat`); or why
    that is not proven."""
    sources: list[Source] = []
    stack: list[Any] = [x.grad_fn]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None:
            return "it has no autograd history to tell its rows by"
        if node in seen or node in flat:
            continue
        if len(seen) >= WALK:
            return f"no batch rows within {WALK} autograd nodes"
        seen.add(node)
        name = node.name().rstrip("0123456789")
        inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
        if name in VIEWS:
            sizes = [int(s) for s in node_saved(node, "self_sym_sizes")]
            if not sizes or not inputs or sizes[0] % rows:
                return f"a reshape of a tensor of shape {tuple(sizes)}, whose dim 0 is not a multiple of the batch's {rows} rows"
            if sizes[0] == rows:
                sources.append((inputs[0][0], tuple(sizes)))
            else:
                stack.append(inputs[0][0])
        elif name in SLICES and _of_dim0(node):
            return f"{name} keeps some of the tokens (a slice or split of dim 0)"
        elif name in ROWWISE | SLICES and len(inputs) == 1:
            stack.append(inputs[0][0])
        elif name in ELEMENTWISE:
            follow = [n for n, nr in inputs if same_rows(node, n, nr) and not isinstance(_variable(n), nn.Parameter)]
            if not follow:
                return f"its tokens are made by {node.name()} from parameters or broadcast tensors alone"
            stack += follow
        else:
            return f"its tokens come through {node.name()}, which per-example norms do not follow"
    return sources


def _of_dim0(node: Any) -> bool:
    """Whether slice or split `node` cut along dim 0."""
    return signed(int(node_saved(node, "dim"))) % max(1, len(node_saved(node, "self_sym_sizes"))) == 0


def _variable(node: Any) -> Any:
    """The leaf tensor of an `AccumulateGrad` node (a parameter: no example's data, a scale or a bias), else None."""
    return getattr(node, "variable", None)
