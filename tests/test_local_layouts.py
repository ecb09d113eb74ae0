"""Local-variable taps on code as people write it: decorated forwards, `self.__x`, odd layouts,
locals named `input` / `output`, sources edited after import, forwards that cannot be rewritten.

Each gradient is checked against one computed here with `torch.autograd.grad` (no gradrunner).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import close, leftover_hooks
from torch import nn

from gradrunner import GradrunnerError, capture
from gradrunner.capturing import forward_locals


def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A `functools.wraps` decorator, as transformers 5 puts on every block's forward."""

    @functools.wraps(fn)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.wrapped_calls = getattr(self, "wrapped_calls", 0) + 1
        return fn(self, *args, **kwargs)

    return wrapper


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.__scale = 1.5  # name-mangled to _Block__scale

    @logged
    @logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        h = torch.tanh(self.lin(x)) * self.__scale
        note = """
a string at column 0 inside an indented forward()
"""
        return h * (len(note) > 0) + residual


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input = self.a(x)
        output = self.b(input)
        return output.square()


def _reference(model: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [model.a.register_forward_hook(lambda m, a, o: seen.__setitem__("a", o)),
             model.b.register_forward_hook(lambda m, a, o: seen.__setitem__("b", o)),
             model.a.lin.register_forward_hook(lambda m, a, o: seen.__setitem__("lin", o))]  # fmt: skip
    try:
        loss = model(x).sum()
    finally:
        for h in hooks:
            h.remove()
    ga, gb, glin = torch.autograd.grad(loss, [seen["a"], seen["b"], seen["lin"]])
    # h = tanh(lin) * 1.5 in block a: dL/dh = dL/d(a's output); residual: dL/d(block input)
    return {"a": ga, "b": gb, "h": ga, "lin": glin}


def test_locals_inside_a_decorated_forward_with_mangled_names_and_odd_layout(strategy: str) -> None:
    model = Net().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    ref = _reference(model, x)
    model.a.wrapped_calls = model.b.wrapped_calls = 0
    taps = ["a:h", "b:residual", "b:h", ":local.input", ":local.output", "a.lin:output"]
    with capture(model, taps, strategy=strategy) as cap:
        cap.backward(model(x).sum())
    close(cap.grads["a:h"], ref["h"])
    close(cap.grads["b:residual"], ref["a"])  # b's residual is its input, a's output
    close(cap.grads["b:h"], ref["b"])
    close(cap.grads[":local.input"], ref["a"])
    close(cap.grads[":local.output"], ref["b"])
    close(cap.grads["a.lin:output"], ref["lin"])
    assert model.a.wrapped_calls == 2 and model.b.wrapped_calls == 2  # both decorators still ran, once each
    assert leftover_hooks(model) == []
    assert "__wrapped__" in vars(Block.forward) and Block.forward.__wrapped__.__wrapped__.__name__ == "forward"


def test_only_the_tapped_instance_runs_the_rewritten_forward(strategy: str) -> None:
    model = Net().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, ["a:h"], strategy=strategy) as cap:
        assert "forward" in vars(model.a) and "forward" not in vars(model.b)
        assert type(model.a).forward is Block.forward  # the class is left as it was
        cap.backward(model(x).sum())
    assert len(cap.grads.calls("a:h")) == 1  # b, the same class, fired nothing
    assert "forward" not in vars(model.a) and leftover_hooks(model) == []


def test_local_named_input_is_told_apart_from_the_module_input(strategy: str) -> None:
    model = Net().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, [":input", ":local.input"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    assert cap.grads[":input"].shape == x.shape  # type: ignore[union-attr]
    assert not torch.equal(cap.grads[":input"], cap.grads[":local.input"])  # type: ignore[arg-type]


def test_globs_over_outputs_and_parameters_never_read_source(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(*args: object) -> None:
        raise AssertionError("a forward()'s source was read")

    monkeypatch.setattr(inspect, "getsourcelines", no_source)
    forward_locals._parse.cache_clear()
    model = Net().double()
    with capture(model, ["*:output", "*:weight", "*:input.0", "a.lin:bias"], strategy="hook") as cap:
        cap.backward(model(torch.randn(2, 3, dtype=torch.float64)).sum())
    assert cap.grads["a.lin:weight"] is not None and cap.grads["b:output"] is not None


def _module_from(path: Path, source: str) -> Any:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


EDITABLE = """
import torch
from torch import nn

class Edited(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        h = self.lin(x) * 1
        return h
"""


def test_a_forward_whose_file_changed_after_import_is_refused(tmp_path: Path) -> None:
    mod = _module_from(tmp_path / "gr_edited_after_import.py", EDITABLE)
    model = mod.Edited()
    (tmp_path / "gr_edited_after_import.py").write_text(EDITABLE.replace("* 1", "* 1000"))
    with pytest.raises(GradrunnerError, match=r"no longer matches the loaded code.*Restart Python") as err:
        capture(model, [":h"])
    assert "edited after it was imported" in str(err.value)
    with capture(model, [":output", "lin:weight"]) as cap:  # taps that need no source still work
        cap.backward(model(torch.ones(1, 2)).sum())
    assert cap.grads[":output"] is not None


def test_a_forward_without_a_def_says_what_to_tap_instead() -> None:
    Lam = type("Lam", (nn.Module,), {
        "forward": lambda self, x: x * 2})  # fmt: skip
    with pytest.raises(GradrunnerError, match=r"'<root>' \(Lam\) has no 'y'.*tap the module's output"):
        capture(Lam(), [":y"])
    model = Lam()
    with capture(model, [":output"]) as cap:  # its output is still tapped
        cap.backward(model(torch.ones(2, requires_grad=True)).sum())
    close(cap.grads[":output"], torch.ones(2))
