"""Calls whose dim 0 has the batch's size but not its rows (`per_example_rows`): null with the reason, never a number.

Each model is run so that the coincidence happens (B equal to the decoder's length, to DeBERTa's
relative-embedding table, to the tokens routed to an expert); the reference is `per_example_reference.loop`
(each row alone, its loss scaled to its share), which every other parameter must still match (rtol 1e-5).
"""

from __future__ import annotations

import logging

import pytest
import torch
from per_example_reference import all_params, assert_matches, batched, loop
from torch import nn


def _quiet_transformers():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def _check(model: nn.Module, inputs: dict[str, torch.Tensor], rows_loss, nulls: dict[str, str], *, all_others: bool = False,
           numbers: list[str] | None = None) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """`nulls` (name: a part of its reason) are None; every other parameter matches the loop (`all_others`: none
    is None; `numbers`: these are not)."""
    params = all_params(model)
    got, reasons = batched(model, inputs, rows_loss, params)
    assert all(got[n] is not None for n in numbers or ()), {n: reasons[n] for n in numbers or ()}
    if all_others:
        assert all(got[n] is not None for n in got if n not in nulls), {n: reasons[n] for n in got if got[n] is None}
    for name, why in nulls.items():
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, rows_loss, params)[0]
    rest = {n: r for n, r in ref.items() if n not in nulls and got[n] is not None}
    assert len(rest) >= len(ref) // 2, {n: reasons[n] for n in ref if got[n] is None}
    assert_matches(got, rest, reasons)


def test_t5_decoder_relative_buckets_when_the_batch_size_equals_the_decoder_length() -> None:
    """B == T_dec != T_enc: the decoder's relative-position buckets (T_dec, T_dec) were taken for rows (found
    2026-11-27: only the first input, the encoder's ids, was compared with B)."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=30, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = tf.T5ForConditionalGeneration(cfg)
    labels = torch.randint(3, 30, (4, 4))
    inputs = {"input_ids": torch.randint(3, 30, (4, 7)), "decoder_input_ids": model._shift_right(labels)}

    def rows_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[0], labels[i], reduction="sum")  # type: ignore[attr-defined]

    _check(model, inputs, rows_loss, {"decoder.block.0.layer.0.SelfAttention.relative_attention_bias:weight":
                                      "made inside the forward"})  # fmt: skip


@pytest.mark.parametrize("length", [6, 4], ids=["T 6", "B == T"])
def test_deberta_layer_norm_of_the_relative_embeddings_when_the_batch_size_equals_their_count(length: int) -> None:
    """`encoder.LayerNorm(rel_embeddings.weight)`: a (4, 16) parameter, B = 4 (found 2026-11-27: wrong numbers). The
    layers past the c2p and p2c `bmm`s (relative positions `repeat`ed to B H rows) keep their numbers, also with B == T
    (the walk goes past a `bmm` since 2026-11-28, looking for a dim 0 moved there only)."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    cfg = tf.DebertaV2Config(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                             max_position_embeddings=32, relative_attention=True, max_relative_positions=2, position_buckets=-1,
                             norm_rel_ebd="layer_norm", pos_att_type=["p2c", "c2p"], share_att_key=True, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, position_biased_input=False)  # fmt: skip
    model = tf.DebertaV2ForMaskedLM(cfg)
    assert model.deberta.encoder.rel_embeddings.weight.shape[0] == 4
    ids = torch.randint(3, 30, (4, length))

    def rows_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[0], ids[i], reduction="sum")  # type: ignore[attr-defined]

    why = "called on a parameter of shape (4, 16)"
    past = [f"deberta.encoder.layer.0.{m}.dense:weight" for m in ("attention.output", "intermediate", "output")]
    _check(model, {"input_ids": ids}, rows_loss, {f"deberta.encoder.LayerNorm:{p}": why for p in ("weight", "bias")},
           numbers=past)  # fmt: skip


