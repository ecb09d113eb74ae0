"""The shared contract suite: every test taking `strategy` runs once per registered strategy.

Reference gradients come from `finite_diff.py` (plain torch hooks, parameter shifts, and the tests'
own re-implementations of each model's math), never from gradrunner.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import class_forwards, close, leftover_hooks
from finite_diff import (
    LocalPerturb,
    Point,
    autograd_at,
    central_diff,
    input_point,
    local_point,
    output_point,
    param_point,
)
from torch import nn
from torch.overrides import TorchFunctionMode

import gradrunner.capturing.stats
from gradrunner import GradrunnerError, capture, record
from gradrunner.capturing import torch_compat
from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.models import MLP, CosineRegression, SmallCNN, TinyTransformerBlock, TwoLayerSigmoid
from gradrunner.records.columns import TapKey

RTOL_STRATEGY, ATOL_STRATEGY = 1e-6, 1e-12  # strategy vs exact autograd reference (float64)
RTOL_FD, ATOL_FD = 1e-5, 1e-7  # vs central differences with eps = 1e-6 (float64)


def half_sse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - target) ** 2).sum()


# -- test-only models ------------------------------------------------------------------------------
class TwiceLinear(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sin(self.lin(x)))


def twice_math(m: TwiceLinear, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    return m.lin(torch.sin(m.lin(x)))


class LoopNet(nn.Module):
    """A local `h` assigned once before a loop and once per iteration (4 assignments)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(3):
            h = torch.tanh(self.lin(h)) + h
        return h


