"""Losses the built-in experiments need beyond `torch.nn`'s (config group `loss`).

| class | option | loss |
| --- | --- | --- |
| `HalfSumSquaredError` | `loss=half_sse` | `0.5 * sum((output - target) ** 2)` |
| `ModelLoss` | `loss=model_loss` | the output's own `.loss` (HuggingFace models given `labels`) |
| `LMCrossEntropy` | `loss=lm_cross_entropy` | cross-entropy of the flattened `logits` against the labels |

`ELEMENTWISE` names the losses (torch's and these) whose targets must have the output's shape.

Example::

    loss = ModelLoss()(gpt2(**batch), labels)     # == gpt2(**batch).loss
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradrunner.errors import GradrunnerError


def _field(output: Any, name: str, option: str) -> Any:
    """`output.<name>` (a ModelOutput attribute or a dict key), or a GradrunnerError saying what it holds."""
    value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
    if value is None:
        have = ", ".join(repr(k) for k in output) if isinstance(output, Mapping) else type(output).__name__
        hint = (
            " (give the model labels: data=tokens keeps them in its keyword arguments, data.labels_in_inputs=true)"
            if name == "loss" else ""
        )  # fmt: skip
        raise GradrunnerError(
            f"loss={option} needs the model's output to have .{name}, but it is {have}{hint}; pick a loss that "
            "takes what the model returns (loss=mse, loss=lm_cross_entropy, loss._target_=<your loss>)"
        )
    return value


class HalfSumSquaredError(nn.Module):
    """`0.5 * sum((output - target) ** 2)`, summed (not averaged) over every element.

    Example::

        loss = HalfSumSquaredError()(torch.tensor([[0.8], [0.3]]), torch.tensor([[1.0], [0.0]]))
        # 0.5 * (0.04 + 0.09) = 0.065; d loss / d output = output - target
    """

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * (output - target).pow(2).sum()


class ModelLoss(nn.Module):
    """The model's own loss: `output.loss` (a HuggingFace model called with `labels`); the targets are unused.

    Example::

        ModelLoss()(model(input_ids=ids, labels=ids), ids)   # == model(input_ids=ids, labels=ids).loss
    """

    def forward(self, output: Any, target: Any = None) -> torch.Tensor:
        loss: torch.Tensor = _field(output, "loss", "model_loss")
        return loss


class LMCrossEntropy(nn.Module):
    """Cross-entropy of `logits` (the output's `.logits`, or the output itself) against integer labels, flattened.

    Example::

        LMCrossEntropy()(torch.randn(2, 8, 100), torch.randint(0, 100, (2, 8)))   # logits (B, T, V), labels (B, T)
        LMCrossEntropy(shift=True)(gpt2(**batch), labels)  # next-token prediction, as the model's own loss

    `shift=True` predicts token t+1 from position t (causal language models); labels equal to
    `ignore_index` take no part.
    """

    def __init__(self, shift: bool = False, ignore_index: int = -100) -> None:
        super().__init__()
        self.shift, self.ignore_index = shift, ignore_index

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = output if isinstance(output, torch.Tensor) else _field(output, "logits", "lm_cross_entropy")
        if self.shift:
            logits, target = logits[..., :-1, :], target[..., 1:]
        if logits.shape[:-1] != target.shape:
            raise GradrunnerError(
                f"loss=lm_cross_entropy: logits of shape {tuple(logits.shape)} do not fit labels of shape "
                f"{tuple(target.shape)}; the logits need one more (vocabulary) dimension than the labels"
            )
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)), target.reshape(-1), ignore_index=self.ignore_index
        )


#: Losses that compare the output with the targets element by element: the targets must have the output's shape.
#: Torch broadcasts two shapes that differ (targets (32,) against an output (32, 1) give a (32, 32) loss, wrong, with
#: at most a warning), so `run.guards.forward_loss` refuses that at the first step.
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.SoftMarginLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
    HalfSumSquaredError,
)  # fmt: skip


def output_hint(output: Any) -> str | None:
    """For a loss that failed on a model output that is not a tensor: the loss option that fits it, or None.

    Example::

        output_hint(vit(pixel_values=x, labels=y))    # 'the output has its own .loss: loss=model_loss ...'
    """
    def get(name: str) -> Any:
        return output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)

    name = type(output).__name__
    if isinstance(get("loss"), torch.Tensor):
        return f"the output ({name}) has its own .loss: use loss=model_loss"
    logits = get("logits")
    if isinstance(logits, torch.Tensor):
        return (f"the output ({name}) holds .logits {tuple(logits.shape)}: give the model labels in its inputs and use "
                "loss=model_loss, or loss=lm_cross_entropy for token labels (it takes .logits)")  # fmt: skip
    return None