class TinyMoE(nn.Module):
    """Switch-style routing: the tokens whose first input feature is positive go through one expert (wi, ReLU, wo),
    picked from the flattened (B T, d) states and added back by `index_add`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.wi, self.wo, self.head = nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).reshape(-1, 4)
        routed = torch.where(x.reshape(-1, 3)[:, 0] > 0)[0]
        expert = self.wo(torch.relu(self.wi(h[None, routed].reshape(-1, 4))))
        return self.head((h + torch.zeros_like(h).index_add(0, routed, expert)).view(*x.shape[:2], 4))  # type: ignore[no-any-return]


def _routed(routed: int) -> torch.Tensor:
    """A (4, 3, 3) batch whose tokens 0, 4, 5, 11 (and 7: `routed` of them) have a positive first feature."""
    x = torch.randn(4, 3, 3)
    x[..., 0] = x[..., 0].abs().neg()
    x.view(-1, 3)[torch.tensor([0, 4, 5, 11, 7])[:routed], 0] *= -1  # these tokens go to the expert
    return x


@pytest.mark.parametrize("routed", [4, 5], ids=["B tokens routed", "B + 1 tokens routed"])
def test_a_mixture_of_experts_expert_given_as_many_tokens_as_the_batch_has_rows(routed: int) -> None:
    """An expert's Linear on exactly B routed tokens (found 2026-11-27 in SwitchTransformers: wrong numbers), and
    the Linear after it; the layers around the routing, on the batch's rows, stay exact."""
    torch.manual_seed(0)
    x = _routed(routed)
    why, after = ("picked by indexing", "the output of a call whose rows") if routed == 4 else ("is not the batch",) * 2
    _check(TinyMoE(), {"x": x}, lambda out, i: ((out - 0.5 * i) ** 2).sum(),
           {"wi:weight": why, "wi:bias": why, "wo:weight": after, "wo:bias": after})  # fmt: skip


def test_an_experts_second_linear_tracked_without_its_first() -> None:
    """Only `wo` tracked (a tap on an expert's second Linear alone, `expert_*.wo:weight`): found 2026-11-27 in
    SwitchTransformers, where its rows, B tokens, got numbers (0.0700, 0.0777 for true shares 0.1245, 0.0), because
    the untracked `wi` was not hooked and so marked nothing. The head, on the batch's rows, stays exact."""
    torch.manual_seed(0)
    model, inputs = TinyMoE(), {"x": _routed(4)}
    params = [(n, m, p) for n, m, p in all_params(model) if n.startswith(("wo:", "head:"))]
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("wo:weight", "wo:bias"):
        assert got[name] is None and "the output of a call whose rows" in str(reasons[name]), reasons[name]
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith("head:")}, reasons)


def _row_sq(out: torch.Tensor, i: int) -> torch.Tensor:
    return ((out - 0.5 * i) ** 2).sum()


class SortedMoE(nn.Module):
    """DeepSeek-style dispatch (its `moe_infer`): the flattened tokens sorted by expert (`h[order]`), each expert's run
    of them taken by a slice (`tokens[start:end]`) or by `split(counts)`, the outputs put back in place. The tokens whose
    first feature is positive go to expert 1, the others to expert 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.head = how, nn.Linear(3, 4), nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).reshape(-1, 4)
        expert = (x.reshape(-1, 3)[:, 0] > 0).long()
        order, counts = expert.argsort(stable=True), torch.bincount(expert, minlength=2).tolist()
        tokens = h[order]
        runs = tokens.split(counts) if self.how == "split" else (tokens[: counts[0]], tokens[counts[0] :])
        out = torch.cat([e(run) for e, run in zip(self.experts, runs, strict=True)])
        back = torch.zeros_like(out).index_add(0, order, out)
        return self.head((h + back).view(*x.shape[:2], 4))  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["slice", "split"])
def test_an_expert_on_a_slice_of_the_sorted_tokens_given_as_many_as_the_batch_has_rows(how: str) -> None:
    """Expert 1 gets B = 4 of the 12 tokens through a slice or a `split` of the sorted tokens: found 2026-11-27 (the
    walk back from its input stopped at the slice: wrong numbers, 0.0347, 0.0415 for true shares 0.0, 0.0529).
    Expert 0 (8 tokens) is null for its dim 0; the layers on the batch's rows stay exact."""
    torch.manual_seed(0)
    model, inputs = SortedMoE(how), {"x": _routed(4)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    nulls = {"experts.1.0": "picked by indexing", "experts.1.2": "the output of a call whose rows",
             "experts.0.0": "is not the batch", "experts.0.2": "is not the batch"}  # fmt: skip
    for layer, why in nulls.items():
        for name in (f"{layer}:weight", f"{layer}:bias"):
            assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith(("inp:", "head:"))}, reasons)


class Latents(nn.Module):
    """Perceiver-style latents broadcast to the batch (`expand`): each row belongs to its example, so rows stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.latents, self.norm, self.lin = nn.Parameter(torch.randn(3, 4)), nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(self.latents.expand(x.shape[0], -1, -1)) * x)  # type: ignore[no-any-return]


def test_a_parameter_broadcast_to_the_batch_keeps_its_rows() -> None:
    torch.manual_seed(0)
    _check(Latents(), {"x": torch.randn(4, 3, 4)}, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {})


class Pooled(nn.Module):
    """A token layer, then one row per example picked (CLIP's `h[arange(B), eos]`, SequenceSummary's
    `gather(-2, cls_index)`), then a head: each picked row is its own example's, so the head's rows are exact."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.tok, self.head = how, nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.tok(x))
        if self.how == "index":
            picked = h[torch.arange(h.shape[0]), last]
        else:
            picked = h.gather(-2, last.view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(-2)
        return self.head(picked)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["index", "gather"])
