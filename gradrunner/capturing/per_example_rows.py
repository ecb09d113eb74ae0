"""Whether a layer call's dim 0 holds the batch's rows, beyond its size: `RowOrigins`, one per `PerExampleNorms`.

`per_example_layers.call_reason` compares a call's dim 0 with the batch size; a tensor whose dim 0
has the batch's size by coincidence passes it. `RowOrigins` catches the coincidences it can tell
from what the call's input is made of, cheaply (a few attribute reads per call, no device work):

- an `Embedding` called on ids made inside the forward (positions, relative-position buckets), or any layer
  called on a tensor with no autograd history made there (`x.transpose(0, 1).contiguous()` of the input), while
  the batch size equals another dim of any tensor the model was called with (`start`; a view of a given tensor
  is its rows where it keeps its dim 0, size and stride: not `x.transpose(0, 1)`, which no autograd node shows);
  and then any layer called on a tensor given to the model with fewer dims than its first one (1-D
  `position_ids` broadcast over the batch: which of its dims is the batch's cannot be told, and broadcast rows
  are no example's);
- an input that is a parameter, or a view, cast or activation of one (DeBERTa's
  `LayerNorm(rel_embeddings.weight)`): its dim 0 is the parameter's (a parameter broadcast to the
  batch, `latents.expand(B, ...)`, is the batch's: each row belongs to its example, and the walk
  stops at the `expand`);
- an input whose rows were picked by indexing out of a dim 0 that is not the batch's, or by a mask over
  several dims (`tokens[idx]`, `h[None, idx]`, `masked_select`, `take`), or a slice or split of such rows (an
  expert's run of the sorted tokens, DeepSeek's `sorted_tokens[start:end]`): a mixture of experts' tokens
  routed to one expert (rows picked out of the batch's own rows, `h[arange(B), eos]`, `gather(-2, ...)`,
  `x[:, idx]`, also of the B T tokens flattened, keep them, and a parameter's rows picked by the batch's ids,
  `table[position_ids]`, are the batch's: `keeps_rows`); and an input made, by views, casts, activations, dropout or
  elementwise ops, from the output of a call whose batch-sized dim 0 was found a coincidence here (the
  expert's second Linear, a gated expert's `down(act(gate(t)) * up(t))`; not one whose dim 0 is another
  size, such as flattened tokens later reshaped back);
- an input whose dim 0 an elementwise op took from an operand without autograd history while no operand shown gives
  it (`lin(x.transpose(0, 1) + p)` with B == T: `_hidden_operand`, by the tensor `*` saves or the layout of the
  layer's input), or made without history with a new dim 0 of B over its rows (`lin(torch.stack([x, 2 * x]))`);
- an input whose dim 0 a transpose or permute filled from a dim of the same size as the dim 0 it moved away
  (`lin(x.transpose(0, 1))` with B == T: which is the batch's cannot be told; `moves_rows`), or a stack or a
  broadcast of `h.unsqueeze(0)` made, pushing a dim 0 of the same size to dim 1 (`lin(h.unsqueeze(0).expand(k,
  ...))`, `lin(torch.stack([...], 0))` with k == B; not a parameter broadcast to the batch: `pushes_rows`).

A call whose dim 0 is a multiple of the batch's rows is judged by `judge`: its tokens must be the batch's rows
flattened (`per_example_tokens.flat_sources`, or `token_rows`), and the tensors of B rows they flatten are then
judged as above; its output is kept (`tokens`) so that the calls it feeds are proven too.

The walk back through the autograd graph (at most `WALK` nodes, all branches together) follows ops of one
tensor operand (`per_example_dims`: `UNARY`; and a transpose, permute, expand or repeat that leaves dim 0 untouched, or an op along other dims, a roll, softmax or cumsum: `keeps_dim0`) and
elementwise ops (`ELEMENTWISE`: dropout's CPU mask, a gated expert's `act(w1 x) * w3 x`, a residual add; and a cat along
another dim: `joins_rows`) into each operand, towards a selection or such an output (not to a
parameter broadcast over dim 0: `x * scale` has x's rows; one that gives the result its dim 0, `p * 2`, is rows of a
parameter). Below an op of several tensor operands only rows picked by indexing, or a dim 0 moved or pushed there
(`moves_rows`, `pushes_rows`), count (`picked`: the batch's rows plus a position's embedding made from ids made in the forward are the
batch's rows), and only if every operand passed gives the result its dim 0 (`same_rows`, shapes read then
only: a bias or a (T, d) table broadcast over the batch are not its rows). Any other op (a matmul, a
LayerNorm, an embedding lookup, whose ids autograd does not show) ends a branch with no verdict, so rows
merged back into the batch (`index_add_` into a batch-shaped tensor) are the batch's again; past a product whose
output's dim 0 is an operand's (`per_example_dims.row_operands`: a `bmm`, a convolution) only a dim 0 moved or pushed
there counts (`_past`). Not told apart
(README): coincidences made by ops that are not elementwise (`x_param @ w`, `cat` along dim 0), a frozen parameter's
views (no autograd node), rows picked from a tensor that does not require grad, and a reordering of the
batch's own rows (`x[perm]`).

Example::

    origins = RowOrigins()
    origins.start(args, kwargs, rows=4)               # at the model's call
    why = origins.reason("linear", x)                 # None, or why dim 0 is not the batch's rows
    why = origins.judge("linear", x, 4, out, "fc")    # the same, marking `out`; x may be the batch's tokens flattened
    origins.mark(output, f"'wi' {why}")               # a call without shares: what it alone feeds is not rows either
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradrunner.capturing.node_compat import Unreadable, node_saved, node_shape
from gradrunner.capturing.node_marks import NodeMarks
from gradrunner.capturing.per_example_dims import (
    MOVES,
    PUSHES,
    ROWS_OF_FIRST,
    SELECTS,
    TABLE,
    UNARY,
    joins_rows,
    keeps_dim0,
    keeps_rows,
    moves_rows,
    of_parameter,
    pushes_rows,
    row_operands,
    tiles_rows,
)
from gradrunner.capturing.per_example_layers import storage, tensors_of
from gradrunner.capturing.per_example_tokens import (
    ELEMENTWISE,
    ROWWISE,
    WALK,
    flat_sources,
    same_rows,
    token_rows,
)


class RowOrigins:
    """What a step's forward knows about where tensors' rows come from: reset at each model call.

    Example::

        origins.start(args, kwargs, rows)   # the model's call: B == another dim of its inputs?
        origins.reason(kind, x)             # a layer's call: None, or why dim 0 is not the batch's rows
    """

    def __init__(self) -> None:
        #: Storages of the tensors the model was called with, where B equals another dim of one of them: each one's
        #: dim 0 (its size, its stride), which a view keeping the batch's rows keeps.
        self.given: dict[int, tuple[int, int]] | None = None
        #: Then: those of fewer dims than the first (the batch's) with dim 0 of B, and the first's shape.
        self.fewer: dict[int, tuple[int, ...]] = {}
        #: Output nodes of this forward's calls with no per-row share: why, whether their rows were picked, and whether
        #: dim 0 was another of the same size (`moved`).
        self.made = NodeMarks()
        #: Whether the last `reason` found was rows picked by indexing, or a call on such rows (what `mark` keeps).
        self.picked = False
        #: Whether it found a dim 0 moved or pushed there from another of the same size (B == T, k == B: a transpose, a
        #: stack, an operand autograd does not show), or a call on such rows: what counts past a product (`_past`).
        self.moved = False
        #: Whether the last node judged had its dim 0 from an operand autograd does not show (`_hidden_operand`).
        self.hidden = False
        #: Whether the last node judged picked a parameter's rows by ids whose dim 0 is the batch's (`TABLE`).
        self.table = False
        #: Output nodes of this forward's calls on the batch's tokens flattened (`judge`): so are the calls they feed.
        self.tokens = NodeMarks()
        #: Whether every tensor in `given` has its dim 0 outermost in memory (`_outer`): then so has an elementwise op's
        #: output on a view of one that keeps its dim 0 (torch gives it its operands' layout), not on `x.transpose(0, 1)`.
        self.given_outer = False
        #: The last `reason`'s input's autograd node and those below it through ops of one operand on each element
        #: (`ROWWISE`: they keep the layout), if that input's dim 0 is outermost in memory (`_hidden_operand`).
        self.front: frozenset[Any] = frozenset()
        #: Elementwise nodes of this forward found in a `front` (their dim 0 outermost: the given tensors' rows).
        self.proven = NodeMarks()
        #: How many dims the model's first tensor input has (a tensor made without history with more: a new dim 0?).
        self.ndim = 0

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int | None) -> None:
        """A forward of the model with `rows` rows (None: no tensor input) begins."""
        tensors = list(tensors_of(args, kwargs))
        clash = rows is not None and any(rows in t.shape[1:] for t in tensors)
        self.given = {storage(t): _dim0(t) for t in tensors if t.dim() > 0} if clash else None
        self.given_outer = all(_outer(t) for t in tensors if t.dim() > 0)
        first = tensors[0].shape if tensors else ()
        self.ndim = len(first)
        self.proven.clear()
        self.fewer = {
            storage(t): tuple(first) for t in tensors if clash and 0 < t.dim() < len(first) and t.shape[0] == rows
        }
        self.made.clear()
        self.tokens.clear()

    def clear(self) -> None:
        self.given, self.fewer = None, {}
        self.made.clear()
        self.tokens.clear()
        self.front = frozenset()
        self.proven.clear()

    def judge(self, kind: str, x: torch.Tensor, rows: int, output: torch.Tensor, path: str) -> str | None:
        """Why the rows of a call's input `x` (dim 0 of the batch's `rows`, or a multiple of them that `call_reason` let
        through: its tokens flattened?) are not the batch's, or None; marks the call's `output` for the calls it feeds
        (`mark`; `tokens`, where `x` is the batch's tokens flattened: `per_example_tokens`)."""
        try:
            if x.shape[0] == rows:
                why = self.reason(kind, x)
            else:
                base = token_rows(x, rows)
                found = flat_sources(x, rows, self.tokens) if base is None else []
                if isinstance(found, str):  # (not marked: reshaped back to (B, ...), its rows are the batch's again)
                    return _not_flat(kind, x, rows, found)
                self.front = frozenset()
                walks = (self._walk(*source) for source in found)
                why = self.reason(kind, base) if base is not None else next(filter(None, walks), None)
                if why is None:
                    self.tokens.set(output.grad_fn, True)
                else:
                    why = f"{why} (the call's input {tuple(x.shape)} flattens its rows)"
        except Unreadable as e:  # (a torch that hides autograd nodes' saved values: null, never a guess)
            why = f"called on a tensor of shape {tuple(x.shape)}: {e}"
        self.front = frozenset()  # (this call's: held no longer, a dropped forward's nodes go with it)
        if why is not None:  # dim 0 has the batch's size by coincidence: so has what this call alone feeds
            self.mark(output, f"{path!r} {why}")
        return why

    def reason(self, kind: str, x: torch.Tensor) -> str | None:
        """Why the rows of `x` (whose dim 0 has the batch's size) are not the batch's, or None."""
        self.picked, self.moved, self.front = False, False, frozenset()
        first = self.fewer.get(storage(x))
        if first is not None:
            return (f"called on a tensor of shape {tuple(x.shape)} given to the model with fewer dims than its first input "
                    f"{first}, one of whose other dims is the batch size: dim 0 may be broadcast over the batch (1-D "
                    "position_ids), not the batch's rows")  # fmt: skip
        if isinstance(x, nn.Parameter):
            return f"called on a parameter of shape {tuple(x.shape)}: dim 0 is the parameter's, not the batch's rows"
        if kind == "embedding" or x.grad_fn is None:  # (ids; or no autograd history, which the walk could read)
            return self._unwalked(kind, x)
        if self.given is not None and self.given_outer and _outer(x):
            self.front = _rowwise_front(x.grad_fn)
        return self._walk(x.grad_fn, tuple(x.shape))

    def _unwalked(self, kind: str, x: torch.Tensor) -> str | None:
        """Why the rows of `x`, an embedding's ids or a tensor without autograd history (its dim 0 of the batch's size),
        are not the batch's, or None: while the batch size equals another dim of a tensor given to the model, only a
        view of one that keeps its dim 0 (its size and stride: not `x.transpose(0, 1)` with B == T) is its rows."""
        self.moved = True  # (what it finds: dim 0 may be another of the batch's size)
        if self.given is None and kind != "embedding" and x.dim() > self.ndim and x.shape[1] == x.shape[0]:
            return (f"called on a tensor of shape {tuple(x.shape)} made inside the forward without autograd history, with "
                    f"more dims than the model's first input ({self.ndim}) and a dim 1 of its dim 0's size, the batch's (a "
                    "stack or broadcast of the input over a new dim 0?): dim 0 may not be the batch")  # fmt: skip
        if self.given is None:
            return None
        dim0 = self.given.get(storage(x))
        if dim0 is not None and dim0 == _dim0(x):
            return None
        what = "ids" if kind == "embedding" else "a tensor"
        if dim0 is not None:
            return (f"called on {what} of shape {tuple(x.shape)}, a view of a tensor given to the model whose dim 0 is "
                    "not that tensor's (a transpose or permute) while the batch size equals another of its dims: dim 0 "
                    "may not be the batch")  # fmt: skip
        made = "(positions, relative-position buckets)" if kind == "embedding" else "without autograd history (a copy)"
        return (f"called on {what} of shape {tuple(x.shape)} made inside the forward {made} while the batch size equals "
                "another dim of the model's input: dim 0 may not be the batch")  # fmt: skip

    def _hidden_operand(self, node: Any, shape: tuple[int, ...]) -> str | None:
        """Why the dim 0 of elementwise `node`'s output, which no operand autograd shows gives it (they are broadcast over
        it: `x.transpose(0, 1) + p`, p of shape (d,)), is not the batch's rows, or None: it comes from an operand without
        autograd history (the model's input or a tensor made in the forward), judged as a layer's input without one is
        (`_unwalked`) where the node saved it (`x.transpose(0, 1) * p` saves it; `+`, `-`, `where` do not: null, as which
        tensor it was cannot be told). Asked only while the batch size equals another dim of the model's inputs."""
        edges = node.next_functions
        out = node_shape(node, 0)
        if all(n is not None for n, _ in edges) or (
            out is not None and any(n is not None and same_rows(node, n, nr) for n, nr in edges)
        ):
            return None  # (every operand shown, or a shown one gives the output its dim 0: the walk follows it)
        saved = [node_saved(node, name, None) for name in ("self", "other")]
        hidden = [t for t in saved if isinstance(t, torch.Tensor) and not t.requires_grad and t.dim() > 0]
        hidden = [t for t in hidden if out is None or (t.dim() == len(out) and t.shape[0] == out[0])]
        if hidden:
            return self._unwalked("tensor", hidden[0])
        if node in self.front or node in self.proven:  # (a layer's input had its dim 0 outermost, as the given tensors)
            self.proven.set(node, True)
            return None
        return (f"called on a tensor of shape {shape} whose dim 0 comes, through {node.name()}, from an operand without "
                "autograd history (the model's input or a tensor made in the forward, which autograd does not show: "
                "x.transpose(0, 1) + p?) while the batch size equals another dim of the model's input: dim 0 may not be "
                "the batch")  # fmt: skip

    def mark(self, output: torch.Tensor, why: str) -> None:
        """`output` of a call whose rows are not the batch's (`why`, the last `reason`): a layer it feeds through a
        view, a cast or an activation is not called on batch rows either; nor, where that reason was rows picked by
        indexing (`picked`), one it feeds through an elementwise op with other operands (a gated expert's product)."""
        if output.grad_fn is not None:
            self.made.set(output.grad_fn, (why, self.picked, self.moved))

    def _walk(self, start: Any, shape: tuple[int, ...]) -> str | None:
        """The first reason found walking back from autograd node `start`, which made a tensor of `shape` (at most `WALK`
        nodes), or None."""
        seen: set[Any] = set()
        self.picked = self.moved = False
        #: (node, below an elementwise op of several tensor operands, the elementwise ops passed to reach it:
        #: (op, operand, its output number)); below any: no parameter verdict
        stack: list[tuple[Any, bool, tuple[tuple[Any, Any, int], ...]]] = [(start, False, ())]
        past: list[tuple[Any, str, bool]] = []  # (an operand of a product giving it its dim 0, the product, several)
        while stack and len(seen) < WALK:
            node, several, via = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = node.name().rstrip("0123456789")
            why = self._verdict(node, name, shape, bool(via), several)
            # (shapes read only for a verdict; nr -1: a stack's operand, whose dim 0 is the stack's)
            if why is not None and all(nr < 0 or same_rows(op, n, nr) for op, n, nr in via):
                return why
            if why is not None:
                continue  # an operand broadcast over the output's dim 0 (a bias, a (T, d) table): not its rows
            inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
            if self.table:  # rows of a parameter picked by the batch's own ids: the batch's rows, as an embedding's
                continue
            if name in ELEMENTWISE or joins_rows(node, name):  # each operand: act(w1 x) * w3 x, `x * mask`, a cat
                stack += [
                    (n, several or len(inputs) > 1, (*via, (node, n, -1 if name == "StackBackward" else nr)))
                    for n, nr in inputs
                ]
            elif len(inputs) == 1 and (name in UNARY | SELECTS or keeps_dim0(node, name)):
                stack.append((inputs[0][0], several, via))
            elif name in ROWS_OF_FIRST and node.next_functions[0][0] is not None:  # (h @ w: h's rows, not w's)
                stack.append((node.next_functions[0][0], several, via))
            elif all(nr < 0 or same_rows(op, n, nr) for op, n, nr in via):  # (a bmm, a convolution: `_past`)
                past += [(n, node.name(), several) for n in row_operands(node, name)]
        return self._past(past, seen, shape)

    def _past(self, stack: list[tuple[Any, str, bool]], seen: set[Any], shape: tuple[int, ...]) -> str | None:
        """The first dim 0 moved or pushed there from another of the same size (B == T, k == B: `moves_rows`, `pushes_rows`,
        or a call's output `made` on one), walking back from the operands in `stack` of products that give their output
        their dim 0 (`row_operands`: a batched matmul's, a convolution's input) at most `WALK` more nodes; or None. Only
        that: past a product a parameter's rows or tiled rows may be a factor broadcast over the batch (DeBERTa's relative
        positions `repeat`ed to B H rows in a `bmm`), and the layout that tells an operand autograd does not show is the
        layer input's (`_hidden_operand`). Until 2026-11-28 the walk ended at a product: `lin(bmm(h.transpose(0, 1), w))`
        with B == T got wrong numbers."""
        walked = 0
        while stack and walked < WALK:
            node, product, several = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            walked += 1
            name = node.name().rstrip("0123456789")
            why = self._verdict(node, name, shape, False, several)
            src = node.next_functions[0][0] if node.next_functions else None
            if why is not None and self.moved and not self.hidden and not (name in MOVES and of_parameter(src)):
                return f"{why} (through {product}, whose output's dim 0 is that operand's)"
            inputs = [(n, nr) for n, nr in node.next_functions if n is not None]
            if name in ELEMENTWISE or joins_rows(node, name):
                stack += [(n, product, several or len(inputs) > 1) for n, nr in inputs if same_rows(node, n, nr)]
            elif len(inputs) == 1 and (name in UNARY | SELECTS or keeps_dim0(node, name)):
                stack.append((inputs[0][0], product, several))
            else:
                operands = [src] if name in ROWS_OF_FIRST else row_operands(node, name)
                stack += [(n, product, several) for n in operands]
        return None

    def _verdict(self, node: Any, name: str, shape: tuple[int, ...], masked: bool, several: bool) -> str | None:
        """Why the rows of autograd node `node` (named `name`) are not the batch's, or None; sets `picked`.

        `masked`: reached through an elementwise op, where a parameter broadcast over dim 0 is a scale, not rows (`x *
        scale`; `_walk` drops the verdict by `same_rows`), and one that gives the result its dim 0 is rows (`p * 2`),
        where the shapes are read (else: a scale, as before 2026-11-27, when `p * 2` got numbers); `several`: through one of
        several operands, where only rows picked by indexing count (the batch's rows plus a position's embedding, made
        from ids made in the forward, are still the batch's rows)."""
        made = self.made.get(node)
        self.picked = name in SELECTS or (made is not None and made[1])
        self.table = self.moved = self.hidden = False
        if made is not None and (self.picked or not several):
            self.moved = made[2]
            return f"called on the output of a call whose rows are not the batch's ({made[0]})"
        if name in MOVES | PUSHES:  # (rows that are not the batch's beside any other operand, as picked rows)
            self.picked = self.moved = True
        if name in MOVES and moves_rows(node, name):
            return (f"called on a tensor of shape {shape} whose dim 0 was moved there ({name}: a transpose or permute) "
                    "from a dim of the same size as the dim 0 it moved away: which of them is the batch's cannot be told")  # fmt: skip
        if name in PUSHES and shape[0] > 1 and pushes_rows(node, name, shape[0]):
            return (f"called on a tensor of shape {shape} whose dim 0 was added by {name} (a stack, or a broadcast of "
                    "unsqueeze(0)) over a tensor whose own dim 0, of the same size, it pushed to dim 1: which of them "
                    "is the batch's cannot be told")  # fmt: skip
        self.moved = False
        if name in ELEMENTWISE and self.given is not None:
            hidden = self._hidden_operand(node, shape)
            if hidden is not None:  # (`moved` for `mark`: `_past` reads no layout, and drops it by `hidden`)
                self.picked = self.moved = self.hidden = True
                return hidden
        if tiles_rows(node, name):
            return (f"called on a tensor of shape {shape} made from rows tiled along dim 0 ({name}: h.repeat(k, ...) of "
                    "several rows): copies of rows, not the batch's")  # fmt: skip
        self.picked = name in SELECTS or (made is not None and made[1])
        keeps = keeps_rows(node, name, shape[0]) if name in SELECTS else True
        if keeps == TABLE:
            self.table = self.given is None or _index(node) in self.given
            keeps = self.table
        if not keeps:
            return (f"called on a tensor of shape {shape} whose rows were picked by indexing ({name}: "
                    "tokens routed to a mixture-of-experts' expert?): its rows are not the batch's")  # fmt: skip
        variable = getattr(node, "variable", None) if name.endswith("AccumulateGrad") else None
        if isinstance(variable, nn.Parameter) and (not masked or node_shape(node, 0) is not None):
            how = "by an op that keeps its dim 0 (elementwise, a cat or a stack)" if masked else "alone"
            return (f"called on a tensor of shape {shape} made from a parameter of shape "
                    f"{tuple(variable.shape)} {how}: its dim 0 is the parameter's, not the batch's rows")  # fmt: skip
        return None


def _outer(t: torch.Tensor) -> bool:
    """Whether `t`'s dim 0 is outermost in memory: its stride is the largest of its dims of more than one entry (a
    contiguous tensor; not `x.transpose(0, 1)`, nor an elementwise op's result on it, which takes its layout)."""
    strides = [abs(s) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]
    return t.dim() == 0 or t.shape[0] <= 1 or abs(t.stride(0)) == max(strides)


#: Ops of one operand on each element that may change the layout (`.contiguous()`, `.to(memory_format=...)`).
_RELAYS = frozenset({"CloneBackward", "ToCopyBackward"})


def _rowwise_front(node: Any) -> frozenset[Any]:
    """`node` and the nodes below it through ops of one operand on each element that keep its layout (an activation,
    dropout: `ROWWISE` but a copy, `_RELAYS`), a few at most: the ops whose output had the layout of a layer's input
    made by `node`."""
    found = [node]
    while len(found) < 4 and found[-1].name().rstrip("0123456789") in ROWWISE - _RELAYS:
        inputs = [n for n, _ in found[-1].next_functions if n is not None]
        if len(inputs) != 1:
            break
        found.append(inputs[0])
    return frozenset(found)


def _dim0(t: torch.Tensor) -> tuple[int, int]:
    """`t`'s dim 0: its size and stride (a view that moves another dim there changes the stride)."""
    return int(t.shape[0]), int(t.stride(0))


def _not_flat(kind: str, x: torch.Tensor, rows: int, why: str) -> str:
    """Why a call whose input's dim 0 is a multiple of the batch's rows is not on its tokens flattened (`why`)."""
    if kind == "experts":
        return (f"called on tokens of shape {tuple(x.shape)} that are not the batch's {rows} rows flattened (a row-major "
                f"view of a tensor whose dim 0 is the batch, or a row-wise op of one): {why}")  # fmt: skip
    return (f"called with an input of shape {tuple(x.shape)} whose dim 0 ({x.shape[0]}) is not the batch ({rows} rows), "
            f"nor provably its rows flattened (a row-major view of a tensor whose dim 0 is the batch, or a row-wise op of "
            f"one): {why}")  # fmt: skip


def _index(node: Any) -> int:
    """Where an `IndexBackward`'s first index tensor's memory is (`storage`)."""
    return storage(node_saved(node, "indices")[0])
