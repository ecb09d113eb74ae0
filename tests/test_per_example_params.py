"""`PerExampleNorms`: per-example parameter-gradient norms against a per-example loop, on stock layers and transformers.

The reference (`loop`) feeds each batch row alone through the model and backwards its own loss
scaled to its share (a mean loss: loss_i / B), with plain autograd. Tolerance: both sides are float32
(rtol 1e-5 of the norm, atol 1e-5 of the parameter's largest row norm): they compute the same sums in
different orders (Gram matrices over positions against autograd's matmuls on one row), whose rounding
is ~1e-7 of the terms; any wrong term (a position, a padded token, a group, a cross term of tied
weights) moves a norm by far more. Every layer runs under each form: the rule's choice, ghost, materialised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch
from conftest import leftover_hooks
from per_example_reference import LAYERS, B, Net, all_params, assert_matches, batched, gpt2, ids, lm_loss, loop, sq_loss
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner.capturing import per_example_math as pem
from gradrunner.capturing import torch_compat
from gradrunner.capturing.per_example import NO_GRAD, OUTSIDE, PerExampleNorms


@pytest.fixture(params=["rule", "ghost", "materialised"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param != "rule":
        ghost = request.param == "ghost"
        monkeypatch.setattr(pem, "ghost_is_cheaper", lambda f: ghost)
        monkeypatch.setattr(pem, "_pairs_ghost_cheaper", lambda facs: ghost)
    yield str(request.param)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_layer_matches_the_per_example_loop(layer: str, form: str) -> None:
    body, x = LAYERS[layer]()
    model = Net(body)
    params = all_params(model)
    ref, total = loop(model, {"x": x}, sq_loss, params)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, ref, reasons)
    for name, _, p in params:  # the shares sum to .grad: the loop's rows add up to the batch's gradient
        torch.testing.assert_close(total[name], p.grad, rtol=1e-4, atol=1e-5)  # float32 sums: the CPU's order


def test_float64_agrees_to_rounding(form: str) -> None:
    """In float64 the shares are computed in float64: the math itself agrees with the loop to 1e-10."""
    for layer in ("linear_seq", "embedding_pad", "conv2d_groups", "conv2d_grouped_rows", "layer_norm"):
        body, x = LAYERS[layer]()
        model = Net(body).double()
        x = x.double() if x.is_floating_point() else x
        params = all_params(model)
        got, reasons = batched(model, {"x": x}, sq_loss, params)
        assert_matches(got, loop(model, {"x": x}, sq_loss, params)[0], reasons, rtol=1e-10)


class TwiceLinear(nn.Module):
    """One Linear used twice per forward, with a different input each time (its shares add, cross terms too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@pytest.mark.parametrize("shape", [(B, 5), (B, 6, 5)])
def test_a_module_called_twice(shape: tuple[int, ...], form: str) -> None:
    model = TwiceLinear()
    x = torch.randn(shape)
    params = all_params(model)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, loop(model, {"x": x}, sq_loss, params)[0], reasons)


