"""Per-example norms of layers called on the batch's tokens flattened to (B T, d) rows (`per_example_tokens`).

`x.view(-1, d)` before an MLP, Qwen2-MoE's `shared_expert` and `shared_expert_gate`: each row's share is the sum over
its T tokens, exact (null before 2026-11-27: 'dim 0 is not the batch'). Checked against a per-example loop for
Linear, transformers' Conv1D, LayerNorm, RMSNorm, Embedding and biases, a gated MLP on them, every strategy,
accumulation, bf16 autocast and a weight used flattened and not; and null with the reason where the tokens are not
provably the batch's rows flattened (B == T, so shapes alone do not tell).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from per_example_reference import all_params, assert_matches, batched, loop, row, tiny_moe
from torch import nn

from gradrunner import capture
from gradrunner.capturing import per_example_rows

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
B, T, D = 4, 5, 6


class FlatMLP(nn.Module):
    """LayerNorm, then the tokens flattened (`how`), a gated MLP, an RMSNorm and transformers' Conv1D on them; a head
    on the rows reshaped back. `tied`: the head is `up` again, called on the batch's (B, T, d) rows."""

    def __init__(self, how: str = "view", tied: bool = False) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.how, self.tied = how, tied
        self.emb, self.ln, self.rms = nn.Embedding(11, D, padding_idx=0), nn.LayerNorm(D), nn.RMSNorm(D)
        self.gate, self.up, self.down, self.c = nn.Linear(D, 8), nn.Linear(D, 8), nn.Linear(8, D), Conv1D(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.ln(self.emb(ids.view(-1)).view(b, t, D) if self.how == "ids" else self.emb(ids))
        flat = {"view": lambda: h.view(-1, D), "reshape": lambda: h.reshape(b * t, D), "flatten": lambda: h.flatten(0, 1),
                "ids": lambda: h.view(-1, D)}[self.how]()  # fmt: skip
        y = flat + self.down(nn.functional.silu(self.gate(flat)) * self.up(flat))
        y = self.c(self.rms(y)).view(b, t, D)
        return self.up(y) if self.tied else self.head(y)  # type: ignore[no-any-return]


def ids(rows: int = B, length: int = T) -> torch.Tensor:
    return torch.randint(1, 11, (rows, length), generator=torch.Generator().manual_seed(rows * 10 + length))


def sq(out: torch.Tensor, i: int) -> torch.Tensor:
    return ((out.float() - 0.3 * (i + 1)) ** 2).sum()


@pytest.mark.parametrize("how", ["view", "reshape", "flatten", "ids"])
def test_every_layer_on_flattened_tokens_matches_the_loop(how: str) -> None:
    torch.manual_seed(0)
    model = FlatMLP(how)
    params = all_params(model)
    got, why = batched(model, {"ids": ids()}, sq, params)
    assert all(r is None for r in why.values()), why
    assert_matches(got, loop(model, {"ids": ids()}, sq, params)[0], why)


def test_a_weight_used_on_flattened_tokens_and_on_the_rows_sums_both_shares() -> None:
    """`up` called on the (B T, d) tokens and on the (B, T, d) rows: row i's shares of both calls summed."""
    torch.manual_seed(0)
    model = FlatMLP(tied=True)
    params = [p for p in all_params(model) if not p[0].startswith("head:")]  # (not called)
    got, why = batched(model, {"ids": ids()}, sq, params)
    assert all(r is None for r in why.values()), why
    assert_matches(got, loop(model, {"ids": ids()}, sq, params)[0], why)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_through_capture_with_accumulation(strategy: str) -> None:
    """Two micro-batches of 3 rows, each loss / 2: six rows, each its share of the accumulated .grad."""
    torch.manual_seed(0)
    model = FlatMLP()
    params = all_params(model)
    chunks = [ids(3, 4), ids(3, 4) % 7 + 1]
    with capture(model, [n for n, _, _ in params], strategy=strategy, per_example=True) as cap:
        for chunk in chunks:
            out = model(chunk)
            cap.backward(sum(sq(row(out, i), i) for i in range(3)) / 6)  # type: ignore[arg-type]
        recs = cap.records()
    got = {recs.keys[i].tap: torch.from_numpy(np.asarray(recs.per_example_norm[i])) for i in range(len(recs))}  # type: ignore[index]
    ref, _ = loop(model, {"ids": torch.cat(chunks)}, lambda out, i: sq(out, i % 3), params)  # (each row's loss / 6)
    assert_matches(got, ref, {t: None for t in got})
    assert all(v.shape == (6,) for v in got.values())


def test_bfloat16_autocast() -> None:
    torch.manual_seed(0)
    model = FlatMLP()
    params = all_params(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = loop(model, {"ids": ids()}, sq, params)
        got, why = batched(model, {"ids": ids()}, sq, params)
    assert_matches(got, ref, why, rtol=3e-2)


def test_qwen2_moe_shared_expert_and_its_gate_are_exact() -> None:
    """Qwen2-MoE calls `shared_expert` (gate, up, down) and `shared_expert_gate` on `hidden.view(-1, d)`."""
    model = tiny_moe("qwen2_moe", "eager")
    params = [p for p in all_params(model) if ".shared_expert" in p[0]]
    assert len(params) == 4
    inputs = {"input_ids": torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(1))}

    def rows_loss(out: object, i: int) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        target = torch.linspace(-1, 1, logits[0].numel()).view(logits.shape[1:]) * (i + 1)
        return (logits.float() - target).square().sum()

    got, why = batched(model, inputs, rows_loss, params)
    assert all(r is None for r in why.values()), why
    assert_matches(got, loop(model, inputs, rows_loss, params)[0], why, rtol=1e-4)


class NotFlat(nn.Module):
    """`fc` on (B T, d) tokens that are not the batch's rows flattened, though B == T (shapes do not tell)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.inp, self.fc, self.head = how, nn.Linear(D, D), nn.Linear(D, 5), nn.Linear(5, 2)
        self.table = nn.Parameter(torch.randn(B, B, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        tokens = {
            "transpose": lambda: h.transpose(0, 1).reshape(-1, D),
            "permute": lambda: h.permute(1, 0, 2).contiguous().view(-1, D),
            "cat": lambda: torch.cat([h, h.flip(0)]).reshape(-1, D),
            "gather": lambda: h.reshape(-1, D)[torch.arange(B * B).roll(3)],
            "slice": lambda: torch.tanh(h.reshape(-1, D)[: B * B // 2]),
            "parameter": lambda: self.table.view(-1, D) * h.reshape(-1, D).mean(),
        }[self.how]()
        y = self.fc(tokens)
        return self.head(y.reshape(B, -1, 5).sum(1))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("how", "why"),
    [("transpose", "moved there (TransposeBackward"), ("permute", "moved there (PermuteBackward"),
     ("cat", "CatBackward0, which per-example norms do not follow"), ("gather", "IndexBackward0"),
     ("slice", "a slice or split of dim 0"), ("parameter", "made from a parameter of shape (4, 4, 6)")],
)  # fmt: skip
def test_tokens_that_are_not_the_batch_flattened_are_null_with_the_reason(how: str, why: str) -> None:
    torch.manual_seed(0)
    model = NotFlat(how)
    params = all_params(model)
    x = torch.randn(B, B, D)
    got, reasons = batched(model, {"x": x}, lambda out, i: ((out - i) ** 2).sum(), params)
    for name in ("fc:weight", "fc:bias"):
        assert got[name] is None and why in str(reasons[name]), reasons[name]
    assert got["inp:weight"] is not None or how != "transpose", reasons["inp:weight"]


def test_a_model_without_flattened_tokens_never_walks_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-call cost where every layer's dim 0 is the batch: the flattened tokens' walk is never entered."""

    def refuse(*_: object) -> object:
        raise AssertionError("walked for flattened tokens")

    monkeypatch.setattr(per_example_rows, "flat_sources", refuse)
    monkeypatch.setattr(per_example_rows, "token_rows", refuse)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    params = all_params(model)
    x = torch.randn(B, T, D)
    got, why = batched(model, {"input": x}, sq, params)
    assert_matches(got, loop(model, {"input": x}, sq, params)[0], why)


class Frames(nn.Module):
    """A convolution and a GroupNorm on a video's B F frames (B * F rows), a head on the frames' means per example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, f = x.shape[:2]
        h = self.norm(self.conv(x.view(b * f, *x.shape[2:])))
        return self.head(h.mean((2, 3)).view(b, f, 4))  # type: ignore[no-any-return]


def test_layers_that_do_not_take_flattened_rows_say_so() -> None:
    torch.manual_seed(0)
    model, inputs = Frames(), {"x": torch.randn(2, 3, 3, 6, 6)}
    params = all_params(model)
    got, why = batched(model, inputs, sq, params)
    for name, cls in (("conv:weight", "Conv2d"), ("norm:bias", "GroupNorm")):
        assert got[
            name
        ] is None and f"only by Linear, transformers' Conv1D, Embedding, LayerNorm and RMSNorm, not {cls}" in str(
            why[name]
        )
    assert_matches(got, {n: r for n, r in loop(model, inputs, sq, params)[0].items() if n.startswith("head:")}, why)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_and_grads_bit_identical_with_per_example_on(strategy: str) -> None:
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = FlatMLP()
        seen: list[torch.Tensor] = []
        hooks = [
            p.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.clone()))
            for p in model.parameters()
        ]
        with capture(model, [n for n, _, _ in all_params(model)], strategy=strategy, per_example=on) as cap:
            out = model(ids())
            loss = sum(sq(row(out, i), i) for i in range(B)) / B  # type: ignore[arg-type]
            cap.backward(loss)
            cap.records(loss)
        for h in hooks:
            h.remove()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], seen))  # type: ignore[union-attr]
    (l0, g0, s0), (l1, g1, s1) = results
    assert torch.equal(l0, l1) and len(s0) == len(s1)
    assert all(torch.equal(a, b) for a, b in zip(g0 + s0, g1 + s1, strict=True))
