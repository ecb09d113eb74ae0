"""The capture sessions open now, and the one rule about opening several: none beside an `autograd_grad` one
on the same model.

Sessions under `hook` and `retain_grad` may be open together (nested `capture()` and `record()` blocks): each
reads every backward around it, and each records the same gradients. A strategy with an engine call of its
own (`autograd_grad`, `Strategy.owns_backward`) cannot share a model: it fills each parameter's `.grad` by
calling the parameter's accumulator itself, which runs no other session's hooks (the other session's parameter
taps would record 'takes no part in the loss' for a parameter whose `.grad` just changed), and it refuses any
backward it did not run, the other session's included. Such a pairing is refused when the second session
opens, before it touches the model or a run dir. Sessions on models that share no module and no parameter
(two models trained side by side, each with its own session and its own backward) are independent, whatever
their strategies: each records its own model's gradients.

Example::

    with capture(model, ["fc1:weight"], strategy="autograd_grad"):
        with record(model, ["fc1:weight"], "runs/a"):      # GradrunnerError, naming both sessions
            ...
    with capture(model_a, ["fc1:weight"], strategy="autograd_grad"), capture(model_b, ["fc1:weight"]):
        ...                                               # fine: the models share nothing
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
    """Raise if `session` may not open while the sessions open now are: one of the two has its own engine call,
    and their models share a module or a parameter (`_shared`).

    Example::

        refuse_beside_open(rec.capture)     # record(): before the run dir is looked at
    """
    for other in list(_OPEN):
        if other is session or not (session.strategy.owns_backward or other.strategy.owns_backward):
            continue
        if not _shared(session, other):
            continue
        own = session if session.strategy.owns_backward else other
        raise GradrunnerError(
            f"{session.label} cannot be opened while {other.label} is open on a model sharing modules or parameters "
            f"with it: strategy {own.strategy_name!r} "
            "computes the gradients with an engine call of its own and fills each parameter's .grad by calling its "
            "accumulator itself, which runs no other session's hooks (the other session's parameter taps would "
            "record no gradient for a parameter whose .grad changed), and it refuses every backward it did not run, "
            f"the other session's included. Close {other.label} before opening {session.label}, or give both sessions "
            "strategy 'hook' or 'retain_grad', which may be open together and record the same gradients."
        )


def refuse_inside_engine_call(session: Capture) -> None:
    """Raise if the backward `session` sees begin is another open session's own engine call (`autograd_grad`).

    Example::

        refuse_inside_engine_call(cap)     # Backwards._seen, as a backward the session did not run begins

    Their models share nothing (else `refuse_beside_open` refused the pair), but that call runs through this
    session's model (one model's output fed to the other's loss): it fills the `.grad` of this model's parameters
    without running this session's hooks on them, as it would beside a session on its own model.
    """
    for other in list(_OPEN):
        running = other._pass  # an explicit captured pass: from the engine call's begin to its end (`Capture.backward`)
        own_call = running is not None and running.explicit and running.captured  # else a plain loss.backward()
        if other is not session and other.strategy.owns_backward and own_call:
            raise GradrunnerError(
                f"{other.label} ran its backward through the model of {session.label}, which is open beside it: "
                f"strategy {other.strategy_name!r} fills each parameter's .grad by calling its accumulator itself, "
                f"which runs no other session's hooks, so the parameter taps of {session.label} would record no "
                "gradient for parameters whose .grad changed. Capture both models in one session (a module holding "
                f"both), or give {session.label} and {other.label} strategy 'hook' or 'retain_grad'."
            )


def _shared(a: Capture, b: Capture) -> bool:
    """Whether the two sessions' models share a module or a parameter (one inside the other, or tied weights)."""

    def reach(session: Capture) -> set[int]:
        model = session.model
        return {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}

    return not reach(a).isdisjoint(reach(b))


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
