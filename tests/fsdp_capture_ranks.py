"""One rank of `tests/test_fsdp_capture.py`: `capture()` on a sharded model in the user's own loop, with and without.

Run by torchrun (gloo, CPU): `python -m torch.distributed.run --standalone --nproc_per_node=N fsdp_capture_ranks.py
OUT CASE...`, a CASE being `<parallel>:<model>:<strategy>` (`fsdp2` · `accum` · `hsdp` · `tp`, `mlp` · `gpt2` ·
`tp_mlp`, `hook` · `retain_grad` · `autograd_grad`; `tpdt`: tensor parallel whose outputs stay DTensors; `submesh`: FSDP2 on a mesh of one process (refused); `edits` / `hsdp+edits` / `tp+edits`: FSDP2 / HSDP / TP with `EDITS`, and
without capture the same edits cannot run, so the second run is plain; `record` as parallel: FSDP2 under `gradrunner.record`, every
rank writing to `OUT/record-<model>-<strategy>`, the user calling `loss.backward()`). Each rank trains `STEPS` steps (SGD) twice from the same
weights: once inside `capture(model, taps, strategy)` with every record kept, once without capture. It writes
`OUT/<case>.rank<r>.pt`: the records of each step, the losses of both runs, the final weights of both (gathered
whole), how often each parameter's post-accumulate-grad hooks fired in each, and a refusal's message. The test computes every reference.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from sharded_ranks import Counting, _shard, batch, build_model, loss_of
from torch import nn

STEPS = 2
MICRO = 2  # micro-batches per step under `accum`
LR = 0.1
#: Taps per model: parameters (a 3-row weight uneven over 2 and 4 ranks; GPT-2's root group: wte, ln_f) and
#: activations (inside a sharded block).
TAPS = {
    "mlp": ["0:weight", "0:bias", "2:weight", "4:bias", "0:output", "3:output", "2:input"],
    "gpt2": ["transformer.wte:weight", "transformer.ln_f:bias", "transformer.h.0.mlp.c_fc:weight",
             "transformer.h.0.attn.c_attn:bias", "transformer.h.0.mlp.c_fc:output", "transformer.h.0:output"],
    "tp_mlp": ["fc1:weight", "fc1:bias", "fc2:weight", "fc2:bias", "fc1:output", "act:output", "fc2:output"],
}  # fmt: skip


#: Edits on sharded parameters (`edits` / `hsdp+edits` cases): the global norm, the unsharded run's draws.
EDITS = {
    "mlp": [{"tap": "0:weight", "clip_norm": 0.05}, {"tap": "2:weight", "noise_std": 0.01}, {"tap": "0:bias", "dropout": 0.5}],
    "tp_mlp": [{"tap": "fc1:weight", "clip_norm": 0.05}, {"tap": "fc2:weight", "noise_std": 0.01},
               {"tap": "fc2:bias", "dropout": 0.5}],  # Shard(0), Shard(1), Replicate
}  # fmt: skip
SEED = 7
#: The layout each case's parallel shards with.
SHARDING = {"accum": "fsdp2", "record": "fsdp2", "edits": "fsdp2", "hsdp+edits": "hsdp", "tp+edits": "tp"}


def tp_dtensor_outputs(model: nn.Module, world: int) -> None:
    """fc1 column-, fc2 row-parallel with DTensor outputs (`use_local_output=False`): forward hooks see DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(use_local_output=False)}
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)  # type: ignore[arg-type]


def fsdp_on_a_sub_mesh(model: nn.Module, world: int) -> None:
    """FSDP2 over the size-1 `shard` dim of a (world, 1) mesh: each parameter's mesh spans one process only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "shard"))
    fully_shard(model, mesh=mesh["shard"])


def loss_on(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`loss_of`, the model's output made a plain tensor where it is a (replicated) DTensor."""
    if name != "tp_mlp":
        return loss_of(model, name, x, y)
    out = model(x)
    return nn.functional.mse_loss(out.full_tensor() if hasattr(out, "full_tensor") else out, y)


def micro_batches(parallel: str, name: str, rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's micro-batches of a step: its own under FSDP2/HSDP, rank 0's on every rank under TP."""
    n = MICRO if parallel == "accum" else 1
    data_rank = 0 if parallel.startswith("tp") else rank
    return [batch(name, data_rank, torch.float64, 100 * step + m) for m in range(n)]


def _recorded(model: nn.Module, name: str, strategy: str, run_dir: Path, out: dict[str, Any]) -> None:
    """The user's own FSDP2 loop under `record(model, taps, run_dir)`: no argument says it is distributed."""
    import torch.distributed as dist

    from gradrunner import record

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    with record(model, TAPS[name], run_dir, strategy=strategy) as rec:
        for step in range(STEPS):
            ((x, y),) = micro_batches("fsdp2", name, dist.get_rank(), step)
            loss = loss_on(model, name, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
            losses.append(loss.detach())
    out["captured_losses"] = torch.stack(losses)
    out["captured_weights"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # type: ignore[attr-defined]


def _train(model: nn.Module, parallel: str, name: str, strategy: str | None, out: dict[str, Any]) -> None:
    import torch.distributed as dist

    from gradrunner import capture

    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    edits = EDITS[name] if parallel.endswith("edits") else None
    cap = None if strategy is None else capture(model, TAPS[name], strategy, edits=edits, seed=SEED)
    losses, records = [], []
    fired: dict[str, int] = {}  # post-accumulate-grad hook calls per parameter, the whole run
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1))
    with cap if cap is not None else _nothing():
        for step in range(STEPS):
            batches = micro_batches(parallel, name, rank, step)
            total = torch.zeros((), dtype=torch.float64)
            for m, (x, y) in enumerate(batches):
                if parallel == "accum":
                    model.set_requires_gradient_sync(m == len(batches) - 1)  # type: ignore[operator]
                loss = loss_on(model, name, x, y) / len(batches)
                if cap is not None:
                    cap.backward(loss)
                else:
                    loss.backward()
                total += loss.detach()
            before = cap.snapshot_params() if cap is not None else None
            opt.step()
            if cap is not None:
                with Counting() as counted:  # every collective the step's records issue
                    records.append(cap.records(total, before))  # with the parameter taps' update norms
                out.setdefault("collectives", []).append((counted.total, counted.ops))
            opt.zero_grad()
            losses.append(total)
    key = "captured" if strategy is not None else "plain"
    out[f"{key}_losses"] = torch.stack(losses)
    out[f"{key}_fired"] = fired
    out[f"{key}_weights"] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    if cap is not None:
        out["records"] = records


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist

    from gradrunner.errors import GradrunnerError

    parallel, name, strategy = case.split(":")
    out: dict[str, Any] = {}
    for strat in (strategy, None):
        model = build_model(name, torch.float64)
        if parallel == "tpdt":
            tp_dtensor_outputs(model, dist.get_world_size())
        elif parallel == "submesh":
            fsdp_on_a_sub_mesh(model, dist.get_world_size())
        else:
            _shard(model, SHARDING.get(parallel, parallel), dist.get_world_size())
        try:
            if parallel == "record" and strat is not None:
                _recorded(model, name, strat, out_dir / case.replace(":", "-"), out)
            else:
                _train(model, parallel, name, strat, out)
        except GradrunnerError as e:
            out["refused"] = str(e)
    torch.save(out, out_dir / f"{case.replace(':', '-')}.rank{dist.get_rank()}.pt")


def main(argv: list[str]) -> None:
    from sharded_ranks import rank_main  # this dir is on sys.path: torchrun runs the script from it

    rank_main(argv, run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
