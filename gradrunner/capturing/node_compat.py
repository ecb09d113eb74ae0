"""Autograd nodes' own internals that the per-example walk reads (`per_example_rows`, `per_example_dims`,
`per_example_tokens`), feature-detected once in `torch_compat.FEATURES`, each with a public fallback a test forces:

| function | private path | public fallback |
| --- | --- | --- |
| `node_shape(node, nr)` | `Node._input_metadata`: the shape of node `node`'s output `nr` (a product's operands whose dim 0 is its output's are followed) | None: unknown, every operand followed |
| `node_saved(node, name)` | `Node._saved_<name>`: what node `node` saved for its backward (a transpose's `dim0`, a view's `self_sym_sizes`, an index's `indices`) | `Unreadable` raised: the call's per-example norms are null, naming the node (`RowOrigins.judge`) |
| `view_base(t)` | `Tensor._base`: the tensor a view `t` was made of (the batch's tokens flattened by `h.view(-1, d)`) | None: the flattening is told from the autograd nodes alone (which `node_saved` reads) |

Example::

    node_saved(h.transpose(0, 1).grad_fn, "dim0")     # 0 (an unsigned 64-bit number for a negative dim)
    node_saved(node, "dims", None)                      # None where the node saved no `dims`
"""

from __future__ import annotations

from typing import Any

import torch

from gradrunner.capturing.torch_compat import FEATURES

_ANY = object()


class Unreadable(Exception):
    """What an autograd node saved is not shown by this torch (`FEATURES["saved_values"]` off): str() says why."""

    def __init__(self, node: Any) -> None:
        super().__init__(
            f"its input came through {node.name()}, whose saved values (what it did to each dim) this torch does not "
            "show: whether dim 0 is the batch's rows cannot be told"
        )


def node_shape(node: Any, nr: int) -> tuple[int, ...] | None:
    """The shape of what autograd node `node` made as its output `nr` (its forward's result); None if unknown."""
    return tuple(node._input_metadata[nr].shape) if FEATURES["input_metadata"] else None


def node_saved(node: Any, name: str, default: Any = _ANY) -> Any:
    """What autograd node `node` saved for its backward as `name` (`node._saved_<name>`), or `default` where it saved
    nothing of that name (without `default`: AttributeError). Raises `Unreadable` where torch does not show it."""
    if not FEATURES["saved_values"]:
        raise Unreadable(node)
    return getattr(node, f"_saved_{name}") if default is _ANY else getattr(node, f"_saved_{name}", default)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor view `t` was made of (None: not a view, or not known here)."""
    return t._base if FEATURES["view_base"] else None
