"""Gradients never silently wrong or missing: tied parameters, one tensor under many taps, modules that
are never called, complex gradients, and steps whose forward or backward failed. Every strategy.

References are computed here with `torch.autograd.grad`, without gradrunner.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import close, compose_cfg, leftover_hooks
from torch import nn

from gradrunner import capture
from gradrunner.records.columns import GRADS_FILE, TapKey
from gradrunner.run.loop import train


# -- tied parameters ---------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """GPT-2's layout in small: the output head's weight is the embedding's `Parameter`."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.wte(ids))))


def test_every_tap_on_a_tied_parameter_gets_its_gradient(strategy: str) -> None:
    model = TiedLM().double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = torch.autograd.grad(model(ids).square().sum(), model.wte.weight)[0]
    with capture(model, ["wte:weight", "head:weight", "mid:weight"], strategy=strategy) as cap:
        cap.backward(model(ids).square().sum())
        recs = cap.records()
    close(cap.grads["wte:weight"], expected)
    close(cap.grads["head:weight"], expected)
    close(model.wte.weight.grad, expected)  # the optimiser sees the same gradient, once
    assert recs.has_grad.all() and recs.reason == [None, None, None]
    assert leftover_hooks(model) == []


# -- one tensor reached by several taps ---------------------------------------------------------------
class Attn(nn.Module):
    """Returns its local `weights` as output element 1, as GPT-2's eager attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.softmax(self.q(h) @ h.transpose(-1, -2), dim=-1)
        out = weights @ h
        return out, weights


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.attn = Attn()
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        out, weights = self.attn(h)
        return self.fc2(out + h) * weights.sum()


SHARED_TAPS = ["attn:weights", "attn:output.1", "fc1:output", "attn:input", ":h", "fc1:output", "attn:input.0"]


def _shared_reference(model: Shared, x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    handles = [
        model.fc1.register_forward_hook(lambda m, a, o: seen.__setitem__("h", o)),
        model.attn.register_forward_hook(lambda m, a, o: seen.__setitem__("w", o[1])),
    ]
    try:
        loss = model(x).square().sum()
    finally:
        for h in handles:
            h.remove()
    gh, gw = torch.autograd.grad(loss, [seen["h"], seen["w"]])
    return {"h": gh, "w": gw}


def test_every_tap_reaching_one_tensor_gets_the_same_gradient(strategy: str) -> None:
    model = Shared().double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    ref = _shared_reference(model, x)
    with capture(model, SHARED_TAPS, strategy=strategy) as cap:
        cap.backward(model(x).square().sum())
    for tap in ("attn:weights", "attn:output.1"):
        close(cap.grads[tap], ref["w"])
    for tap in ("fc1:output", "attn:input", "attn:input.0", ":h"):
        close(cap.grads[tap], ref["h"])
    assert leftover_hooks(model) == []


# -- taps that do not fire ----------------------------------------------------------------------------
class Skips(nn.Module):
    """`out_proj` is used by weight only (as in nn.MultiheadAttention); `branch` runs on odd calls only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.out_proj = nn.Linear(3, 3)
        self.branch = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.nn.functional.linear(self.fc(x), self.out_proj.weight)
        if self.calls % 2 == 0:
            late = self.branch(h)
            h = h + late
        return h


def test_a_module_never_called_gets_a_row_saying_so(strategy: str) -> None:
    model = Skips().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    taps = ["out_proj:output", "branch:output", ":late", "fc:output", "out_proj:weight", "out_proj:bias"]
    with capture(model, taps, strategy=strategy, keep_grads=False) as cap:
        cap.backward(model(x).sum())
        recs = cap.records()
    rows = {k.tap: recs.row(i) for i, k in enumerate(recs.keys)}
    assert sorted(rows) == sorted(taps)  # no tap silently missing
    assert rows["out_proj:output"]["reason"] == "module not called in this step"
    assert rows["branch:output"]["reason"] == "module not called in this step"
    assert rows[":late"]["reason"].startswith("not assigned in this step")  # type: ignore[union-attr]
    assert rows["out_proj:bias"]["reason"] == "takes no part in the loss"
    assert rows["fc:output"]["has_grad"] and rows["fc:output"]["reason"] is None
    assert rows["out_proj:weight"]["has_grad"]  # used by weight: its gradient is there
    assert not any(rows[t]["has_grad"] for t in ("out_proj:output", "branch:output", ":late", "out_proj:bias"))
    with cap:  # the next step calls `branch`: now it has its gradient
        cap.backward(model(x).sum())
        recs = cap.records()
    rows = {k.tap: recs.row(i) for i, k in enumerate(recs.keys)}
    assert rows["branch:output"]["has_grad"] and rows[":late"]["has_grad"]
    assert leftover_hooks(model) == []


def test_a_never_called_tap_has_no_phantom_call_in_grads(strategy: str) -> None:
    model = Skips().double()
    with capture(model, ["out_proj:output", "fc:output"], strategy=strategy) as cap:
        cap.backward(model(torch.randn(2, 3, dtype=torch.float64)).sum())
    assert cap.grads["out_proj:output"] is None and cap.grads.calls("out_proj:output") == []
    assert cap.reasons()[TapKey("out_proj", "output", 0)] == "module not called in this step"


