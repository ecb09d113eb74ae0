"""Per-example norms of transformers' own RMSNorm weights (`per_example_hfnorms`) against a per-example loop.

Tiny random-init Llama, Qwen2, Mistral (Llama's forward), OLMo2 (GPT-OSS's), Gemma (Gemma's `1 + weight`), T5 (its
own) and a Gemma3n norm: float64 and float32, every strategy with accumulation, a bf16 model and bf16 autocast, the
norm on the batch's tokens flattened; a subclass that changes the math, or a forward set on the instance, is null
with the reason. The loop (`per_example_reference.loop`) backwards each row alone with plain autograd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from per_example_reference import B, Net, Params, all_params, assert_matches, batched, loop, row, sq_loss
from torch import nn

from gradrunner import capture
from gradrunner.capturing.per_example_layers import kind_of

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
KIND = {"llama": "hf_rms_norm", "qwen2": "hf_rms_norm", "mistral": "hf_rms_norm", "olmo2": "hf_rms_norm_cast_after",
        "gemma": "hf_gemma_norm", "t5": "hf_t5_norm"}  # fmt: skip


def tiny(family: str) -> nn.Module:
    """A one-layer random-init model of `family`, its norm weights drawn away from their init (ones, or Gemma's zeros)."""
    import transformers as tf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    common: dict[str, Any] = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    configs: dict[str, Callable[[], tuple[type, object]]] = {
        "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(**common)),
        "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**common)),
        "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(head_dim=8, **common)),
        "olmo2": lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**common)),
        "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(head_dim=8, **common)),
        "t5": lambda: (tf.T5ForConditionalGeneration, tf.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=24, num_layers=1,
                                                                  num_heads=2, decoder_start_token_id=0, dropout_rate=0.0)),
    }  # fmt: skip
    torch.manual_seed(0)
    cls, cfg = configs[family]()
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3) if family == "gemma" else p.uniform_(0.5, 1.5)
    return model


def norm_params(model: nn.Module) -> Params:
    return [(n, m, p) for n, m, p in all_params(model) if "norm" in n and kind_of(m)[0] is not None]


