"""transformers' Wav2Vec2 (tiny random-init config, no downloads): its feature encoder sets `requires_grad` on a view
of its input in training (`h = input_values[:, None]; h.requires_grad = True`), which torch allows only while the
input has no autograd history. An input tap there hands it the alias that requires grad (`input_alias`), so its
forward raises torch's leaf-only error, as it does without capture on an input that requires grad: the error then
names the tap and the tap that works (`note_alias_error`). References: plain hooks and `.grad` on a model without
gradrunner, and `torch.autograd.grad`.
"""

from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner import capture

transformers = pytest.importorskip("transformers", reason="the real-model suite needs the extra gradrunner[hf]")


def _wav2vec2() -> nn.Module:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(4, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0)  # fmt: skip
    return transformers.Wav2Vec2Model(cfg).double().train()


X = torch.randn(2, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, x: torch.Tensor = X) -> torch.Tensor:
    return model(input_values=x).last_hidden_state.square().mean()  # type: ignore[no-any-return]


@pytest.mark.parametrize("tap", ["feature_extractor:input", ":input.input_values"])
def test_a_forward_that_sets_requires_grad_on_its_aliased_input_names_the_tap(strategy: str, tap: str) -> None:
    model = _wav2vec2()
    own = leftover_hooks(model)  # the weight-norm parametrisation's load_state_dict pre-hook is the model's own
    with pytest.raises(RuntimeError, match="requires_grad flags of leaf variables") as info:
        with capture(model, [tap], strategy=strategy):
            _loss(model)
    if sys.version_info >= (3, 11):
        note = info.value.__notes__[-1]
        assert f"input tap(s) {tap!r}" in note and "feature_extractor.conv_layers.0:input" in note
    assert leftover_hooks(model) == own
    _loss(model).backward()  # the model runs as before the session: nothing of it is left


def test_the_first_convs_input_tap_gets_the_leaf_gradient_and_is_transparent(strategy: str) -> None:
    """The tap the note names: d loss / d (input_values[:, None]), the leaf the encoder makes; loss and `.grad` as
    without capture."""
    model = _wav2vec2()
    plain = copy.deepcopy(model)
    leaf: list[torch.Tensor] = []
    handle = plain.feature_extractor.conv_layers[0].register_forward_pre_hook(lambda _m, a: leaf.append(a[0]))
    loss = _loss(plain)
    loss.backward()
    handle.remove()
    assert leaf[0].is_leaf and leaf[0].grad is not None
    taps = ["feature_extractor.conv_layers.0:input", "feature_extractor:output"]
    with capture(model, taps, strategy=strategy) as cap:
        tapped = _loss(model)
        cap.backward(tapped)
    assert torch.equal(tapped, loss)
    torch.testing.assert_close(cap.grads["feature_extractor.conv_layers.0:input"], leaf[0].grad, rtol=1e-12, atol=0)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


def test_in_eval_mode_the_encoders_input_tap_gets_d_loss_d_input(strategy: str) -> None:
    """The encoder sets `requires_grad` only in training: in eval mode its input tap is d loss / d input_values."""
    model = _wav2vec2().eval()
    x = X.clone().requires_grad_()
    (expected,) = torch.autograd.grad(_loss(copy.deepcopy(model), x), x)
    with capture(model, ["feature_extractor:input"], strategy=strategy) as cap:
        cap.backward(_loss(model))
    torch.testing.assert_close(cap.grads["feature_extractor:input"], expected, rtol=1e-12, atol=0)