def test_a_head_on_one_row_picked_per_example_is_exact(how: str) -> None:
    """Found 2026-11-27 (a regression of the routed-tokens rule: CLIP's text_projection and GPT2DoubleHeads'
    summary were null). B = 4 = T: the picked rows' dim 0 has the batch's size and is the batch."""
    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 4, 4), "last": torch.tensor([3, 1, 0, 2])}
    _check(Pooled(how), inputs, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {}, all_others=True)


class Flattened(nn.Module):
    """A layer on the batch's tokens flattened to (B * T, D), reshaped back to (B, T, ...) for the next one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return self.fc2(torch.relu(self.fc1(x.reshape(b * t, d)).reshape(b, t, -1)))  # type: ignore[no-any-return]


def test_a_layer_after_flattened_tokens_reshaped_back_to_the_batch_is_exact() -> None:
    """fc2, on the rows reshaped back, is the batch's (it was null too); fc1, on the batch's tokens flattened to
    B * T rows (a row-major view), is exact since 2026-11-27 (null before: 'dim 0 is not the batch')."""
    torch.manual_seed(0)
    _check(Flattened(), {"x": torch.randn(4, 5, 6)}, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {}, all_others=True)


class _Positions1D(nn.Module):
    """The reference's GPT-2 call: 1-D position_ids (T,), broadcast over the batch, with each row alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> object:
        return self.model(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1]))


def test_gpt2_given_1d_position_ids_when_the_batch_size_equals_the_length() -> None:
    """position_ids of shape (T,) given to the model, B == T: wpe's rows were taken for the batch's (found 2026-11-27:
    wrong norms, silently); now None with the reason, every other parameter exact."""
    _quiet_transformers()
    from per_example_reference import gpt2, ids, lm_loss, row

    from gradrunner.capturing.per_example import PerExampleNorms

    torch.manual_seed(0)
    model, t = gpt2(), 4
    inputs = ids((4, t), 40)
    params = all_params(model)
    with PerExampleNorms(model, params) as pex:
        out = model(input_ids=inputs, position_ids=torch.arange(t))
        (sum(lm_loss(row(out, i), i) for i in range(4)) / 4).backward()
        got, reasons = pex.norms(), pex.reasons()
    wpe = "transformer.wpe:weight"
    assert got[wpe] is None and "broadcast over the batch" in str(reasons[wpe])
    ref = loop(_Positions1D(model), {"input_ids": inputs}, lm_loss, [(f"model.{n}", m, p) for n, m, p in params])[0]
    assert_matches(got, {n[len("model.") :]: r for n, r in ref.items() if n != f"model.{wpe}"}, reasons)


class GatedMoE(nn.Module):
    """A Mixtral-style gated (SwiGLU) expert, `down(silu(gate(t)) * up(t))` on the tokens routed to it (`t = h[idx]` or
    Mixtral's `h[None, idx].reshape(-1, d)`), weighted by the router's probability, added back by `index_add`."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.router, self.head = how, nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)
        self.gate, self.up, self.down = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).reshape(-1, 4)
        weights = self.router(h).softmax(-1)
        idx = torch.where(x.reshape(-1, 3)[:, 0] > 0)[0]
        t = h[idx] if self.how == "h[idx]" else h[None, idx].reshape(-1, 4)
        out = self.down(nn.functional.silu(self.gate(t)) * self.up(t)) * weights[idx, 1, None]
        return self.head((h + torch.zeros_like(h).index_add(0, idx, out)).view(*x.shape[:2], 4))  # type: ignore[no-any-return]


@pytest.mark.parametrize("shapes", [True, False], ids=["shapes read", "shapes unknown"])
@pytest.mark.parametrize("how", ["h[idx]", "h[None, idx]"])
def test_a_gated_experts_down_projection_given_as_many_tokens_as_the_batch_has_rows(
    how: str, shapes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B = 4 of the 12 tokens routed to the expert: `down` is called on `silu(gate(t)) * up(t)`, a product of two
    operands, where the walk back stopped (found 2026-11-27: down:weight got 0.0811, 0.0467 for true shares 0.1095,
    0.0). Null with the reason, with the autograd nodes' shapes read or not (`node_shape`'s fallback)."""
    from gradrunner.capturing import torch_compat

    monkeypatch.setitem(torch_compat.FEATURES, "input_metadata", shapes)
    torch.manual_seed(0)
    picked, after = "picked by indexing", "the output of a call whose rows"
    layers = (("gate", picked), ("up", picked), ("down", after))
    model, inputs = GatedMoE(how), {"x": _routed(4)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for layer, why in layers:
        for name in (f"{layer}:weight", f"{layer}:bias"):
            assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]  # the router, on the batch's 12 tokens flattened: exact (2026-11-27)
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith(("inp:", "head:", "router:"))}, reasons)


