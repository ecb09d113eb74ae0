"""Shared fixtures: the registered strategies, seeding, and a check that a model carries no hooks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gradrunner.capturing.strategies import STRATEGIES

#: Every hook registry an `nn.Module` has (some only exist in newer torch versions).
MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request: pytest.FixtureRequest) -> str:
    """Every registered capture strategy: a new strategy gets the whole contract suite for free."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def leftover_hooks(model: nn.Module) -> list[str]:
    """Everything a capture could have left on `model`: hooks, patched `forward`s, parameter hooks."""
    found: list[str] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for attr in MODULE_HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                found.append(f"{path or '<root>'}.{attr}: {dict(hooks)}")
        if "forward" in module.__dict__:
            found.append(f"{path or '<root>'}: instance attribute forward = {module.__dict__['forward']!r}")
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "_backward_hooks", None):
                found.append(f"{path or '<root>'}.{name}._backward_hooks: {dict(param._backward_hooks)}")
            if getattr(param, "_post_accumulate_grad_hooks", None):
                found.append(f"{path or '<root>'}.{name}._post_accumulate_grad_hooks")
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"):
        if getattr(nn.modules.module, attr, None):
            found.append(f"torch.nn.modules.module.{attr}")
    return found


def class_forwards(model: nn.Module) -> dict[type, object]:
    """Snapshot of `type(m).forward` for every module class in `model`."""
    return {type(m): type(m).forward for m in model.modules()}


@pytest.fixture
def interrupt_at_step_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C arrives as the runner ends step 3 (its 4th peak-memory reading): steps 0-2 are complete."""
    import gradrunner.run.loop as runner

    calls = {"n": 0}

    def peak_memory_bytes(device: torch.device) -> int:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return 1

    monkeypatch.setattr(runner, "peak_memory_bytes", peak_memory_bytes)
