"""The closure of an `optimizer.step(closure)` call: the only place a backward runs inside a step.

A session tells a closure evaluated again (LBFGS) from steps in a row (`Capture._note_begin`) by the step call each
backward ran in. Only a closure runs backwards inside `step()`, so the session counts itself inside step N exactly
while N's closure runs: torch runs the global step post-hooks only when `step()` returns, and a step that raised (its
closure, or the step itself outside it: a custom optimizer refusing a NaN) would otherwise leave it counted inside a
step that is over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

StepArgs = tuple[tuple[Any, ...], dict[str, Any]]
_T = TypeVar("_T")


def around_closure(
    args: tuple[Any, ...], kwargs: dict[str, Any], begin: Callable[[], _T], end: Callable[[_T], object]
) -> StepArgs | None:
    """A step pre-hook's answer for `(optimizer, *args)`: the step's closure wrapped so that `begin()` runs before each
    evaluation and `end(begin's result)` after it, returned or raised (None: no closure).

    Example::

        def pre_hook(opt, args, kwargs):
            return around_closure(args, kwargs, lambda: print("in"), lambda _: print("out"))

    The wrapper calls the closure as it is (same arguments, same result, the exception raised again).
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
    if not callable(closure):
        return None

    def evaluating(*a: Any, **kw: Any) -> Any:
        token = begin()
        try:
            return closure(*a, **kw)
        finally:
            end(token)

    if "closure" in kwargs:
        return args, {**kwargs, "closure": evaluating}
    return (args[0], evaluating, *args[2:]), kwargs
