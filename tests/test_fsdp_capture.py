"""`capture()` in a user's own FSDP2 / HSDP / tensor-parallel loop records what a single-process run records.

Each torchrun (gloo, CPU; 2 ranks, 4 for HSDP's 2 x 2 mesh) runs `fsdp_capture_ranks.py`: every rank trains a
small model (`torch.nn` layers whose 3-row weight is split 2 + 1 over 2 ranks and 1 + 1 + 1 + 0 over 4; a
random-init transformers GPT-2) for two SGD steps inside `capture(model, taps, strategy)`, then again without
capture. The references are computed here without gradrunner, on the same model unsharded in this process:

- parameter taps: the statistics of the whole gradient of the mean of the ranks' losses (what FSDP2 averages;
  under accumulation the sum over micro-batches, each loss divided by their number), the same on every rank;
- activation taps: DDP's convention, per rank, the gradient of that rank's own (micro-)batch loss;
- tensor parallel (every rank the same batch): a tap whose gradient is a `DTensor` (`tpdt`: outputs kept as
  DTensors) is one tensor, merged over the ranks like a parameter; a colwise output TP hands on as a plain
  tensor (`tp`: the default `use_local_output`) is the rank's columns, as it holds them;
- loss and final weights: bitwise the same with and without capture on each rank, and equal to the unsharded
  run's (float64: the ranks' reductions add in another order, `RTOL`).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from fsdp_capture_ranks import EDITS, LR, SEED, STEPS, TAPS, micro_batches
from rank_launch import torchrun
from sharded_ranks import build_model, loss_of

pytestmark = pytest.mark.slow

CASES = {
    2: ["fsdp2:mlp:hook", "fsdp2:mlp:retain_grad", "fsdp2:mlp:autograd_grad", "fsdp2:gpt2:hook",
        "fsdp2:gpt2:retain_grad", "accum:mlp:hook", "accum:mlp:retain_grad", "accum:mlp:autograd_grad", "record:mlp:hook", "record:gpt2:retain_grad",
        "edits:mlp:hook", "tp:tp_mlp:hook", "tpdt:tp_mlp:hook", "tpdt:tp_mlp:retain_grad", "tpdt:tp_mlp:autograd_grad",
        "submesh:mlp:hook", "tp+edits:tp_mlp:hook"],
    4: ["hsdp:mlp:hook", "hsdp:mlp:retain_grad", "hsdp+edits:mlp:retain_grad"],
}  # fmt: skip
ALL = [(w, c) for w, cases in CASES.items() for c in cases]
CAPTURED = [(w, c) for w, c in ALL if not c.startswith(("record", "submesh")) and "edits" not in c]
EDITED = [(w, c) for w, c in ALL if "edits" in c]
RECORDED = [(w, c) for w, c in ALL if c.startswith("record")]
#: float64 models: the sharded gradients differ from the unsharded ones by the order of the ranks' additions
#: (a few roundings of 2**-52 ~ 2e-16); a mean's error is relative to the gradient's largest element.
RTOL = 1e-12


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], Any]:
    out: dict[tuple[int, str], Any] = {}
    for world, cases in CASES.items():
        d = tmp_path_factory.mktemp(f"capture{world}")
        torchrun(world, d, cases, timeout=600, script="fsdp_capture_ranks.py")
        for case in cases:
            name = case.replace(":", "-")
            out[world, case] = [torch.load(d / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]
            out[world, case, "dir"] = d / name
    return out


def _split(tap: str) -> tuple[str, str]:
    module, _, what = tap.rpartition(":")
    return module, what


def _act(tap: str) -> bool:
    """An activation tap (a module's output or input: per rank, from its own batch), not a parameter's."""
    return _split(tap)[1] in ("output", "input")


def reference(world: int, parallel: str, name: str) -> dict[str, Any]:
    """The unsharded run, plain torch: per step the parameter gradients, each rank's activation gradients, losses."""
    model = build_model(name, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    modules = dict(model.named_modules())
    params = [t for t in TAPS[name] if not _act(t)]
    acts = [t for t in TAPS[name] if _act(t)]
    steps = []
    for step in range(STEPS):
        act_grads: dict[tuple[int, int, str], torch.Tensor] = {}
        losses = []
        for rank in range(world):
            batches = micro_batches(parallel, name, rank, step)
            rank_loss = torch.zeros((), dtype=torch.float64)
            for micro, (x, y) in enumerate(batches):
                copied = copy.deepcopy(model)  # this rank's micro-batch alone: its activation gradients
                handles = [dict(copied.named_modules())[_split(t)[0]].register_forward_hook(_grab(act_grads, (rank, micro, t)))
                           for t in acts]  # fmt: skip
                loss = loss_of(copied, name, x, y) / len(batches)
                loss.backward()
                rank_loss += loss.detach()
                for h in handles:
                    h.remove()
                (loss_of(model, name, x, y) / len(batches) / world).backward()  # FSDP2 averages the ranks'
            losses.append(rank_loss)
        values = {t: getattr(modules[_split(t)[0]], _split(t)[1]).detach().clone() for t in params}
        grads = {t: getattr(modules[_split(t)[0]], _split(t)[1]).grad.clone() for t in params}
        steps.append({"params": grads, "values": values, "acts": act_grads, "losses": losses})
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "weights": {n: p.detach() for n, p in model.named_parameters()}}


def _grab(into: dict[Any, torch.Tensor], key: Any) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        tensor = args[0] if _split(key[-1])[1] == "input" else output
        tensor.register_hook(lambda g: into.__setitem__(key, g.detach().clone()))

    return hook


def stats_of(g: torch.Tensor) -> dict[str, float]:
    """The recorded statistics of a whole gradient, computed directly."""
    g = g.detach().double().reshape(-1)
    return {"norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std()), "min": float(g.min()),
            "max": float(g.max()), "abs_max": float(g.abs().max()), "zero_frac": float((g == 0).double().mean())}  # fmt: skip


def assert_record(rec: Any, i: int, want: torch.Tensor, what: str) -> None:
    assert rec.has_grad[i], what
    assert rec.numel[i] == want.numel() and tuple(rec.shape[i]) == tuple(want.shape), what
    scale = float(want.abs().max())
    for col, v in stats_of(want).items():
        got = float(rec.stats[col][i])
        assert abs(got - v) <= RTOL * (abs(v) + (scale if col in ("mean", "std") else 0.0)), (what, col, got, v)


@pytest.mark.parametrize(("world", "case"), CAPTURED)
def test_records_equal_the_single_process_runs(results: Any, world: int, case: str) -> None:
    parallel, name, _ = case.split(":")
    ref = reference(world, parallel, name)
    for rank, r in enumerate(results[world, case]):
        assert "refused" not in r, r.get("refused")
        assert len(r["records"]) == STEPS
        for step, (rec, want) in enumerate(zip(r["records"], ref["steps"], strict=True)):
            micro = rec.micro_step if rec.micro_step is not None else [None] * len(rec.keys)
            seen = set()
            for i, key in enumerate(rec.keys):
                module, what = _split(key.tap)
                where = f"rank {rank} step {step} {key.tap} call {key.call} micro {micro[i]}"
                if what in ("output", "input"):  # per rank, from its own batch
                    grad = want["acts"][rank, micro[i] or 0, key.tap]
                    if parallel == "tp" and key.tap != "fc2:output":  # TP hands on the rank's columns, no DTensor
                        grad = grad[:, 3 * rank : 3 * rank + 3]
                    assert_record(rec, i, grad, where)
                else:  # the whole parameter's gradient, the same on every rank
                    assert micro[i] is None, where  # one record for the step, at the sync
                    assert_record(rec, i, want["params"][key.tap], where)
                    np.testing.assert_allclose(rec.value_norm[i], float(want["values"][key.tap].norm()), rtol=RTOL)
                    # plain SGD: the whole parameter moved by lr times the whole gradient
                    np.testing.assert_allclose(rec.update_norm[i], LR * float(want["params"][key.tap].norm()), rtol=1e-9)
                seen.add((key.tap, micro[i]))
            n_micro = 2 if parallel == "accum" else 1
            wanted = {(t, None) for t in TAPS[name] if not _act(t)}
            wanted |= {(t, m if n_micro > 1 else None) for t in TAPS[name] if _act(t) for m in range(n_micro)}
            assert seen == wanted, (rank, step, seen ^ wanted)
            np.testing.assert_allclose(float(r["captured_losses"][step]), float(want["losses"][rank]), rtol=RTOL)


@pytest.mark.parametrize(("world", "case"), CAPTURED)
def test_loss_and_weights_are_bitwise_the_same_without_capture(results: Any, world: int, case: str) -> None:
    parallel, name, _ = case.split(":")
    ref = reference(world, parallel, name)
    for r in results[world, case]:
        assert torch.equal(r["captured_losses"], r["plain_losses"])
        assert r["captured_weights"].keys() == r["plain_weights"].keys() == ref["weights"].keys()
        for n, w in r["plain_weights"].items():
            assert torch.equal(r["captured_weights"][n], w), n
            torch.testing.assert_close(w, ref["weights"][n], rtol=RTOL, atol=RTOL)  # and the training is real
            assert not torch.equal(w, build_model(name, torch.float64).state_dict()[n]), n


@pytest.mark.parametrize(("world", "case"), CAPTURED)
def test_post_accumulate_grad_hooks_fire_as_often_as_without_capture(results: Any, world: int, case: str) -> None:
    """Once per parameter and step, at the sync (FSDP2 fires them after its reduce-scatter); `autograd_grad` under
    accumulation fired them twice, its engine call for the taps running FSDP2's post-backward too."""
    for r in results[world, case]:
        assert r["captured_fired"] == r["plain_fired"] == {n: STEPS for n in r["plain_weights"]}, r["captured_fired"]


def test_records_are_the_same_on_every_rank_for_parameters_and_differ_for_activations(results: Any) -> None:
    for world, case in CAPTURED:
        if case.startswith("tp"):  # every rank the same batch: see the TP test
            continue
        ranks = results[world, case]
        for step in range(STEPS):
            recs = [r["records"][step] for r in ranks]
            param = [i for i, k in enumerate(recs[0].keys) if not _act(k.tap)]
            act = [i for i, k in enumerate(recs[0].keys) if _act(k.tap)]
            for rec in recs[1:]:
                np.testing.assert_array_equal(rec.stats["norm"][param], recs[0].stats["norm"][param])
                assert (rec.stats["norm"][act] != recs[0].stats["norm"][act]).all(), (world, case)


@pytest.mark.parametrize(("world", "case"), RECORDED)
def test_record_in_a_users_fsdp2_loop_writes_every_ranks_rows_in_one_run_dir(results: Any, world: int, case: str) -> None:
    from gradrunner.analysis import load

    _, name, _ = case.split(":")
    ref = reference(world, "fsdp2", name)
    df = load(results[world, case, "dir"])
    assert sorted(df["rank"].unique()) == list(range(world))
    assert len(df) == STEPS * world * len(TAPS[name])  # one row per (step, rank, tap): nothing lost or doubled
    for row in df.itertuples():
        want = ref["steps"][row.step]
        tap = f"{row.module}:{row.tap}" if ":" not in str(row.tap) else str(row.tap)
        grad = want["acts"][row.rank, 0, tap] if _act(tap) else want["params"][tap]
        for col, v in stats_of(grad).items():
            scale = float(grad.abs().max()) if col in ("mean", "std") else 0.0
            assert abs(getattr(row, col) - v) <= RTOL * (abs(v) + scale), (row.step, row.rank, tap, col)


def edited_reference(world: int, parallel: str, name: str) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """gradrunner's edits on the unsharded model (the mean of the ranks' losses, one backward): records, weights."""
    from gradrunner import capture

    model = build_model(name, torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    records = []
    with capture(model, TAPS[name], "hook", edits=EDITS[name], seed=SEED) as cap:
        for step in range(STEPS):
            loss = sum(loss_of(model, name, *micro_batches(parallel, name, r, step)[0]) for r in range(world)) / world
            cap.backward(loss)
            records.append(cap.records())
            opt.step()
            opt.zero_grad()
    return records, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("world", "case"), EDITED)
def test_edits_on_sharded_gradients_are_the_unsharded_runs_edits(results: Any, world: int, case: str) -> None:
    """clip_norm clips by the whole gradient's norm; noise_std and dropout draw what the unsharded run draws."""
    parallel, name, _ = case.split(":")
    want_recs, want_weights = edited_reference(world, parallel, name)
    edited_taps = {e["tap"] for e in EDITS[name]}
    clipped = EDITS[name][0]["tap"]
    for r in results[world, case]:
        for n, w in want_weights.items():  # training with the edits went where the unsharded edits went
            torch.testing.assert_close(r["captured_weights"][n], w, rtol=RTOL, atol=RTOL)
        for n in {t.replace(":", ".") for t in edited_taps}:  # and the edits did change the training
            assert not torch.equal(r["captured_weights"][n], r["plain_weights"][n]), n
        for got, want in zip(r["records"], want_recs, strict=True):
            rows = {k.tap: i for i, k in enumerate(want.keys)}
            for i, key in enumerate(got.keys):
                if key.tap not in edited_taps:
                    continue
                j = rows[key.tap]
                assert got.edited[i] and want.edited[j], key.tap
                for col in ("norm", "mean", "max"):  # the record: the gradient before the edit
                    np.testing.assert_allclose(got.stats[col][i], want.stats[col][j], rtol=RTOL, atol=RTOL)
                np.testing.assert_allclose(got.edited_norm[i], want.edited_norm[j], rtol=RTOL)
                if key.tap == clipped:  # clipped to 0.05 as a whole, not each shard to 0.05
                    assert got.stats["norm"][i] > 0.05
                    assert got.edited_norm[i] == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize(("world", "case"), CAPTURED + EDITED)
def test_a_captured_steps_records_cost_one_sum_and_one_max_all_reduce(results: Any, world: int, case: str) -> None:
    """The merge of every sharded record of the step: one packed SUM and one MAX, no gather, nothing per tap."""
    for r in results[world, case]:
        assert r["collectives"] == [(2, ["SUM", "MAX"])] * STEPS, r["collectives"]


def test_parameter_taps_on_a_mesh_that_spans_part_of_the_world_are_refused_in_one_paragraph(results: Any) -> None:
    """What is not supported, said exactly (it advised "a 2-D mesh for data x tensor parallel", the layout whose
    sub-mesh `fully_shard(model, mesh=mesh["dp"])` gives the layers outside the tensor-parallel plan)."""
    for r in results[2, "submesh:mlp:hook"]:
        assert "records" not in r and "captured_losses" not in r  # refused as the capture opened: no step ran
        msg = r["refused"]
        assert "0:weight" in msg and "mesh of 1 of the 2 processes" in msg and "\n" not in msg, msg
        assert "does not merge parameters on a sub-mesh" in msg and "2-D mesh for data x tensor" not in msg, msg
