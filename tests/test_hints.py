"""Hints where a tap or a loss meets an HF-style output: tuple outputs, attention weights that are None, ModelOutputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradrunner import capture
from gradrunner.errors import GradrunnerError
from gradrunner.run.guards import forward_loss


class Block(nn.Module):
    """An attention block: `attn` returns a tuple (output, weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x)
        return out


class NoWeights(nn.Module):
    """Returns (output, None), as HF attention does for its weights under SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.lin(x), None


def test_a_tuple_output_tapped_by_a_glob_names_its_elements_in_the_reason() -> None:
    model, x = Block(), torch.randn(2, 3, 4)
    out = model.attn(x, x, x)  # plain torch: what the tapped output is
    elements = [f"attn:output.{i}" for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    assert elements == ["attn:output.0", "attn:output.1"]
    with capture(model, ["att*:output"], strategy="hook") as cap:
        loss = model(x).sum()
        cap.backward(loss)
        recs = cap.records(loss)
    (i,) = [k for k, key in enumerate(recs.keys) if key.tap == "attn:output"]
    assert not recs.has_grad[i]
    assert recs.reason[i] == f"not a tensor (a tuple); tap one of its elements instead: {', '.join(elements)}"


def test_attention_weights_that_are_none_point_to_eager_attention() -> None:
    model = nn.Sequential()
    model.add_module("attn", NoWeights())
    with pytest.raises(GradrunnerError, match=r"tap 'attn:output\.1' cannot carry a gradient: its value is a NoneType.*"
                                              r'attn_implementation="eager"'), capture(model, ["attn:output.1"]):  # fmt: skip
        model(torch.randn(2, 4))


class Output(dict):  # type: ignore[type-arg]
    """What a HuggingFace classifier returns (a ModelOutput is a dict with attributes)."""

    def __getattr__(self, name: str) -> object:
        return self.get(name)


@pytest.mark.parametrize(("fields", "says"), [
    ({"loss": torch.tensor(1.0), "logits": torch.randn(2, 3)}, "the output (Output) has its own .loss: use loss=model_loss"),
    ({"logits": torch.randn(2, 3)}, "the output (Output) holds .logits (2, 3): give the model labels in its inputs"),
])  # fmt: skip
def test_a_classifier_output_with_cross_entropy_points_to_model_loss(fields: dict[str, torch.Tensor], says: str) -> None:
    with pytest.raises(GradrunnerError) as err:
        forward_loss(lambda x: Output(fields), nn.CrossEntropyLoss(), torch.randn(2, 4), torch.tensor([0, 1]), 0,
                     model_name="ViTForImageClassification", loss_name="torch.nn.CrossEntropyLoss")  # fmt: skip
    assert f"To fix it, {says}" in str(err.value)
