"""Targets of another shape than the output: an elementwise loss would broadcast them, and is refused at step 0.

`run.guards.forward_loss` refuses the losses of `losses.ELEMENTWISE` (torch's MSELoss, L1Loss, ..., and
`half_sse`) on targets whose shape differs from the output's, and any loss torch warns about ("Using a
target size ...") at step 0. A loss of the user's that broadcasts on purpose, without that warning, is
left alone, and other warnings a loss raises pass on. The runner's cases (records left, the app's exit
status) are rows of `tests/test_errors.py`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradrunner.errors import GradrunnerError
from gradrunner.losses import HalfSumSquaredError
from gradrunner.run.guards import forward_loss

X, Y_ROWS = torch.randn(4, 3), torch.randn(4)  # targets (4,) against an output (4, 1)


def loss_of(loss_fn: object, y: torch.Tensor, step: int = 0) -> torch.Tensor:
    return forward_loss(nn.Linear(3, 1), loss_fn, X, y, step, model_name="nn.Linear", loss_name="the loss")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "loss_fn", [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(), nn.HuberLoss(), HalfSumSquaredError()]
)
@pytest.mark.parametrize("step", [0, 3])
def test_an_elementwise_loss_on_targets_of_another_shape_is_refused(loss_fn: nn.Module, step: int) -> None:
    with pytest.raises(GradrunnerError) as info:
        loss_of(loss_fn, Y_ROWS, step)
    message = str(info.value)
    assert message.startswith(f"step {step} failed in the loss: the loss cannot take the model's output, (4, 1) float32, "
                              "with targets (4,) float32: their shapes differ")  # fmt: skip
    assert "broadcast them to (4, 4)" in message and "check data.* target shapes" in message
    assert "\n" not in message


def test_the_same_targets_in_the_output_s_shape_are_taken() -> None:
    assert loss_of(nn.MSELoss(), Y_ROWS.unsqueeze(1)).shape == ()


def test_a_loss_that_broadcasts_on_purpose_without_torch_s_warning_is_taken() -> None:
    """A loss of the user's against the targets' mean, say: not elementwise, no warning, no refusal."""
    assert loss_of(lambda out, y: (out - y.mean()).pow(2).mean(), Y_ROWS).shape == ()


def test_torch_s_warning_is_refused_at_step_0_and_other_warnings_pass_on() -> None:
    def warns(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        warnings.warn("something else", UserWarning, stacklevel=1)
        return nn.functional.mse_loss(out, y)

    with pytest.warns(UserWarning, match="something else"), pytest.raises(GradrunnerError, match="torch warned"):
        loss_of(warns, Y_ROWS)
    with pytest.warns(UserWarning, match="something else"):
        loss_of(warns, Y_ROWS.unsqueeze(1))
