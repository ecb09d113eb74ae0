"""Capture under sequence and tensor parallel where hunt S broke it (2026-11-27).

One torchrun (gloo, CPU, 2 ranks) runs `tensor_parallel_ranks.py`; the references are the same models unsharded
in this process, without gradrunner. Before the fixes: tapping a `SequenceParallel` module's output killed both
ranks (SIGSEGV: the gradient's local piece, an `AsyncCollectiveTensor` waiting for its reduce-scatter, went to
the C kernel), a parameter tap on that LayerNorm raised inside `backward()` (its `.grad` is `Partial(sum)`), and
`per_example=True` gave an activation `DTensor` a null `per_example_norm` without a word. Before the fixes of hunt
TP (2026-11-27): `dropout`, `noise_std` and `mask` on an activation `DTensor`'s gradient raised inside `backward()`
(mixed torch.Tensor and DTensor) and any edit of a `Partial(sum)` parameter gradient raised there too. Before the
fix of hunt TPVN (2026-11-27): the `value_norm` of a tapped `DTensor` that got no gradient (an activation, a
parameter) and such a parameter's `update_norm` were the rank's piece's (the hunt's: 2.90 and 4.28, the whole 5.17).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_launch import torchrun
from tensor_parallel_ranks import EDITS, SIDE_STEP, SIDE_TAPS, rows_data, rows_model, side_model, sp_data, sp_model
from torch import nn

pytestmark = pytest.mark.slow

CASES = ["sp:hook", "sp:autograd_grad", "rows:hook", "rows:autograd_grad", "edits:hook"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("tp")
    torchrun(2, d, CASES, timeout=300, script="tensor_parallel_ranks.py")
    load = lambda case, rank: torch.load(d / f"{case.replace(':', '-')}.rank{rank}.pt", weights_only=False)  # noqa: E731
    return {case: [load(case, rank) for rank in range(2)] for case in CASES}


def _rows(results: dict[str, list[dict[str, Any]]], case: str, rank: int) -> dict[str, dict[str, Any]]:
    got = results[case][rank]
    assert "error" not in got, got.get("error")
    return {r["tap"]: r for r in got["rows"][0]}


def _reference(model: nn.Module, loss_of: Any, modules: list[str]) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """Each module's output gradient and the parameters' `.grad`, one process, plain torch hooks."""
    grads: dict[str, torch.Tensor] = {}
    for name in modules:

        def keep(m: nn.Module, a: Any, out: torch.Tensor, name: str = name) -> None:
            out.register_hook(lambda g: grads.__setitem__(name, g))

        model.get_submodule(name).register_forward_hook(keep)
    loss_of(model).backward()
    return grads, model


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad"])
def test_a_sequence_parallel_modules_output_is_recorded_whole(results: dict, strategy: str) -> None:
    grads, _ = _reference(sp_model(), lambda m: m(sp_data()).square().sum(), ["norm"])
    want = grads["norm"]
    for rank in range(2):
        row = _rows(results, f"sp:{strategy}", rank)["norm:output"]
        assert row["has_grad"] and row["numel"] == want.numel()
        assert row["norm"] == pytest.approx(float(want.norm()), rel=1e-12)
        assert row["mean"] == pytest.approx(float(want.mean()), rel=1e-9, abs=1e-15)
        assert row["max"] == float(want.max()) and row["min"] == float(want.min())


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad"])
def test_a_partial_parameter_gradient_is_summed_first_leaving_grad_as_it_was(results: dict, strategy: str) -> None:
    _, ref = _reference(sp_model(), lambda m: m(sp_data()).square().sum(), [])
    for rank in range(2):
        got = results[f"sp:{strategy}"][rank]
        assert got["placements"]["weight"] == "(Partial(sum),)", got["placements"]  # what the hunt met
        rows = _rows(results, f"sp:{strategy}", rank)
        for name in ("weight", "bias"):
            want = getattr(ref.norm, name).grad
            assert rows[f"norm:{name}"]["has_grad"]
            assert rows[f"norm:{name}"]["norm"] == pytest.approx(float(want.norm()), rel=1e-12)
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-12, atol=1e-14)  # .grad untouched


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad"])
def test_per_example_norms_of_activation_dtensors_are_the_whole_gradients_rows(results: dict, strategy: str) -> None:
    x, y = rows_data()
    grads, _ = _reference(rows_model(), lambda m: nn.functional.mse_loss(m(x), y), ["norm", "fc1"])
    for rank in range(2):
        got = results[f"rows:{strategy}"][rank]
        assert got["placements"]["norm:output"] == "(Shard(dim=0),)", got["placements"]  # the batch sharded
        rows = _rows(results, f"rows:{strategy}", rank)
        for tap, module in (("norm:output", "norm"), ("fc1:output", "fc1")):
            want = grads[module]
            assert rows[tap]["norm"] == pytest.approx(float(want.norm()), rel=1e-12)
            pex = rows[tap]["per_example_norm"]
            assert pex is not None, (tap, got["warned"])
            torch.testing.assert_close(torch.as_tensor(pex), want.norm(dim=1), rtol=1e-12, atol=0)


def test_value_and_update_norms_of_dtensor_taps_are_the_whole_tensors_with_or_without_a_gradient(results: dict) -> None:
    """`Side`: `side:*` take no part in the loss (no gradient), `norm:output` (`Shard(0)`) and `fc1:output`
    (`Shard(-1)`) do; every `value_norm` is the unsharded tensor's, on both ranks, and so is `side.weight`'s update."""
    x, _ = rows_data()
    model = side_model()
    with torch.no_grad():  # the reference: the unsharded model on the whole batch, plain torch
        h = model.norm(x)
        want = {"norm:output": h.norm(), "fc1:output": model.fc1(h).norm(), "side:output": model.side(x).norm(),
                "side:weight": model.side.weight.norm(), "side:bias": model.side.bias.norm()}  # fmt: skip
    for rank in range(2):
        rows = _rows(results, "rows:hook", rank)
        for tap in SIDE_TAPS:
            assert rows[tap]["has_grad"] == (not tap.startswith("side")), tap
            assert rows[tap]["value_norm"] == pytest.approx(float(want[tap]), rel=1e-12), (rank, tap)
        step = (1 - SIDE_STEP) * float(want["side:weight"])
        assert rows["side:weight"]["update_norm"] == pytest.approx(step, rel=1e-12)
        assert rows["side:bias"]["update_norm"] == 0.0


def test_edits_of_tensor_parallel_gradients_are_the_unsharded_runs_edits(results: dict) -> None:
    """`dropout` on a `Shard(-1)` activation gradient, `noise_std` on a `Replicate` one, `clip_norm` on a `Partial(sum)`
    LayerNorm weight: every parameter's `.grad` as the unsharded run's under the same edits, the records as its."""
    from gradrunner import capture

    x, y = rows_data()
    model, plain = rows_model(), rows_model()
    with capture(model, [e["tap"] for e in EDITS], edits=EDITS) as cap:
        cap.backward(nn.functional.mse_loss(model(x), y))
        recs = cap.records()
    nn.functional.mse_loss(plain(x), y).backward()
    want = {recs.row(i)["tap"]: recs.row(i) for i in range(len(recs))}
    for rank in range(2):
        got = results["edits:hook"][rank]
        rows = _rows(results, "edits:hook", rank)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-12, atol=1e-14)
        assert not torch.allclose(got["grads"]["fc1.weight"], plain.fc1.weight.grad)  # the edits did act
        for tap, row in want.items():
            assert rows[tap]["edited"] and rows[tap]["norm"] == pytest.approx(row["norm"], rel=1e-12), tap
            assert rows[tap]["edited_norm"] == pytest.approx(row["edited_norm"], rel=1e-12), tap
        assert rows["norm:weight"]["norm"] > 0.01  # clipped as the whole sum, not each rank's term
        assert rows["norm:weight"]["edited_norm"] == pytest.approx(0.01, rel=1e-4)