def loop_math(m: LoopNet, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    h = p("h", m.lin(x))
    for _ in range(3):
        h = p("h", torch.tanh(m.lin(h)) + h)
    return h


class Unused(nn.Module):
    """Locals that get no gradient: unused, not a tensor, an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        unused = h * 2
        n = x.shape[0]
        idx = h.argmax(-1)
        return h + 0 * n + 0 * idx.unsqueeze(-1)


class Kitchen(nn.Module):
    """Submodules with outputs, inputs, parameters and locals to tap; can raise inside forward()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.block = MLP(in_features=3, hidden=4, depth=1, out_features=3, inplace=True)
        self.cos = CosineRegression(a=0.7, b=0.2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = self.block(h)
        if self.fail:
            raise RuntimeError("boom in forward")
        out = self.cos(h)
        return out


KITCHEN_TAPS = ["*:output", "*:input", ":h", ":out", ":input", "lin:weight", "cos:a", "cos:mul_x", "block.fc1:bias"]


# -- the built-in models, tiny and in float64 --------------------------------------------------------
@dataclass
class Setup:
    model: nn.Module
    x: torch.Tensor
    target: torch.Tensor

    def loss(self) -> torch.Tensor:
        return half_sse(self.model(self.x), self.target)


def _setup(model: nn.Module, x_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> Setup:
    model = model.double()
    x = torch.randn(x_shape, dtype=torch.float64)
    target = torch.randn(target_shape, dtype=torch.float64)
    return Setup(model, x, target)


def _seeded(fn: Callable[[], Setup]) -> Callable[[], Setup]:
    @functools.wraps(fn)
    def build() -> Setup:
        torch.manual_seed(1234)
        return fn()

    return build


BUILDERS: dict[str, Callable[[], Setup]] = {
    "mlp": _seeded(lambda: _setup(MLP(in_features=3, hidden=4, depth=2, out_features=2), (2, 3), (2, 2))),
    "mlp_inplace": _seeded(
        lambda: _setup(MLP(in_features=3, hidden=4, depth=2, out_features=2, inplace=True), (2, 3), (2, 2))
    ),
    "cnn": _seeded(lambda: _setup(SmallCNN(in_channels=1, num_classes=3, channels=2), (2, 1, 4, 4), (2, 3))),
    "transformer": _seeded(
        lambda: _setup(TinyTransformerBlock(d_model=4, n_heads=2, d_ff=8, out_features=2), (1, 3, 4), (1, 3, 2))
    ),
    "transformer_reuse": _seeded(
        lambda: _setup(
            TinyTransformerBlock(d_model=4, n_heads=2, d_ff=8, out_features=2, reuse_act=True), (1, 3, 4), (1, 3, 2)
        )
    ),
    "cosine": _seeded(lambda: _setup(CosineRegression(a=1.3, b=0.4), (5,), (5,))),
    "sigmoid2": _seeded(
        lambda: _setup(TwoLayerSigmoid(w1=[[0.5, -1.0, 0.3], [0.8, 0.2, -0.6]], w2=[[1.0, -2.0], [0.7, 0.4]]), (3, 4), (2, 4))
    ),
    "twice": _seeded(lambda: _setup(TwiceLinear(), (2, 3), (2, 3))),
    "loop": _seeded(lambda: _setup(LoopNet(), (2, 3), (2, 3))),
}


# Independent re-implementations of each forward(), with `p(name, value)` at every assignment of a local.
def cosine_math(m: CosineRegression, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    mul_x = p("mul_x", m.a * x)
    return p("sum_x", torch.cos(mul_x) - m.b)


def sigmoid2_math(m: TwoLayerSigmoid, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    z_1 = p("z_1", m.w1 @ x)
    y_1 = p("y_1", torch.sigmoid(z_1))
    z_2 = p("z_2", m.w2 @ y_1)
    return p("y_2", torch.sigmoid(z_2))


def cnn_math(m: SmallCNN, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    h = p("h", m.pool1(m.relu1(m.conv1(x))))
    h = p("h", m.relu2(m.conv2(h)))
    features = p("features", h.mean(dim=(2, 3)))
    return p("logits", m.fc(features))


def transformer_math(m: TinyTransformerBlock, x: torch.Tensor, p: LocalPerturb) -> torch.Tensor:
    q = m.ln1(x)
    attn_out = p("attn_out", m.attn(q, q, q)[0])
    h = p("h", x + attn_out)
    ff = p("ff", m.ff2(m.act(m.ff1(m.ln2(h)))))
    h = p("h", h + ff)
    if m.reuse_act:
        h = p("h", m.act(h))
    return m.head(h)


MATH: dict[str, Callable[[Any, torch.Tensor, LocalPerturb], torch.Tensor]] = {
    "cosine": cosine_math,
    "sigmoid2": sigmoid2_math,
    "cnn": cnn_math,
    "transformer": transformer_math,
    "transformer_reuse": transformer_math,
    "twice": twice_math,
    "loop": loop_math,
}


@dataclass(frozen=True)
class Case:
    model: str
    tap: str
    call: int = 0

    @property
    def id(self) -> str:
        return f"{self.model}-{self.tap}" + (f"#{self.call}" if self.call else "")

    def point(self, s: Setup) -> Point:
        """Where to perturb for this tap, read from the tap string by the test itself."""
        module_path, name = self.tap.split(":")
        head, _, rest = name.partition(".")
        if head == "output":
            return output_point(s.model, module_path, s.loss, int(rest) if rest else None, self.call)
        if head == "input":
            return input_point(s.model, module_path, s.loss, int(rest) if rest else 0, self.call)
        module = dict(s.model.named_modules())[module_path]
        if name in dict(module.named_parameters(recurse=False)):
            return param_point(getattr(module, name), s.loss)
        math = MATH[self.model]
        return local_point(lambda p: half_sse(math(s.model, s.x, p), s.target), name, self.call)


CASES = [
    *(Case("mlp", t) for t in ("fc1:output", "relu1:output", "fc2:input", "head:output", ":output", ":input",
                                "fc1:weight", "head:bias")),
    *(Case("mlp_inplace", t) for t in ("fc1:output", "fc2:output", "relu1:input", "relu2:output", ":input")),
    *(Case("cnn", t) for t in ("conv1:output", "pool1:output", "conv2:input", "fc:output", ":input", "conv1:weight",
                                ":features", ":logits")),
    Case("cnn", ":h", 0),
    Case("cnn", ":h", 1),
    *(Case("transformer", t) for t in ("attn:output.0", "ln1:output", "ff1:output", "act:output", "head:output",
                                        ":input", "attn:in_proj_weight", "ln2:weight", ":attn_out", ":ff")),
    Case("transformer", ":h", 0),
    Case("transformer", ":h", 1),
    Case("transformer_reuse", "act:output", 0),
    Case("transformer_reuse", "act:output", 1),
    Case("transformer_reuse", ":h", 2),
    *(Case("cosine", t) for t in (":mul_x", ":sum_x", ":a", ":b", ":input", ":output")),
    *(Case("sigmoid2", t) for t in (":z_1", ":y_1", ":z_2", ":y_2", ":w1", ":w2", ":input", ":output")),
    Case("twice", "lin:output", 0),
    Case("twice", "lin:output", 1),
    Case("twice", "lin:input", 0),
    Case("twice", "lin:input", 1),
    *(Case("loop", ":h", n) for n in range(4)),
    *(Case("loop", "lin:output", n) for n in range(4)),
]
CASE_IDS = [c.id for c in CASES]
MODELS_WITH_CASES = sorted({c.model for c in CASES})


@functools.cache
def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact autograd gradient, central finite differences) at the case's point, on a fresh model."""
    point = case.point(BUILDERS[case.model]())
    return autograd_at(point), central_diff(point, eps=1e-6)


# -- gradients -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_matches_finite_differences(case: Case) -> None:
    exact, fd = reference(case)
    assert exact.abs().max() > 1e-6, "a reference gradient of zero would make the case vacuous"
    close(exact, fd, RTOL_FD, ATOL_FD)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradient_matches_reference_and_finite_differences(case: Case, strategy: str) -> None:
    s = BUILDERS[case.model]()
    with capture(s.model, [case.tap], strategy=strategy) as cap:
        cap.backward(s.loss())
    got = cap.grads[case.tap, case.call]
    exact, fd = reference(case)
    assert got is not None
    assert got.dtype == torch.float64
    close(got, exact, RTOL_STRATEGY, ATOL_STRATEGY)
    close(got, fd, RTOL_FD, ATOL_FD)


def _capture_all(model_name: str, strategy: str) -> dict[tuple[str, int], torch.Tensor | None]:
    s = BUILDERS[model_name]()
    taps = sorted({c.tap for c in CASES if c.model == model_name})
    with capture(s.model, taps, strategy=strategy) as cap:
        cap.backward(s.loss())
    return {(t, n): g for t in taps for n, g in enumerate(cap.grads.calls(t))}


@pytest.mark.parametrize("model_name", MODELS_WITH_CASES)
def test_all_taps_at_once_match_reference(model_name: str, strategy: str) -> None:
    got = _capture_all(model_name, strategy)
    for case in (c for c in CASES if c.model == model_name):
        grad = got[case.tap, case.call]
        assert grad is not None, case.id
        close(grad, reference(case)[0], RTOL_STRATEGY, ATOL_STRATEGY)


@pytest.mark.parametrize("model_name", MODELS_WITH_CASES)
def test_strategies_agree(model_name: str) -> None:
    results = {name: _capture_all(model_name, name) for name in sorted(STRATEGIES)}
    first, *others = results
    for other in others:
        assert results[other].keys() == results[first].keys()
        for key, grad in results[first].items():
            assert grad is not None and results[other][key] is not None, key
            close(results[other][key], grad, RTOL_STRATEGY, ATOL_STRATEGY)


@pytest.mark.parametrize("model_name", MODELS_WITH_CASES)
def test_parameter_grads_equal_plain_backward(model_name: str, strategy: str) -> None:
    """Two steps without zero_grad: `.grad` accumulates exactly as with `loss.backward()`."""
    plain, tapped = BUILDERS[model_name](), BUILDERS[model_name]()
    taps = sorted({c.tap for c in CASES if c.model == model_name})
    for _ in range(2):
        plain.loss().backward()
    with capture(tapped.model, taps, strategy=strategy) as cap:
        for _ in range(2):
            cap.backward(tapped.loss())
    plain_grads = dict(plain.model.named_parameters())
    for name, param in tapped.model.named_parameters():
        assert param.grad is not None, name
        close(param.grad, plain_grads[name].grad, 1e-12, 1e-15)


def test_optimizer_step_is_identical(strategy: str) -> None:
    plain, tapped = BUILDERS["transformer"](), BUILDERS["transformer"]()
    opt_plain = torch.optim.Adam(plain.model.parameters(), lr=0.1)
    opt_tapped = torch.optim.Adam(tapped.model.parameters(), lr=0.1)
    with capture(tapped.model, ["*:output", ":h", "head:weight", ":input"], strategy=strategy) as cap:
        for _ in range(3):
            opt_plain.zero_grad()
            plain.loss().backward()
            opt_plain.step()
            opt_tapped.zero_grad()
            cap.backward(tapped.loss())
            opt_tapped.step()
    for (name, p), q in zip(tapped.model.named_parameters(), plain.model.parameters(), strict=True):
        close(p, q, 1e-12, 1e-14)


def test_param_tap_reports_this_steps_gradient_while_grad_accumulates(strategy: str) -> None:
    s = BUILDERS["mlp"]()
    (single,) = torch.autograd.grad(s.loss(), [s.model.fc1.weight])
    with capture(s.model, ["fc1:weight", ":input"], strategy=strategy) as cap:
        cap.backward(s.loss())
        cap.backward(s.loss())
    close(cap.grads["fc1:weight"], single, 1e-12, 1e-15)
    close(s.model.fc1.weight.grad, 2 * single, 1e-12, 1e-15)
    kept = cap.grads["fc1:weight"].clone()
    s.model.fc1.weight.grad.zero_()  # the captured gradient must not alias .grad
    close(cap.grads["fc1:weight"], kept, 0, 0)


def test_input_tap_reports_this_steps_gradient_on_a_reused_input(strategy: str) -> None:
    s = BUILDERS["cosine"]()
    exact, _ = reference(Case("cosine", ":input"))
    with capture(s.model, [":input"], strategy=strategy) as cap:
        for _ in range(2):
            cap.backward(s.loss())
            close(cap.grads[":input"], exact, RTOL_STRATEGY, ATOL_STRATEGY)


# -- calls -----------------------------------------------------------------------------------------
def test_module_called_twice_yields_two_calls(strategy: str) -> None:
    s = BUILDERS["transformer_reuse"]()
    with capture(s.model, ["act:output", "head:output"], strategy=strategy) as cap:
        cap.backward(s.loss())
    calls = cap.grads.calls("act:output")
    assert len(calls) == 2
    assert [tuple(c.shape) for c in calls] == [(1, 3, 8), (1, 3, 4)]
    assert cap.grads["act:output", 1] is calls[1]
    assert cap.grads["act:output"] is calls[0]
    for n in (0, 1):
        close(calls[n], reference(Case("transformer_reuse", "act:output", n))[1], RTOL_FD, ATOL_FD)
    assert len(cap.grads.calls("head:output")) == 1
    with pytest.raises(KeyError, match="fired 2 time"):
        cap.grads["act:output", 2]
    recs = cap.records()
    assert [(k.tap, k.call) for k in recs.keys if k.tap == "act:output"] == [("act:output", 0), ("act:output", 1)]


def test_same_linear_twice_gets_distinct_correct_gradients(strategy: str) -> None:
    s = BUILDERS["twice"]()
    with capture(s.model, ["lin:output", "lin:input"], strategy=strategy) as cap:
        cap.backward(s.loss())
    for tap in ("lin:output", "lin:input"):
        calls = cap.grads.calls(tap)
        assert len(calls) == 2
        assert not torch.allclose(calls[0], calls[1])
        for n in (0, 1):
            close(calls[n], reference(Case("twice", tap, n))[0], RTOL_STRATEGY, ATOL_STRATEGY)


def test_local_assigned_in_loop_yields_one_call_per_assignment(strategy: str) -> None:
    s = BUILDERS["loop"]()
    with capture(s.model, [":h"], strategy=strategy) as cap:
        cap.backward(s.loss())
        cap.backward(s.loss())  # call numbering restarts every step
    calls = cap.grads.calls(":h")
    assert len(calls) == 4
    for n in range(4):
        close(calls[n], reference(Case("loop", ":h", n))[1], RTOL_FD, ATOL_FD)


# -- in-place ops after a tapped module -----------------------------------------------------------
def test_inplace_relu_after_module(strategy: str) -> None:
    inplace, plain = BUILDERS["mlp_inplace"](), BUILDERS["mlp"]()
    taps = ["fc1:output", "relu1:input", "relu1:output", "fc2:output", "relu2:output"]
    grads = []
    for s in (inplace, plain):
        with capture(s.model, taps, strategy=strategy) as cap:
            cap.backward(s.loss())
        grads.append(dict(cap.grads))
    for tap in taps:
        close(grads[0][tap], grads[1][tap], 1e-12, 1e-15)
    close(grads[0]["fc1:output"], reference(Case("mlp_inplace", "fc1:output"))[1], RTOL_FD, ATOL_FD)
    # the ReLU's mask must show: fc1's gradient is zero exactly where its output was negative
    fc1_out = inplace.model.fc1(inplace.x)
    assert torch.equal(grads[0]["fc1:output"][fc1_out < 0], torch.zeros_like(fc1_out[fc1_out < 0]))
    assert (fc1_out < 0).any() and (grads[0]["fc1:output"][fc1_out > 0] != 0).any()


# -- taps that get no gradient ---------------------------------------------------------------------
def test_tuple_element_outside_the_loss_has_no_gradient(strategy: str) -> None:
    s = BUILDERS["transformer"]()
    taps = ["attn:output.0", "attn:output.1", ":_weights"]
    with capture(s.model, taps, strategy=strategy) as cap:
        cap.backward(s.loss())
    assert cap.grads["attn:output.1"] is None
    assert cap.grads[":_weights"] is None
    close(cap.grads["attn:output.0"], reference(Case("transformer", "attn:output.0"))[0], RTOL_STRATEGY, ATOL_STRATEGY)
    rows = {r["tap"]: r for r in (cap.records().row(i) for i in range(3))}
    assert set(rows) == set(taps)
    assert rows["attn:output.1"]["has_grad"] is False and rows[":_weights"]["has_grad"] is False
    assert rows["attn:output.0"]["has_grad"] is True


@pytest.mark.parametrize("keep_grads", [True, False])
def test_local_outside_the_loss_is_reported_without_gradient(strategy: str, keep_grads: bool) -> None:
    torch.manual_seed(0)
    model = Unused().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    taps = [":h", ":unused"]
    with capture(model, taps, strategy=strategy, keep_grads=keep_grads) as cap:
        loss = model(x).pow(2).sum()
        cap.backward(loss)
        recs = cap.records(loss)
    rows = {recs.keys[i].tap: recs.row(i) for i in range(len(recs))}
    assert set(rows) == set(taps)
    assert rows[":h"]["has_grad"] is True and rows[":h"]["numel"] == 8
    assert rows[":unused"]["has_grad"] is False
    assert rows[":unused"]["numel"] == 0
    assert np.isnan(rows[":unused"]["norm"])
    assert recs.loss == pytest.approx(float(loss.detach()))
    if keep_grads:
        close(cap.grads[":h"], 2 * model(x).detach(), 1e-12, 1e-15)
        assert cap.grads[":unused"] is None


@pytest.mark.parametrize("tap, what", [(":n", "int, not a tensor"), (":idx", "torch.int64")])
def test_explicit_tap_on_a_value_without_gradient_fails_in_forward(strategy: str, tap: str, what: str) -> None:
    model = Unused().double()
    with pytest.raises(GradrunnerError, match=rf"'{tap}'.*{what}"):
        with capture(model, [":h", tap], strategy=strategy):
            model(torch.randn(4, 3, dtype=torch.float64))
    assert leftover_hooks(model) == []


def test_glob_selected_values_without_gradient_are_recorded(strategy: str) -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 1)).double()
    x = torch.tensor([[0, 3, 4]])
    with capture(model, ["*:input", "*:output"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
        recs = cap.records()
    assert cap.grads["0:input"] is None
    assert "int64" in {k.tap: r for k, r in cap.reasons().items()}["0:input"]
    assert cap.grads["1:input"] is not None and cap.grads["0:output"] is not None
    close(cap.grads["1:input"], model[1].weight.detach().expand(1, 3, 3).clone(), 1e-12, 1e-15)
    assert [recs.row(i)["has_grad"] for i in range(len(recs))] == [False, True, True, True]
    assert not x.requires_grad


# -- inputs ----------------------------------------------------------------------------------------
def test_root_input_tap_leaves_the_callers_input_untouched(strategy: str) -> None:
    # The model gets an alias that requires grad; the caller's tensor is never made to require grad.
    s = BUILDERS["sigmoid2"]()
    with capture(s.model, [":input"], strategy=strategy) as cap:
        loss = s.loss()
        assert not s.x.requires_grad
        cap.backward(loss)
    assert not s.x.requires_grad and s.x.grad is None
    close(cap.grads[":input"], reference(Case("sigmoid2", ":input"))[0], RTOL_STRATEGY, ATOL_STRATEGY)


def test_input_that_already_requires_grad_is_left_so(strategy: str) -> None:
    s = BUILDERS["cosine"]()
    s.x.requires_grad_(True)
    with capture(s.model, [":input"], strategy=strategy) as cap:
        cap.backward(s.loss())
    assert s.x.requires_grad
    close(cap.grads[":input"], reference(Case("cosine", ":input"))[0], RTOL_STRATEGY, ATOL_STRATEGY)


# -- hooks never leak ------------------------------------------------------------------------------
def _kitchen() -> tuple[Kitchen, torch.Tensor]:
    torch.manual_seed(7)
    return Kitchen().double(), torch.randn(2, 3, dtype=torch.float64)


class Boom(Exception):
    pass


def _run(model: Kitchen, x: torch.Tensor, strategy: str, how: str) -> None:
    with capture(model, KITCHEN_TAPS, strategy=strategy) as cap:
        if how == "normal":
            cap.backward(model(x).sum())
        elif how == "raise_in_body":
            model(x)
            raise Boom()
        elif how == "raise_in_forward":
            model.fail = True
            model(x)
        elif how == "raise_in_backward":
            cap.backward(model(x).sum().detach())


EXITS = {"normal": None, "raise_in_body": Boom, "raise_in_forward": RuntimeError, "raise_in_backward": RuntimeError}


def test_leftover_check_sees_hooks_and_patches() -> None:
    model, _ = _kitchen()
    handle = model.block.fc1.register_forward_hook(lambda *a: None)
    assert len(leftover_hooks(model)) == 1
    handle.remove()
    handle = model.cos.a.register_hook(lambda g: g)
    assert len(leftover_hooks(model)) == 1
    handle.remove()
    model.cos.forward = model.cos.forward
    assert len(leftover_hooks(model)) == 1
    del model.cos.forward
    assert leftover_hooks(model) == []


@pytest.mark.parametrize("how", list(EXITS))
def test_no_hooks_left_after_exit(strategy: str, how: str) -> None:
    model, x = _kitchen()
    forwards = class_forwards(model)
    assert leftover_hooks(model) == []
    error = EXITS[how]
    if error is None:
        _run(model, x, strategy, how)
    else:
        with pytest.raises(error):
            _run(model, x, strategy, how)
    assert leftover_hooks(model) == []
    assert all(cls.forward is fwd for cls, fwd in forwards.items())
    assert not x.requires_grad


@pytest.mark.parametrize("how", list(EXITS))
def test_second_capture_works_after_exit(strategy: str, how: str) -> None:
    model, x = _kitchen()
    with pytest.raises(Exception) if EXITS[how] else _nothing():
        _run(model, x, strategy, how)
    model.fail = False
    model.zero_grad()
    fresh, _ = _kitchen()
    expected = output_point(fresh, "block", lambda: fresh(x).sum())
    with capture(model, KITCHEN_TAPS, strategy=strategy) as cap:
        cap.backward(model(x).sum())
    close(cap.grads["block:output"], autograd_at(expected), RTOL_STRATEGY, ATOL_STRATEGY)
    assert len(cap.grads.calls(":h")) == 2
    assert leftover_hooks(model) == []


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_model_runs_untapped_after_exit(strategy: str) -> None:
    model, x = _kitchen()
    with capture(model, KITCHEN_TAPS, strategy=strategy) as cap:
        cap.backward(model(x).sum())
    assert len(cap.grads.calls("lin:output")) == 1
    model(x).sum().backward()  # outside the block: nothing fires, nothing changes
    assert len(cap.grads.calls("lin:output")) == 1


def test_instance_forward_set_before_capture_is_restored(strategy: str) -> None:
    s = BUILDERS["cosine"]()
    original = s.model.forward  # a bound method, stored on the instance
    s.model.forward = original
    with capture(s.model, [":mul_x"], strategy=strategy) as cap:
        cap.backward(s.loss())
    assert s.model.__dict__["forward"] is original
    assert cap.grads[":mul_x"] is not None


def test_bad_tap_raises_before_anything_is_installed(strategy: str) -> None:
    model, _ = _kitchen()
    with pytest.raises(GradrunnerError):
        capture(model, ["lin:output", "nope:output"], strategy=strategy)
    assert leftover_hooks(model) == []


def test_bad_element_raises_in_forward_and_cleans_up(strategy: str) -> None:
    model, x = _kitchen()
    with pytest.raises(GradrunnerError, match="lin:output.3"):
        with capture(model, ["lin:output.3", "cos:mul_x"], strategy=strategy):
            model(x)
    assert leftover_hooks(model) == []


# -- the Grads mapping and the registry ------------------------------------------------------------
def test_grads_mapping(strategy: str) -> None:
    s = BUILDERS["mlp"]()
    with capture(s.model, ["fc*:output", "fc1:weight"], strategy=strategy) as cap:
        cap.backward(s.loss())
    assert list(cap.grads) == ["fc1:output", "fc2:output", "fc1:weight"]
    assert len(cap.grads) == 3
    with pytest.raises(KeyError, match="fc1:output"):
        cap.grads["head:output"]


def test_registry_names_are_the_contracts() -> None:
    assert {"retain_grad", "hook", "autograd_grad"} <= set(STRATEGIES)
    assert all(cls.name == name for name, cls in STRATEGIES.items())


def test_unknown_strategy_lists_the_allowed_ones() -> None:
    s = BUILDERS["mlp"]()
    with pytest.raises(GradrunnerError, match="'hooks'") as err:
        capture(s.model, ["fc1:output"], strategy="hooks")
    assert all(name in str(err.value) for name in STRATEGIES)


def test_records_of_statistics_only_agree_with_kept_grads(strategy: str) -> None:
    s = BUILDERS["transformer_reuse"]()
    taps = ["*:output", ":h", "head:weight"]
    with capture(s.model, taps, strategy=strategy, values="full") as cap:
        cap.backward(s.loss())
    kept = cap.records()
    s2 = BUILDERS["transformer_reuse"]()
    with capture(s2.model, taps, strategy=strategy, values="full", keep_grads=False) as cap2:
        cap2.backward(s2.loss())
        streamed = cap2.records()
    assert kept.keys == streamed.keys
    # 7 modules' outputs + act's second call + 3 h + weight, + attn.out_proj's row: never called, still recorded
    assert len(kept) == 13
    assert kept.reason == streamed.reason
    out_proj = kept.keys.index(TapKey("attn.out_proj", "output", 0))
    assert not kept.has_grad[out_proj] and kept.reason[out_proj] == "module not called in this step"
    for col in kept.stats:
        np.testing.assert_allclose(streamed.stats[col], kept.stats[col], rtol=1e-12, equal_nan=True)
    for i, key in enumerate(kept.keys):
        grad = cap.grads[key.tap, key.call]
        if grad is None:
            assert not kept.has_grad[i] and streamed.values[i] is None
        else:
            assert kept.row(i)["norm"] == pytest.approx(float(grad.norm()), rel=1e-12)
            np.testing.assert_allclose(streamed.values[i], grad.flatten().float().numpy(), rtol=2e-7)


# -- device-to-host transfers ----------------------------------------------------------------------
_HOST_METHODS = ("item", "tolist", "cpu", "to", "__bool__", "__float__", "__int__", "__index__")


def _is_host_read(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name != "to":
        return name in _HOST_METHODS
    # `t.to(other.device)` is a same-device move, a no-op on every device: only a move that would
    # cross devices counts, and a literal "cpu" target always does (it would on an accelerator).
    source = args[0]
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if isinstance(target, str):
        return torch.device(target).type == "cpu"
    if isinstance(target, torch.device):
        return target.type == "cpu" and source.device.type != "cpu"
    return False


class HostReads(TorchFunctionMode):
    """Counts torch-level host reads (`item`, `tolist`, `cpu`, `to(cpu)`, `bool()`, `float()`, `int()`).

    A TorchFunctionMode is not active inside autograd hooks (checked: the mode stack is empty
    there), so while it is entered the Tensor methods are also wrapped, counting only calls made
    where the mode is not active.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._saved: dict[str, object] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_host_read(name, args, kwargs):
            self.calls.append(name)
        func = getattr(func, "_unwrapped", func)  # one of the wrappers below: already counted here
        return func(*args, **kwargs)

    def __enter__(self) -> HostReads:
        for name in _HOST_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            original = getattr(torch.Tensor, name)

            def wrapper(t: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
                if torch._C._len_torch_function_stack() == 0 and _is_host_read(_name, (t, *a), k):
                    self.calls.append(_name + " (outside the mode)")
                return _orig(t, *a, **k)

            wrapper.__name__ = name
            wrapper._unwrapped = original  # type: ignore[attr-defined]

            setattr(torch.Tensor, name, wrapper)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, saved in self._saved.items():
            if saved is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


_MISSING = object()


def test_host_read_counter_sees_every_kind() -> None:
    t = torch.tensor([1.5])
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g.sum().item() and None)
    with HostReads() as reads:
        t.item(), t.tolist(), t.cpu(), t.to("cpu"), bool(t), float(t), int(t)
        t.to(t.device), t.to(torch.float64), t.sum()  # not host reads
        y.sum().backward()  # one item() inside the hook
    assert len(reads.calls) == 8, reads.calls
    assert reads.calls[-1] == "item (outside the mode)"
    assert float(t) == 1.5  # methods restored


def _step_traffic(
    monkeypatch: pytest.MonkeyPatch, strategy: str, taps: list[str], values: str
) -> tuple[int, list[str], int]:
    to_host_calls = []
    real_to_host = gradrunner.capturing.stats.to_host

    def counting_to_host(t: torch.Tensor) -> torch.Tensor:
        to_host_calls.append(t.numel())
        return real_to_host(t)

    monkeypatch.setattr(gradrunner.capturing.stats, "to_host", counting_to_host)
    torch.manual_seed(3)
    model = MLP(in_features=3, hidden=4, depth=15, out_features=2).double()
    x, target = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    with capture(model, taps, strategy=strategy, values=values, sample_size=4, keep_grads=False) as cap:
        cap.backward(half_sse(model(x), target))  # a first step, uncounted (caches are warm)
        cap.records()
        model.zero_grad()
        loss = half_sse(model(x), target)
        to_host_calls.clear()
        with HostReads() as reads:
            cap.backward(loss)
            recs = cap.records(loss)
    assert recs.loss == pytest.approx(float(loss.detach()))
    return len(to_host_calls), reads.calls, len(recs)


FEW_TAPS = ["fc1:output", "head:weight"]
MANY_TAPS = ["*:output", "*:input", "*:weight", ":output", ":input"]


@pytest.mark.parametrize("values, transfers", [("none", 1), ("full", 2)])
def test_host_transfers_per_step_do_not_grow_with_taps(
    monkeypatch: pytest.MonkeyPatch, strategy: str, values: str, transfers: int
) -> None:
    few = _step_traffic(monkeypatch, strategy, FEW_TAPS, values)
    many = _step_traffic(monkeypatch, strategy, MANY_TAPS, values)
    assert few[2] == 2 and many[2] >= 30
    assert few[0] == many[0] == transfers
    assert len(few[1]) == len(many[1]) <= 4, (few[1], many[1])


def test_host_transfers_per_step_do_not_grow_with_taps_when_sampling(
    monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    few = _step_traffic(monkeypatch, strategy, FEW_TAPS, "sample")
    many = _step_traffic(monkeypatch, strategy, MANY_TAPS, "sample")
    assert few[0] == many[0] == 2
    assert len(few[1]) == len(many[1]), (few[1], many[1])


def test_host_traffic_check_catches_a_per_tap_read(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    """The check above can fail: a reduction that reads one value per tap is seen."""
    real_reduce = gradrunner.capturing.stats.reduce_one

    def reduce_and_peek(
        flat: torch.Tensor, scratch: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out = real_reduce(flat, scratch)
        out[0][0].item()
        return out

    monkeypatch.setattr(gradrunner.capturing.stats, "reduce_one", reduce_and_peek)
    monkeypatch.setattr(gradrunner.capturing.stats, "DEFER_NUMEL", 0)  # every gradient reduced on its own
    monkeypatch.setenv("GRADRUNNER_FUSED", "0")  # through `_reduce`, not the fused kernel
    few = _step_traffic(monkeypatch, strategy, FEW_TAPS, "none")
    many = _step_traffic(monkeypatch, strategy, MANY_TAPS, "none")
    assert len(many[1]) - len(few[1]) == many[2] - few[2]


# -- structured outputs and inputs -----------------------------------------------------------------
class Structured(nn.Module):
    """Returns a dict; its child takes a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scaled = Scaled()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"sin": torch.sin(h), "out": self.scaled(h, scale=torch.cos(h))}


class Scaled(nn.Module):
    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h * scale


@pytest.mark.parametrize("tap, point", [(":output.sin", ("out", "", "sin")), (":output.out", ("out", "", "out")),
                                         ("scaled:input.scale", ("kw", "scaled", "scale"))])
def test_dict_output_and_keyword_input_elements(strategy: str, tap: str, point: tuple[str, str, str]) -> None:
    torch.manual_seed(2)
    model = Structured().double()
    x = torch.randn(2, 3, dtype=torch.float64)

    def loss() -> torch.Tensor:
        out = model(x)
        return (out["sin"] ** 2).sum() + (out["out"] ** 3).sum()

    kind, path, key = point
    if kind == "out":
        ref = output_point(model, path, loss, key)
    else:
        ref = _kwarg_point(model, path, key, loss)
    exact, fd = autograd_at(ref), central_diff(ref)
    close(exact, fd, RTOL_FD, ATOL_FD)
    with capture(model, [tap], strategy=strategy) as cap:
        cap.backward(loss())
    close(cap.grads[tap], exact, RTOL_STRATEGY, ATOL_STRATEGY)


def _kwarg_point(model: nn.Module, path: str, key: str, loss: Callable[[], torch.Tensor]) -> Point:
    module = dict(model.named_modules())[path]
    shapes: list[torch.Size] = []

    def loss_at(delta: torch.Tensor | None) -> torch.Tensor:
        def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            shapes.append(kwargs[key].shape)
            return None if delta is None else (args, {**kwargs, key: kwargs[key] + delta})

        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            return loss()
        finally:
            handle.remove()

    with torch.no_grad():
        loss_at(None)
    return Point(loss_at, shapes[0])


def test_two_forwards_before_one_backward(strategy: str) -> None:
    """Gradient accumulation over micro-batches: each forward is its own call."""
    s = BUILDERS["mlp"]()
    x2 = torch.randn(2, 3, dtype=torch.float64)
    with capture(s.model, ["fc1:output"], strategy=strategy) as cap:
        cap.backward(s.loss() + half_sse(s.model(x2), s.target))
    calls = cap.grads.calls("fc1:output")
    assert len(calls) == 2
    close(calls[0], reference(Case("mlp", "fc1:output"))[0], RTOL_STRATEGY, ATOL_STRATEGY)
    second = output_point(s.model, "fc1", lambda: half_sse(s.model(x2), s.target))
    close(calls[1], autograd_at(second), RTOL_STRATEGY, ATOL_STRATEGY)


def test_activation_checkpointing_does_not_fire_taps_again(strategy: str) -> None:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.a, x, use_reentrant=False)
            return self.b(torch.tanh(h))

    torch.manual_seed(4)
    model = Checkpointed().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    exact = autograd_at(output_point(model, "a", lambda: model(x).sum()))
    with capture(model, ["a:output", ":h"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    for tap in ("a:output", ":h"):
        assert len(cap.grads.calls(tap)) == 1
        close(cap.grads[tap], exact, RTOL_STRATEGY, ATOL_STRATEGY)


# -- side effects on the user's tensors and shared modules (known core bugs) ------------------------
def test_step_inputs_are_not_kept_alive(strategy: str) -> None:
    import gc
    import weakref

    s = BUILDERS["mlp"]()
    with capture(s.model, [":input"], strategy=strategy) as cap:
        refs = []
        for _ in range(3):
            x = torch.randn(2, 3, dtype=torch.float64)
            refs.append(weakref.ref(x))
            cap.backward(half_sse(s.model(x), s.target))
            del x
        gc.collect()
        assert [r() is None for r in refs] == [True, True, True]


def test_input_tap_leaves_no_grad_on_the_input(strategy: str) -> None:
    s = BUILDERS["mlp"]()
    with capture(s.model, [":input"], strategy=strategy) as cap:
        cap.backward(s.loss())
        cap.backward(s.loss())
    assert not s.x.requires_grad
    assert s.x.grad is None


def test_shared_module_under_two_paths_local_taps(strategy: str) -> None:
    shared = CosineRegression(a=1.3, b=0.4).double()
    model = nn.Sequential(shared, shared)
    with capture(model, ["*:mul_x", "*:output"], strategy=strategy) as cap:
        cap.backward(model(torch.randn(3, dtype=torch.float64)).sum())
    assert len(cap.grads.calls("0:output")) == len(cap.grads.calls("1:output")) == 2
    assert len(cap.grads.calls("0:mul_x")) == len(cap.grads.calls("1:mul_x"))


@pytest.mark.parametrize("values", ["none", "full"])
def test_records_survive_zero_grad_in_place_before_they_are_read(strategy: str, values: str) -> None:
    """A parameter's gradient may become its .grad; zeroing that in place must not change the records."""
    torch.manual_seed(0)
    model = MLP(4, 8, 1, 2).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    with capture(model, ["fc1:weight", "fc1:output"], strategy=strategy, values=values, keep_grads=False) as cap:
        loss = model(x).pow(2).sum()
        cap.backward(loss)
        expected = {"fc1:weight": model.fc1.weight.grad.clone()}
        model.zero_grad(set_to_none=False)  # in place: what an optimiser loop may do before reading
        recs = cap.records(loss)
    row = next(recs.row(i) for i in range(len(recs)) if recs.keys[i].tap == "fc1:weight")
    assert row["norm"] == pytest.approx(float(expected["fc1:weight"].norm()), rel=1e-12)
    if values == "full":
        np.testing.assert_allclose(row["values"], expected["fc1:weight"].reshape(-1).float().numpy(), rtol=1e-6)


@pytest.mark.parametrize(("option", "value"), [("sample_size", -3), ("sample_size", 0), ("sample_size", 2.5),
                                               ("seed", "a"), ("seed", True)])  # fmt: skip
def test_capture_refuses_a_sample_size_or_seed_record_would_refuse_before_anything_is_installed(
    option: str, value: object
) -> None:
    """capture(values='sample', sample_size=-3) failed at records() with numpy's ValueError, and sample_size=0 was
    taken, while record() and the runner refuse both (found 2026-11-27): the same one paragraph now, at once."""
    model = nn.Linear(3, 2)
    with pytest.raises(GradrunnerError, match=rf"^{option}={value!r} is not allowed; it must be a whole number"):
        capture(model, [":weight"], values="sample", **{option: value})
    assert not leftover_hooks(model)


def test_capture_and_record_take_numpy_integers_as_the_whole_numbers_they_are(tmp_path: Path) -> None:
    """capture(seed=np.int64(3), sample_size=np.int64(5)) was refused ('seed=np.int64(3) is not allowed; it must be a
    whole number') since d948d13, which took them before, and record() refused them too (found 2026-11-27): a numpy
    integer is a whole number (as rec.start_at takes it). The sample is the one plain ints give."""
    torch.manual_seed(0)
    model = nn.Linear(3, 8)
    x = torch.randn(4, 3)

    def sampled(seed: object, size: object) -> np.ndarray:
        with capture(model, [":output"], values="sample", seed=seed, sample_size=size, keep_grads=False) as cap:
            loss = model(x).pow(2).sum()
            cap.backward(loss)
            return np.asarray(cap.records(loss).values[0])

    plain = sampled(3, 5)
    assert plain.shape == (5,)
    np.testing.assert_array_equal(sampled(np.int64(3), np.int64(5)), plain)
    with record(model, [":output"], tmp_path / "run", seed=np.int64(3), every=np.int64(2), values="sample",
                sample_size=np.int32(5), anomaly=False) as rec:  # fmt: skip
        for _ in range(2):
            loss = model(x).pow(2).sum()
            loss.backward()
            rec.step(loss)
    df = pd.read_parquet(tmp_path / "run" / "grads.parquet")
    assert df.step.tolist() == [0]  # every=2: step 0 only
    np.testing.assert_array_equal(np.asarray(df["values"].iloc[0]), plain)


def test_a_session_entered_again_records_what_it_recorded_the_first_time(strategy: str) -> None:
    """`with cap:` a second time (a benchmark's rounds, a session per phase): every column as in the first entry,
    and the parameters' per-example norms those of a per-example loop. They were null from the second entry on
    (with "its modules' outputs got gradients but it did not"): the check's gradient hook went with the first
    entry's hooks and was never registered again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    taps = ["0:weight", "1:weight", "3:bias", "0:output", "2:input"]
    cap = capture(model, taps, strategy=strategy, per_example=True, histogram=True, values="full",
                  edits=[{"tap": "0:output", "scale": 0.5}])  # fmt: skip
    entries = []
    for _ in range(2):
        with cap:
            loss = model(x).pow(2).mean()
            cap.backward(loss)
            rec = cap.records(loss)
            model.zero_grad(set_to_none=True)
        entries.append(rec)
    first, second = entries
    assert second.keys == first.keys and second.reason == first.reason
    for column in ("per_example_norm", "hist_counts", "values"):
        for a, b in zip(getattr(first, column), getattr(second, column), strict=True):
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), column
    for name, values in first.stats.items():
        np.testing.assert_array_equal(second.stats[name], values)
    params = dict(model.named_parameters())
    for i, key in enumerate(second.keys):
        if key.module in ("0", "1", "3") and key.name in ("weight", "bias"):
            param = params[f"{key.module}.{key.name}"]
            scale = 0.5 if key.module == "0" else 1.0  # the edit halves 0:output's gradient on its way to 0:weight
            rows = [scale * torch.autograd.grad(model(x[r:r + 1]).pow(2).sum() / (len(x) * 2), param)[0] for r in range(len(x))]
            np.testing.assert_allclose(second.per_example_norm[i], [float(g.norm()) for g in rows], rtol=1e-5)


def test_a_session_entered_again_after_its_entry_raised_records_only_its_own_step(strategy: str) -> None:
    """The first entry raised after its backward, before `records()` (an optimiser step that failed); the second
    entry's records held that backward's activation rows too (five rows for three, `micro_step` 0, 0, 1, 1, and the
    parameter's per-example norms null with a warning of a `zero_grad` between backwards): what a fresh session
    records, every column, and per-example norms those of a per-example loop."""
    x = torch.randn(5, 4)
    taps = ["0:weight", "0:output", "1:output"]

    def model_and_session() -> tuple[nn.Module, capture]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, capture(model, taps, strategy=strategy, per_example=True, values="full")

    model, fresh = model_and_session()
    with fresh:
        loss = model(x).pow(2).mean()
        fresh.backward(loss)
        want = fresh.records(loss)
    model, cap = model_and_session()
    with pytest.raises(RuntimeError, match="the step failed"), cap:
        cap.backward(model(x).pow(2).mean())
        raise RuntimeError("the step failed")
    model.zero_grad(set_to_none=True)
    with cap:
        loss = model(x).pow(2).mean()
        cap.backward(loss)
        got = cap.records(loss)
    assert got.keys == want.keys and got.micro_step == want.micro_step and got.reason == want.reason
    for name, values in want.stats.items():
        np.testing.assert_array_equal(got.stats[name], values)
    for a, b in zip(want.values, got.values, strict=True):
        np.testing.assert_array_equal(a, b)
    weight = model[0].weight
    rows = [torch.autograd.grad(model(x[r : r + 1]).pow(2).sum() / (len(x) * 2), weight)[0] for r in range(len(x))]
    np.testing.assert_allclose(got.per_example_norm[2], [float(g.norm()) for g in rows], rtol=1e-5)


def test_a_session_entered_per_micro_batch_keeps_every_backward_for_the_records_after_the_loop(strategy: str) -> None:
    """Only a step left by a block that raised is dropped at the next entry: 8b875f2 dropped any step an earlier
    entry left, so a session entered once per micro-batch with `records()` after the loop recorded the last
    micro-batch only (the parameter tap 1.298 beside a `.grad` of norm 3.176). It records what one block around the
    three backwards records, every column; the parameter tap's norm is that of `.grad`, which the optimiser uses."""
    xs = [torch.randn(2, 4) for _ in range(3)]

    def run(entry_per_micro_batch: bool) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        cap = capture(model, ["0:weight", "0:output"], strategy=strategy, values="full")
        if entry_per_micro_batch:
            for x in xs:
                with cap:
                    cap.backward(model(x).pow(2).mean())
        else:
            with cap:
                for x in xs:
                    cap.backward(model(x).pow(2).mean())
        return model, cap.records()

    model, got = run(True)
    _, want = run(False)
    assert got.keys == want.keys and got.micro_step == want.micro_step and len(got.keys) == 4
    for name, values in want.stats.items():
        np.testing.assert_array_equal(got.stats[name], values)
    for a, b in zip(want.values, got.values, strict=True):
        np.testing.assert_array_equal(a, b)
    weight = next(got.row(i) for i in range(len(got.keys)) if got.row(i)["tap"] == "0:weight")
    assert weight["norm"] == pytest.approx(float(model[0].weight.grad.norm()), rel=1e-6)


def test_a_session_entered_again_after_the_model_changed_refuses_what_it_would_record_wrong(strategy: str) -> None:
    """A module replaced between two entries: its parameter tap recorded `takes no part in the loss` (NaN, has_grad
    False) while the model's new parameter got a gradient of norm 0.516; a module removed raised KeyError '2'. Both
    are one paragraph naming the tap now, nothing left installed; a replaced module with only activation taps
    records what a fresh session records (those find their module by path at each entry)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    cap = capture(model, ["2:output", "2:weight"], strategy=strategy)
    outputs = capture(model, ["2:output"], strategy=strategy)
    for session in (cap, outputs):
        with session:
            session.backward(model(x).pow(2).mean())
            session.records()
    model.zero_grad(set_to_none=True)
    model[2] = nn.Linear(8, 2)
    with pytest.raises(GradrunnerError, match=r"its tap 2:weight names parameter 'weight' of module '2', which is an"):
        cap.__enter__()
    assert not leftover_hooks(model)
    _records_as_a_fresh_session(outputs, model, x, ["2:output"], strategy)
    del model[2]
    with pytest.raises(GradrunnerError, match=r"its tap 2:output names module '2', which the model no longer has"):
        outputs.__enter__()
    assert not leftover_hooks(model)


def test_a_model_changed_inside_the_block_is_refused_at_its_next_forward(strategy: str) -> None:
    """A tapped parameter re-assigned, its module replaced, a `load_state_dict(assign=True)` or a pruning
    reparametrisation between two steps of one block: the parameter tap kept the old Parameter and recorded
    "takes no part in the loss" (or the old one's number) while the live one got a gradient. Refused now at the
    next forward, before it runs, in one paragraph naming the tap; the step before it is recorded as a fresh
    session records it; nothing is left installed after the block."""
    import torch.nn.utils.prune as prune

    def swap_weight(m: nn.Sequential) -> None:
        m[2].weight = nn.Parameter(m[2].weight.detach() * 2)

    def swap_module(m: nn.Sequential) -> None:
        m[2] = nn.Linear(8, 2)

    def assign(m: nn.Sequential) -> None:
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)

    def pruned(m: nn.Sequential) -> None:
        prune.l1_unstructured(m[2], "weight", amount=0.5)

    for change in (swap_weight, swap_module, assign, pruned):
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
        with capture(model, ["2:output", "2:weight"], strategy=strategy) as cap:
            cap.backward(model(x).pow(2).mean())
            got = cap.records()
            weight_grad = float(model[2].weight.grad.norm())
            model.zero_grad(set_to_none=True)
            change(model)
            # a replaced module: its activation tap, hooked on the old one, is named first
            named = r"2:output names" if change is swap_module else r"2:weight names parameter 'weight' of"
            with pytest.raises(GradrunnerError, match=rf"its tap {named} module '2'"):
                model(x)
            assert all(p.grad is None for p in model.parameters()), change.__name__  # nothing ran
        if change is pruned:
            prune.remove(model[2], "weight")  # pruning's own hook, not the session's
        assert not leftover_hooks(model)
        assert float(got.stats["norm"][1]) == pytest.approx(weight_grad, rel=1e-6), change.__name__


def test_parameters_lent_by_functional_call_inside_the_block_are_no_replacement(strategy: str) -> None:
    """`torch.func.functional_call(model, dict(ema.named_parameters()), x)` (an EMA copy's metric, gradients on) puts
    the copy's Parameters in the model's slots for one call, without a registration, and puts the model's back. As
    the first forward of an entry, or after any module was built in the block, it was refused ("its tap 0:weight
    names parameter 'weight' of module '0', which is another object now (replaced)"): nothing was replaced. The
    steps are recorded, the parameter tap's norm that of `.grad`; a Parameter assigned to the slot is still refused."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    ema = copy.deepcopy(model)
    with capture(model, ["0:weight"], strategy=strategy) as cap:
        for step in range(2):
            torch.func.functional_call(model, dict(ema.named_parameters()), (x,)).pow(2).mean()  # no backward
            cap.backward(model(x * (step + 1)).pow(2).mean())
            got = cap.records()
            assert float(got.stats["norm"][0]) == pytest.approx(float(model[0].weight.grad.norm()), rel=1e-6), step
            model.zero_grad(set_to_none=True)
            nn.Linear(2, 2)  # a module built anywhere: the registration hooks ask for the check at the next step
        model[0].weight = ema[0].weight
        with pytest.raises(GradrunnerError, match=r"its tap 0:weight names parameter 'weight' of module '0'"):
            model(x)
    assert not leftover_hooks(model)


@contextmanager
def _on_conversion(flag: str) -> Iterator[None]:
    """`torch.__future__.set_<flag>_module_params_on_conversion(True)` for the block (a global of torch's)."""
    future: Any = torch.__future__
    was = getattr(future, f"get_{flag}_module_params_on_conversion")()
    getattr(future, f"set_{flag}_module_params_on_conversion")(True)
    try:
        yield
    finally:
        getattr(future, f"set_{flag}_module_params_on_conversion")(was)


def _weight_row(got: Any) -> dict[str, Any]:
    return next(row for row in (got.row(i) for i in range(len(got))) if row["tap"] == "2:weight")


def test_a_parameter_replaced_without_a_registration_is_refused(strategy: str) -> None:
    """A tapped parameter replaced by a write torch runs no registration hook for: `lin._parameters["weight"] = ...`
    (what accelerate-style offload does), `.double()` under `set_overwrite_module_params_on_conversion(True)`. The
    step ran, and the tap recorded "takes no part in the loss" (has_grad False, NaN) for the Parameter the model no
    longer holds, while the live one got a gradient (norm 1.07 for the dict write). Refused now as the step's
    backward begins (a root forward cannot tell it from `functional_call`'s lend), before any of the model's nodes
    runs, in the same paragraph; and as the block is entered again."""

    def dict_write(m: nn.Sequential) -> None:
        m[2]._parameters["weight"] = nn.Parameter(m[2].weight.detach() * 2)

    def overwrite_double(m: nn.Sequential) -> None:
        with _on_conversion("overwrite"):
            m.double()

    replaced = r"its tap 2:weight names parameter 'weight' of module '2', which is another object now \(replaced\)"
    for change in (dict_write, overwrite_double):
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
        cap = capture(model, ["2:weight", "0:output"], strategy=strategy)
        with cap:
            cap.backward(model(x).pow(2).mean())
            assert bool(_weight_row(cap.records())["has_grad"])
            model.zero_grad(set_to_none=True)
            change(model)
            x = x.to(model[0].weight.dtype)
            with pytest.raises(GradrunnerError, match="cannot run this step: " + replaced):
                cap.backward(model(x).pow(2).mean())
            assert all(p.grad is None for p in model.parameters()), change.__name__  # none of the model's nodes ran
        assert not leftover_hooks(model)
        with pytest.raises(GradrunnerError, match="cannot open: " + replaced):  # a later entry
            with cap:
                pass
        if strategy != "autograd_grad":  # the user's own backward through a forward before the write
            with capture(model, ["2:weight"], strategy=strategy):
                loss = model(x).pow(2).mean()
                change(model)
                with pytest.raises(GradrunnerError, match="cannot run this step: " + replaced):
                    loss.backward()
                assert all(p.grad is None for p in model.parameters()), change.__name__
            assert not leftover_hooks(model)


@pytest.mark.parametrize("cdata", [True, False], ids=["cdata", "fallback"])
def test_a_parameter_swapped_in_place_is_recorded(strategy: str, cdata: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.utils.swap_tensors(lin.weight, new)` keeps the Parameter object and swaps the tensor inside it (and
    its gradient accumulator): under `hook` and `retain_grad` the tap kept hooking the old accumulator and recorded
    "takes no part in the loss" (has_grad False, NaN) while the live `.grad` had norm 1.07. The held edge is taken
    again now (`torch_compat.tensor_impl`, its fallback forced too): the record is the `.grad` the step leaves, as
    after `.double()` under `set_swap_module_params_on_conversion(True)` and after `to_empty()` (no replacement)."""
    monkeypatch.setitem(torch_compat.FEATURES, "tensor_cdata", cdata)

    def swap(m: nn.Sequential) -> None:
        torch.utils.swap_tensors(m[2].weight, nn.Parameter(m[2].weight.detach() * 2))

    def swap_double(m: nn.Sequential) -> None:
        with _on_conversion("swap"):
            m.double()

    def empty(m: nn.Sequential) -> None:
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p))

    for change in (swap, swap_double, empty):
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
        with capture(model, ["2:weight", "0:output"], strategy=strategy) as cap:
            for step in range(2):
                cap.backward(model(x).pow(2).mean())
                row = _weight_row(cap.records())
                assert bool(row["has_grad"]), (change.__name__, step)
                assert row["norm"] == pytest.approx(float(model[2].weight.grad.norm()), rel=1e-6), change.__name__
                model.zero_grad(set_to_none=True)
                change(model)
                x = x.to(model[0].weight.dtype)
        assert not leftover_hooks(model)


def _double_and_back(m: nn.Module) -> None:
    m.double()
    m.float()


def _half_and_back(m: nn.Module) -> None:
    m.half()
    m.float()


def _data_double_and_back(m: nn.Module) -> None:
    for p in m.parameters():
        p.data = p.data.double()
    for p in m.parameters():
        p.data = p.data.float()


def _data_clone(m: nn.Module) -> None:
    for p in m.parameters():
        p.data = p.data.clone()


@pytest.mark.parametrize("storage", [True, False], ids=["storage", "lookup"])
@pytest.mark.parametrize("between", ["steps", "micro_batches"])
@pytest.mark.parametrize("change", [_double_and_back, _half_and_back, _data_double_and_back, _data_clone])
def test_a_cast_there_and_back_gives_a_new_accumulator_whose_gradient_is_recorded(
    strategy: str, change: Callable[[nn.Module], None], between: str, storage: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.double(); model.float()` with no forward between: torch gives each parameter a new gradient accumulator
    (`.data` set twice) while its dtype, device and tensor end as they were, so the held edge's pre-hook never fired
    again: under `hook` and `retain_grad` the taps recorded "takes no part in the loss" (has_grad False) while `.grad`
    had norm 0.815 (2:weight), and between micro-batches only the first one's gradient (0.296 for 0:weight against
    0.225). The storage replaced is seen now (its fallback forced too: the accumulator looked up at each check): each
    record's norm is the `.grad` of the same steps run without capture."""
    monkeypatch.setitem(torch_compat.FEATURES, "storage_cdata", storage)
    if change is _half_and_back and between == "micro_batches":
        pytest.skip("the cast rounds the .grad already there, not the record (README)")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    ref, taps = copy.deepcopy(model), ["0:weight", "2:weight", "2:bias"]

    def step(m: nn.Module, backward: Callable[[torch.Tensor], None], last: bool) -> None:
        for k, c in enumerate(x.chunk(2)):
            backward(m(c).pow(2).sum() / 6)
            if between == "micro_batches" and k == 0 and last:
                change(m)

    with capture(model, taps, strategy=strategy) as cap:
        for s in range(2):
            step(ref, lambda loss: loss.backward(), s == 1)
            step(model, cap.backward, s == 1)
            recs = cap.records()
            got = {r["tap"]: r for r in (recs.row(i) for i in range(len(recs)))}
            for t in taps:
                want = dict(ref.named_parameters())[t.replace(":", ".")].grad
                assert torch.equal(dict(model.named_parameters())[t.replace(":", ".")].grad, want), (s, t)
                assert bool(got[t]["has_grad"]), (s, t, got[t]["reason"])
                assert got[t]["norm"] == pytest.approx(float(want.double().norm()), rel=1e-6), (s, t)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
                if between == "steps":
                    change(m)
    assert not leftover_hooks(model)


def test_a_model_changed_between_the_forward_and_its_own_backward_is_refused_as_the_backward_begins(
    strategy: str,
) -> None:
    """A tapped parameter re-assigned, its module replaced or deleted after the forward and before the user's own
    `loss.backward()` (`hook`, `retain_grad`): the backward was recorded under the taps' names from the objects the
    model no longer holds (`2:weight` a gradient of 0.41 while the model's `2:weight.grad` stayed None), where
    `cap.backward(loss)` refuses the same step. Refused now as the backward begins, before any of the model's
    nodes runs, in the same paragraph naming the tap; the step before it keeps its records."""
    if strategy == "autograd_grad":
        pytest.skip("refuses every backward it did not run: test_engine.py")

    def swap_weight(m: nn.Sequential) -> None:
        m[2].weight = nn.Parameter(m[2].weight.detach() * 2)

    def swap_module(m: nn.Sequential) -> None:
        m[2] = nn.Linear(8, 2)

    def del_item(m: nn.Sequential) -> None:
        del m[2]

    cases = [
        (swap_weight, ["2:weight"], r"its tap 2:weight names parameter 'weight' of module '2', which is another"),
        (swap_module, ["2:output"], r"its tap 2:output names module '2', which is another module now"),
        (del_item, ["3:output"], r"its tap 3:output names module '3', which the model no longer has"),
    ]
    for change, taps, refusal in cases:
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Identity()), torch.randn(5, 4)
        params = list(model.parameters())
        with capture(model, taps, strategy=strategy) as cap:
            model(x).pow(2).mean().backward()
            got = cap.records()
            model.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            change(model)
            with pytest.raises(GradrunnerError, match=refusal):
                loss.backward()
            assert all(p.grad is None for p in params), change.__name__  # none of the model's nodes ran
        assert not leftover_hooks(model)
        assert bool(got.has_grad[0]), change.__name__  # the step before is recorded


def test_a_tapped_module_deleted_inside_the_block_is_refused_at_its_next_step(strategy: str) -> None:
    """`del model[2]`, `delattr(model, "2")` or `del model[2].weight` between two steps of one block run no
    registration hook: the parameter tap recorded "takes no part in the loss" for a Parameter the model no longer
    holds, and `3:output` recorded the renumbered module's gradient under its old path. Refused now at the next
    forward (or `cap.backward()`), before it runs, in one paragraph naming the tap; nothing left installed."""

    def del_item(m: nn.Sequential) -> None:
        del m[2]

    def del_attr(m: nn.Sequential) -> None:
        delattr(m, "2")

    def del_param(m: nn.Sequential) -> None:
        del m[2].weight

    cases = [
        (del_item, "2:weight", r"its tap 2:weight names module '2', which is another module now"),
        (del_item, "3:output", r"its tap 3:output names module '3', which the model no longer has"),
        (del_attr, "2:output", r"its tap 2:output names module '2', which the model no longer has"),
        (del_param, "2:weight", r"its tap 2:weight names parameter 'weight' of module '2', which the module no longer"),
    ]
    for change, tap, refusal in cases:
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Identity()), torch.randn(5, 4)
        with capture(model, [tap], strategy=strategy) as cap:
            cap.backward(model(x).pow(2).mean())
            got = cap.records()
            model.zero_grad(set_to_none=True)
            change(model)
            with pytest.raises(GradrunnerError, match=refusal):
                model(x)
            assert all(p.grad is None for p in model.parameters()), change.__name__  # nothing ran
            with pytest.raises(GradrunnerError, match=refusal):  # and again: not a one-off
                cap.backward(x.sum())
        assert not leftover_hooks(model)
        assert bool(got.has_grad[0]), (change.__name__, tap)  # the step before is recorded


def test_a_tapped_parameter_set_to_none_is_refused_as_deleted(strategy: str) -> None:
    """`lin.bias = None` (torch's way to drop a bias: the slot stays, holding None) runs no registration hook and
    kept the slot's name, so inside the block the step ran and the tap recorded "takes no part in the loss" for a
    parameter the model no longer has (`del lin.bias` was refused), and between entries the refusal called it
    "another object now (replaced)". Both now refuse it as deleted, before the step runs."""
    deleted = r"its tap 2:bias names parameter 'bias' of module '2', which the module no longer holds \(deleted\)"
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    cap = capture(model, ["2:bias", "0:output"], strategy=strategy)
    with cap:
        cap.backward(model(x).pow(2).mean())
        got = cap.records()
        model.zero_grad(set_to_none=True)
        model[2].bias = None
        assert "2.bias" not in dict(model.named_parameters())
        with pytest.raises(GradrunnerError, match=deleted):
            model(x)
        assert all(p.grad is None for p in model.parameters())  # nothing ran
        with pytest.raises(GradrunnerError, match=deleted):
            cap.backward(x.sum())
    assert not leftover_hooks(model)
    assert bool(got.has_grad.all())  # the step before is recorded
    with pytest.raises(GradrunnerError, match="cannot open: " + deleted):  # a later entry
        with cap:
            pass
    assert not leftover_hooks(model)


def test_a_backward_outside_the_block_is_refused_and_runs_nothing(strategy: str) -> None:
    """`cap.backward(loss)` after the block (or before the first) ran the backward with no hook installed: the
    activation tap's record said "no forward since the last backward, which freed the graph" though a forward
    had run. One paragraph now, before anything runs (no `.grad` filled); inside the block as before."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    cap = capture(model, ["0:output", "2:weight"], strategy=strategy)
    for entered in (False, True):
        if entered:
            with cap:
                cap.backward(model(x).pow(2).mean())
                assert cap.records().has_grad.all()
            model.zero_grad(set_to_none=True)
        with pytest.raises(GradrunnerError, match=r"\.backward\(\) was called outside its `with` block"):
            cap.backward(model(x).pow(2).mean())
        assert all(p.grad is None for p in model.parameters())


def test_an_entry_after_one_ended_inside_an_optimizer_step_sees_no_closure_evaluated_again(strategy: str) -> None:
    """The first entry ended inside `LBFGS.step(closure)` (its closure raised): the session still counted itself
    inside that step, and in the next entry a `zero_grad()` between two backwards was taken for LBFGS evaluating
    its closure again, dropping the first backward's rows (2 records, `micro_step` None, for 3: 0, 1, None).
    The entry records what a fresh session records."""
    x = torch.randn(5, 4)

    def model_and_session() -> tuple[nn.Module, capture]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return model, capture(model, ["0:output", "2:weight"], strategy=strategy)

    def two_backwards(model: nn.Module, cap: capture) -> Any:
        with cap:
            cap.backward(model(x).pow(2).mean())
            model.zero_grad(set_to_none=True)
            loss = model(x[:3]).pow(2).mean()
            cap.backward(loss)
            return cap.records(loss)

    want = two_backwards(*model_and_session())
    model, cap = model_and_session()
    opt = torch.optim.LBFGS(model.parameters())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        cap.backward(model(x).pow(2).mean())
        raise RuntimeError("the closure failed")

    with pytest.raises(RuntimeError, match="the closure failed"), cap:
        opt.step(closure)  # type: ignore[arg-type]
    model.zero_grad(set_to_none=True)
    got = two_backwards(model, cap)
    assert got.keys == want.keys and got.micro_step == want.micro_step == [0, 1, None]
    np.testing.assert_array_equal(got.stats["norm"], want.stats["norm"])


def test_a_closure_that_raised_inside_the_block_ends_its_optimizer_step(strategy: str) -> None:
    """`opt.step(closure)` whose closure raised, caught inside the same block: no post-hook ran, so the session
    counted itself inside that step until the next `opt.step()` returned, and the next step's `zero_grad()` between
    two backwards (a GAN's two losses) was taken for a closure evaluated again, dropping the first backward's row
    (2 records for 3). That step records what a fresh session records; a closure passed by keyword too."""
    x = torch.randn(5, 4)

    def two_backwards(failed_closure: str | None) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with capture(model, ["0:output", "2:weight"], strategy=strategy) as cap:

            def closure() -> torch.Tensor:
                cap.backward(model(x).pow(2).mean())
                raise RuntimeError("the closure failed")

            if failed_closure is not None:
                with pytest.raises(RuntimeError, match="the closure failed"):
                    opt.step(closure=closure) if failed_closure == "keyword" else opt.step(closure)  # type: ignore[func-returns-value]
                cap.records()
                model.zero_grad(set_to_none=True)
            cap.backward(model(x).pow(2).mean())
            model.zero_grad(set_to_none=True)
            loss = model(x[:3]).pow(2).mean()
            cap.backward(loss)
            opt.step()
            return cap.records(loss)

    want = two_backwards(None)
    for how in ("positional", "keyword"):
        got = two_backwards(how)
        assert got.keys == want.keys and got.micro_step == want.micro_step == [0, 1, None], how
        np.testing.assert_array_equal(got.stats["norm"], want.stats["norm"])


def test_a_session_whose_entry_failed_is_not_open_and_enters_again(strategy: str) -> None:
    """An entry that raised while installing (an edited parameter frozen after the session was made: torch refuses
    its hook) left the session marked open, nothing of it installed: entered again once the cause was fixed, it was
    refused as 'open already: a session is entered once at a time', which it was not. It enters and records: the
    edited tap's norm is that of the gradient before the edit, `.grad` the edited one (scale 0.5)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), torch.randn(5, 4)
    cap = capture(model, ["0:weight"], strategy=strategy, edits=[{"tap": "0:weight", "scale": 0.5}])
    model[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError), cap:
        pass
    assert not leftover_hooks(model)
    model[0].weight.requires_grad_(True)
    want = torch.autograd.grad(model(x).pow(2).mean(), model[0].weight)[0]
    with cap:
        cap.backward(model(x).pow(2).mean())
        recs = cap.records()
    assert recs.keys == [TapKey("0", "weight", 0)]
    np.testing.assert_allclose(recs.stats["norm"], [float(want.norm())], rtol=1e-6)
    torch.testing.assert_close(model[0].weight.grad, want * 0.5)
    assert not leftover_hooks(model)


class _NanGuardSGD(torch.optim.SGD):
    """SGD that refuses a non-finite gradient, raising in `step()` itself (no closure): as a GradScaler-style check."""

    def step(self, closure: Any = None) -> Any:
        if any(p.grad is not None and not torch.isfinite(p.grad).all() for g in self.param_groups for p in g["params"]):
            raise FloatingPointError("non-finite gradient")
        return super().step(closure)


def test_an_optimizer_step_that_raised_outside_a_closure_leaves_no_step_running(strategy: str) -> None:
    """`opt.step()` raising outside any closure (an optimizer refusing a NaN), caught inside the block: no post-hook
    ran, so the session counted itself inside that step until the next `step()` returned, and the next step's
    `zero_grad()` between two backwards (PCGrad's tasks, each gradient alone) was taken for a closure evaluated again,
    dropping the first backward's rows (1 record, `micro_step` None, for 2: 0 and 1). That step records what a fresh
    session records."""
    x = torch.randn(6, 4)

    def two_tasks(nan_step_first: bool) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = _NanGuardSGD(model.parameters(), lr=0.1)
        with capture(model, ["0:output", "2:weight"], strategy=strategy) as cap:
            if nan_step_first:
                cap.backward(model(x * float("nan")).sum())
                with pytest.raises(FloatingPointError, match="non-finite gradient"):
                    opt.step()
                opt.zero_grad()
                cap.records()
            out = model(x)
            first, second = out[:, 0].pow(2).mean(), out[:, 1].abs().mean()
            cap.backward(first, retain_graph=True)
            opt.zero_grad()
            cap.backward(second)
            opt.step()
            return cap.records(first + second)

    want = two_tasks(False)
    got = two_tasks(True)
    assert want.micro_step == [0, 1, None]
    assert got.keys == want.keys and got.micro_step == want.micro_step
    np.testing.assert_array_equal(got.stats["norm"], want.stats["norm"])


def test_a_session_entered_inside_its_own_block_is_refused_and_records_each_call_once(strategy: str) -> None:
    """`with cap:` inside `with cap:` installed every hook a second time: one forward recorded `0:output` as calls 0
    and 1 (the same gradient twice), and leaving the inner block closed the outer one. Refused now before anything
    is touched: the outer block records one call, as plain tensor hooks see it."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    seen: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, i, out: out.register_hook(seen.append) and None)
    with capture(model, ["0:output"], strategy=strategy) as cap:
        with pytest.raises(GradrunnerError, match=r"is open already: a session is entered once at a time"):
            cap.__enter__()
        cap.backward(model(x).pow(2).mean())
        recs = cap.records()
    handle.remove()
    assert recs.keys == [TapKey("0", "output", 0)] and len(seen) == 1
    np.testing.assert_allclose(recs.stats["norm"], [float(seen[0].double().norm())], rtol=1e-6)
    assert not leftover_hooks(model)


def test_grads_of_a_session_that_keeps_none_are_refused_not_none(strategy: str) -> None:
    """`capture(..., keep_grads=False)` keeps statistics only, yet `cap.grads["fc1:output"]` answered None, which
    `Grads` and the README give as "the tap took no part in the loss", for a tap whose gradient (norm 0.2 here, the
    record's) did arrive. Reading `cap.grads` of such a session is now one paragraph naming `keep_grads`; its
    records are as before, and a session that keeps gradients gives them as a plain tensor hook sees them."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    seen: list[torch.Tensor] = []
    plain = copy.deepcopy(model)
    out = plain[0](x)
    out.register_hook(seen.append)
    plain[2](plain[1](out)).pow(2).mean().backward()
    for keep in (False, True):
        with capture(model, ["0:output", "2:weight"], strategy=strategy, keep_grads=keep) as cap:
            cap.backward(model(x).pow(2).mean())
            rec = cap.records()
        assert float(rec.stats["norm"][0]) == pytest.approx(float(seen[0].norm()), rel=1e-6)
        assert list(cap.grads) == ["0:output", "2:weight"]  # the taps are listed either way
        if keep:
            torch.testing.assert_close(cap.grads["0:output"], seen[0])
            torch.testing.assert_close(cap.grads["2:weight"], plain[2].weight.grad)
        else:
            for read in (
                lambda: cap.grads["0:output"],
                lambda: cap.grads["2:weight", 0],
                lambda: cap.grads.calls("0:output"),
            ):
                with pytest.raises(GradrunnerError, match=r"keep_grads=False.*keep_grads=True"):
                    read()
        model.zero_grad(set_to_none=True)


class _TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin(x)
        return torch.tanh(hidden)


class _ReluBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.lin(x)
        return torch.relu(pre)


def _records_as_a_fresh_session(cap: Any, model: nn.Module, x: torch.Tensor, taps: list[str], strategy: str) -> None:
    """Entered again, `cap` records one step of `model` on `x` as a new session on `taps` records it (with gradients)."""
    with capture(model, taps, strategy=strategy) as fresh:
        fresh.backward(model(x).pow(2).mean())
        want = fresh.records()
    model.zero_grad(set_to_none=True)
    with cap:
        cap.backward(model(x).pow(2).mean())
        got = cap.records()
    assert got.keys == want.keys and got.has_grad.all()
    np.testing.assert_array_equal(got.stats["norm"], want.stats["norm"])


def test_a_session_entered_again_after_a_tapped_local_left_its_module_is_refused(strategy: str) -> None:
    """`blk:hidden` tapped, then `blk` replaced between two entries by a module whose forward() assigns no `hidden`:
    the entry was taken, and every step recorded `not assigned in this step (module not called, ...)` though the
    module ran and its forward() has no such variable, where a new session refuses the tap. The entry is refused
    now, naming the tap, nothing installed; a replacement that assigns the local records what a new session does."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), _TanhBlock(), nn.Linear(4, 2)), torch.randn(5, 3)
    cap = capture(model, ["1:hidden", "1:output"], strategy=strategy)
    with cap:
        cap.backward(model(x).pow(2).mean())
        assert cap.records().has_grad.all()
    model.zero_grad(set_to_none=True)
    model[1] = _ReluBlock()
    with pytest.raises(GradrunnerError, match=r"no 'hidden'"):
        capture(model, ["1:hidden"], strategy=strategy)  # what a new session says
    with pytest.raises(GradrunnerError, match=r"its tap 1:hidden names local 'hidden' of module '1', whose forward"):
        cap.__enter__()
    assert not leftover_hooks(model)
    model[1] = _TanhBlock()  # assigns `hidden` again: taken, as a new session would take it
    _records_as_a_fresh_session(cap, model, x, ["1:hidden", "1:output"], strategy)
    assert not leftover_hooks(model)


def test_a_session_whose_entry_was_refused_is_closed_not_left_open(strategy: str) -> None:
    """An entry refused after its first checks (here: a local another open session already taps) left the session
    marked open: `cap.backward(loss)` outside any block was not refused and recorded every tap as 'no forward since
    the last backward', and `with cap:` once the other session closed was refused as 'open already'. The refused
    entry now leaves it closed: the backward is refused, running nothing, and a later entry records what a new
    session records."""
    if strategy == "autograd_grad":  # refused beside the other session before its locals are looked at
        pytest.skip("autograd_grad is refused beside another session on the model as it opens")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), _TanhBlock(), nn.Linear(4, 2)), torch.randn(5, 3)
    cap = capture(model, ["1:hidden", "0:output"], strategy=strategy)
    with capture(model, ["1:hidden"], strategy=strategy):
        with pytest.raises(GradrunnerError, match=r"already has its locals \['hidden'\] tapped by another open"):
            cap.__enter__()
    assert not leftover_hooks(model)
    with pytest.raises(GradrunnerError, match=r"\.backward\(\) was called outside its `with` block"):
        cap.backward(model(x).pow(2).mean())
    assert all(p.grad is None for p in model.parameters())
    _records_as_a_fresh_session(cap, model, x, ["1:hidden", "0:output"], strategy)
    assert not leftover_hooks(model)
