"""A leaf's `.grad` that autograd took as a view of a tapped gradient never changes the records.

`loss.backward()` keeps the gradient a leaf's `AccumulateGrad` node receives as its `.grad` when nothing else holds
that tensor, and a view (`nn.Flatten` before the tapped layer, a parameter used as `p.view(...)`) is a tensor of its
own: the leaf's `.grad` then shares the memory of the gradient gradrunner read at the tap (PyTorch issue #34082).
An FGSM step's `x.grad.sign_()`, clipping `.grad` in place or the next micro-batch's accumulation changed the kept
values, `cap.grads` and a tapped parameter's gradient before the records were taken. So did the node a tap's gradient
flows into, writing it in place (a custom `autograd.Function` computing its input's gradient in that memory, as
Liger-Kernel's RMSNorm does by default). The reference is plain `torch.autograd.grad` (or a plain hook's copy) of the
same model and batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gradrunner import capture, record
from gradrunner.analysis import load

STRATEGIES = ["hook", "retain_grad", "autograd_grad"]


def _flat_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _x() -> torch.Tensor:
    return torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_input_gradient_changed_in_place_after_flatten_leaves_the_tap_as_it_arrived(strategy: str) -> None:
    model, seen = _flat_mlp(), []
    handle = model[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    out = model(_x().requires_grad_())
    handle.remove()
    (want,) = torch.autograd.grad(out.square().sum(), seen)

    model, x = _flat_mlp(), _x().requires_grad_()
    with capture(model, ["1:input"], strategy=strategy, values="full") as cap:
        loss = model(x).square().sum()
        cap.backward(loss) if strategy == "autograd_grad" else loss.backward()
        x.grad.sign_()  # type: ignore[union-attr]  # an FGSM step's direction, in place
        recs = cap.records(loss)
        kept = cap.grads["1:input"]
    assert torch.equal(torch.as_tensor(recs.values[0]).reshape(2, 16), want)
    assert float(recs.stats["norm"][0]) == pytest.approx(float(want.double().norm()), rel=1e-6)
    assert torch.equal(kept, want)  # type: ignore[arg-type]


class Views(nn.Module):
    """Two parameters used through `.view`: their gradients are views of one tensor, the addition's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.a = nn.Parameter(torch.randn(12))
        self.b = nn.Parameter(torch.randn(12))
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x) + self.a.view(3, 4) + self.b.view(3, 4))


def _batches() -> list[torch.Tensor]:
    return [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d a and d loss / d (the addition's output, `act`'s input), by plain torch."""
    model, seen = Views(), []
    handle = model.act.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    out = model(x)
    handle.remove()
    ga, gsum = torch.autograd.grad(out.square().sum(), [model.a, seen[0]])
    return ga, gsum


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_tapped_parameter_and_a_tap_keep_their_gradients_when_another_leafs_grad_views_them(strategy: str) -> None:
    refs = [_reference(x) for x in _batches()]
    model = Views()
    with capture(model, [":a", "act:input"], strategy=strategy, values="full") as cap:
        for x in _batches():  # two micro-batches: the second backward adds into `.grad` in place
            loss = model(x).square().sum()
            cap.backward(loss) if strategy == "autograd_grad" else loss.backward()
        model.b.grad.mul_(0.0)  # type: ignore[union-attr]  # in place, before the step's records
        recs = cap.records(loss)
    got = {(k.tap, m): i for i, (k, m) in enumerate(zip(recs.keys, recs.micro_step, strict=True))}
    a_row = next(i for (tap, _), i in got.items() if tap == ":a")
    want_a = refs[0][0] + refs[1][0]
    assert float(recs.stats["norm"][a_row]) == pytest.approx(float(want_a.double().norm()), rel=1e-6)
    for micro, (_, gsum) in enumerate(refs):
        values = recs.values[got[("act:input", micro)]]
        assert torch.equal(torch.as_tensor(values).reshape(3, 4), gsum), micro


def test_record_with_clipping_in_place_writes_the_gradients_that_arrived(tmp_path: Path) -> None:
    """The README's `record()` loop, `clip_grad_norm_` between the backward and `rec.step`."""
    refs = [_reference(x) for x in _batches()]
    model = Views()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights for both steps: the reference's
    with record(model, [":a", "act:input"], tmp_path / "run", values="full") as rec:
        for x in _batches():
            loss = model(x).square().sum()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "run", values=True)
    for step, (ga, gsum) in enumerate(refs):
        a = df[(df.step == step) & (df.tap == ":a")].iloc[0]
        assert a.norm == pytest.approx(float(ga.double().norm()), rel=1e-6)
        s = df[(df.step == step) & (df.tap == "act:input")].iloc[0]
        np.testing.assert_array_equal(np.asarray(s["values"], dtype=np.float32), gsum.flatten().numpy())


class _ReusesGrad(torch.autograd.Function):
    """y = 2x whose backward computes dx in dy's memory, as Liger-Kernel's RMSNorm does by default (`in_place=True`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        return dy.mul_(2.0)


class _Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReusesGrad.apply(x)


class _WithNorm(nn.Module):
    """`norm`'s output gradient is what `_ReusesGrad.backward` receives, and writes; `changed` writes the output in place
    after the tap (`retain_grad` then reads the tap at its node)."""

    def __init__(self, changed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2, self.changed = nn.Linear(4, 6), _Norm(), nn.Linear(6, 3), changed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(x))
        if self.changed:
            h.mul_(1.5)
        return self.fc2(torch.tanh(h))


@pytest.mark.parametrize("fused", [True, False])  # False: the torch path, a GPU's for gradients up to 16384 elements
@pytest.mark.parametrize("changed", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_its_node_writes_in_place_is_recorded_as_it_arrived(
    strategy: str, changed: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model, arrived = _WithNorm(changed), []
    model.norm.register_forward_hook(
        lambda _m, _a, out: out.register_hook(lambda g: arrived.append(g.clone())) and None
    )
    model(x).square().sum().backward()
    (want,) = arrived

    if not fused:
        monkeypatch.setenv("GRADRUNNER_FUSED", "0")
    model = _WithNorm(changed)
    with capture(model, ["norm:output"], strategy=strategy, values="full") as cap:
        loss = model(x).square().sum()
        cap.backward(loss)
        recs = cap.records(loss)
    assert float(recs.stats["norm"][0]) == pytest.approx(float(want.double().norm()), rel=1e-6)
    assert torch.equal(torch.as_tensor(recs.values[0]).reshape(5, 6), want)
    assert torch.equal(cap.grads["norm:output"], want)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_the_torch_internals_every_kept_gradient_is_a_copy(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch_compat`'s fallbacks (no custom-Function check, no storage use count): the records as they arrived."""
    from gradrunner.capturing import torch_compat

    monkeypatch.setitem(torch_compat.FEATURES, "python_node", False)
    monkeypatch.setitem(torch_compat.FEATURES, "storage_use_count", False)
    test_a_gradient_its_node_writes_in_place_is_recorded_as_it_arrived(strategy, True, False, monkeypatch)
    test_an_input_gradient_changed_in_place_after_flatten_leaves_the_tap_as_it_arrived(strategy)