class SwiGLU(nn.Module):
    """Llama's MLP on the batch's rows, `down(silu(gate(x)) * up(x))`, a residual add, a gated sum with a
    broadcast (1, 1, d) parameter and a (T, d) table picked by `arange(T)` (rows of no example): all exact."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down, self.head = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 2)
        self.scale, self.table = nn.Parameter(torch.randn(1, 1, 4)), nn.Parameter(torch.randn(7, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.table[torch.arange(x.shape[1])]
        h = h + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return self.head(torch.where(h > 0, h * self.scale, h))  # type: ignore[no-any-return]


def test_a_swiglu_mlp_on_the_batchs_rows_stays_exact() -> None:
    """B = 4 = T: the table's picked rows (4, 4) are broadcast over the batch, not followed as its rows."""
    torch.manual_seed(0)
    own = {":scale": "is not a layer", ":table": "is not a layer"}  # the model's own: not a supported layer's
    _check(SwiGLU(), {"x": torch.randn(4, 4, 4)}, _row_sq, own, all_others=True)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_transformers_moe_given_one_token_per_example(arch: str) -> None:
    """Tiny random Mixtral / Qwen2-MoE (eager experts), T = 1: the 4 flattened tokens are the batch's rows, and each
    expert gets some of them. transformers 5's experts hold 3-D parameters (null: not a supported layer); every
    number given matches the loop, and Llama-style SwiGLU Linears on the batch's rows (Qwen2-MoE's shared expert, its
    sigmoid gate times the expert) are exact, not null."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    common = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 1, "max_position_embeddings": 8}  # fmt: skip
    if arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=2, **common))
    else:
        cfg = tf.Qwen2MoeConfig(num_experts=2, moe_intermediate_size=12, shared_expert_intermediate_size=20, **common)
        model = tf.Qwen2MoeForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    ids, labels = torch.randint(3, 40, (4, 1)), torch.randint(3, 40, (4, 1))

    def rows_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[0], labels[i], reduction="sum")  # type: ignore[attr-defined]

    params = all_params(model)
    got, reasons = batched(model, {"input_ids": ids}, rows_loss, params)
    ref = loop(model, {"input_ids": ids}, rows_loss, params)[0]
    given = {n: r for n, r in ref.items() if got[n] is not None}
    linears = [n for n, m, _ in params if isinstance(m, nn.Linear)]
    assert all(n in given for n in linears), {n: reasons[n] for n in linears if n not in given}
    assert_matches(got, given, reasons)


def test_bert_when_the_batch_size_equals_the_length_keeps_every_layer_after_the_embeddings() -> None:
    """B == T, no token_type_ids: BERT's token types (B, T) made inside the forward are null (dim 0 may not be the
    batch), but the embeddings' sum with the tokens' is the batch's rows: its LayerNorm and every layer after it are
    exact (only rows picked by indexing are carried through an op of several operands; a first version of the
    gated-expert fix carried every reason, and made the whole model null)."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    model, ids = tf.BertForMaskedLM(cfg), torch.randint(3, 40, (4, 4))

    def rows_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[0], ids[i], reduction="sum")  # type: ignore[attr-defined]

    head = "is not a layer"  # BertLMPredictionHead's own bias, tied to the decoder's
    nulls = {"bert.embeddings.token_type_embeddings:weight": "made inside the forward", "cls.predictions:bias": head,
             "bert.embeddings.position_embeddings:weight": "is not the batch", "cls.predictions.decoder:bias": head}  # fmt: skip
    _check(model, {"input_ids": ids}, rows_loss, nulls, all_others=True)


class ApartIndices(nn.Module):
    """`h4[:, i, :, j]` with the advanced indices apart: numpy's rule puts their dims first, (K, B, 2); K == B here."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 6), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h4 = torch.tanh(self.inp(x)).view(x.shape[0], x.shape[1], 2, 3)
        z = h4[:, torch.tensor([0, 1, 2, 3]), :, torch.tensor([0, 1, 2, 0])]
        return self.lin(z).transpose(0, 1)  # type: ignore[no-any-return]


def test_advanced_indices_apart_put_the_index_dims_first_and_are_null() -> None:
    """Found 2026-11-27: the first index being a slice was taken for 'dim 0 left as it is', and lin (on K = 4 index
    positions, each mixing all examples) got numbers (a float64 repro: 2.97, 1.26, 2.28, 2.49 against the loop's
    0.66, 1.80, 3.33, 2.87)."""
    torch.manual_seed(0)
    why = "picked by indexing"
    _check(ApartIndices(), {"x": torch.randn(4, 5, 3)}, lambda out, i: (out**2).sum() * (i + 1),
           {"lin:weight": why, "lin:bias": why}, all_others=True)  # fmt: skip


class ApartFromDimZero(nn.Module):
    """`h4[arange(B), :, j]`: advanced indices apart, the first on dim 0, so the index dims (B,) come first and row i
    is `h4[i, :, j[i]]`: the batch's rows, as `h4[arange(B), j]` (j picked from each row's own values)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 6), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h4 = torch.tanh(self.inp(x)).view(x.shape[0], x.shape[1], 2, 3)
        j = (x[:, 0, 0].abs() * 100).long() % 2
        return self.lin(h4[torch.arange(x.shape[0]), :, j])  # type: ignore[no-any-return]