def test_gpt2_every_parameter_tied_lm_head(form: str) -> None:
    """GPT-2 from transformers: Conv1D, LayerNorm, Embedding, and lm_head tied to wte (the shares of both uses summed)."""
    pytest.importorskip("transformers")
    model = gpt2()
    t = 7
    tokens = ids((B, t), 40)
    inputs = {"input_ids": tokens, "position_ids": torch.arange(t).expand(B, t)}  # position rows per example
    params = all_params(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    ref, total = loop(model, inputs, lm_loss, params)
    got, reasons = batched(model, inputs, lm_loss, params)
    assert_matches(got, ref, reasons)
    assert torch.equal(got["lm_head:weight"], got["transformer.wte:weight"])  # type: ignore[arg-type]
    torch.testing.assert_close(total["lm_head:weight"], model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)


def test_gpt2_default_positions_are_not_per_example() -> None:
    """Without position_ids, GPT-2 calls wpe on (1, T): dim 0 is not the batch, so its norms are None, the rest exact."""
    pytest.importorskip("transformers")
    model = gpt2()
    inputs = {"input_ids": ids((B, 6), 40)}
    got, reasons = batched(model, inputs, lm_loss, all_params(model))
    assert got["transformer.wpe:weight"] is None
    assert "dim 0 (1) is not the batch (4 rows)" in str(reasons["transformer.wpe:weight"])
    assert sum(v is None for v in got.values()) == 1


def test_bert_every_parameter() -> None:
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
    model = transformers.BertForSequenceClassification(cfg)
    t = 6
    inputs = {"input_ids": ids((B, t), 30), "position_ids": torch.arange(t).expand(B, t),
              "token_type_ids": (torch.arange(t) > 2).long().expand(B, t)}  # fmt: skip

    def cls_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits, torch.tensor([i % 3]), reduction="sum")  # type: ignore[attr-defined]

    params = all_params(model)
    got, reasons = batched(model, inputs, cls_loss, params)
    assert_matches(got, loop(model, inputs, cls_loss, params)[0], reasons)


