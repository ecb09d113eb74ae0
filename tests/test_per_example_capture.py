"""`capture(..., per_example=True)` on parameter taps: each row's share of `.grad`, against a per-example loop.

The reference is `per_example_reference.loop` (each row alone through the model, its own loss
scaled to its share, plain autograd); the layers are its `LAYERS` (stock torch.nn: Linear on 2-D
and sequence inputs, Embedding with padding_idx, Conv1d/2d/3d with every padding mode, LayerNorm,
RMSNorm, GroupNorm, eval BatchNorm) and a tiny random-init GPT-2 (transformers' Conv1D, a tied
lm_head). Every strategy. Tolerance as there: float32 both sides, rtol 1e-5.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch
from conftest import EveryExpert
from per_example_reference import LAYERS, B, Net, Params, all_params, assert_matches, gpt2, lm_loss, loop, row, sq_loss
from torch import nn

from gradrunner import capture
from gradrunner.capturing.per_example_check import PerExampleWarning
from gradrunner.records.columns import StepRecords

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]


def by_tap(recs: StepRecords) -> dict[str, dict[str, object]]:
    return {recs.row(i)["tap"]: recs.row(i) for i in range(len(recs))}  # type: ignore[misc]


def captured(model: nn.Module, inputs: dict[str, torch.Tensor], rows_loss, params: Params,  # type: ignore[no-untyped-def]
             strategy: str, taps: list[str] | None = None) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None], StepRecords]:  # fmt: skip
    """One step under capture: each parameter tap's `per_example_norm` (float64 tensor or None) and `reason`."""
    model.zero_grad(set_to_none=True)
    with capture(model, taps or [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        out = model(**inputs)
        rows = next(iter(inputs.values())).shape[0]
        loss = sum(rows_loss(row(out, i), i) for i in range(rows)) / rows
        cap.backward(loss)
        recs = cap.records(loss)
    got: dict[str, torch.Tensor | None] = {}
    why: dict[str, str | None] = {}
    for tap, r in by_tap(recs).items():
        pe = r["per_example_norm"]
        got[tap] = None if pe is None else torch.from_numpy(np.asarray(pe, dtype=np.float64))
        why[tap] = r["reason"]  # type: ignore[assignment]
    return got, why, recs


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_layer_through_capture(layer: str, strategy: str) -> None:
    torch.manual_seed(0)
    body, x = LAYERS[layer]()
    model = Net(body)
    params = all_params(model)
    ref, _ = loop(model, {"x": x}, sq_loss, params)
    got, why, recs = captured(model, {"x": x}, sq_loss, params, strategy)
    assert_matches(got, ref, why)
    assert all(r is None for r in why.values())
    for name, _, p in params:  # the record is still the whole .grad's
        rec = by_tap(recs)[name]
        assert rec["has_grad"] and rec["norm"] == pytest.approx(p.grad.double().norm().item(), rel=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tiny_gpt2_tied_lm_head_through_capture(strategy: str) -> None:
    """transformers' GPT-2 (random init): Conv1D, LayerNorm, both embeddings, and lm_head tied to wte (both uses summed)."""
    torch.manual_seed(0)
    model = gpt2()
    params = all_params(model)  # lm_head:weight and transformer.wte:weight: one Parameter
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs = {"input_ids": torch.randint(0, 40, (3, 6)), "position_ids": torch.arange(6).expand(3, 6)}
    ref, _ = loop(model, inputs, lm_loss, params)
    got, why, _ = captured(model, inputs, lm_loss, params, strategy)
    assert_matches(got, ref, why)
    torch.testing.assert_close(got["lm_head:weight"], got["transformer.wte:weight"], rtol=0, atol=0)


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_norm_in_training_gives_null_with_the_reason(strategy: str) -> None:
    """Rows mix through batch statistics: fc1 (before it) and bn itself are null with why; fc2 (after it) is exact."""
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(5, 4)
    taps = ["fc1:weight", "bn:weight", "fc2:weight", "fc2:bias"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, why, recs = captured(model, {"x": x}, sq_loss, all_params(model), strategy, taps)
    said = {str(w.message).split()[4]: str(w.message) for w in caught if issubclass(w.category, PerExampleWarning)}
    assert sorted(said) == ["bn:weight", "fc1:weight"]
    for tap in ("fc1:weight", "bn:weight"):
        assert got[tap] is None and by_tap(recs)[tap]["has_grad"]
        assert why[tap] is None  # CONTRACT: `reason` says why has_grad is false, null otherwise; the warning says why
        assert said[tap].startswith(f"per_example_norm of parameter tap {tap} is null: ") and "statistics" in said[tap]
    # fc2's rows: a per-example loop with bn's batch statistics frozen at this batch's (the mixing is upstream)
    assert got["fc2:weight"] is not None and got["fc2:weight"].shape == (5,) and why["fc2:weight"] is None
    h = torch.tanh(model.bn(model.fc1(x))).detach()
    head = Net(model.fc2)
    ref, _ = loop(head, {"x": h}, sq_loss, [("fc2:weight", model.fc2, model.fc2.weight), ("fc2:bias", model.fc2, model.fc2.bias)])
    assert_matches({k: got[k] for k in ref}, ref, why)


class Outside(nn.Module):
    """fc's weight also used directly in the forward: its gradient is not its calls' shares."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x @ self.fc.weight


def test_a_parameter_used_outside_its_module_is_null_never_wrong() -> None:
    model = Outside()
    with pytest.warns(PerExampleWarning, match="fc:weight is null: .*outside"):
        got, why, recs = captured(model, {"x": torch.randn(3, 4)}, sq_loss, all_params(model), "hook")
    assert got["fc:weight"] is None and why["fc:weight"] is None and by_tap(recs)["fc:weight"]["has_grad"]
    assert got["fc:bias"] is not None


class Branch(nn.Module):
    """A conditional branch (MoE-style): a micro-batch may use `b` and never `a`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_b: bool = False) -> torch.Tensor:
        return self.b(x) if use_b else self.a(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("taps", [["a:weight"], ["a:weight", "b:weight"]], ids=["a alone", "a and b"])
def test_a_micro_batch_that_skips_a_layer_keeps_its_rows_as_zeros(strategy: str, taps: list[str]) -> None:
    """N micro-batches give N x B rows in order: zeros for the rows of one that did not use the parameter, also
    when no tapped layer was called in it (the rows vanished then, shifting the others: found 2026-11-27)."""
    torch.manual_seed(0)
    m = Branch()
    micro = [(torch.randn(2, 3), True), (torch.randn(3, 3), False), (torch.randn(2, 3), True)]
    y = torch.tensor([0.5, -0.5])
    want = []  # each row alone, its loss / (B * N)
    for x, use_b in micro:
        for i in range(x.shape[0]):
            m.zero_grad(set_to_none=True)
            (((m(x[i : i + 1], use_b) - y) ** 2).sum() / x.shape[0] / len(micro)).backward()
            want.append(0.0 if m.a.weight.grad is None else float(m.a.weight.grad.norm()))
    m.zero_grad(set_to_none=True)
    with capture(m, taps, strategy=strategy, per_example=True) as cap:
        for x, use_b in micro:
            loss = ((m(x, use_b) - y) ** 2).sum(1).mean() / len(micro)
            cap.backward(loss)
        got = by_tap(cap.records(loss))["a:weight"]["per_example_norm"]
    assert got is not None
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_expert_called_on_no_tokens_has_no_rows_not_a_crash(strategy: str) -> None:
    """Found 2026-11-27: with per_example=True the (0, 4) gradient of expert 2's output raised inside backward
    ('cannot reshape tensor of 0 elements into shape [0, -1]'). Its record has no rows; the other experts' rows are
    their gradients' row norms (plain tensor hooks), the head's per-example norms the loop's."""
    torch.manual_seed(0)
    model, x = EveryExpert(), torch.randn(5, 3)
    seen: dict[int, torch.Tensor] = {}

    def keep(e: int, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__(e, g))

    hooks = [ex.register_forward_hook(lambda m, a, out, e=e: keep(e, out)) for e, ex in enumerate(model.experts)]
    ((model(x) - 0.5) ** 2).mean().backward()
    for hook in hooks:
        hook.remove()
    params = [("head:weight", model.head, model.head.weight)]
    taps = ["experts.*:output", "head:weight"]
    got, _, recs = captured(model, {"x": x}, lambda out, i: ((out - 0.5) ** 2).sum(), params, strategy, taps)
    rows = by_tap(recs)
    assert rows["experts.2:output"]["has_grad"] and rows["experts.2:output"]["numel"] == 0
    for e in range(3):
        want = seen[e].double().norm(dim=1).numpy()
        assert want.shape == ((0,) if e == 2 else want.shape) and got[f"experts.{e}:output"] is not None
        np.testing.assert_allclose(got[f"experts.{e}:output"].numpy(), want, rtol=1e-6)  # type: ignore[union-attr]
    assert_matches(got, loop(model, {"x": x}, lambda out, i: ((out - 0.5) ** 2).sum(), params)[0], {})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_forward_never_backwarded_adds_no_rows(strategy: str) -> None:
    """A metric's forward with gradients on after the step's backward (never backwarded) added 3 zero rows to the
    step's 4, and `noise_scale` then took B = 7 (found 2026-11-27): a micro-batch is a backward that fills `.grad`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    params = all_params(model)
    x = torch.randn(B, 5)
    ref, _ = loop(model, {"input": x}, sq_loss, params)
    with capture(model, [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        out = model(x)
        loss = sum(sq_loss(out[i : i + 1], i) for i in range(B)) / B
        cap.backward(loss)
        model(torch.randn(3, 5)).abs().mean()  # a metric, gradients on, no backward
        rows = by_tap(cap.records(loss))
    got = {n: torch.from_numpy(np.asarray(rows[n]["per_example_norm"], dtype=np.float64)) for n in ref}
    assert_matches(got, ref, {n: rows[n]["reason"] for n in ref})  # type: ignore[misc]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forwards_dropped_before_the_backward_hold_no_layer_inputs(strategy: str) -> None:
    """30 forwards with gradients on before the step's backward, each output dropped (an evaluation loop that forgot
    `torch.no_grad()`): each layer call's record kept the layer's input until the step ended, 30 inputs of `2` alive
    (320 MiB over 40 forwards of a 4096x256 batch). They go with the forward's graph now; the step's per-example norms
    are still the per-row loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))
    params = all_params(model)
    x, x_eval = torch.randn(B, 5), torch.randn(7, 5)
    ref, _ = loop(model, {"input": x}, sq_loss, params)
    with capture(model, [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        for _ in range(30):
            float(model(x_eval).sum())
        gc.collect()
        held = sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == (7, 6))
        out = model(x)
        loss = sum(sq_loss(out[i : i + 1], i) for i in range(B)) / B
        cap.backward(loss)
        rows = by_tap(cap.records(loss))
    got = {n: torch.from_numpy(np.asarray(rows[n]["per_example_norm"], dtype=np.float64)) for n in ref}
    assert_matches(got, ref, {n: rows[n]["reason"] for n in ref})  # type: ignore[misc]
    assert held <= 1, f"{held} inputs of layer 2 from dropped forwards held"


class NanoPositions(nn.Module):
    """nanoGPT's embeddings: `wte(idx) + wpe(arange(T))`, the positions made inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(10, 4), nn.Embedding(8, 4), nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))))  # type: ignore[no-any-return]


@pytest.mark.parametrize("T", [4, 5], ids=["B == T", "B != T"])
def test_position_ids_made_inside_the_forward_are_never_taken_for_the_batch(T: int) -> None:
    """With B == T, `wpe(arange(T))` has dim 0 of the batch's size: its rows were taken for the batch's (wrong
    numbers, found 2026-11-27). Null with the reason; `wte`, called on the batch's own ids, stays exact."""
    torch.manual_seed(0)
    model, idx = NanoPositions(), torch.randint(0, 10, (4, T))

    def row_loss(out: torch.Tensor, i: int) -> torch.Tensor:
        return ((out - 0.3 * (i + 1)) ** 2).sum()

    want = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        (row_loss(model(idx[i : i + 1]), i) / 4).backward()
        want.append(float(model.wte.weight.grad.norm()))  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture(model, ["wte:weight", "wpe:weight"], strategy="hook", per_example=True) as cap:
            out = model(idx)
            loss = sum(row_loss(out[i : i + 1], i) for i in range(4)) / 4
            loss.backward()
            rows = by_tap(cap.records(loss))
    assert rows["wpe:weight"]["per_example_norm"] is None
    why = _said(caught)["wpe:weight"]
    assert ("made inside the forward" if T == 4 else "is not the batch") in why
    np.testing.assert_allclose(np.asarray(rows["wte:weight"]["per_example_norm"]), want, rtol=1e-5)


def test_t5s_relative_position_buckets_are_not_rows_when_the_batch_size_equals_the_length() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=30, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.0)
    model = transformers.T5EncoderModel(config)
    ids = torch.randint(0, 30, (4, 4))
    tap = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias:weight"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture(model, [tap, "shared:weight"], strategy="hook", per_example=True) as cap:
            loss = model(input_ids=ids).last_hidden_state.pow(2).sum()
            cap.backward(loss)
            rows = by_tap(cap.records(loss))
    assert rows[tap]["per_example_norm"] is None and "made inside the forward" in _said(caught)[tap]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sequence_first_model_is_null_with_the_reason(strategy: str) -> None:
    """torch's default `batch_first=False`: dim 0 of the model's input is the sequence; its rows are positions."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
    x = torch.randn(5, 3, 8)  # (T, B, E)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture(model, ["linear1:weight", "norm1:weight"], strategy=strategy, per_example=True) as cap:
            loss = model(x).pow(2).sum()
            cap.backward(loss)
            rows = by_tap(cap.records(loss))
    for tap in ("linear1:weight", "norm1:weight"):
        assert rows[tap]["per_example_norm"] is None and "batch_first=False" in _said(caught)[tap], tap


def _said(caught: list[warnings.WarningMessage]) -> dict[str, str]:
    """Each parameter tap's null reason, as its PerExampleWarning says it."""
    return {str(w.message).split()[4]: str(w.message) for w in caught if issubclass(w.category, PerExampleWarning)}
