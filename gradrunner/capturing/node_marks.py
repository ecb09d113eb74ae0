"""Marks on autograd nodes that hold no node: a value per node, kept in the node's own `metadata` dict.

A dict or set keyed by nodes keeps each node (and the graph below it) alive; a forward whose outputs were
dropped then never goes (`pending`). `NodeMarks` keeps its marks in the nodes' metadata under one key, tagged
with a token that `clear()` replaces, so a mark goes with its node.
"""

from __future__ import annotations

from typing import Any


class NodeMarks:
    """Autograd nodes marked during a forward, each with a value, kept in the nodes' own `metadata`: no mark holds its
    node, so a forward whose outputs were dropped goes as plain torch frees it (`pending`: a mark that held the node of
    a call's output kept the forward's graph, and the forward was recorded as rows without gradient). `clear` forgets
    every mark at once: a new token, which the old marks, left to go with their nodes, do not carry.

    Example::

        marks = NodeMarks()
        marks.set(out.grad_fn, "why")
        marks.get(out.grad_fn)   # "why"; None for a node not marked since the last clear()
    """

    def __init__(self) -> None:
        self._key = f"gradrunner.rows.{id(self)}"
        self._token = object()
        self._some = False  # whether any node was marked since the last clear: else no node's metadata is read
        self._held: dict[Any, Any] = {}  # a node without `metadata` (not an autograd Node): held, as before

    def clear(self) -> None:
        self._token, self._some, self._held = object(), False, {}

    def set(self, node: Any, value: Any) -> None:
        self._some = True
        try:
            node.metadata[self._key] = (self._token, value)
        except (AttributeError, TypeError):
            self._held[node] = value

    def get(self, node: Any) -> Any:
        if not self._some:
            return None
        try:
            entry = node.metadata.get(self._key)
        except (AttributeError, TypeError):
            return self._held.get(node)
        return entry[1] if entry is not None and entry[0] is self._token else None

    def __contains__(self, node: Any) -> bool:
        return self.get(node) is not None
