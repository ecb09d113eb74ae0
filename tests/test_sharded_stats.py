"""Statistics of sharded gradients (`capturing.sharded`) equal the unsharded gradients' (FSDP2, HSDP, TP; gloo, CPU).

Each torchrun (2 or 4 ranks, `sharded_ranks.py`) shards small models (an MLP whose 3-row weight is split 2 + 1
over 2 ranks and 1 + 1 + 1 + 0 over 4, a transformers GPT-2 of one layer), runs one backward and merges every
parameter gradient's statistics. Here they are checked against two references computed without the merge:

- the existing `Collector` on the whole gradient the ranks gathered (`full_tensor()`, test only): the merge
  alone. Only the order of float64 additions differs: the sums within `MERGE_RTOL`, the rest exact.
- the existing `Collector` on the same model unsharded in this process, with every rank's data: the whole path.
  float64 models: the gradients themselves differ by float64 rounding (reduce-scatter's order); float32 ones
  by float32 rounding (`E2E_RTOL`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rank_launch import torchrun
from sharded_ranks import SAMPLE, batch, build_model, loss_of, sharded_records

from gradrunner.capturing.extras import value_norm
from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import STAT_COLUMNS, StepRecords, TapKey

pytestmark = pytest.mark.slow

CASES = {
    2: ["fsdp2:mlp:float32", "fsdp2:mlp:float64", "fsdp2:gpt2:float32", "fsdp2:gpt2:float64", "tp:tp_mlp:float32",
        "tp:tp_mlp:float64", "accum:mlp:float64"],
    4: ["fsdp2:mlp:float32", "fsdp2:mlp:float64", "fsdp2:gpt2:float64", "hsdp:mlp:float32", "hsdp:mlp:float64",
        "hsdp:gpt2:float32", "hsdp:gpt2:float64"],
}  # fmt: skip
ALL = [(w, c) for w, cases in CASES.items() for c in cases]
#: The merge against the gathered gradient: the same float64 sums of the same elements in another order
#: (at most a few hundred elements: error below n * 2**-53 ~ 3e-14); a mean's error is relative to abs_max.
#: Measured: 5.5e-16 at most (2026-11-25, torch 2.13 CPU); min, max, counts and histogram bins are exact.
MERGE_RTOL = 1e-13
#: The whole path against the unsharded run: the gradients themselves differ by the ranks' reduction order,
#: float64 in their last bits (2**-52 ~ 2e-16: measured 5.5e-16 on the statistics), float32 by about one float32
#: rounding (2**-24 ~ 6e-8: measured 1.1e-7). The data are seeded, so these margins do not flake.
E2E_RTOL = {"float64": 1e-13, "float32": 1e-6}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], list[dict[str, Any]]]:
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for world, cases in CASES.items():
        d = tmp_path_factory.mktemp(f"ranks{world}")
        torchrun(world, d, cases)
        for case in cases:
            name = case.replace(":", "-")
            out[world, case] = [torch.load(d / f"{name}.rank{r}.pt", weights_only=False) for r in range(world)]
    return out


def keys_of(names: list[str]) -> list[TapKey]:
    return [TapKey(*n.rsplit(".", 1), 0) for n in names]  # type: ignore[call-arg]


def collector_records(names: list[str], grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                      values: str) -> StepRecords:  # fmt: skip
    """The existing single-process `Collector` on whole gradients: the reference."""
    col = Collector(values=values, sample_size=SAMPLE, seed=3, histogram=True)
    for key, n in zip(keys_of(names), names, strict=True):
        col.add(key, grads[n], batched=False, value_norm=value_norm(params[n]))
    return col.finish()


def unsharded(world: int, case: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients and parameters of the case's model unsharded in this process, on every rank's data.

    FSDP2/HSDP average the ranks' gradients (each rank's loss a mean over its batch): the gradient of
    the mean of the ranks' losses; accumulation sums the micro-batches'. TP: every rank has the same batch.
    """
    parallel, name, dtype_name = case.split(":")
    dtype = getattr(torch, dtype_name)
    model = build_model(name, dtype)
    if parallel == "tp":
        loss_of(model, name, *batch(name, 0, dtype)).backward()
    else:
        for rank in range(world):
            for micro in range(2 if parallel == "accum" else 1):
                (loss_of(model, name, *batch(name, rank, dtype, micro)) / world).backward()
    return ({n: p.grad for n, p in model.named_parameters()},  # type: ignore[misc]
            {n: p.detach() for n, p in model.named_parameters()})  # fmt: skip