class BroadcastIndices(nn.Module):
    """`h[arange(B), j]` with j of shape (B, 1): the indices broadcast to (B, B), j's dim leading, so row a of the
    result is `h[b, j[a]]` for every b: every example's rows in each (`sum(1)` then mixes them into every output row)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        j = ((x[:, 0, 0].abs() * 100).long() % x.shape[1]).view(-1, 1)
        return self.lin(h[torch.arange(x.shape[0]), j]).sum(1)  # type: ignore[no-any-return]


def test_an_index_that_broadcasts_the_first_away_from_dim_0_is_null() -> None:
    """Found 2026-11-27 (in the code before 6912016 too): dim 0 of B picked with arange(B) first was taken for the
    batch's rows whatever the other indices' shapes; a repro (Linear(5, 3) after it) gave 2.85, 3.53, 3.34, 1.40
    against the loop's 0.12, 0.99, 0.81, 0.14."""
    torch.manual_seed(0)
    why = "picked by indexing"
    model = BroadcastIndices()
    got, reasons = batched(
        model, {"x": torch.randn(4, 6, 3)}, lambda out, i: (out**2).sum() * (i + 1), all_params(model)
    )
    for name in ("lin:weight", "lin:bias"):
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])


def test_advanced_indices_apart_from_dim_0_keep_the_rows() -> None:
    """Found 2026-11-27: the fix for `h[:, i, :, j]` nulled every pick with indices apart, this one too (the code
    before it gave the loop's numbers)."""
    torch.manual_seed(0)
    _check(ApartFromDimZero(), {"x": torch.randn(4, 5, 3)}, lambda out, i: (out**2).sum() * (i + 1), {},
           all_others=True)  # fmt: skip


class FlatPicks(nn.Module):
    """Features picked from the batch's tokens flattened to (B T, D) (`[:, idx]`, `index_select(1, ...)`,
    `gather(1, ...)`), reshaped back to (B, T, k) for the next Linear: dim 0 is never indexed."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.lin = how, nn.Linear(3, 6), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        flat = torch.tanh(self.inp(x)).reshape(b * t, 6)
        idx = torch.tensor([4, 1])
        if self.how == "index":
            picked = flat[:, idx]
        elif self.how == "index_select":
            picked = flat.index_select(1, idx)
        else:
            picked = flat.gather(1, idx.expand(b * t, 2))
        return self.lin(picked.view(b, t, 2))  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["index", "index_select", "gather"])
def test_features_picked_from_flattened_tokens_keep_the_rows(how: str) -> None:
    """Found 2026-11-27: a selection along dim 1 of the (B T, D) tokens was taken for rows picked out of a dim 0 that
    is not the batch's (lin null, 'picked by indexing'), although dim 0 is left as it is."""
    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 5, 3)}
    _check(FlatPicks(how), inputs, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {}, all_others=True)


class LearnedPositions(nn.Module):
    """A learned position table (a parameter) indexed by (B, T) position ids: `table[position_ids]`, an embedding's
    lookup by indexing; given to the model, or made in the forward (`arange(T).expand(B, T)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 4))
        self.inp, self.lin = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        return self.lin(torch.tanh(self.inp(x) + self.table[position_ids]))  # type: ignore[no-any-return]


def test_a_parameter_table_indexed_by_the_batchs_position_ids_keeps_the_rows() -> None:
    """Found 2026-11-27: `table[position_ids]` (the batch's (B, T) ids) was taken for rows picked out of another dim 0
    (the table's 9): lin null. Its rows are the batch's, as an Embedding's lookup."""
    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 5, 3), "position_ids": torch.randint(0, 9, (4, 5))}
    _check(LearnedPositions(), inputs, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {":table": "is not a layer"},
           all_others=True)  # fmt: skip


@pytest.mark.parametrize("length", [5, 4])
def test_a_parameter_table_indexed_by_ids_made_in_the_forward(length: int) -> None:
    """Ids made in the forward: the batch's rows while B equals no other dim of the inputs (T = 5); null when it does
    (T = B = 4: which dim of the ids is the batch's cannot be told), as an Embedding's."""
    torch.manual_seed(0)
    nulls = {":table": "is not a layer"}
    if length == 4:
        nulls |= {"lin:weight": "picked by indexing", "lin:bias": "picked by indexing"}
    _check(LearnedPositions(), {"x": torch.randn(4, length, 3)}, lambda out, i: ((out - 0.5 * i) ** 2).sum(), nulls,
           all_others=True)  # fmt: skip


