"""An `optimizer.step(closure)` call whose closure raises: the step is over, though no post-hook says so.

Torch runs the global step post-hooks only when `step()` returns; a session that tells a closure evaluated
again (LBFGS) from steps in a row (`Capture._note_begin`) must learn the end of a step its closure ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

StepArgs = tuple[tuple[Any, ...], dict[str, Any]]


def on_closure_raise(args: tuple[Any, ...], kwargs: dict[str, Any], ended: Callable[[], None]) -> StepArgs | None:
    """A step pre-hook's answer for `(optimizer, *args)`: the step's closure wrapped so that `ended()` runs if it raises (None: no closure).

    Example::

        def pre_hook(opt, args, kwargs):
            return on_closure_raise(args, kwargs, lambda: print("step over"))

    The wrapper calls the closure as it is (same arguments, same result, the exception raised again).
    """
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
    if not callable(closure):
        return None

    def closure_ending(*a: Any, **kw: Any) -> Any:
        try:
            return closure(*a, **kw)
        except BaseException:
            ended()
            raise

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_ending}
    return (args[0], closure_ending, *args[2:]), kwargs
