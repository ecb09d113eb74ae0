"""One rank of `tests/test_sharded_edges.py`: capture on a sharded model where the hunt of 2026-11-27 broke it.

Run by torchrun (gloo, CPU): `sharded_edges_ranks.py OUT CASE...`, a CASE being `<what>:<strategy>`:

- `unfreeze_fsdp`, `unfreeze_tp`: `2.weight` frozen at step 0, unfrozen at step 1 (its record at step 1);
- `tp_input`: the input of a column-parallel layer, whose gradient is a `Partial(sum)` DTensor;
- `tp_per_example`: `per_example=True` on a tensor-parallel parameter;
- `twod`: 2-D mesh (dp=2, tp=2), the activation a DTensor on the tp sub-mesh (4 ranks).

Each rank writes `OUT/<case>.rank<r>.pt`: the records' rows of each step (or the error it raised) and its
batches; the test computes every reference without gradrunner, in one process.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, generator=g).double(), torch.randn(4, 3, generator=g).double()


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradrunner import capture

    what, strategy = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp()
    local = what != "twod"
    if what in ("unfreeze_tp", "tp_input", "tp_per_example"):
        parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif what == "unfreeze_fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=mesh)
    else:  # twod
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False),
                                               "2": RowwiseParallel(use_local_output=False)})  # fmt: skip
        fully_shard(model, mesh=mesh["dp"])
    taps = {"tp_input": ["0:input", "0:weight"], "tp_per_example": ["2:bias", "0:weight"], "twod": ["0:output", "0:weight"]}
    steps = 2 if what.startswith("unfreeze") else 1
    if what.startswith("unfreeze"):
        model[2].weight.requires_grad_(False)
    seed = {"unfreeze_fsdp": 1 + rank, "twod": 1 + rank // 2}.get(what, 1)  # data parallel: each rank its batch
    out: dict[str, Any] = {"rows": [], "warned": []}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with capture(model, taps.get(what, ["2:weight"]), strategy=strategy,
                         per_example=what == "tp_per_example") as cap:  # fmt: skip
                for step in range(steps):
                    if step == 1:
                        model[2].weight.requires_grad_(True)
                    x, y = batch(seed + 10 * step)
                    out_t = model(x)
                    cap.backward(nn.functional.mse_loss(out_t if local else out_t.full_tensor(), y))
                    recs = cap.records()
                    out["rows"].append([recs.row(i) for i in range(len(recs))])
                    model.zero_grad()
        out["warned"] = [str(w.message) for w in caught]
    except Exception as e:  # what the hunt saw: a crash inside the backward
        out["error"] = f"{type(e).__name__}: {e}"
    torch.save(out, out_dir / f"{case.replace(':', '-')}.rank{rank}.pt")


def main(argv: list[str]) -> None:
    from sharded_ranks import rank_main  # this dir is on sys.path: torchrun runs the script from it

    rank_main(argv, run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