# -- complex gradients --------------------------------------------------------------------------------
class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(self.lin(x), x)
        spec = z * (1 + 2j)
        return spec.abs().sum(-1)


def test_complex_gradient_statistics_are_those_of_its_magnitude(strategy: str) -> None:
    model = ComplexNet().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    seen: list[torch.Tensor] = []

    def math(x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(model.lin(x), x)
        z.register_hook(lambda g: seen.append(g))
        return (z * (1 + 2j)).abs().sum(-1).sum()

    math(x).backward()
    model.zero_grad()
    true = seen[0]
    assert true.is_complex() and float(true.imag.abs().max()) > 0.1
    with capture(model, [":z"], strategy=strategy, keep_grads=False) as cap:
        cap.backward(model(x).sum())
        row = cap.records().row(0)
    magnitude = true.abs()
    assert row["norm"] == pytest.approx(float(torch.linalg.vector_norm(true)), rel=1e-12)  # the complex norm
    assert row["max"] == pytest.approx(float(magnitude.max()), rel=1e-12)
    assert row["mean"] == pytest.approx(float(magnitude.mean()), rel=1e-12)
    assert row["min"] >= 0
    with capture(model, [":z"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    close(cap.grads[":z"], true)  # the kept gradient is the complex one itself


# -- failed steps -------------------------------------------------------------------------------------
class Flaky(nn.Module):
    """Raises in forward or in backward when told to: after `fc` and `act` have fired."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.act = nn.Tanh()
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        if self.fail == "forward":
            raise RuntimeError("forward failed")
        if self.fail == "backward":
            h = _FailingBackward.apply(h)
        return self.act(h)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, h: torch.Tensor) -> torch.Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


@pytest.mark.parametrize("keep_grads", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_a_step_after_failed_forwards_and_backwards_is_exact(strategy: str, keep_grads: bool, seed: int) -> None:
    rng = random.Random(seed)
    model = Flaky().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    clean = Flaky().double()
    clean.load_state_dict(model.state_dict())
    ref = torch.autograd.grad(clean(x).sum(), clean.fc.weight)[0]
    taps = ["fc:output", "act:output", ":h", "fc:weight"]
    with capture(model, taps, strategy=strategy, keep_grads=keep_grads) as cap:
        for _ in range(rng.randint(1, 3)):  # a seeded number of failures, in a seeded order
            model.fail = rng.choice(["forward", "backward"])
            with pytest.raises(RuntimeError, match="failed"):
                cap.backward(model(x).sum())
            model.zero_grad()
        model.fail = None
        cap.backward(model(x).sum())
        recs = cap.records()
    keys = [(k.tap, k.call) for k in recs.keys]
    assert sorted(keys) == sorted([("fc:output", 0), ("act:output", 0), ("act:output", 1), (":h", 0),
                                   ("fc:weight", 0)])  # fmt: skip
    assert recs.has_grad.all()
    if keep_grads:
        assert len(cap.grads.calls("act:output")) == 2 and all(g is not None for g in cap.grads.calls("act:output"))
        close(cap.grads["fc:weight"], ref)
    close(model.fc.weight.grad, ref)  # type: ignore[arg-type]
    assert leftover_hooks(model) == []


def test_reset_forgets_calls_of_a_step_whose_loss_failed(strategy: str) -> None:
    model = Flaky().double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, ["fc:output"], strategy=strategy) as cap:
        model(x)  # the loss then failed: the caller resets
        cap.reset()
        cap.backward(model(x).sum())
    assert len(cap.grads.calls("fc:output")) == 1


def test_nothing_stays_on_a_non_leaf_input(strategy: str) -> None:
    model = Flaky().double()
    base = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    x = base * 2  # a non-leaf input the caller keeps
    with capture(model, [":input", "fc:input"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    close(cap.grads[":input"], expected)
    close(cap.grads["fc:input"], expected)
    assert not x.retains_grad and x.requires_grad and not x._backward_hooks
    assert leftover_hooks(model) == []


# -- through the runner: the reason column and one warning per tap -------------------------------------
def test_records_carry_the_reason_and_the_log_warns_once_per_tap(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                  ) -> None:  # fmt: skip
    cfg = compose_cfg("+experiment=mlp", "steps=3", "taps=['fc*:input.1','fc1:output']", "device=cpu")
    with caplog.at_level(logging.WARNING, logger="gradrunner.run.watch"):
        train(cfg, out_dir=tmp_path)
    grads = pd.read_parquet(tmp_path / GRADS_FILE)
    without = grads[~grads.has_grad]
    assert sorted(without.tap.unique()) == ["fc1:input.1", "fc2:input.1", "fc3:input.1"] and len(without) == 9
    assert without.reason.str.contains("no element 1").all()
    assert grads[grads.has_grad].reason.isna().all() and (grads[grads.has_grad].tap == "fc1:output").all()
    warned = [r.getMessage() for r in caplog.records if "has no gradient" in r.getMessage()]
    assert len(warned) == 3 and all("no element 1" in w for w in warned)  # once per tap, not per step
