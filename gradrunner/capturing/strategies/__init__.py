"""Capture strategies, one per file, keyed by the contract's names.

| name | file | how the gradient is seen |
| --- | --- | --- |
| `retain_grad` | `retain_grad.py` | `tensor.retain_grad()`, `.grad` read after backward |
| `hook` | `hook.py` | `tensor.register_hook(...)` while backward runs |
| `autograd_grad` | `autograd_grad.py` | `torch.autograd.grad(loss, [taps..., params...])` |

Example::

    STRATEGIES["hook"]  # HookStrategy
"""

from __future__ import annotations

from gradrunner.capturing.strategies.autograd_grad import AutogradGradStrategy
from gradrunner.capturing.strategies.base import Slot, Strategy
from gradrunner.capturing.strategies.hook import HookStrategy
from gradrunner.capturing.strategies.retain_grad import RetainGradStrategy
from gradrunner.errors import GradrunnerError

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (RetainGradStrategy, HookStrategy, AutogradGradStrategy)
}


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered under `name`; a GradrunnerError lists the allowed names."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise GradrunnerError(
            f"capture.strategy={name!r} is not a capture strategy; allowed: {', '.join(STRATEGIES)}"
        ) from None


__all__ = ["STRATEGIES", "Slot", "Strategy", "get_strategy"]
