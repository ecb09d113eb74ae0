"""The capture sessions open now, and the one rule about opening several: none beside an `autograd_grad` one.

Sessions under `hook` and `retain_grad` may be open together (nested `capture()` and `record()` blocks): each
reads every backward around it, and each records the same gradients. A strategy with an engine call of its
own (`autograd_grad`, `Strategy.owns_backward`) cannot share: it fills each parameter's `.grad` by calling
the parameter's accumulator itself, which runs no other session's hooks (the other session's parameter taps
would record 'takes no part in the loss' for a parameter whose `.grad` just changed), and it refuses any
backward it did not run, the other session's included. Such a pairing is refused when the second session
opens, before it touches the model or a run dir.

Example::

    with capture(model, ["fc1:weight"], strategy="autograd_grad"):
        with record(model, ["fc1:weight"], "runs/a"):      # GradrunnerError, naming both sessions
            ...
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING

from gradrunner.errors import GradrunnerError

if TYPE_CHECKING:
    from torch import nn

    from gradrunner.capturing.session import Capture

#: The sessions open now (weakly: a session never closed whose model is gone is no longer open).
_OPEN: weakref.WeakSet[Capture] = weakref.WeakSet()


def refuse_beside_open(session: Capture) -> None:
    """Raise if `session` may not open while the sessions open now are: one of the two has its own engine call.

    Example::

        refuse_beside_open(rec.capture)     # record(): before the run dir is looked at
    """
    for other in list(_OPEN):
        if other is session or not (session.strategy.owns_backward or other.strategy.owns_backward):
            continue
        own = session if session.strategy.owns_backward else other
        raise GradrunnerError(
            f"{session.label} cannot be opened while {other.label} is open: strategy {own.strategy_name!r} "
            "computes the gradients with an engine call of its own and fills each parameter's .grad by calling its "
            "accumulator itself, which runs no other session's hooks (the other session's parameter taps would "
            "record no gradient for a parameter whose .grad changed), and it refuses every backward it did not run, "
            f"the other session's included. Close {other.label} before opening {session.label}, or give both sessions "
            "strategy 'hook' or 'retain_grad', which may be open together and record the same gradients."
        )


def hold_open(session: Capture, stack: contextlib.ExitStack) -> None:
    """Refuse `session` beside the open ones (`refuse_beside_open`), else count it open until `stack` closes."""
    refuse_beside_open(session)
    _OPEN.add(session)
    stack.callback(_OPEN.discard, session)


def refuse_open_on(model: nn.Module, what: str) -> None:
    """Raise if a session open now taps `model` or shares a module with it: `what`'s forward pass would fire its taps.

    Example::

        refuse_open_on(model, "list_taps(...)")     # inside `with capture(model, ...)`: GradrunnerError
    """
    ids = {id(m) for m in model.modules()}
    for session in list(_OPEN):
        if any(id(m) in ids for m in session.model.modules()):
            raise GradrunnerError(
                f"{what} runs a forward pass of the model, on which {session.label} is open: the session would count "
                "that pass into its step (a call of each tap, with no gradient, and the step's own forward as the next "
                "call); call it before or after the session's `with` block"
            )
