"""Whether a layer call's dim 0 holds the batch's rows, beyond its size: `RowOrigins`, one per `PerExampleNorms`.

`per_example_layers.call_reason` compares a call's dim 0 with the batch size; a tensor whose dim 0
has the batch's size by coincidence passes it. `RowOrigins` catches the coincidences it can tell
from what the call's input is made of, cheaply (a few attribute reads per call, no device work):

- an `Embedding` called on ids made inside the forward (positions, relative-position buckets) while
  the batch size equals another dim of any tensor the model was called with (`start`); and then any layer
  called on a tensor given to the model with fewer dims than its first one (1-D `position_ids` broadcast
  over the batch: which of its dims is the batch's cannot be told, and broadcast rows are no example's);
- an input that is a parameter, or a view, cast or activation of one (DeBERTa's
  `LayerNorm(rel_embeddings.weight)`): its dim 0 is the parameter's (a parameter broadcast to the
  batch, `latents.expand(B, ...)`, is the batch's: each row belongs to its example, and the walk
  stops at the `expand`);
- an input whose rows were picked by indexing out of a dim 0 that is not the batch's, or by a mask over
  several dims (`tokens[idx]`, `h[None, idx]`, `masked_select`, `take`), or a slice or split of such rows (an
  expert's run of the sorted tokens, DeepSeek's `sorted_tokens[start:end]`): a mixture of experts' tokens
  routed to one expert (rows picked out of the batch's own rows, `h[arange(B), eos]`, `gather(-2, ...)`,
  `x[:, idx]`, also of the B T tokens flattened, keep them, and a parameter's rows picked by the batch's ids,
  `table[position_ids]`, are the batch's: `_keeps_rows`); and an input made, by views, casts, activations, dropout or
  elementwise ops, from the output of a call whose batch-sized dim 0 was found a coincidence here (the
  expert's second Linear, a gated expert's `down(act(gate(t)) * up(t))`; not one whose dim 0 is another
  size, such as flattened tokens later reshaped back).

The walk back through the autograd graph (at most `WALK` nodes, all branches together) follows ops of one
tensor operand (`_UNARY`) and elementwise ops (`_SEVERAL`: dropout's CPU mask, a gated expert's
`act(w1 x) * w3 x`, a residual add) into each operand, towards a selection or such an output (not to a
parameter: `x * scale` has x's rows). Below an op of several tensor operands only rows picked by indexing
count (`picked`: the batch's rows plus a position's embedding made from ids made in the forward are the
batch's rows), and only if every operand passed gives the result its dim 0 (`_same_rows`, shapes read then
only: a bias or a (T, d) table broadcast over the batch are not its rows). Any other op (a matmul, a
LayerNorm, an embedding lookup, whose ids autograd does not show) ends a branch with no verdict, so rows
merged back into the batch (`index_add_` into a batch-shaped tensor) are the batch's again. Not told apart
(README): coincidences made by ops that are not elementwise (`x_param @ w`, `cat`), a frozen parameter's
views (no autograd node), rows picked from a tensor that does not require grad, and a reordering of the
batch's own rows (`x[perm]`).

Example::

    origins = RowOrigins()
    origins.start(args, kwargs, rows=4)               # at the model's call
    why = origins.reason("linear", x)                 # None, or why dim 0 is not the batch's rows
    origins.mark(output, f"'wi' {why}")               # a call without shares: what it alone feeds is not rows either
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradrunner.capturing.per_example_layers import storage, tensors_of
from gradrunner.capturing.torch_compat import node_shape

#: Autograd nodes whose output rows are rows of their input picked by an index tensor.
SELECTS = frozenset({"IndexBackward", "IndexSelectBackward", "GatherBackward", "MaskedSelectBackward", "TakeBackward"})
#: Autograd nodes of ops with one tensor operand that keep dim 0 where it is (views, casts, activations; slices and
#: splits, which keep some of its rows: an expert's run of the sorted tokens, `tokens[start:end]`, `split(counts)`).
_UNARY = frozenset({
    "ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "AliasBackward", "UnsqueezeBackward",
    "SqueezeBackward", "ToCopyBackward", "CloneBackward", "ReluBackward", "GeluBackward", "SiluBackward",
    "TanhBackward", "SigmoidBackward", "EluBackward", "LeakyReluBackward", "NativeDropoutBackward",
    "SliceBackward", "SplitBackward", "SplitWithSizesBackward", "UnsafeSplitBackward",
})  # fmt: skip
#: Autograd nodes of elementwise ops of one or several tensor operands (dropout's CPU mask `x * mask`, a gated
#: expert's `act(w1 x) * w3 x`, a residual add): followed into each operand that gives the output its dim 0, to a
#: selection or a call without shares, not to a parameter (`x * scale`: rows of x).
_SEVERAL = frozenset({
    "MulBackward", "DivBackward", "AddBackward", "SubBackward", "WhereBackward", "MaximumBackward", "MinimumBackward",
    "AddcmulBackward", "AddcdivBackward", "LerpBackward",
})  # fmt: skip
#: Autograd nodes of a view or reshape of a whole tensor (which saves its input's sizes).
_VIEWS = frozenset({"ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward"})
#: The most autograd nodes walked back from a call's input, all operands' branches together.
WALK = 16


class RowOrigins:
    """What a step's forward knows about where tensors' rows come from: reset at each model call.

    Example::

        origins.start(args, kwargs, rows)   # the model's call: B == another dim of its inputs?
        origins.reason(kind, x)             # a layer's call: None, or why dim 0 is not the batch's rows
    """

    def __init__(self) -> None:
        #: Storages of the tensors the model was called with, where B equals another dim of one of them.
        self.given: set[int] | None = None
        #: Then: those of fewer dims than the first (the batch's) with dim 0 of B, and the first's shape.
        self.fewer: dict[int, tuple[int, ...]] = {}
        #: Output nodes of this forward's calls with no per-row share: why, and whether their rows were picked.
        self.made: dict[Any, tuple[str, bool]] = {}
        #: Whether the last `reason` found was rows picked by indexing, or a call on such rows (what `mark` keeps).
        self.picked = False
        #: Whether the last node judged picked a parameter's rows by ids whose dim 0 is the batch's (`TABLE`).
        self.table = False

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int | None) -> None:
        """A forward of the model with `rows` rows (None: no tensor input) begins."""
        tensors = list(tensors_of(args, kwargs))
        clash = rows is not None and any(rows in t.shape[1:] for t in tensors)
        self.given = {storage(t) for t in tensors} if clash else None
        first = tensors[0].shape if tensors else ()
        self.fewer = {
            storage(t): tuple(first) for t in tensors if clash and 0 < t.dim() < len(first) and t.shape[0] == rows
        }
        self.made = {}

    def clear(self) -> None:
        self.given, self.fewer, self.made = None, {}, {}

    def reason(self, kind: str, x: torch.Tensor) -> str | None:
        """Why the rows of `x` (whose dim 0 has the batch's size) are not the batch's, or None."""
        self.picked = False
        first = self.fewer.get(storage(x))
        if first is not None:
            return (f"called on a tensor of shape {tuple(x.shape)} given to the model with fewer dims than its first input "
                    f"{first}, one of whose other dims is the batch size: dim 0 may be broadcast over the batch (1-D "
                    "position_ids), not the batch's rows")  # fmt: skip
        if kind == "embedding":
            if self.given is not None and storage(x) not in self.given:
                return (f"called on ids of shape {tuple(x.shape)} made inside the forward (positions, relative-position "
                        "buckets) while the batch size equals another dim of the model's input: dim 0 may not be the batch")  # fmt: skip
            return None
        if isinstance(x, nn.Parameter):
            return f"called on a parameter of shape {tuple(x.shape)}: dim 0 is the parameter's, not the batch's rows"
        return self._walk(x)

    def mark(self, output: torch.Tensor, why: str) -> None:
        """`output` of a call whose rows are not the batch's (`why`, the last `reason`): a layer it feeds through a
        view, a cast or an activation is not called on batch rows either; nor, where that reason was rows picked by
        indexing (`picked`), one it feeds through an elementwise op with other operands (a gated expert's product)."""
        if output.grad_fn is not None:
            self.made[output.grad_fn] = (why, self.picked)

    def _walk(self, x: torch.Tensor) -> str | None:
        """The first reason found walking back from `x` (at most `WALK` nodes), or None."""
        rows, seen = x.shape[0], set[Any]()
        #: (node, below an elementwise op of several tensor operands, the elementwise ops passed to reach it:
        #: (op, operand, its output number)); below any: no parameter verdict
        stack: list[tuple[Any, bool, tuple[tuple[Any, Any, int], ...]]] = [(x.grad_fn, False, ())]
        while stack and len(seen) < WALK:
            node, several, via = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = node.name().rstrip("0123456789")
            why = self._verdict(node, name, x, rows, bool(via), several)
            if why is not None and all(_same_rows(op, n, nr) for op, n, nr in via):  # shapes read only for a verdict
                return why
            if why is not None:
                continue  # an operand broadcast over the output's dim 0 (a bias, a (T, d) table): not its rows
            inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
            if self.table:  # rows of a parameter picked by the batch's own ids: the batch's rows, as an embedding's
                continue
            if name in _SEVERAL:  # each operand: a gated expert's act(w1 x) * w3 x, dropout's `x * mask`
                stack += [(n, several or len(inputs) > 1, (*via, (node, n, nr))) for n, nr in inputs]
            elif len(inputs) == 1 and name in _UNARY | SELECTS:
                stack.append((inputs[0][0], several, via))
        return None

    def _verdict(self, node: Any, name: str, x: torch.Tensor, rows: int, masked: bool, several: bool) -> str | None:
        """Why the rows of autograd node `node` (named `name`) are not the batch's, or None; sets `picked`.

        `masked`: reached through an elementwise op, where a parameter is a scale, not rows; `several`: through one of
        several operands, where only rows picked by indexing count (the batch's rows plus a position's embedding, made
        from ids made in the forward, are still the batch's rows)."""
        made = self.made.get(node)
        self.picked = name in SELECTS or (made is not None and made[1])
        self.table = False
        if made is not None and (self.picked or not several):
            return f"called on the output of a call whose rows are not the batch's ({made[0]})"
        keeps = _keeps_rows(node, name, rows) if name in SELECTS else True
        if keeps == TABLE:
            self.table = self.given is None or _index(node) in self.given
            keeps = self.table
        if not keeps:
            return (f"called on a tensor of shape {tuple(x.shape)} whose rows were picked by indexing ({name}: "
                    "tokens routed to a mixture-of-experts' expert?): its rows are not the batch's")  # fmt: skip
        variable = getattr(node, "variable", None) if name.endswith("AccumulateGrad") and not masked else None
        if isinstance(variable, nn.Parameter):
            return (f"called on a tensor of shape {tuple(x.shape)} made from a parameter of shape "
                    f"{tuple(variable.shape)} alone: its dim 0 is the parameter's, not the batch's rows")  # fmt: skip
        return None


def _same_rows(product: Any, operand: Any, nr: int) -> bool:
    """Whether the output `nr` of autograd node `operand`, an operand of elementwise `product`, gives the product its
    dim 0, not broadcast over it (a bias, 1-D position embeddings, a (1, ...) mask); True where a shape is unknown."""
    out, shape = node_shape(product, 0), node_shape(operand, nr)
    return shape is None or out is None or (len(shape) == len(out) and shape[:1] == out[:1])


def _signed(dim: int) -> int:
    """A dim autograd saved as an unsigned 64-bit number (-2 reads 2**64 - 2)."""
    return dim - 2**64 if dim >= 2**63 else dim


#: `_keeps_rows`' answer for rows of a parameter picked by a batch-sized index tensor (`table[ids]`): the batch's rows
#: if the ids are the batch's (given to the model, or made in the forward while B equals no other dim of its inputs).
TABLE = "table"


def _keeps_rows(node: Any, name: str, rows: int) -> bool | str:
    """Whether a selection keeps dim 0's rows as its input's rows: it picks along another dim, leaving a dim 0 of B
    or B T rows as it is (`gather(-2, ...)`, `index_select(1, ...)`, `h[:, idx]`, `flat_tokens[..., idx]`:
    `_grouped`), or picks `rows` rows out of a batch-sized dim 0 (`h[arange(B), last]`: one row per example; a reordering `x[perm]` is not
    told apart, README). `TABLE` where it picks a parameter's rows by one index tensor of `rows` rows (`table[ids]`,
    learned positions indexed by (B, T) position ids). Rows picked out of another dim 0 (a mixture of experts'
    flattened tokens), by a mask over several dims, or by advanced indices apart (`h[:, i, :, j]`: numpy's rule puts
    the index dims first, so dim 0 is the index's, whatever its size) are not the batch's."""
    if name == "GatherBackward":
        saved, index = getattr(node, "_saved_self", None), getattr(node, "_saved_index", None)
        if saved is None or index is None or saved.dim() == 0:
            return False
        along = _signed(int(node._saved_dim)) % saved.dim() != 0  # (a shorter index would pick the first rows)
        return along and index.shape[0] == saved.shape[0] and _grouped(node, saved.shape[0], rows)
    if name == "IndexSelectBackward":
        sizes = node._saved_self_sym_sizes
        return bool(sizes) and _signed(int(node._saved_dim)) % len(sizes) != 0 and _grouped(node, int(sizes[0]), rows)
    if name == "IndexBackward":
        indices, sizes = node._saved_indices, node._saved_self_sym_sizes
        at = [i for i, index in enumerate(indices) if index is not None]
        if not at or at != list(range(at[0], at[-1] + 1)):
            return False  # advanced indices apart (`h[:, i, :, j]`): their dims come first, dim 0 is not the input's
        if at[0] > 0:
            return _grouped(node, int(sizes[0]), rows)  # dim 0 left as it is
        first = indices[0]
        if first.dtype in (torch.bool, torch.uint8):
            return bool(sizes) and int(sizes[0]) == rows and first.dim() == 1
        if len(at) == 1 and first.dim() > 0 and first.shape[0] == rows and _of_parameter(node.next_functions[0][0]):
            return TABLE
        return bool(sizes) and int(sizes[0]) == rows  # else picked out of a dim 0 of another size (`h[None, idx]`)
    return False


def _grouped(node: Any, size: int, rows: int) -> bool:
    """Whether a dim 0 of `size` that selection `node` leaves as it is (picking along another dim) holds the batch's
    rows: `rows` of them, or the batch's tokens flattened (a view of a tensor whose dim 0 has `rows`: a later view back
    to (B, ...) keeps each example's together); not a dim of another size (`h[None, idx]`'s 1, whose picked tokens a
    reshape then makes rows; two batches concatenated)."""
    if size == rows:
        return True
    src = node.next_functions[0][0] if node.next_functions else None
    view = src is not None and src.name().rstrip("0123456789") in _VIEWS
    sizes: Any = getattr(src, "_saved_self_sym_sizes", None) if view else None
    return bool(sizes) and rows > 0 and int(sizes[0]) == rows and size % rows == 0


def _index(node: Any) -> int:
    """Where an `IndexBackward`'s first index tensor's memory is (`storage`)."""
    return storage(node._saved_indices[0])


def _of_parameter(node: Any) -> bool:
    """Whether autograd node `node` is a parameter's leaf (its `AccumulateGrad`), or a view or cast of one (a few ops of
    one operand: `table.to(dtype)`, `table[:n]`)."""
    for _ in range(4):
        if node is None:
            return False
        if isinstance(getattr(node, "variable", None), nn.Parameter):
            return True
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1 or node.name().rstrip("0123456789") not in _UNARY:
            return False
        node = inputs[0]
    return False