def assert_records(got: StepRecords, want: StepRecords, rtol: float, exact: bool) -> None:
    """Equal statistics: sums-based ones within `rtol` (a mean's error relative to abs_max), the rest exact if `exact`."""
    scale = np.nan_to_num(want.stats["abs_max"])
    for col in STAT_COLUMNS:
        a, b = got.stats[col], want.stats[col]
        if exact and col in ("min", "max", "abs_max", "zero_frac"):
            np.testing.assert_array_equal(a, b, err_msg=col)
        else:
            atol = rtol * scale if col == "mean" else 0.0
            ok = (np.abs(a - b) <= atol + rtol * np.abs(b)) | (np.isnan(a) & np.isnan(b))
            assert ok.all(), (col, a[~ok], b[~ok], np.abs(a - b)[~ok] / np.abs(b[~ok]))
    for col in ("nan_count", "inf_count"):
        np.testing.assert_array_equal(got.counts[col], want.counts[col], err_msg=col)
    np.testing.assert_array_equal(got.numel, want.numel)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.value_norm, want.value_norm, rtol=rtol)  # type: ignore[arg-type]
    if exact:  # |g| binned in float32: the same elements, the same counts
        for h, r in zip(got.hist_counts or [], want.hist_counts or [], strict=True):
            np.testing.assert_array_equal(h, r)


@pytest.mark.parametrize(("world", "case"), ALL)
def test_merged_statistics_equal_the_collectors_on_the_gathered_gradient(results: Any, world: int, case: str) -> None:
    r0 = results[world, case][0]
    for values in ("none", "full", "sample"):
        want = collector_records(r0["names"], r0["full_grads"], r0["full_params"], values)
        assert_records(r0[values], want, MERGE_RTOL, exact=True)
        if values != "none":  # only the elements asked for travelled, bit for bit
            for got, ref in zip(r0[values].values, want.values, strict=True):
                np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))
        if values == "sample":
            for got, ref in zip(r0[values].positions, want.positions, strict=True):
                np.testing.assert_array_equal(got, ref)
    assert r0["none"].stats["norm"].min() > 0  # real gradients, not zeros agreeing with zeros


@pytest.mark.parametrize(("world", "case"), ALL)
def test_merged_statistics_equal_the_unsharded_run(results: Any, world: int, case: str) -> None:
    r0 = results[world, case][0]
    grads, params = unsharded(world, case)
    rtol = E2E_RTOL[case.rsplit(":", 1)[1]]
    assert_records(r0["none"], collector_records(r0["names"], grads, params, "none"), rtol, exact=False)
    want = collector_records(r0["names"], grads, params, "full")
    for got, ref in zip(r0["full"].values, want.values, strict=True):
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize(("world", "case"), ALL)
def test_every_rank_holds_the_same_records(results: Any, world: int, case: str) -> None:
    ranks = results[world, case]
    for r in ranks[1:]:
        for values in ("none", "sample"):
            for col in STAT_COLUMNS:
                np.testing.assert_array_equal(r[values].stats[col], ranks[0][values].stats[col])
            for a, b in zip(r[values].hist_counts, ranks[0][values].hist_counts, strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("world", "case"), ALL)
def test_one_sum_and_one_max_all_reduce_per_step_and_nothing_else(results: Any, world: int, case: str) -> None:
    for r in results[world, case]:
        for values in ("none", "full", "sample"):
            total, ops = r[f"collectives_{values}"]
            assert total == 2 and ops == ["SUM", "MAX"], (values, total, ops)