@pytest.mark.parametrize("mode", ["training", "eval without running statistics"])
def test_batch_norm_in_training_mixes_rows(mode: str) -> None:
    """BatchNorm on batch statistics: its parameters and those called before it get None; the head after it is exact.
    In eval mode with track_running_stats=False the reason said "(training mode)" (found 2026-11-27)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=mode == "training"), nn.Tanh(),
                          nn.Linear(4, 2))  # fmt: skip
    model.train(mode == "training")
    x = torch.randn(B, 3)
    params = all_params(model)
    got, reasons = batched(model, {"input": x}, sq_loss, params)
    said = "(training mode)" if mode == "training" else "(track_running_stats=False: it keeps none)"
    for name in ("1:weight", "1:bias"):
        assert got[name] is None and f"batch's statistics {said}" in str(reasons[name])
    for name in ("0:weight", "0:bias"):
        assert got[name] is None and "mixes rows" in str(reasons[name]) and "'1'" in str(reasons[name])
    out = model(x)  # the head's rows: each row's loss backwarded alone through the batch's forward
    for name in ("3:weight", "3:bias"):
        p = dict((n, p) for n, _, p in params)[name]
        ref = torch.stack([torch.autograd.grad(sq_loss(out[i : i + 1], i) / B, p, retain_graph=True)[0].double().norm()
                           for i in range(B)])  # fmt: skip
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-7)


def test_accumulation_concatenates_micro_batches() -> None:
    model = TwiceLinear()
    xs = [torch.randn(3, 6, 5), torch.randn(2, 6, 5)]
    params = all_params(model)
    with PerExampleNorms(model, params) as pex:
        for x in xs:
            (sum(sq_loss(model(x)[i : i + 1], i) for i in range(x.shape[0])) / x.shape[0] / len(xs)).backward()
        got, reasons = pex.norms(), pex.reasons()
    refs = [loop(model, {"x": x}, lambda out, i: sq_loss(out, i) / len(xs), params)[0] for x in xs]
    assert_matches(got, {n: torch.cat([r[n] for r in refs]) for n in refs[0]}, reasons)
    with PerExampleNorms(model, params) as pex:  # head only in the second micro-batch: zeros for the first's rows
        model.lin(xs[0]).sum().backward()
        model(xs[1]).sum().backward()
        assert torch.equal(pex.norms()["head:weight"][:3], torch.zeros(3, dtype=torch.float64))  # type: ignore[index]


def test_a_forward_without_backward_between_micro_batches_has_no_rows() -> None:
    """Forwards never backwarded (a metric's, gradients on) before, between and after two micro-batches: 3 + 2 rows."""
    model = TwiceLinear()
    xs = [torch.randn(3, 6, 5), torch.randn(2, 6, 5)]
    params = all_params(model)
    with PerExampleNorms(model, params) as pex:
        for x in xs:
            (sum(sq_loss(model(x)[i : i + 1], i) for i in range(x.shape[0])) / x.shape[0] / len(xs)).backward()
            model(torch.randn(7, 6, 5)).sum()
        got, reasons = pex.norms(), pex.reasons()
    refs = [loop(model, {"x": x}, lambda out, i: sq_loss(out, i) / len(xs), params)[0] for x in xs]
    assert_matches(got, {n: torch.cat([r[n] for r in refs]) for n in refs[0]}, reasons)


def test_float32_ghost_norms_of_a_row_whose_positions_nearly_cancel(form: str) -> None:
    """A row's positions with nearly equal inputs and weights summing to ~0: its share is small against each
    position's term. The float32 ghost norm (Gram matrices squared the cancellation) was off by 3% to 11% (found
    2026-11-27); the loop and the materialised form agree to 1e-6. Against the float64 exact norms here."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    t = 16  # T (p + q) <= p q: the rule picks ghost
    x = torch.randn(B, 1, 64).expand(B, t, 64) + 1e-3 * torch.randn(B, t, 64)
    w = torch.randn(B, t)
    w = w - w.mean(1, keepdim=True)
    w[0] += 1.0 / t
    r = torch.randn(64)
    with PerExampleNorms(lin, [("weight", lin, lin.weight)]) as pex:
        ((lin(x) @ r) * w).sum().div(B).backward()
        got = pex.norms()["weight"]
    exact = torch.stack([torch.outer(r.double(), w[i].double() @ x[i].double()).norm() / B for i in range(B)])
    assert got is not None
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=0)


def test_transparent_and_hooks_removed() -> None:
    """Loss and every .grad bit-identical with and without, dropout on (no RNG drawn), in-place ReLU after a Linear."""
    pytest.importorskip("transformers")
    gpt_inputs = {"input_ids": ids((B, 6), 40), "position_ids": torch.arange(6).expand(B, 6)}
    for make, inputs in ((lambda: gpt2(dropout=0.1), gpt_inputs),
                         (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)),
                          {"input": torch.randn(B, 4)})):  # fmt: skip
        results = []
        for on in (False, True):
            torch.manual_seed(0)
            model = make()
            with PerExampleNorms(model, all_params(model)) if on else contextlib.nullcontext() as pex:
                out = model(**inputs)
                loss = sum(sq_loss(o.unsqueeze(0), i) for i, o in enumerate(getattr(out, "logits", out)))
                loss.backward()
                if pex is not None:
                    assert all(v is not None for v in pex.norms().values()), pex.reasons()
            results.append((loss, [p.grad for p in model.parameters()]))
            assert not leftover_hooks(model)
        (l0, g0), (l1, g1) = results
        assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_hooks_removed_on_exception() -> None:
    model = TwiceLinear()
    with pytest.raises(KeyError), PerExampleNorms(model, all_params(model)):
        model(torch.randn(B, 5)).sum().backward()
        raise KeyError("boom")
    assert not leftover_hooks(model)


class OutsideUse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(x) + x @ self.lin.weight.T)  # lin.weight also used outside lin's call


def test_parameter_used_outside_its_module_gets_none() -> None:
    model = OutsideUse()
    got, reasons = batched(model, {"x": torch.randn(B, 4)}, sq_loss, all_params(model))
    assert got["lin:weight"] is None and reasons["lin:weight"] == OUTSIDE
    assert got["lin:bias"] is not None and got["head:weight"] is not None
    plain = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    with PerExampleNorms(plain, all_params(plain)) as pex:  # a weight penalty in the loss: not a row's
        (plain(torch.randn(B, 4)).square().mean() + 1e-2 * plain[0].weight.square().sum()).backward()
        assert pex.norms()["0:weight"] is None and pex.reasons()["0:weight"] == OUTSIDE
        assert pex.norms()["1:weight"] is not None


def test_unsupported_and_unbatched_get_reasons() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.mha = nn.MultiheadAttention(4, 2, batch_first=True)  # calls out_proj's weight functionally
            self.flat = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.rnn(x)[0]
            h = self.mha(h, h, h)[0]
            return self.flat(h.transpose(0, 1).reshape(-1, 4)).view(x.shape[0], -1)  # (T*B, 4): not the batch's rows

    model = Model()
    got, reasons = batched(model, {"x": torch.randn(B, 5, 3)}, sq_loss, all_params(model))
    assert got["rnn:weight_ih_l0"] is None and "GRU is not a layer" in str(reasons["rnn:weight_ih_l0"])
    assert got["flat:weight"] is None and "dim 0 (20) is not the batch (4 rows)" in str(reasons["flat:weight"])
    assert got["unused:weight"] is None and reasons["unused:weight"] == NO_GRAD
    assert "MultiheadAttention is not a layer" in str(reasons["mha:in_proj_weight"])
    assert reasons["mha.out_proj:weight"] == OUTSIDE


def test_a_parameter_frozen_at_open_gets_norms_once_unfrozen() -> None:
    """Gradual unfreezing: frozen in a step, null with the reason; unfrozen later, the loop's norms (and checked)."""
    torch.manual_seed(0)
    model = Net(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    params, x = all_params(model), torch.randn(B, 3)
    model.body[0].requires_grad_(False)
    with PerExampleNorms(model, params) as pex:
        (sum(sq_loss(model(x=x)[i : i + 1], i) for i in range(B)) / B).backward()
        frozen, why, head = pex.norms()["body.0:weight"], pex.reasons()["body.0:weight"], pex.norms()["body.2:weight"]
        model.body[0].requires_grad_(True)
        model.zero_grad(set_to_none=True)
        (sum(sq_loss(model(x=x)[i : i + 1], i) for i in range(B)) / B).backward()
        got, reasons = pex.norms(), pex.reasons()
    assert frozen is None and why == "parameter does not require grad (frozen)" and head is not None
    assert_matches(got, loop(model, {"x": x}, sq_loss, params)[0], reasons)
    assert not leftover_hooks(model)


def test_norms_end_the_step_and_no_grad_forwards_are_ignored() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(B, 3)
    with PerExampleNorms(model, all_params(model)) as pex:
        model(x).square().sum().backward()
        first = pex.norms()["0:weight"]
        assert torch.equal(pex.norms()["0:weight"], first)  # type: ignore[arg-type]
        with torch.no_grad():
            model(torch.randn(7, 3))
        model(x[:2]).square().sum().backward()
        second = pex.norms()["0:weight"]
    assert second is not None and second.shape == (2,)
    torch.testing.assert_close(second, first[:2])  # type: ignore[index]


def test_checkpointing_and_torch_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under activation checkpointing (non-reentrant: the recomputed calls ignored; reentrant: they are the calls
    backward sees) and with torch internals forced to their fallbacks."""
    block = nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5), nn.Tanh())
    head = nn.Linear(5, 2)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head, self.reentrant = block, head, False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))

    model, x = Model(), torch.randn(B, 3, 5, requires_grad=True)
    params = all_params(model)
    for model.reentrant in (False, True):
        ref = loop(model, {"x": x}, sq_loss, params)[0]
        got, reasons = batched(model, {"x": x}, sq_loss, params)
        assert_matches(got, ref, reasons)
    monkeypatch.setitem(torch_compat.FEATURES, "get_gradient_edge", False)
    monkeypatch.setitem(torch_compat.FEATURES, "tensor_version", False)
    plain = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))
    p2 = all_params(plain)
    got, reasons = batched(plain, {"input": x}, sq_loss, p2)
    assert_matches(got, loop(plain, {"input": x}, sq_loss, p2)[0], reasons)


def test_autocast_bfloat16_close_to_the_loop_under_autocast() -> None:
    """Under CPU autocast the Linear runs in bf16: shares from the bf16 input cast, to bf16's rounding (2e-2)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(B, 5, 6)
    params = all_params(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loop(model, {"input": x}, lambda o, i: sq_loss(o.float(), i), params)[0]
        got, reasons = batched(model, {"input": x}, lambda o, i: sq_loss(o.float(), i), params)
    assert_matches(got, ref, reasons, rtol=2e-2)


def test_the_rule_picks_ghost_for_short_sequences_and_materialises_long_ones() -> None:
    def f(t: int, p: int, q: int) -> pem.Factors:
        return pem.Factors(torch.zeros(1, 1, t, p), torch.zeros(1, 1, t, q), p)

    assert pem.ghost_is_cheaper(f(1, 3, 3))  # a 2-D Linear: always
    assert pem.ghost_is_cheaper(f(128, 768, 3072))  # 2 T (p + q) = 983k <= p q = 2.4M
    assert not pem.ghost_is_cheaper(f(64, 128, 384))  # 2 T (p + q) = 65k > p q = 49k: float64 Gram matrices cost twice
    assert not pem.ghost_is_cheaper(f(1024, 64, 64))  # a conv's 32x32 positions over 64 channels
    index = pem.Factors(torch.zeros(1, 1, 64, dtype=torch.long), torch.zeros(1, 1, 64, 8), 100)
    assert not pem.ghost_is_cheaper(index) and pem.ghost_is_cheaper(pem.Factors(index.left[..., :8], index.right[:, :, :8], 100))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("mode", ["bf16 model", "bf16 autocast", "fp16 model"])
def test_rms_norm_default_eps_on_low_precision_input_is_float32s(mode: str) -> None:
    """RMSNorm(eps=None) on a bf16/fp16 input computes in float32 with float32's epsilon (not the input dtype's):
    with small inputs (RMS ~0.1) bf16's epsilon 0.0078 moved the rows by 10%; to bf16's rounding here (2e-2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(0.2)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(B, 5, 16)
    if mode != "bf16 autocast":
        dtype = torch.bfloat16 if mode == "bf16 model" else torch.float16
        model, x = model.to(dtype), x.to(dtype)
    params = [p for p in all_params(model) if p[0] == "1:weight"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
        ref = loop(model, {"input": x}, lambda o, i: sq_loss(o.float(), i), params)[0]
        got, reasons = batched(model, {"input": x}, lambda o, i: sq_loss(o.float(), i), params)
    assert_matches(got, ref, reasons, rtol=2e-2)


@pytest.mark.parametrize("sizes", [(B, B), (B, B + 2)], ids=["equal sizes", "unequal sizes"])
def test_one_backward_through_two_forwards_is_null_never_rows_summed_by_index(sizes: tuple[int, int]) -> None:
    """Two forwards on different examples, one backward of their summed losses: row i of each is another example.
    With equal sizes the rows were the norms of g(x1_i) + g(x2_i), silently (found 2026-11-27); now None, with why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    x1, x2 = torch.randn(sizes[0], 6), torch.randn(sizes[1], 6)
    params = all_params(model)
    with PerExampleNorms(model, params) as pex:
        (model(x1).square().sum() + model(x2).square().sum()).backward()
        norms, reasons = pex.norms(), pex.reasons()
    said = "one backward reached 2 forwards of the model given different batch tensors"
    for name, _, _ in params:
        assert norms[name] is None and said in str(reasons[name])
    with PerExampleNorms(model, params) as pex:  # the same rows, a backward after each forward: exact, 2 micro-batches
        for x in (x1, x2):
            (model(x).square().sum() / len(x)).backward()
        norms, reasons = pex.norms(), pex.reasons()
    refs = [loop(model, {"input": x}, lambda out, i: out.square().sum(), params)[0] for x in (x1, x2)]
    assert_matches(norms, {n: torch.cat([r[n] for r in refs]) for n in refs[0]}, reasons)


class InPlaceAfter(nn.Module):
    """A Linear's output changed in place: ReLU(inplace=True), then a residual added with `+=`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(5, 5), nn.ReLU(inplace=True)
        self.up, self.head = nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))
        h2 = self.up(h)
        h2 += x
        return self.head(h2)  # type: ignore[no-any-return]


@pytest.mark.parametrize("shape", [(B, 5), (B, 6, 5)])
def test_an_in_place_op_on_a_layers_output_keeps_its_rows(shape: tuple[int, ...]) -> None:
    """On 3-D input a Linear's output is a view of its matmul's; changed in place its autograd node was dropped, so
    no share arrived and the weight was null as "used outside them" (found 2026-11-27): now exact."""
    torch.manual_seed(0)
    model, x = InPlaceAfter(), torch.randn(shape)
    params = all_params(model)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    assert_matches(got, loop(model, {"x": x}, sq_loss, params)[0], reasons)


class CheckpointedBN(nn.Module):
    """A training-mode BatchNorm inside an activation checkpoint, a head after it."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.blk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.blk(h) if self.reentrant is None else checkpoint(self.blk, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["no checkpoint", "non-reentrant", "reentrant"])
def test_a_head_after_a_checkpointed_batch_norm_is_exact(reentrant: bool | None) -> None:
    """In a reentrant checkpoint the BatchNorm is recomputed during backward, after the head's call: the head was null
    as "called before" it (found 2026-11-27). Those before it are null, the head exact (each row's loss backwarded
    alone through the batch's forward)."""
    torch.manual_seed(0)
    model, x = CheckpointedBN(reentrant), torch.randn(5, 3)
    params = all_params(model)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    for name in ("a:weight", "blk.0:weight"):
        assert got[name] is None and "called before 'blk.1'" in str(reasons[name])
    out = model(x)
    head = model.head.weight
    ref = torch.stack([torch.autograd.grad(sq_loss(out[i : i + 1], i) / 5, head, retain_graph=True)[0].double().norm()
                       for i in range(5)])  # fmt: skip
    assert got["head:weight"] is not None, reasons["head:weight"]
    torch.testing.assert_close(got["head:weight"], ref, rtol=1e-5, atol=1e-7)


def test_the_check_follows_a_parameter_made_float64_mid_session() -> None:
    """`model.double()` inside the block: the check's projection vectors stayed float32, so a float64 gradient below
    float32's range (a loss scaled by 1e-60) projected to 0 against its calls' float64 terms, and every row was null,
    "used outside them", where each row alone gives its norm. They follow the parameter now; a weight penalty after
    the move is still caught, and a move between two micro-batches of a step keeps both micro-batches' rows."""
    scale = 1e-60
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    params = all_params(model)
    x = torch.randn(B, 5)
    with PerExampleNorms(model, params) as pex:
        model(x).pow(2).sum().backward()
        pex.norms()
        model.zero_grad(set_to_none=True)
        model.double()
        (model(x.double()).pow(2).sum() * scale).backward()
        got, reasons = pex.norms(), pex.reasons()
        want = loop(model, {"input": x.double()}, lambda out, i: out.pow(2).sum() * scale * B, params)[0]
        assert_matches(got, want, reasons)
        (scale * (model(x.double()).pow(2).sum() + 1e-2 * model[2].weight.pow(2).sum())).backward()
        assert pex.norms()["2:weight"] is None and pex.reasons()["2:weight"] == OUTSIDE
    model.float()
    a, b = x[:2], x[2:]
    want_a = loop(model, {"input": a}, lambda out, i: out.pow(2).sum() * 2, params)[0]
    want_b = loop(model.double(), {"input": b.double()}, lambda out, i: out.pow(2).sum() * 2, params)[0]
    model.float()
    with PerExampleNorms(model, params) as pex:
        model(a).pow(2).sum().backward()
        model.double()
        model(b.double()).pow(2).sum().backward()
        assert_matches(pex.norms(), {n: torch.cat([want_a[n], want_b[n]]) for n in want_a}, pex.reasons())