class TwoBatchesPicked(nn.Module):
    """Features picked from two batches concatenated (2B rows) and viewed as (B, 2, k): rows 2b and 2b + 1 of the
    concatenation are two examples, not one (a view of cat's output is not told apart, but the pick is no way in)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        both = torch.cat([h, h.flip(-1)])[:, torch.tensor([3, 0, 2, 1])]
        return self.lin(both.view(x.shape[0], 2, 4))  # type: ignore[no-any-return]


def test_features_picked_from_two_concatenated_batches_stay_null() -> None:
    """(The model mixes rows by that view, so no loop is its reference; lin's rows are no example's: null.)"""
    torch.manual_seed(0)
    model = TwoBatchesPicked()
    got, why = batched(model, {"x": torch.randn(4, 3)}, lambda out, i: ((out - 0.5 * i) ** 2).sum(), all_params(model))
    assert got["lin:weight"] is None and "picked by indexing" in str(why["lin:weight"])


class CastTable(nn.Module):
    """`table.to(dtype)[position_ids]`: a cast of the parameter, indexed by the batch's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 4, dtype=torch.float64))
        self.inp, self.lin = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.inp(x) + self.table.to(x.dtype)[:8][position_ids]))  # type: ignore[no-any-return]


def test_a_cast_parameter_table_indexed_by_the_batchs_ids_keeps_the_rows() -> None:
    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 5, 3), "position_ids": torch.randint(0, 8, (4, 5))}
    _check(CastTable(), inputs, lambda out, i: ((out - 0.5 * i) ** 2).sum(), {":table": "is not a layer"},
           all_others=True)  # fmt: skip


