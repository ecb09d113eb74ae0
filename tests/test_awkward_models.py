"""Awkward models, over every strategy: structured outputs, keyword inputs, frozen parameters,
compiled and scripted modules, low precision, activation checkpointing, no_grad blocks.

(Reused modules, in-place ops after a tap, dict outputs and keyword inputs by value are covered in
test_capture_contract.py; these tests add what those do not.)
"""

from __future__ import annotations

import copy
from typing import Any

import awkward
import pytest
import torch
from conftest import close, leftover_hooks
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner import GradrunnerError, capture
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.models import MLP
from gradrunner.records.columns import TapKey

# -- structured outputs ----------------------------------------------------------------------------
ELEMENTS = {
    "dict": ("output.logits", "output.aux"),
    "tuple": ("output.0", "output.1"),
    "namedtuple": ("output.logits", "output.1"),
    "dataclass": ("output.logits", "output.aux"),
}


def _parts(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(out, dict):
        return out["logits"], out["aux"]
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.logits, out.aux


@pytest.mark.parametrize("kind", list(ELEMENTS))
def test_structured_output_elements_by_index_key_or_field(strategy: str, kind: str) -> None:
    torch.manual_seed(0)
    model = awkward.Structured(kind).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    logits_tap, aux_tap = (f":{e}" for e in ELEMENTS[kind])
    with capture(model, [logits_tap, aux_tap], strategy=strategy) as cap:
        out = model(x)
        names = {"dict": "dict", "tuple": "tuple", "namedtuple": "Pair", "dataclass": "Output"}
        assert type(out).__name__ == names[kind]  # the container type survives the taps
        logits, aux = _parts(out)
        cap.backward((logits**2).sum() + 3 * aux.sum())
    # The tap is the logits tensor itself, which aux = tanh(logits) was computed from: both paths count.
    h = model.lin(x).detach()
    close(cap.grads[logits_tap], 2 * h + 3 * (1 - torch.tanh(h) ** 2))
    close(cap.grads[aux_tap], torch.full((4, 1), 3.0, dtype=torch.float64))
    assert leftover_hooks(model) == []


# -- keyword arguments -----------------------------------------------------------------------------
class Masked(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h * mask


class MaskNet(nn.Module):
    """Calls `inner(h, mask=...)` with a float mask (gets a gradient) or a bool mask (cannot)."""

    def __init__(self, boolean: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inner = Masked()
        self.boolean = boolean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        mask = h > 0 if self.boolean else torch.sigmoid(h)
        return self.inner(h, mask=mask)


def test_keyword_input_mask_gets_its_gradient(strategy: str) -> None:
    torch.manual_seed(1)
    model = MaskNet(boolean=False).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, ["inner:input.mask", "inner:input"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    h = model.lin(x).detach()
    close(cap.grads["inner:input.mask"], h)  # d(sum h * mask)/d mask = h
    s = torch.sigmoid(h)  # h is the tensor mask was computed from: both paths count
    close(cap.grads["inner:input"], s + h * s * (1 - s))


def test_boolean_keyword_input_is_an_error_when_named_and_recorded_when_globbed(strategy: str) -> None:
    model = MaskNet(boolean=True).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(GradrunnerError, match=r"'inner:input.mask' cannot carry a gradient: its value is a torch.bool"):
        with capture(model, ["inner:input.mask"], strategy=strategy):
            model(x)
    assert leftover_hooks(model) == []
    with capture(model, ["*:input.mask", "lin:output"], strategy=strategy, keep_grads=False) as cap:
        cap.backward(model(x).sum())
        recs = cap.records()
    rows = {recs.keys[i].tap: recs.row(i) for i in range(len(recs))}
    assert rows["inner:input.mask"]["has_grad"] is False and rows["lin:output"]["has_grad"] is True
    assert rows["lin:input.mask"]["has_grad"] is False  # the glob matched lin too, which takes no mask
    reasons = {k.tap: r for k, r in cap.reasons().items()}
    assert "torch.bool" in reasons["inner:input.mask"] and "no element 'mask'" in reasons["lin:input.mask"]


# -- frozen parameters -----------------------------------------------------------------------------
FROZEN_TAPS = ["fc2:weight", "fc2:bias", "fc2:output", "fc1:weight", "fc1:output"]


def _frozen_mlp() -> tuple[MLP, torch.Tensor]:
    torch.manual_seed(2)
    model = MLP(in_features=3, hidden=4, depth=2, out_features=1).double()
    model.fc2.requires_grad_(False)
    return model, torch.randn(5, 3, dtype=torch.float64)


def test_frozen_parameters_get_no_gradient_and_strategies_agree() -> None:
    grads = {}
    for name in STRATEGIES:
        model, x = _frozen_mlp()
        with capture(model, FROZEN_TAPS, strategy=name) as cap:
            cap.backward(model(x).pow(2).sum())
            recs = cap.records()
        assert cap.grads["fc2:weight"] is None and cap.grads["fc2:bias"] is None
        assert model.fc2.weight.grad is None
        has_grad = {recs.keys[i].tap: bool(recs.has_grad[i]) for i in range(len(recs))}
        assert has_grad == {"fc1:output": True, "fc2:output": True, "fc2:weight": False, "fc2:bias": False,
                            "fc1:weight": True}  # fmt: skip
        grads[name] = dict(cap.grads)
        assert leftover_hooks(model) == []
    model, x = _frozen_mlp()
    (w,) = torch.autograd.grad(model(x).pow(2).sum(), [model.fc1.weight])
    for name, got in grads.items():
        close(got["fc1:weight"], w)
        for tap in ("fc1:output", "fc2:output"):
            close(got[tap], grads["hook"][tap])


def test_a_parameter_unfrozen_part_way_gets_its_gradient_from_then_on(strategy: str) -> None:
    model, x = _frozen_mlp()
    with capture(model, ["fc2:weight"], strategy=strategy) as cap:
        cap.backward(model(x).pow(2).sum())
        assert cap.grads["fc2:weight"] is None
        model.fc2.requires_grad_(True)
        cap.backward(model(x).pow(2).sum())
    (expected,) = torch.autograd.grad(model(x).pow(2).sum(), [model.fc2.weight])
    close(cap.grads["fc2:weight"], expected)
    assert leftover_hooks(model) == []


# -- compiled and scripted -------------------------------------------------------------------------
def test_compiled_model_is_tapped_by_the_eager_models_paths() -> None:
    model = MLP(in_features=3, hidden=4, depth=1)
    with capture(torch.compile(model, backend="aot_eager"), ["fc1:output"]) as cap:
        assert cap.model is model  # torch.compile(model)'s _orig_mod: paths without '_orig_mod.'
    assert leftover_hooks(model) == []


def test_scripted_model_is_refused_with_the_way_out() -> None:
    scripted = torch.jit.script(MLP(in_features=3, hidden=4, depth=1))
    with pytest.raises(GradrunnerError, match=r"^the model is a TorchScript module .*give it the eager module"):
        capture(scripted, ["fc1:output"])


# -- bfloat16 and float16 --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_statistics_of_half_precision_gradients_are_computed_in_float32(dtype: torch.dtype) -> None:
    grad = torch.full((4096,), 300.0, dtype=dtype)  # in float16 the sum of squares (3.7e8) would overflow
    grad[0] = 301.0 if dtype == torch.float16 else 302.0
    col = Collector()
    col.add(TapKey("m", "output", 0), grad)
    row = col.finish().row(0)
    exact = grad.double()
    assert row["norm"] == pytest.approx(float(exact.norm()), rel=1e-6)
    assert row["mean"] == pytest.approx(float(exact.mean()), rel=1e-6)
    assert row["std"] == pytest.approx(float(exact.std()), rel=1e-3)
    assert row["nan_count"] == row["inf_count"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_gradients_and_their_statistics(strategy: str, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    model = MLP(in_features=8, hidden=16, depth=2, out_features=2)
    ref = copy.deepcopy(model).double()
    x = torch.randn(16, 8)
    model.to(dtype)
    with capture(model, ["*:output", "fc1:weight"], strategy=strategy, keep_grads=True) as cap:
        cap.backward(model(x.to(dtype)).float().pow(2).mean())
        recs = cap.records()
    with capture(ref, ["*:output", "fc1:weight"], strategy=strategy) as ref_cap:
        ref_cap.backward(ref(x.double()).pow(2).mean())
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for i, key in enumerate(recs.keys):
        grad = cap.grads[key.tap, key.call]
        assert grad is not None and grad.dtype == dtype
        row = recs.row(i)
        assert row["norm"] == pytest.approx(float(grad.double().norm()), rel=1e-5)  # float32 accumulation
        assert row["norm"] == pytest.approx(float(ref_cap.grads[key.tap].norm()), rel=5 * tol)
        close(grad, ref_cap.grads[key.tap], rtol=tol, atol=tol * float(ref_cap.grads[key.tap].abs().max()))


# -- activation checkpointing ----------------------------------------------------------------------
class Checkpointed(nn.Module):
    """`block` runs twice per forward, each time under `torch.utils.checkpoint` (or plainly: reentrant=None)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.block(h)
        return checkpoint(self.block, h, use_reentrant=self.reentrant)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        inner = self._block(h)
        inner = self._block(inner)
        out = self.head(inner)
        return out


CHECKPOINT_TAPS = ["stem:output", "block:output", "block.0:output", "block.0:input", "block.0:weight", ":inner",
                   "head:output"]  # fmt: skip


def _checkpointed_grads(reentrant: bool | None, strategy: str) -> dict[str, list[torch.Tensor | None]]:
    torch.manual_seed(4)
    model = Checkpointed(reentrant).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, CHECKPOINT_TAPS, strategy=strategy) as cap:
        cap.backward(model(x).pow(2).sum())
        records = cap.records()
    assert [k.tap for k in records.keys].count("block.0:output") == 2  # one record per call, not per firing
    assert leftover_hooks(model) == []
    return {tap: cap.grads.calls(tap) for tap in CHECKPOINT_TAPS}


@pytest.mark.parametrize("reentrant", [False, True], ids=["use_reentrant=False", "use_reentrant=True"])
def test_checkpointed_taps_count_once_and_match_no_checkpointing(strategy: str, reentrant: bool) -> None:
    if strategy == "autograd_grad" and reentrant:
        pytest.skip("refused: see test_autograd_grad_refuses_reentrant_checkpointing")
    plain = _checkpointed_grads(None, strategy)
    checkpointed = _checkpointed_grads(reentrant, strategy)
    calls = {tap: len(grads) for tap, grads in checkpointed.items()}
    assert calls == {"stem:output": 1, "block:output": 2, "block.0:output": 2, "block.0:input": 2,
                     "block.0:weight": 1, ":inner": 2, "head:output": 1}  # fmt: skip
    for tap in CHECKPOINT_TAPS:
        for got, want in zip(checkpointed[tap], plain[tap], strict=True):
            assert want is not None
            close(got, want)


def test_autograd_grad_refuses_reentrant_checkpointing() -> None:
    model = Checkpointed(reentrant=True).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(GradrunnerError, match=r"^capture.strategy='autograd_grad' cannot run through "
                       r"torch.utils.checkpoint\(..., use_reentrant=True\).*use_reentrant=False"):  # fmt: skip
        with capture(model, ["block.0:output"], strategy="autograd_grad") as cap:
            cap.backward(model(x).sum())
    assert leftover_hooks(model) == []


# -- values made under torch.no_grad() -------------------------------------------------------------
def test_local_from_a_no_grad_block_is_recorded_without_gradient_when_globbed(strategy: str) -> None:
    model = awkward.GatedNet().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with capture(model, ["*:gate", "*:out"], strategy=strategy, keep_grads=False) as cap:
        cap.backward(model(x).sum())
        recs = cap.records()
    rows = {recs.keys[i].tap: recs.row(i) for i in range(len(recs))}
    assert rows["block:gate"]["has_grad"] is False and rows["block:out"]["has_grad"] is True
    assert cap.reasons()[TapKey("block", "gate", 0)] == "made under no_grad"


def test_an_evaluation_pass_under_no_grad_records_nothing_and_raises_nothing(strategy: str) -> None:
    model = awkward.Gated().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    with capture(model, [":gate", "lin:output"], strategy=strategy, keep_grads=False) as cap:
        with torch.no_grad():
            model(x)  # evaluation: the explicit ':gate' is not an error here
        assert len(cap.records()) == 0
