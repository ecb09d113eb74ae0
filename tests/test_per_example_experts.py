"""Per-example norms of transformers' 3-D expert parameters (`per_example_experts`) against a per-example loop.

Tiny random-init Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / GPT-OSS (transposed, biased, a custom gate) under each
experts implementation that is followed ("eager", "batched_mm", "grouped_mm"), every strategy, accumulation and bf16
autocast; and null with the reason where the experts' math is not followed.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from per_example_reference import all_params, assert_matches, batched, loop, row, tiny_moe
from torch import nn

from gradrunner import capture
from gradrunner.capturing.per_example import PerExampleNorms
from gradrunner.capturing.per_example_check import PerExampleWarning

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
EXPERTS = "model.layers.0.mlp.experts"


def rows_loss(out: object, i: int) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    target = torch.linspace(-1, 1, logits[0].numel()).view(logits.shape[1:]) * (i + 1)
    return (logits.float() - target).square().sum() / logits.shape[1]


def expert_params(model: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter]]:
    return [p for p in all_params(model) if p[0].startswith(EXPERTS + ":")]


def input_ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, 40, (rows, length), generator=torch.Generator().manual_seed(rows * 100 + length))


CASES = [("mixtral", "eager"), ("mixtral", "batched_mm"), ("mixtral", "grouped_mm"), ("qwen2_moe", "eager"),
         ("qwen3_moe", "batched_mm"), ("olmoe", "grouped_mm"), ("gpt_oss", "batched_mm"), ("gpt_oss", "grouped_mm")]  # fmt: skip


@pytest.mark.parametrize(("family", "impl"), CASES)
@pytest.mark.parametrize(
    ("length", "top_k"), [(1, 2), (4, 1), (12, 2)]
)  # few pairs per row and expert: ghost; many: both
def test_every_expert_parameter_matches_the_loop(family: str, impl: str, length: int, top_k: int) -> None:
    model = tiny_moe(family, impl, top_k)
    params = expert_params(model)
    assert len(params) == (4 if family == "gpt_oss" else 2)  # GPT-OSS: transposed, with biases
    inputs = {"input_ids": input_ids(4, length)}
    ref, _ = loop(model, inputs, rows_loss, params)
    got, why = batched(model, inputs, rows_loss, params)
    assert all(r is None for r in why.values()), why
    assert_matches(got, ref, why, rtol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_through_capture_with_accumulation(strategy: str) -> None:
    """Two micro-batches of 3 rows, each loss / 2: six rows, each its share of the accumulated .grad."""
    model = tiny_moe("mixtral", "eager")
    params = expert_params(model)
    chunks = [input_ids(3, 4), input_ids(3, 5)[:, :4]]
    with capture(model, [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        for ids in chunks:
            out = model(input_ids=ids)
            cap.backward(sum(rows_loss(row(out, i), i) for i in range(3)) / 6)
        recs = cap.records()
    got = {recs.keys[i].tap: torch.from_numpy(np.asarray(recs.per_example_norm[i])) for i in range(len(recs))}  # type: ignore[index]
    ids = torch.cat(chunks)
    ref, _ = loop(model, {"input_ids": ids}, lambda out, i: rows_loss(out, i % 3), params)  # (each row's loss / 6)
    assert_matches(got, ref, {t: None for t in got})
    assert all(v.shape == (6,) for v in got.values())


@pytest.mark.parametrize("impl", ["eager", "batched_mm"])
def test_bfloat16_autocast(impl: str) -> None:
    """CPU autocast: the experts' matmuls in bf16; rows close to the loop under the same autocast (bf16's rounding)."""
    model = tiny_moe("mixtral", impl)
    params = expert_params(model)
    inputs = {"input_ids": input_ids(4, 5)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = loop(model, inputs, rows_loss, params)
        got, why = batched(model, inputs, rows_loss, params)
    assert_matches(got, ref, why, rtol=3e-2)


def test_an_implementation_not_followed_is_null_with_its_name() -> None:
    """GPT-OSS's own eager forward (clamped gate, its own loop) is not transformers' stock loop: null, saying so."""
    model = tiny_moe("gpt_oss", "eager")
    params = expert_params(model)
    got, why = batched(model, {"input_ids": input_ids(4, 3)}, rows_loss, params)
    assert all(v is None for v in got.values())
    assert all("GptOssExperts's eager forward is not transformers' stock experts loop" in str(r) for r in why.values())


def test_a_registered_kernel_is_null_with_its_name() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    ALL_EXPERTS_FUNCTIONS.register("my_kernel", batched_mm_experts_forward)
    try:
        model = tiny_moe("mixtral", "my_kernel")
        params = expert_params(model)
        got, why = batched(model, {"input_ids": input_ids(4, 3)}, rows_loss, params)
    finally:
        ALL_EXPERTS_FUNCTIONS._global_mapping.pop("my_kernel", None)
        ALL_EXPERTS_FUNCTIONS._local_mapping.pop("my_kernel", None)
    assert all(v is None for v in got.values())
    assert all("experts implementation 'my_kernel'" in str(r) for r in why.values()), why


class SeqMajor(nn.Module):
    """A Mixtral MoE block that flattens its tokens sequence-major: token n of the experts' input is row n % B."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = block.gate, block.experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        flat = hidden.transpose(0, 1).reshape(-1, h)
        _, weights, index = self.gate(flat)
        return self.experts(flat, index, weights).view(t, b, h).transpose(0, 1)  # type: ignore[no-any-return]