@pytest.mark.parametrize(("world", "case"), ALL)
def test_hooks_hand_each_gradient_out_once_with_this_ranks_piece(results: Any, world: int, case: str) -> None:
    ranks = results[world, case]
    for rank, r in enumerate(ranks):
        names = [h[0] for h in r["handed"]]
        assert sorted(names) == sorted(r["names"]), "every parameter once"
        assert r["local_is_grad"]  # the piece handed out is .grad's own storage, not a copy
        shapes = {h[0]: h[1] for h in r["handed"]}
        counted = {h[2] for h in r["handed"]}
        if case.startswith("hsdp"):  # (Replicate, Shard(0)) on a 2 x 2 mesh: the first replica group counts
            assert counted == {rank < 2}
        elif not case.startswith("tp"):
            assert counted == {True}
        if case.split(":")[1] == "mlp":  # the 3-row weight: 2 + 1 over 2 ranks, 1 + 1 + 1 + 0 over 4 (FSDP2)
            rows = {2: [2, 1], 4: [1, 1, 1, 0]}[world] if case.startswith(("fsdp2", "accum")) else [2, 1, 2, 1]
            assert shapes["0.weight"] == (rows[rank], 5)
    if case.startswith("tp"):  # fc2's bias is Replicate: counted on rank 0 only; the rest sharded
        assert {h[0]: h[2] for h in ranks[1]["handed"]} == {"fc1.weight": True, "fc1.bias": True,
                                                            "fc2.weight": True, "fc2.bias": False}  # fmt: skip


def test_under_accumulation_the_hooks_wait_for_the_syncing_backward(results: Any) -> None:
    for r in results[2, "accum:mlp:float64"]:
        assert r["handed_before_sync"] == 0  # set_requires_gradient_sync(False): no .grad, no hook
        assert len(r["handed"]) == len(r["names"])


def test_a_plain_tensor_is_a_replica_counted_once_and_a_partial_one_is_refused(results: Any) -> None:
    for (world, case), ranks in results.items():
        for r in ranks:
            assert r["plain_norm"] == pytest.approx(55**0.5, rel=1e-15), (world, case)  # not sqrt(world) times it
            if case.startswith("tp"):
                assert "Partial" in r["partial_refused"] and "redistribute" in r["partial_refused"]


def test_plain_tensors_outside_a_process_group_give_the_collectors_records() -> None:
    grads = [torch.randn(3, 4), torch.tensor([0.0, -0.0, float("nan"), 1.0]), torch.zeros(0, 3), None,
             torch.randn(5, dtype=torch.float64), torch.randn(4, 4).t()]  # fmt: skip
    tensors = [torch.randn(3, 4), torch.randn(4), torch.zeros(0, 3), None, torch.randn(5), torch.randn(4, 4)]
    keys = [TapKey("m", f"p{i}", 0) for i in range(len(grads))]
    for values in ("none", "full", "sample"):
        got = sharded_records(keys, grads, tensors=tensors, values=values, sample_size=2, histogram=True)
        col = Collector(values=values, sample_size=2, histogram=True)
        for k, g, t in zip(keys, grads, tensors, strict=True):
            col.add(k, g, batched=False, value_norm=None if t is None else value_norm(t))
        want = col.finish()
        np.testing.assert_array_equal(got.has_grad, want.has_grad)
        assert_records(got, want, 1e-15, exact=True)
        for a, b in zip(got.values or [None] * 6, want.values or [None] * 6, strict=True):
            assert (a is None and b is None) or np.array_equal(a.view(np.int32), b.view(np.int32))


def test_position_tables_of_shapes_that_vary_are_kept_to_a_bound(tmp_path: Path) -> None:
    """`sharded.global_positions` keeps a table per shape: under shapes that vary (sequence lengths) it keeps the last
    `POSITIONS_KEPT`, each still right (it grew without end). One gloo process, in a subprocess of its own."""
    code = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from gradrunner.capturing import sharded
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
try:
    mesh = init_device_mesh("cpu", (1,))
    for rows in range(1, sharded.POSITIONS_KEPT + 20):
        t = distribute_tensor(torch.zeros(rows, 3), mesh, [Shard(0)])
        assert sharded.global_positions(t).tolist() == list(range(rows * 3))
        assert sharded.global_positions(t) is sharded.global_positions(t)  # kept while in use
    assert len(sharded._POSITIONS) == sharded.POSITIONS_KEPT, len(sharded._POSITIONS)
finally:
    dist.destroy_process_group()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
