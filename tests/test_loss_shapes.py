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


class Flaky:
    """A loss of the user's that works, then raises an error of its own (not about what it is given)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 6:
            raise ValueError("lost connection to the metrics server")
        return nn.functional.mse_loss(out, y)


def test_an_error_of_the_loss_s_own_is_named_not_told_as_shapes() -> None:
    """It was "the loss cannot take the model's output ... check data.* target shapes" for shapes the loss had taken
    at steps 0-4, equal to the output's."""
    flaky, y = Flaky(), Y_ROWS.unsqueeze(1)
    for step in range(5):
        assert loss_of(flaky, y, step).shape == ()
    with pytest.raises(GradrunnerError) as info:
        loss_of(flaky, y, 5)
    assert str(info.value) == (
        "step 5 failed in the loss: the loss raised ValueError: lost connection to the metrics server (given the "
        "model's output, (4, 1) float32, and targets (4, 1) float32). Check the loss (loss._target_ and its loss.* "
        "keys); HYDRA_FULL_ERROR=1 shows the traceback."
    )


@pytest.mark.parametrize(
    ("loss_fn", "y", "says"),
    [
        (nn.CrossEntropyLoss(), torch.randn(4), "expected target dtype to be Long"),
        (nn.CrossEntropyLoss(), torch.zeros(5, dtype=torch.long), "Expected input batch_size (4) to match target"),
        (nn.NLLLoss(), torch.zeros(4, 3), "0D or 1D target tensor expected"),
        (nn.BCEWithLogitsLoss(), torch.zeros(4, 3, dtype=torch.long), "can't be cast to the desired output type Long"),
    ],
)
def test_torch_s_shape_and_dtype_errors_are_told_as_the_targets(loss_fn: nn.Module, y: torch.Tensor, says: str) -> None:
    with pytest.raises(GradrunnerError) as info:
        forward_loss(nn.Linear(3, 3), loss_fn, X, y, 3, model_name="nn.Linear", loss_name="the loss")
    message = str(info.value)
    assert message.startswith("step 3 failed in the loss: the loss cannot take the model's output, (4, 3) float32")
    assert says in message and "To fix it, check data.* target shapes" in message