def test_tokens_that_are_not_the_batch_flattened_are_null() -> None:
    """The experts called on the tokens of a (T, B, H) copy: which row a token is cannot be told."""
    model = tiny_moe("mixtral", "eager")
    model.model.layers[0].mlp = SeqMajor(model.model.layers[0].mlp)
    params = expert_params(model)
    got, why = batched(model, {"input_ids": input_ids(4, 3)}, rows_loss, params)
    assert all(v is None for v in got.values())
    assert all("not the batch's 4 rows flattened" in str(r) for r in why.values()), why


def test_a_penalty_on_the_experts_is_caught_by_the_check() -> None:
    model = tiny_moe("qwen3_moe", "batched_mm")
    params = expert_params(model)
    experts = model.model.layers[0].mlp.experts

    def penalised(out: object, i: int) -> torch.Tensor:
        return rows_loss(out, i) + 0.1 * experts.down_proj.square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerExampleWarning)
        got, why = batched(model, {"input_ids": input_ids(4, 3)}, penalised, params)
    assert got[f"{EXPERTS}:down_proj"] is None and "outside" in str(why[f"{EXPERTS}:down_proj"])


@pytest.mark.filterwarnings("ignore::gradrunner.capturing.per_example_check.PerExampleWarning")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_and_grads_bit_identical_with_per_example_on(strategy: str) -> None:
    """The recomputation (and its small autograd call inside the backward) changes no gradient and no hook."""
    results = []
    for on in (False, True):
        model = tiny_moe("mixtral", "batched_mm")
        seen: list[torch.Tensor] = []
        hooks = [
            p.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.clone()))
            for p in model.parameters()
        ]
        with capture(model, [n for n, _, _ in all_params(model)], strategy=strategy, per_example=on) as cap:
            out = model(input_ids=input_ids(4, 5))
            loss = sum(rows_loss(row(out, i), i) for i in range(4)) / 4
            cap.backward(loss)
            cap.records(loss)
        for h in hooks:
            h.remove()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], seen))
    (l0, g0, s0), (l1, g1, s1) = results
    assert torch.equal(l0, l1) and len(s0) == len(s1)
    assert all(torch.equal(a, b) for a, b in zip(g0 + s0, g1 + s1, strict=True))


def test_an_experts_module_called_twice_sums_both_calls_shares() -> None:
    """One experts module in two layers (its parameters used by two calls per forward): the rows' shares of both
    calls summed, cross terms included (the materialised form)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2)  # fmt: skip
    cfg._experts_implementation = "batched_mm"
    model = tf.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.3)
    model.model.layers[1].mlp.experts = model.model.layers[0].mlp.experts
    params = expert_params(model)
    inputs = {"input_ids": input_ids(4, 3)}
    ref, _ = loop(model, inputs, rows_loss, params)
    got, why = batched(model, inputs, rows_loss, params)
    assert_matches(got, ref, why, rtol=1e-4)


def test_an_implementation_switched_after_the_session_opened_is_seen_at_the_call() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    model = tiny_moe("mixtral", "eager")
    params = expert_params(model)
    ALL_EXPERTS_FUNCTIONS.register("my_kernel", batched_mm_experts_forward)
    try:
        with PerExampleNorms(model, params) as pex:
            model.config._experts_implementation = "my_kernel"
            out = model(input_ids=input_ids(4, 3))
            (sum(rows_loss(row(out, i), i) for i in range(4)) / 4).backward()
            got, why = pex.norms(), pex.reasons()
    finally:
        ALL_EXPERTS_FUNCTIONS._global_mapping.pop("my_kernel", None)
        ALL_EXPERTS_FUNCTIONS._local_mapping.pop("my_kernel", None)
    assert all(v is None for v in got.values())
    assert all("experts implementation 'my_kernel'" in str(r) for r in why.values()), why


def test_a_stock_loop_patched_in_its_module_is_not_taken_for_the_stock_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stock loop's bytecode was read from `modeling_mixtral.MixtralExperts` by name: a kernel library's experts
    class put in its place (its own eager math, here half the stock output) became the reference, so its modules were
    taken for the stock loop (numbers of the stock math, twice the truth) and the 55 stock classes were not. Now a
    reference whose forward is not the one Mixtral's file defines recognises nothing: null, naming the class."""
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.mixtral import modeling_mixtral

    from gradrunner.capturing import per_example_experts

    stock = modeling_mixtral.MixtralExperts
    experts = next(m for m in tiny_moe("mixtral", "eager").modules() if isinstance(m, stock))
    assert per_example_experts.experts_reason(experts) is None

    @use_experts_implementation
    class Halved(stock):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
            return 0.5 * stock.forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)

    halved = Halved(experts.config)
    monkeypatch.setattr(modeling_mixtral, "MixtralExperts", Halved)
    per_example_experts._stock_eager.cache_clear()
    try:
        assert "not transformers' stock experts loop" in str(per_example_experts.experts_reason(halved))
        assert "not transformers' stock experts loop" in str(per_example_experts.experts_reason(experts))
    finally:
        monkeypatch.undo()
        per_example_experts._stock_eager.cache_clear()
    assert per_example_experts.experts_reason(experts) is None
