"""Forward-mode AD (`torch.autograd.forward_ad`) through a captured model gives the tangents it gives without capture.

An input tap on a tensor that does not require grad hands the model an alias that does (`input_alias`), and an edited
tap hands it the value through an edit node: both are custom `autograd.Function`s, which dropped a dual input's
tangent (the model's JVP became None) or raised `NotImplementedError` (no `jvp`). A JVP inside a training forward is
real use (a PINN's directional derivatives, a JVP regulariser, forward gradients). The reference is the same model
without gradrunner; the tap's gradient is checked against `torch.autograd.grad`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from gradrunner import capture

STRATEGIES = ["hook", "retain_grad", "autograd_grad"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _x() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


def _jvp(model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    with fwAD.dual_level():
        return fwAD.unpack_dual(model(fwAD.make_dual(x, torch.ones_like(x)))).tangent


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("taps", "edits"),
    [
        (["0:input"], None),
        ([":input"], None),
        (["2:input"], [{"tap": "2:input", "scale": 0.5}]),
        (["0:output"], [{"tap": "0:output", "clip_norm": 0.1}]),
    ],
)
def test_a_jvp_through_tapped_and_edited_values_is_as_without_capture(
    strategy: str, taps: list[str], edits: list[dict[str, Any]] | None
) -> None:
    model, x = _model(), _x()
    want = _jvp(model, x)
    assert want is not None
    with capture(model, taps, strategy=strategy, edits=edits):
        got = _jvp(model, x)
    assert got is not None
    assert torch.equal(got, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_input_tap_records_its_gradient_in_a_forward_that_takes_a_jvp(strategy: str) -> None:
    """The model adds its own JVP to the loss: the tangent must flow, and the tap's gradient is d loss / d x."""
    model, x = _model(), _x()

    def loss_of(inp: torch.Tensor) -> torch.Tensor:
        with fwAD.dual_level():
            out = model(fwAD.make_dual(inp, torch.ones_like(inp)))
            primal, tangent = fwAD.unpack_dual(out)
        return primal.pow(2).sum() + tangent.pow(2).sum()

    xr = x.clone().requires_grad_()
    want = torch.autograd.grad(loss_of(xr), xr)[0]
    model.zero_grad()
    with capture(model, ["0:input"], strategy=strategy, values="full") as cap:
        loss = loss_of(x)
        cap.backward(loss)
        rec = cap.records(loss).row(0)
    assert rec["has_grad"]
    torch.testing.assert_close(cap.grads["0:input"], want, rtol=1e-6, atol=1e-7)
    assert rec["norm"] == pytest.approx(want.double().norm().item(), rel=1e-6)
