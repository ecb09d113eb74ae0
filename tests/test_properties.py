"""Property-based tests: random small MLPs and conv nets (depths, widths, kernel sizes, strides,
padding, pooling, activations, in-place flags, biases) with random tap sets (module outputs and
inputs, parameters, the root's input and output). For every draw, in float64:

- the strategies agree with each other, tap by tap and call by call, leave `.grad` as a plain
  `loss.backward()` would, and leave no hooks behind;
- each tap's gradient agrees with central finite differences (`finite_diff.py`, no gradrunner code).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from conftest import leftover_hooks
from finite_diff import Point, central_diff, input_point, output_point, param_point
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradrunner import capture
from gradrunner.capturing.strategies import STRATEGIES

#: Activations, and whether each has an in-place form.
ACTIVATIONS: dict[str, tuple[Callable[..., nn.Module], bool]] = {
    "relu": (nn.ReLU, True),
    "leaky_relu": (nn.LeakyReLU, True),
    "elu": (nn.ELU, True),
    "hardtanh": (nn.Hardtanh, True),
    "silu": (nn.SiLU, True),
    "tanh": (nn.Tanh, False),
    "sigmoid": (nn.Sigmoid, False),
    "gelu": (nn.GELU, False),
    "softplus": (nn.Softplus, False),
}
#: Differentiable everywhere (ELU with alpha=1 is C1): finite differences are exact to O(eps) at any point.
#: The others have kinks, and ReLU zeros reach them exactly (no bias, or a max-pool tie): agreement only.
SMOOTH = ("elu", "silu", "tanh", "sigmoid", "gelu", "softplus")
LAYERS: dict[str, Callable[..., nn.Module]] = {
    "linear": nn.Linear, "conv": nn.Conv2d, "maxpool": nn.MaxPool2d, "avgpool": nn.AvgPool2d, "flatten": nn.Flatten,
}  # fmt: skip
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RTOL_FD, ATOL_FD = 1e-5, 1e-7
Layer = tuple[str, str, dict[str, Any]]  # (module name, kind, keyword arguments)


@dataclass
class Net:
    """A drawn network, its input shape and its taps; the repr of a failing example names every choice."""

    layers: list[Layer]
    input_shape: tuple[int, ...]
    taps: list[str]
    seed: int

    def build(self) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        torch.manual_seed(self.seed)
        modules: OrderedDict[str, nn.Module] = OrderedDict()
        for name, kind, kwargs in self.layers:
            if kind in ACTIVATIONS:
                factory, has_inplace = ACTIVATIONS[kind]
                modules[name] = factory(**kwargs) if has_inplace else factory()
            else:
                modules[name] = LAYERS[kind](**kwargs)
        model = nn.Sequential(modules).double()
        x = torch.randn(self.input_shape, dtype=torch.float64)
        with torch.no_grad():
            target = torch.randn_like(model(x.clone()))
        return model, x, target


def _activation(draw: st.DrawFn, i: int, smooth: bool) -> Layer:
    name = draw(st.sampled_from(SMOOTH if smooth else sorted(ACTIVATIONS)))
    return f"act{i}", name, {"inplace": draw(st.booleans())}


def mlp_layers(draw: st.DrawFn, smooth: bool) -> tuple[list[Layer], tuple[int, ...]]:
    width = first = draw(st.integers(1, 4))
    layers: list[Layer] = []
    for i in range(1, draw(st.integers(0, 3)) + 1):
        out = draw(st.integers(1, 5))
        layers += [(f"fc{i}", "linear", {"in_features": width, "out_features": out, "bias": draw(st.booleans())}),
                   _activation(draw, i, smooth)]  # fmt: skip
        width = out
    layers.append(("head", "linear", {"in_features": width, "out_features": draw(st.integers(1, 3))}))
    return layers, (draw(st.integers(1, 3)), first)


def conv_layers(draw: st.DrawFn, smooth: bool) -> tuple[list[Layer], tuple[int, ...]]:
    channels, size = draw(st.integers(1, 2)), draw(st.integers(3, 6))
    shape = (draw(st.integers(1, 2)), channels, size, size)
    layers: list[Layer] = []
    for i in range(1, draw(st.integers(1, 2)) + 1):
        k = draw(st.integers(1, min(3, size)))
        pad, stride, out = draw(st.integers(0, k // 2)), draw(st.sampled_from([1, 1, 2])), draw(st.integers(1, 3))
        conv = {"in_channels": channels, "out_channels": out, "kernel_size": k, "stride": stride, "padding": pad,
                "bias": draw(st.booleans())}  # fmt: skip
        layers += [(f"conv{i}", "conv", conv), _activation(draw, i, smooth)]
        size, channels = (size + 2 * pad - k) // stride + 1, out
        if size >= 2 and draw(st.booleans()):
            pools = ["avgpool"] if smooth else ["maxpool", "avgpool"]
            layers.append((f"pool{i}", draw(st.sampled_from(pools)), {"kernel_size": 2}))
            size //= 2
    head = {"in_features": channels * size * size, "out_features": draw(st.integers(1, 3))}
    layers += [("flat", "flatten", {}), ("head", "linear", head)]
    return layers, shape


def tap_candidates(model: nn.Module) -> list[str]:
    found = [":input", ":output"]
    for path, module in model.named_modules():
        if path:
            found += [f"{path}:output", f"{path}:input"]
            found += [f"{path}:{name}" for name, _ in module.named_parameters(recurse=False)]
    return found


@st.composite
def nets(draw: st.DrawFn, kind: str, smooth: bool = False) -> Net:
    layers, shape = (mlp_layers if kind == "mlp" else conv_layers)(draw, smooth)
    net = Net(layers, shape, [], draw(st.integers(0, 2**16)))
    candidates = tap_candidates(net.build()[0])
    net.taps = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=6, unique=True))
    return net


def half_sse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - target) ** 2).sum()


def captured(net: Net, strategy: str) -> tuple[dict[str, list[torch.Tensor | None]], list[torch.Tensor | None]]:
    """Every tap's gradients (per call) and every parameter's `.grad` after one captured step."""
    model, x, target = net.build()
    with capture(model, net.taps, strategy=strategy) as cap:
        cap.backward(half_sse(model(x), target))
    assert leftover_hooks(model) == []
    assert not x.requires_grad
    return {tap: cap.grads.calls(tap) for tap in net.taps}, [p.grad for p in model.parameters()]


def check_strategies_agree(net: Net) -> None:
    model, x, target = net.build()
    half_sse(model(x), target).backward()
    plain = [p.grad for p in model.parameters()]
    results = {name: captured(net, name) for name in STRATEGIES}
    ref_grads, _ = results["hook"]
    for name, (grads, param_grads) in results.items():
        for tap in net.taps:
            assert len(grads[tap]) == len(ref_grads[tap]) == 1, (name, tap)
            got, want = grads[tap][0], ref_grads[tap][0]
            assert got is not None and want is not None, (name, tap)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{name} {tap}")
        for got, want in zip(param_grads, plain, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{name} .grad")


def fd_point(model: nn.Module, tap: str, loss: Callable[[], torch.Tensor]) -> Point:
    path, name = tap.split(":")
    if name == "output":
        return output_point(model, path, loss)
    if name == "input":
        return input_point(model, path, loss)
    return param_point(getattr(dict(model.named_modules())[path], name), loss)


def check_finite_differences(net: Net, strategy: str) -> None:
    grads, _ = captured(net, strategy)
    model, x, target = net.build()
    for tap in net.taps:
        approx = central_diff(fd_point(model, tap, lambda: half_sse(model(x), target)))
        got = grads[tap][0]
        assert got is not None, tap
        torch.testing.assert_close(got, approx, rtol=RTOL_FD, atol=ATOL_FD, msg=f"{strategy} {tap}")


@SETTINGS
@given(net=nets("mlp"))
def test_strategies_agree_on_random_mlps(net: Net) -> None:
    check_strategies_agree(net)


@SETTINGS
@given(net=nets("conv"))
def test_strategies_agree_on_random_convnets(net: Net) -> None:
    check_strategies_agree(net)


@SETTINGS
@given(net=nets("mlp", smooth=True), strategy=st.sampled_from(sorted(STRATEGIES)))
def test_random_mlps_match_finite_differences(net: Net, strategy: str) -> None:
    check_finite_differences(net, strategy)


@SETTINGS
@given(net=nets("conv", smooth=True), strategy=st.sampled_from(sorted(STRATEGIES)))
def test_random_convnets_match_finite_differences(net: Net, strategy: str) -> None:
    check_finite_differences(net, strategy)