class SequenceFirstInside(nn.Module):
    """`lin` on the batch transposed to (T, B, d), its output transposed back for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(torch.tanh(self.inp(x)).transpose(0, 1)).transpose(0, 1)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("length", [4, 5], ids=["B == T", "B != T"])
def test_a_layer_on_the_batch_transposed_when_the_batch_size_equals_the_length(length: int) -> None:
    """B == T: `lin`'s dim 0 is the batch's size but the sequence (found 2026-11-27: lin got 7.28, 8.92, 15.36, 11.90
    for true 0.93, 7.72, 18.15, 18.13, documented as not detected); null now, and the head, transposed back, too
    (which dim is the batch's is not tracked through the transposes). B != T: the shapes tell, the head is exact."""
    torch.manual_seed(0)
    model, inputs = SequenceFirstInside(), {"x": torch.randn(4, length, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    why, nulls = "whose dim 0 was moved there (TransposeBackward", ("lin", "head")
    if length == 5:
        why, nulls = "is not the batch", ("lin",)
    for name in [f"{layer}:{p}" for layer in nulls for p in ("weight", "bias")]:
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if not n.startswith(nulls)}, reasons)


class ScaledParameter(nn.Module):
    """`lin` on a (B, 3) parameter (B rows by coincidence) scaled elementwise, or on the batch scaled by a parameter."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.p, self.scale = how, nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
        self.inp, self.lin = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = {"p * 2": lambda: self.p * 2, "x * p": lambda: x * self.p, "x * scale": lambda: x * self.scale}[self.how]()
        return self.inp(x) + self.lin(q)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["p * 2", "x * p", "x * scale"])
def test_a_layer_on_a_parameter_scaled_elementwise(how: str) -> None:
    """Found 2026-11-27: `lin(p * 2)` got numbers (38.67, 7.70, 3.84, 5.63: the parameter's rows, no example's) while
    `lin(p)` was null; the parameter was taken for a scale of other rows below any elementwise op. Null now where it
    gives the result its dim 0; a parameter broadcast over the batch (`x * scale`) still scales the batch's rows."""
    torch.manual_seed(0)
    model, inputs = ScaledParameter(how), {"x": torch.randn(4, 3)}
    params = [p for p in all_params(model) if p[0].startswith(("inp:", "lin:"))]
    got, reasons = batched(model, inputs, _row_sq, params)
    if how == "x * scale":
        assert_matches(got, loop(model, inputs, _row_sq, params)[0], reasons)
        return
    for name in ("lin:weight", "lin:bias"):  # (and no loop: a row alone meets all of p's rows)
        assert got[name] is None and "made from a parameter of shape (4, 3)" in str(reasons[name]), reasons[name]
    assert got["inp:weight"] is not None


class RawInputTransposed(nn.Module):
    """`lin` on the model's input transposed, or a copy of it; `emb` on the ids transposed: no autograd history."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.lin, self.emb, self.head = how, nn.Linear(3, 4), nn.Embedding(9, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.how == "same":
            return self.head(torch.tanh(self.lin(x) + self.emb(ids)))  # type: ignore[no-any-return]
        t = x.transpose(0, 1) if self.how == "view" else x.transpose(0, 1).contiguous()
        return self.head(torch.tanh(self.lin(t) + self.emb(ids.t())).transpose(0, 1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["view", "copy", "same"])
def test_a_layer_on_the_models_input_transposed_when_the_batch_size_equals_the_length(how: str) -> None:
    """B == T: `lin(x.transpose(0, 1))` on the input given to the model has no autograd node for the walk to see (found
    2026-11-27: lin got 2.69, 0.52, 0.44, 0.90 for true 0.55, 1.39, 1.55, 1.59; emb on `ids.t()` was taken for the
    given ids too). Null now; the input itself, or a view keeping its dim 0, stays exact."""
    torch.manual_seed(0)
    model, inputs = RawInputTransposed(how), {"ids": torch.randint(0, 9, (4, 4)), "x": torch.randn(4, 4, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    ref = loop(model, inputs, _row_sq, params)[0]
    if how == "same":
        assert_matches(got, ref, reasons)
        return
    whys = {"view": "a view of a tensor given to the model whose dim 0 is not", "copy": "without autograd history"}
    for name, why in [("lin:weight", whys[how]), ("lin:bias", whys[how]), ("emb:weight", "a view of a tensor given")]:
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])


class NewDimZero(nn.Module):
    """`lin` on k copies or transforms of the batch's (B, 4) states stacked in a new dim 0 (B pushed to dim 1), then
    summed over it: k == B is a coincidence."""

    def __init__(self, how: str, k: int) -> None:
        super().__init__()
        self.how, self.k, self.inp, self.lin, self.head = how, k, nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, k = torch.tanh(self.inp(x)), self.k
        w = {
            "unsqueeze(0).expand": lambda: h.unsqueeze(0).expand(k, -1, -1),
            "[None].repeat": lambda: h[None].repeat(k, 1, 1),
            "view(1, ...).expand": lambda: h.view(1, *h.shape).expand(k, -1, -1),
            "expand(k, *shape)": lambda: h.expand(k, *h.shape),
            "stack(0)": lambda: torch.stack([h * (j + 1) for j in range(k)], 0),
        }[self.how]()
        return self.head(torch.tanh(self.lin(w)).sum(0))  # type: ignore[no-any-return]


@pytest.mark.parametrize("k", [3, 2], ids=["k == B", "k != B"])
@pytest.mark.parametrize(
    "how", ["unsqueeze(0).expand", "[None].repeat", "view(1, ...).expand", "expand(k, *shape)", "stack(0)"]
)
def test_a_layer_on_a_new_dim_0_over_the_batch(how: str, k: int) -> None:
    """k == B: `lin`'s dim 0 has the batch's size, each of its rows every example (found 2026-11-27: unsqueeze(0).expand
    gave lin's weight 1.12 for every row, true 0.51, 0.50, 3.44; stack 1.11, 2.16, 0.86 for 0.54, 0.53, 3.64). Null
    now; k != B: the shapes tell (not the batch); the other layers stay exact."""
    torch.manual_seed(0)
    model, inputs = NewDimZero(how, k), {"x": torch.randn(3, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    why = "it pushed to dim 1" if k == 3 else "is not the batch"
    for name in ("lin:weight", "lin:bias"):
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if not n.startswith("lin:")}, reasons)


class PastAnOpKeepingDimZero(nn.Module):
    """`lin1` on the batch with dim 0 transposed away (B == T, or B == the features), then `lin2` on its output through
    an op that keeps dim 0 (an expand or repeat of another dim), or `lin1` after a transpose of two other dims."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.lin1, self.lin2 = how, nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, T, 4)
        if self.how == "transpose(1, 2)":
            return self.lin2(torch.tanh(self.lin1(h.transpose(0, 2).transpose(1, 2)))).permute(1, 2, 0)  # type: ignore[no-any-return]  # fmt: skip
        g = torch.tanh(self.lin1(h.transpose(0, 1)))  # (T, B, 4)
        g = g.unsqueeze(2).expand(-1, -1, 2, -1) if self.how == "expand" else g.unsqueeze(2).repeat(1, 1, 2, 1)
        return self.lin2(g).sum(2).transpose(0, 1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["expand", "repeat", "transpose(1, 2)"])
def test_the_walk_goes_past_ops_that_keep_dim_0(how: str) -> None:
    """Found 2026-11-27: an expand or repeat of another dim, or a transpose of two other dims, ended the walk with no
    verdict, so `lin2` on `lin1`'s output expanded got 7.19, 2.89, 2.12, 6.07 (true 0.31, 0.56, 1.59, 1.57), and
    `lin1` after `transpose(0, 2).transpose(1, 2)` 1.01, 0.67, 0.63, 1.16 (true 0.18, 0.44, 0.69, 0.78). The walk
    now goes on below them: null; `inp`, on the batch, stays exact."""
    torch.manual_seed(0)
    model, inputs = PastAnOpKeepingDimZero(how), {"x": torch.randn(4, 4, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("lin1:weight", "lin1:bias", "lin2:weight", "lin2:bias"):
        assert got[name] is None and "cannot be told" in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith("inp:")}, reasons)


class JoinedAfterAMovedDimZero(nn.Module):
    """`lin1` on the batch transposed (B == T: null), then `lin2` on its output joined with itself: a cat along the
    features, or `g - g.mean(0)` (a mean over the sequence, now dim 0: no rows mixed)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.lin1 = how, nn.Linear(3, 4), nn.Linear(4, 4)
        self.lin2 = nn.Linear(8 if how == "cat" else 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.tanh(self.lin1(torch.tanh(self.inp(x)).transpose(0, 1)))  # (T, B, 4)
        g = torch.cat([g, g * g], -1) if self.how == "cat" else g - g.mean(0)
        return self.lin2(g).transpose(0, 1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["cat", "g - g.mean(0)"])
def test_a_layer_fed_by_a_moved_dim_0_through_several_operands(how: str) -> None:
    """Found 2026-11-27: a cat along another dim ended the walk, and below an op of several operands only rows picked by
    indexing counted, so `lin2` got 3.58, 1.29, 1.27, 3.38 after the cat (true 0.49, 0.25, 0.46, 0.59) and 1.36, 0.65,
    0.19, 0.83 after the subtraction (true 0.10, 0.12, 0.58, 0.39). The walk follows a cat along another dim into each
    operand, and a dim 0 moved there counts beside other operands: null; `inp` stays exact."""
    torch.manual_seed(0)
    model, inputs = JoinedAfterAMovedDimZero(how), {"x": torch.randn(4, 4, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("lin2:weight", "lin2:bias"):
        assert got[name] is None and "whose rows are not the batch's ('lin1'" in str(reasons[name]), (
            name,
            reasons[name],
        )
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith("inp:")}, reasons)


_ALONG_OPS = {
    "roll": lambda g: g.roll(1, -1),
    "softmax": lambda g: g.softmax(-1),
    "cumsum": lambda g: g.cumsum(-1),
    "sort": lambda g: g.sort(-1)[0],
    "sum": lambda g: g.unsqueeze(2).expand(-1, -1, 2, -1).sum(2),
    "stack(2)": lambda g: torch.stack([g, g * g], 2).sum(2),
    "roll(1, 0)": lambda g: g.roll(1, 0),
    "flip(0)": lambda g: g.flip(0),
}


class AlongAnotherDim(nn.Module):
    """`lin` on the batch transposed (B == T), then passed through an op along another dim than 0."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.lin = how, nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, B, 4)
        return self.lin(_ALONG_OPS[self.how](g)).transpose(0, 1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", list(_ALONG_OPS))
def test_the_walk_goes_past_ops_along_another_dim(how: str) -> None:
    """Found 2026-11-27: a roll, softmax, cumsum, sort or sum along another dim than 0, a stack along another dim, and a
    roll or flip of dim 0 (a reordering, followed as `x[perm]` is) ended the walk before the transpose, so `lin` got
    numbers (after the roll 2.43, 0.69, 0.37, 3.95 for true 0.49, 0.36, 3.06, 4.07). Null now; `inp` stays exact."""
    torch.manual_seed(0)
    model, inputs = AlongAnotherDim(how), {"x": torch.randn(4, 4, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("lin:weight", "lin:bias"):
        assert got[name] is None and "whose dim 0 was moved there" in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith("inp:")}, reasons)


class TiledRows(nn.Module):
    """`lin` on the batch's (B, 4) states tiled twice along dim 0 and regrouped to (2, B, 4): dim 0 is the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(self.inp(x)).repeat(2, 1).unflatten(0, (2, -1))
        return self.lin(t * torch.tensor([1.0, 2.0]).view(2, 1, 1)).sum(0)  # type: ignore[no-any-return]


def test_a_layer_on_rows_tiled_by_repeat_along_dim_0() -> None:
    """B = 2 copies: found 2026-11-27, the repeat ended the walk, so `lin` got numbers. Null now; `inp` stays exact."""
    torch.manual_seed(0)
    model, inputs = TiledRows(), {"x": torch.randn(2, 3)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("lin:weight", "lin:bias"):
        assert got[name] is None and "tiled along dim 0" in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    assert_matches(got, {n: r for n, r in ref.items() if n.startswith("inp:")}, reasons)
