"""Hooks that act for the module they were installed on, and for no other.

`copy.deepcopy(model)` copies each module's hook dicts (and an instance-level `forward()`), so a copy
made while a session is open (a reference, EMA or lookahead copy) carries the session's hooks.
`owned(module, hook)` is the one rule every module hook of gradrunner follows: called with any other
module first (the copy), it does nothing, so the copy's forward and backward leave no trace in the records.

Example::

    handle = model.register_forward_hook(owned(model, hook))
    copy.deepcopy(model)(x)     # `hook` is not called: the copy's forward is not captured
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_R = TypeVar("_R")


def _nothing(*args: Any) -> None:
    return None


def owned(
    module: object, hook: Callable[..., _R], unowned: Callable[..., _R | None] = _nothing
) -> Callable[..., _R | None]:
    """`hook(module, *rest)` when called as `(module, *rest)` with `module` itself; `unowned(*rest)` otherwise.

    Example::

        model.register_forward_pre_hook(owned(model, pre))   # a copy of `model` calls it: returns None

    `unowned` defaults to returning None: a module hook that changes nothing. The check is one `is`.
    """

    def run(owner: object, *args: Any) -> _R | None:
        if owner is module:
            return hook(owner, *args)
        return unowned(*args)

    return run