def inputs_of(family: str, rows: int = B, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = {"input_ids": torch.randint(0, 40, (rows, length), generator=g)}
    if family == "t5":
        ids["decoder_input_ids"] = torch.randint(0, 40, (rows, length - 2), generator=g)
    return ids


def rows_loss(out: object, i: int) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    target = torch.linspace(-1, 1, logits[0].numel()).view(logits.shape[1:]) * (i + 1)
    return (logits.float() - target).square().sum() / logits.shape[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", sorted(KIND))
def test_every_norm_weight_matches_the_loop(family: str, dtype: torch.dtype) -> None:
    model = tiny(family).to(dtype)
    params = norm_params(model)
    kinds = {kind_of(m)[0] for _, m, _ in params}
    assert kinds == {KIND[family]} and len(params) >= (4 if family == "olmo2" else 3)  # OLMo2: q_norm, k_norm too
    inputs = inputs_of(family)
    ref, _ = loop(model, inputs, rows_loss, params)
    got, why = batched(model, inputs, rows_loss, params)  # (with the per-step check: the rows sum to .grad)
    assert all(r is None for r in why.values()), why
    assert_matches(got, ref, why, rtol=1e-6 if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_through_capture_with_accumulation(strategy: str) -> None:
    """Two micro-batches of 3 rows, each loss / 2: six rows, each its share of the accumulated .grad."""
    model = tiny("llama")
    params = norm_params(model)
    chunks = [inputs_of("llama", 3, 5, seed=1)["input_ids"], inputs_of("llama", 3, 5, seed=2)["input_ids"]]
    with capture(model, [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        for ids in chunks:
            out = model(input_ids=ids)
            cap.backward(sum(rows_loss(row(out, i), i) for i in range(3)) / 6)
        recs = cap.records()
    assert all(r is None for r in recs.reason)
    got = {recs.keys[i].tap: torch.from_numpy(np.asarray(recs.per_example_norm[i])) for i in range(len(recs))}  # type: ignore[index]
    ref, _ = loop(model, {"input_ids": torch.cat(chunks)}, lambda out, i: rows_loss(out, i % 3), params)
    assert_matches(got, ref, {t: None for t in got}, rtol=1e-4)
    assert all(v.shape == (6,) for v in got.values())


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma", "t5"])
@pytest.mark.parametrize("mode", ["bf16 autocast", "bf16 model"])
def test_bfloat16(family: str, mode: str) -> None:
    """bf16 under autocast (float32 norms: their inputs are the float32 residual stream) and a bf16 model (the
    normalised input rounded to bf16 as the forward does): rows close to the loop in the same mode (bf16's rounding)."""
    model = tiny(family)
    if mode == "bf16 model":
        model = model.to(torch.bfloat16)
    params = norm_params(model)
    inputs = inputs_of(family)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
        ref, _ = loop(model, inputs, rows_loss, params)
        got, why = batched(model, inputs, rows_loss, params)
    assert all(r is None for r in why.values()), why
    assert_matches(got, ref, why, rtol=3e-2)


NORMS = {"hf_rms_norm": ("llama", "LlamaRMSNorm"), "hf_rms_norm_cast_after": ("gpt_oss", "GptOssRMSNorm"),
         "hf_gemma_norm": ("gemma", "GemmaRMSNorm"), "hf_gemma3n_norm": ("gemma3n", "Gemma3nRMSNorm"),
         "hf_t5_norm": ("t5", "T5LayerNorm")}  # fmt: skip
#: (weight dtype, input dtype, bf16 autocast)
MODES = [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, False), (torch.float16, torch.float16, False),
         (torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.float32, False), (torch.float32, torch.float32, True),
         (torch.float64, torch.float64, False)]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(NORMS))
def test_the_terms_are_autograds_own_products(kind: str) -> None:
    """Summed over every position, the terms (cast to the weight's dtype) are the weight's .grad bit for bit, in every
    dtype mix: h is what the forward multiplied by the weight, and each product is taken in autograd's dtype (a bf16
    model's h rounded to bf16 before the product, Gemma's in float32, T5's cast to a half weight's dtype)."""
    import importlib

    from gradrunner.capturing.per_example_hfnorms import terms

    package, name = NORMS[kind]
    cls = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)
    for wd, xd, autocast in MODES:
        torch.manual_seed(0)
        norm = cls(64).to(wd)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        assert kind_of(norm) == (kind, None)
        x = (torch.randn(4, 33, 64) * 3).to(xd)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = norm(x)
        g = torch.randn(y.shape, dtype=y.dtype)
        y.backward(g)
        assert torch.equal(terms(kind, norm, x, g).sum((0, 1)).to(wd), norm.weight.grad), (wd, xd, autocast)


def _gemma3n_net() -> nn.Module:
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    torch.manual_seed(0)
    norm = Gemma3nRMSNorm(6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return Net(nn.Sequential(nn.Linear(4, 6), norm, Gemma3nRMSNorm(6, with_scale=False), nn.Linear(6, 3)))


def test_gemma3n_norm() -> None:
    model = _gemma3n_net().double()
    params = all_params(model)
    assert kind_of(model.body[1])[0] == "hf_gemma3n_norm"
    x = torch.randn(B, 5, 4, dtype=torch.float64)
    ref, _ = loop(model, {"x": x}, sq_loss, params)
    got, why = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, ref, why, rtol=1e-6)


class FlatNorm(nn.Module):
    """A Llama norm on the batch's tokens flattened to (B T, d), between two Linears."""

    def __init__(self) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(4, 6), LlamaRMSNorm(6), nn.Linear(6, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.norm(h.view(-1, h.shape[-1])).view(h.shape))  # type: ignore[no-any-return]


def test_on_the_batchs_tokens_flattened() -> None:
    torch.manual_seed(0)
    model = FlatNorm().double()
    params = all_params(model)
    x = torch.randn(B, 5, 4, dtype=torch.float64)
    ref, _ = loop(model, {"x": x}, sq_loss, params)
    got, why = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, ref, why, rtol=1e-6)


def test_a_subclass_that_changes_the_math_is_null_with_the_reason() -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Scaled(LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(hidden_states)

    class OwnNorm(GemmaRMSNorm):
        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return x / x.abs().amax(-1, keepdim=True)

    class Kept(LlamaRMSNorm):  # a subclass that keeps the forward computes the same
        pass

    kernel = LlamaRMSNorm(6)
    kernel.forward = lambda h: 3 * h  # type: ignore[method-assign]  # (a hub kernel's forward is set on the instance)
    for module in (Scaled(6), OwnNorm(6), kernel):
        kind, why = kind_of(module)
        assert kind is None and f"{type(module).__name__} is not a layer per-example norms support" in str(why)
    assert kind_of(Kept(6)) == ("hf_rms_norm", None)
    model = Net(nn.Sequential(nn.Linear(4, 6), Scaled(6), nn.Linear(6, 3)))
    got, why = batched(model, {"x": torch.randn(B, 5, 4)}, sq_loss, all_params(model))
    assert got["body.1:weight"] is None and "Scaled is not a layer per-example norms support" in str(why["body.1:weight"])
    assert got["body.0:weight"] is not None


def test_a_weight_that_is_not_one_per_feature_is_null() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(1)  # (its weight broadcast over 6 features)
    model = Net(nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 3)))
    got, why = batched(model, {"x": torch.randn(B, 5, 4)}, sq_loss, all_params(model))
    assert got["body.1:weight"] is None and "shape (1,) is not one entry per feature" in str(why["body.1:weight"])


def test_a_reference_class_patched_in_its_module_recognises_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's `modeling_llama.LlamaRMSNorm = LigerRMSNorm` (another class under the reference's name): its modules are
    not taken for Llama's math, nor are Llama's."""
    from transformers.models.llama import modeling_llama
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from gradrunner.capturing import per_example_hfnorms

    class Patched(nn.Module):
        def __init__(self, hidden_size: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.weight * hidden_states

    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", Patched)
    per_example_hfnorms._reference.cache_clear()
    try:
        assert kind_of(Patched(6))[0] is None and kind_of(LlamaRMSNorm(6))[0] is None
    finally:
        monkeypatch.undo()
        per_example_hfnorms._reference.cache_clear()
    assert kind_of(LlamaRMSNorm(6)) == ("hf_rms_norm", None)
