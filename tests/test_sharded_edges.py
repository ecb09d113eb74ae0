"""Capture on sharded models where a hunt against single-process references broke it (2026-11-27).

Each torchrun (gloo, CPU; 2 ranks, 4 for the 2-D mesh) runs `sharded_edges_ranks.py`; the references are the
same small MLP unsharded in this process, without gradrunner. Before the fixes: a tensor-parallel layer's
input tap and `per_example=True` under tensor parallel raised inside `backward()` on every rank, an activation
`DTensor` on a 2-D mesh's sub-mesh raised too, and a sharded parameter unfrozen after the capture opened got
`has_grad=False` with a false reason ("no backward of this step synchronised the gradients"). Hunt TP found the
`edited_norm` of a `Partial(sum)` input gradient and the value norm of a sub-mesh activation to be one rank's piece's,
and a `dropout` on a sub-mesh activation raising inside `backward()`. Hunt TPVN found the value norm of a frozen
sharded parameter (FSDP2 and tensor parallel) to be one rank's piece's. Hunt REGRESS2 found FSDP2's own unsharded
parameters, left in the modules' slots after a forward under no_grad, taken for replaced taps (the `unsharded_*` cases).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_unsharded_ranks import PARAM_TAPS, STEPS
from rank_launch import torchrun
from sharded_edges_ranks import Checkpointed, batch, ddp_gan_step, gan, mlp
from torch import nn

pytestmark = pytest.mark.slow

CASES = {
    2: ["unfreeze_fsdp:hook", "unfreeze_tp:autograd_grad", "tp_input:hook", "tp_input:autograd_grad",
        "tp_input:retain_grad", "tp_per_example:hook", "ddp_gan:hook", "ddp_inner:hook", "ddp_wrapper:hook",
        "ddp_wrapper:autograd_grad", "ddp_reentrant:hook", "ddp_reentrant:autograd_grad"],
    4: ["twod:hook", "twod:retain_grad"],
}  # fmt: skip
#: FSDP2's unsharded parameters left in their slots (`fsdp_unsharded_ranks.py`), in the same torchruns.
UNSHARDED = {
    2: ["unsharded_default:reenter", "unsharded_default:inblock", "unsharded_false:reenter", "unsharded_false:inblock"],
    4: ["unsharded_int2:reenter", "unsharded_int2:inblock"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for world, cases in CASES.items():
        cases = cases + UNSHARDED[world]
        d = tmp_path_factory.mktemp(f"edges{world}")
        torchrun(world, d, cases, timeout=600, script="sharded_edges_ranks.py")
        for case in cases:
            out[case] = [torch.load(d / f"{case.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in range(world)]
    return out


def _rows(results: dict[str, list[dict[str, Any]]], case: str, rank: int, step: int = 0) -> dict[str, dict[str, Any]]:
    got = results[case][rank]
    assert "error" not in got, got.get("error")
    return {r["tap"]: r for r in got["rows"][step]}


def _grad_of(seeds: list[int], at: str) -> torch.Tensor:
    """The unsharded reference: `at`'s gradient of the mean of the batches' losses (FSDP2 averages), one process."""
    model = mlp()
    kept: dict[str, torch.Tensor] = {}
    model[0].register_forward_hook(lambda m, a, out: kept.update(input=a[0], output=out))
    total = torch.zeros((), dtype=torch.float64)
    for s in seeds:
        x, y = batch(s)
        x.requires_grad_(True)
        total = total + nn.functional.mse_loss(model(x), y) / len(seeds)
        if at in kept:
            (g,) = torch.autograd.grad(total, kept[at])
            return g
    total.backward()
    return model[2].weight.grad  # type: ignore[return-value]


@pytest.mark.parametrize("case", ["unfreeze_fsdp:hook", "unfreeze_tp:autograd_grad"])
def test_a_sharded_parameter_unfrozen_after_the_capture_opened_is_recorded(results: dict, case: str) -> None:
    seeds = [11, 12] if case.startswith("unfreeze_fsdp") else [11]  # step 1: seed + 10; FSDP2: each rank its own
    want = float(_grad_of(seeds, "weight").norm())
    for rank in range(2):
        frozen, unfrozen = _rows(results, case, rank, 0)["2:weight"], _rows(results, case, rank, 1)["2:weight"]
        assert not frozen["has_grad"] and "frozen" in frozen["reason"]
        assert unfrozen["has_grad"] and unfrozen["reason"] is None
        assert unfrozen["norm"] == pytest.approx(want, rel=1e-12)
        whole = pytest.approx(float(mlp()[2].weight.norm()), rel=1e-12)  # no optimiser step: the weight as made
        assert frozen["value_norm"] == whole and unfrozen["value_norm"] == whole  # with a gradient or not


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad", "retain_grad"])
def test_a_tensor_parallel_layers_input_tap_merges_its_partial_gradient(results: dict, strategy: str) -> None:
    want = _grad_of([1], "input")
    for rank in range(2):
        row = _rows(results, f"tp_input:{strategy}", rank)["0:input"]
        assert row["has_grad"] and row["numel"] == want.numel()
        assert row["norm"] == pytest.approx(float(want.norm()), rel=1e-12)


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad", "retain_grad"])
def test_the_edited_norm_of_a_partial_gradient_is_the_whole_edited_gradients(results: dict, strategy: str) -> None:
    """`scale: 0.5` on the column-parallel layer's input: its `edited_norm` was one rank's term of the `Partial(sum)`
    gradient (0.0435 where the whole edited gradient's norm is 0.0475), not the sum the record's `norm` is of."""
    want = _grad_of([1], "input")
    for rank in range(2):
        row = _rows(results, f"tp_input:{strategy}", rank)["0:input"]
        assert row["edited"] and row["edited_norm"] == pytest.approx(0.5 * float(want.norm()), rel=1e-12)


def test_per_example_under_tensor_parallel_is_null_with_the_reason_not_a_crash(results: dict) -> None:
    for rank in range(2):
        rows = _rows(results, "tp_per_example:hook", rank)
        assert all(r["per_example_norm"] is None and r["has_grad"] for r in rows.values())
        said = " ".join(results["tp_per_example:hook"][rank]["warned"])
        assert "2:bias is null: a sharded parameter" in said and "0:weight is null: a sharded parameter" in said


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_an_activation_dtensor_on_a_sub_mesh_is_recorded_per_data_parallel_rank(results: dict, strategy: str) -> None:
    for rank in range(4):
        want = _grad_of([1 + rank // 2], "output")  # the rank's own batch (dp coordinate), its whole activation
        row = _rows(results, f"twod:{strategy}", rank)["0:output"]
        assert row["has_grad"] and row["norm"] == pytest.approx(float(want.norm()), rel=1e-12)


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_an_activation_dtensor_on_a_sub_mesh_has_its_whole_value_norm(results: dict, strategy: str) -> None:
    """Its gradient is gathered and recorded whole per rank, its `value_norm` was the rank's columns' (1.91 of 2.81)."""
    for rank in range(4):
        x, _ = batch(1 + rank // 2)
        want = float(mlp()[0](x).norm())
        assert _rows(results, f"twod:{strategy}", rank)["0:output"]["value_norm"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_an_edit_of_an_activation_dtensor_on_a_sub_mesh_is_the_unsharded_runs(results: dict, strategy: str) -> None:
    """`dropout` on the tp sub-mesh's activation raised inside `backward()` (mixed torch.Tensor and DTensor): now each
    rank edits its piece with the unsharded run's draw; `0:weight` gets the mean of the ranks' edited gradients."""
    from gradrunner import capture

    edited_norm, weight_grad = {}, torch.zeros(6, 4, dtype=torch.float64)
    for seed in (1, 2):  # each data-parallel rank's batch
        model = mlp()
        x, y = batch(seed)
        with capture(model, ["0:output"], edits=[{"tap": "0:output", "dropout": 0.5}]) as cap:
            cap.backward(nn.functional.mse_loss(model(x), y))
            edited_norm[seed] = cap.records().row(0)["edited_norm"]
        weight_grad += model[0].weight.grad / 2  # FSDP2 averages over the data-parallel ranks
    for rank in range(4):
        rows = _rows(results, f"twod:{strategy}", rank)
        assert rows["0:output"]["edited_norm"] == pytest.approx(edited_norm[1 + rank // 2], rel=1e-12)
        assert rows["0:weight"]["norm"] == pytest.approx(float(weight_grad.norm()), rel=1e-12)


def test_ddp_a_gan_step_zeroing_each_networks_grad_after_its_step_records_both_weights(results: dict) -> None:
    """Both ranks see the same batches: each step's records equal the single-process GAN step's `.grad` at each
    optimiser step (the generator's was read after its own backward; a second synchronised backward of the step,
    in which it got no gradient and `.grad` was zeroed, replaced it with "takes no part in the loss")."""
    net = gan()
    opts = (torch.optim.SGD(net["g"].parameters(), lr=0.1), torch.optim.SGD(net["d"].parameters(), lr=0.1))
    want: list[dict[str, float]] = []

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        grad = net["g"][0].weight.grad if len(want[-1]) == 0 else net["d"].weight.grad
        want[-1]["net.g.0:weight" if len(want[-1]) == 0 else "net.d:weight"] = float(grad.norm())

    for step in range(2):
        want.append({})
        ddp_gan_step(lambda x, part: net[part](x), opts, *batch(1 + 10 * step), backward)
    for rank in range(2):
        for step in range(2):
            rows = _rows(results, "ddp_gan:hook", rank, step)
            for tap, norm in want[step].items():
                assert rows[tap]["has_grad"], (rank, step, tap, rows[tap]["reason"])
                assert rows[tap]["norm"] == pytest.approx(norm, rel=1e-12), (rank, step, tap)


def test_ddp_given_as_its_module_with_parameter_taps_is_refused(results: dict) -> None:
    """record(ddp.module, ...) recorded each rank's own gradient (2.03 and 0.59 where the averaged .grad was 1.23):
    now its first forward, run by the wrapper, refuses it in one paragraph saying what to pass; activation taps
    alone are recorded as ever (per rank, its own batch)."""
    for rank in range(2):
        got = results["ddp_inner:hook"][rank]
        msg = got["error"]
        assert msg.startswith("GradrunnerError") and "DistributedDataParallel" in msg and "2:weight" in msg, msg
        assert "record(ddp_model, ...) or capture(ddp_model, ...)" in msg and "params_synced" in msg and "\n" not in msg, msg
        (row,) = got["rows"][0]
        assert row["tap"] == "0:output" and row["norm"] == pytest.approx(float(_output_grad(rank).norm()), rel=1e-12)


def _output_grad(rank: int) -> torch.Tensor:
    """Layer 0's output gradient of `mlp()(x).sum()` on `rank`'s batch: one process, a plain tensor hook."""
    model = mlp()
    got: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, out: out.register_hook(got.append) and None)
    model(batch(1 + rank)[0]).sum().backward()
    return got[0]


@pytest.mark.parametrize("strategy", ["hook", "autograd_grad"])
def test_ddp_wrapper_given_to_capture_records_the_averaged_gradient(results: dict, strategy: str) -> None:
    """capture(ddp, ...) without params_synced, two micro-batches (the first under no_sync): a parameter tap's record is
    the all-reduced `.grad`, and `.grad` is DDP's average, with an activation tap alone too. Before the fix `hook`
    recorded each rank's own gradient, and under `autograd_grad` DDP's all-reduce never ran (each rank kept its own
    `.grad`, the record matching neither)."""
    model = mlp()
    total = sum(nn.functional.mse_loss(model(x), y) for x, y in (batch(s) for s in (1, 2, 3, 4))) / 2  # DDP: mean
    total.backward()  # type: ignore[union-attr]
    want = model[0].weight.grad
    assert want is not None
    for rank in range(2):
        got = results[f"ddp_wrapper:{strategy}"][rank]
        row = _rows(results, f"ddp_wrapper:{strategy}", rank)["module.0:weight"]
        assert row["has_grad"] and row["norm"] == pytest.approx(float(want.norm()), rel=1e-12)
        for grad in got["grad"]:  # the parameter tap's run, the activation tap's
            assert torch.allclose(grad, want, rtol=1e-12, atol=0)

def test_ddp_autograd_grad_refuses_a_tap_inside_a_reentrant_checkpoint(results: dict) -> None:
    """Under DDP autograd_grad's one engine call is `loss.backward()`: a tap inside checkpoint(use_reentrant=True) got
    a null record saying it "takes no part in the loss"; now it is refused as without DDP (docs/errors.md). The same
    run under `hook` records it, as plain tensor hooks give it."""
    for rank in range(2):
        msg = results["ddp_reentrant:autograd_grad"][rank]["error"]
        assert msg.startswith("GradrunnerError: capture.strategy='autograd_grad' cannot run through "
                              "torch.utils.checkpoint(..., use_reentrant=True)"), msg  # fmt: skip
        assert "b.0:output" in msg and "use_reentrant=False" in msg and "\n" not in msg, msg
        row = _rows(results, "ddp_reentrant:hook", rank)["b.0:output"]
        assert row["has_grad"] and row["norm"] == pytest.approx(float(_checkpointed_grad(rank).norm()), rel=1e-12)


def _checkpointed_grad(rank: int) -> torch.Tensor:
    """`b.0:output`'s gradient in `Checkpointed` on `rank`'s batch: one process, a plain tensor hook."""
    model, got = Checkpointed(), []

    def keep(m: nn.Module, a: Any, out: torch.Tensor) -> None:
        if out.requires_grad:  # the recomputation inside backward, not the first (no-grad) pass
            out.register_hook(got.append)

    model.b[0].register_forward_hook(keep)
    x, y = batch(1 + rank)
    nn.functional.mse_loss(model(x), y).backward()
    return got[0]


@pytest.mark.parametrize("case", [c for cases in UNSHARDED.values() for c in cases])
def test_unsharded_parameters_left_in_their_slots_are_not_taken_for_replacements(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    """FSDP2 puts an unsharded copy of each sharded parameter in its module's slot for the forward and swaps it back
    as it reshards, without a registration; a group that does not reshard after forward (the root group by default,
    `reshard_after_forward=False`; or `=2`: a copy sharded on a smaller mesh) leaves it there after a forward under
    no_grad. The check for replaced taps (at each entry; in the block after any registration) took those copies for
    replacements and refused the session. Recorded: the norm of each tapped parameter's whole `.grad`
    (`full_tensor()`), every step, every rank; a tapped parameter really replaced is still refused."""
    for rank, out in enumerate(results[case]):
        assert "refused" not in out, (rank, out["refused"])
        assert len(out["recorded"]) == STEPS
        for step, (got, whole) in enumerate(zip(out["recorded"], out["whole"], strict=True)):
            for tap in PARAM_TAPS:
                assert got[tap] == pytest.approx(whole[tap], rel=1e-12, abs=0), (rank, step, tap)
        if case.endswith("reenter"):
            assert "its tap 4:weight names parameter 'weight' of module '4', which is another object now" in out.get(
                "replaced_refused", ""
            ), rank
