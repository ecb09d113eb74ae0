"""`per_example_conv.ConvShare`: its three exact ways (ghost, im2col, rows as groups) against each other and a loop.

Each way computes the same sums in a different order, so they agree to float32 rounding (rtol 1e-5);
the per-row weight gradients of a convolution, taken one row at a time by autograd, are the reference.
"""

from __future__ import annotations

import pytest
import torch
from per_example_reference import B, all_params, assert_matches, batched, loop, sq_loss
from torch import nn

from gradrunner.capturing import per_example_conv as pec
from gradrunner.capturing import per_example_math as pem
from gradrunner.capturing.per_example import OUTSIDE, PerExampleNorms

CONVS = {
    "2d_reflect_groups": (lambda: nn.Conv2d(16, 6, 3, padding=1, groups=2, padding_mode="reflect"), (B, 16, 12, 12)),
    "1d_dilated_stride": (lambda: nn.Conv1d(8, 3, 5, stride=2, dilation=2, padding=3), (B, 8, 300)),
    "3d_same": (lambda: nn.Conv3d(8, 2, 3, padding="same"), (B, 8, 6, 6, 4)),
    "2d_first_layer": (lambda: nn.Conv2d(3, 4, 3, padding=1), (B, 3, 12, 12)),
    "2d_same_even_kernel": (lambda: nn.Conv2d(8, 3, 4, padding="same", dilation=2), (B, 8, 12, 13)),
}


def per_row_grads(conv: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Row i's weight gradient for output gradient g[i], by autograd on row i alone: (B, weight numel)."""
    rows = []
    for i in range(x.shape[0]):
        conv.zero_grad(set_to_none=True)
        conv(x[i : i + 1]).backward(g[i : i + 1])
        rows.append(conv.weight.grad.reshape(-1).clone())
    return torch.stack(rows)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", sorted(CONVS))
def test_every_way_agrees_with_autograd_per_row(name: str) -> None:
    make, shape = CONVS[name]
    conv = make()
    x = torch.randn(shape)
    g = torch.randn(conv(x).shape)
    ref = per_row_grads(conv, x, g)
    form = pec.ConvShare(conv, x, g, torch.float32)
    atol = 1e-5 * float(ref.abs().max())  # sums over hundreds of positions: rounding of their terms
    torch.testing.assert_close(form.dense(0, B), ref, rtol=1e-5, atol=atol)
    torch.testing.assert_close(pem.to_dense(form.factors()), ref, rtol=1e-5, atol=atol)
    want = ref.double().square().sum(1)
    for ghost, grouped in ((True, False), (False, False), (False, True)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pem, "ghost_is_cheaper", lambda f, ghost=ghost: ghost)
            mp.setattr(pec, "GROUPED_MIN_CHANNELS", 1 if grouped else 10**9)
            torch.testing.assert_close(form.self_sq().double(), want, rtol=1e-5, atol=1e-6 * float(want.max()))
    u, v = torch.randn(conv.weight.shape[0]), torch.randn(conv.weight[0].numel())
    terms = ref * torch.outer(u, v).reshape(-1)
    for grouped in (False, True):  # through the patches, and from the rows (their norms kept for self_sq)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pec, "GROUPED_MIN_CHANNELS", 1 if grouped else 10**9)
            form = pec.ConvShare(conv, x, g, torch.float32)
            got = form.project(u, v)
            torch.testing.assert_close(got.sum(), terms.sum(), rtol=1e-4, atol=1e-5 * float(terms.abs().sum()))
            torch.testing.assert_close(form.self_sq().double(), want, rtol=1e-5, atol=1e-6 * float(want.max()))


class TwiceConv(nn.Module):
    """One Conv2d used twice per forward: its rows' shares materialised and summed (cross terms included)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Conv2d(channels, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))))


@pytest.mark.parametrize("shape", [(B, 3, 5, 5), (B, 8, 12, 12)])
def test_a_conv_called_twice(shape: tuple[int, ...]) -> None:
    """Small channels (im2col) and >= 8 channels at 144 positions (rows as groups of one convolution)."""
    model = TwiceConv(shape[1])
    x = torch.randn(shape)
    params = all_params(model)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, loop(model, {"x": x}, sq_loss, params)[0], reasons)


def test_the_rule_takes_the_grouped_convolution_only_with_channels_and_positions() -> None:
    def form(c_in: int, side: int, c_out: int = 4) -> pec.ConvShare:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        return pec.ConvShare(conv, torch.zeros(1, c_in, side, side), torch.zeros(1, c_out, side, side), torch.float32)

    assert form(8, 12).way() == "grouped" and form(3, 32).way() == form(8, 8).way() == "im2col"
    assert form(128, 4, 128).way() == "ghost"  # 16 positions, 128 channels: T (p + q) <= p q


@pytest.mark.parametrize("shape", [(B, 3, 6, 6), (B, 8, 12, 12)])
def test_a_conv_weight_also_used_outside_its_calls_gets_none(shape: tuple[int, ...]) -> None:
    """The check catches a weight penalty on a convolution, whichever way (im2col, grouped) its rows are computed."""
    model = TwiceConv(shape[1])
    params = all_params(model)
    with PerExampleNorms(model, params) as pex:
        (model(torch.randn(shape)).square().mean() + 1e-3 * model.conv.weight.square().sum()).backward()
        norms, reasons = pex.norms(), pex.reasons()
    assert norms["conv:weight"] is None and reasons["conv:weight"] == OUTSIDE
    assert norms["conv:bias"] is not None and norms["head:weight"] is not None
