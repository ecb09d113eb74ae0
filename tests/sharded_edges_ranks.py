"""One rank of `tests/test_sharded_edges.py`: capture on a sharded model where the hunt of 2026-11-27 broke it.

Run by torchrun (gloo, CPU): `sharded_edges_ranks.py OUT CASE...`, a CASE being `<what>:<strategy>`:

- `unfreeze_fsdp`, `unfreeze_tp`: `2.weight` frozen at step 0, unfrozen at step 1 (its record at step 1);
- `tp_input`: the input of a column-parallel layer, whose gradient is a `Partial(sum)` DTensor, edited (`scale`);
- `tp_per_example`: `per_example=True` on a tensor-parallel parameter;
- `twod`: 2-D mesh (dp=2, tp=2), the activation a DTensor on the tp sub-mesh, edited (`dropout`; 4 ranks);
- `ddp_inner`: DDP given as its `.module`: activation taps alone, then `record()` with a parameter tap (refused);
- `ddp_gan`: DDP (not sharded), a GAN step of two optimisers each stepped then zeroed after its own backward
  (`ddp_gan_step`): the generator's weight has no gradient in the second backward;
- `ddp_wrapper`: `capture()` given the DDP wrapper itself, no `params_synced`, two micro-batches (the first under
  `no_sync()`): a parameter tap, then an activation tap alone;
- `ddp_reentrant`: DDP, a tap inside `checkpoint(..., use_reentrant=True)` (`Checkpointed`).

Each rank writes `OUT/<case>.rank<r>.pt`: the records' rows of each step (or the error it raised) and its
batches; the test computes every reference without gradrunner, in one process.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Edits per case: the records checked of the other taps are those of gradients the edits do not reach.
EDITS = {"tp_input": [{"tap": "0:input", "scale": 0.5}], "twod": [{"tap": "0:output", "dropout": 0.5}]}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, generator=g).double(), torch.randn(4, 3, generator=g).double()


def gan() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"g": nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), "d": nn.Linear(3, 1)}).double()


def ddp_gan_step(net: nn.Module, opts: tuple[Any, Any], x: torch.Tensor, y: torch.Tensor, backward: Any) -> None:
    """The generator's loss backward, its step and zero_grad; then the discriminator's (on a detached sample)."""
    og, od = opts
    backward(nn.functional.mse_loss(net(x, "g"), y))
    og.step()
    og.zero_grad()
    backward(net(net(x, "g").detach(), "d").pow(2).mean())
    od.step()
    od.zero_grad()


class _Both(nn.Module):
    """`gan()` called by part (`net(x, "g")`), so one DDP wrapper holds both networks (as Lightning's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = gan()

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        return self.net[part](x)


def _ddp_gan(out: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from gradrunner import capture

    inner = _Both()
    ddp = DistributedDataParallel(inner, find_unused_parameters=True)
    opts = (torch.optim.SGD(inner.net["g"].parameters(), lr=0.1), torch.optim.SGD(inner.net["d"].parameters(), lr=0.1))
    with capture(inner, ["net.g.0:weight", "net.d:weight"], params_synced=lambda: ddp.require_backward_grad_sync) as cap:
        for step in range(2):
            ddp_gan_step(ddp, opts, *batch(1 + 10 * step), lambda loss: loss.backward())
            recs = cap.records()
            out["rows"].append([recs.row(i) for i in range(len(recs))])


def _ddp_inner(out: dict[str, Any], run_dir: Path) -> None:
    """`record(ddp.module, ...)` with a parameter tap: refused at the first forward (a DDP wrapper runs it); with
    activation taps only, recorded (per rank, DDP's convention for activations)."""
    from torch.nn.parallel import DistributedDataParallel

    from gradrunner import capture, record

    model = mlp()
    ddp = DistributedDataParallel(model)
    x, y = batch(1 + dist_rank())
    with capture(model, ["0:output"]) as cap:
        ddp(x).sum().backward()
        out["rows"].append([cap.records().row(0)])
    with record(model, ["0:output", "2:weight"], run_dir, overwrite=True) as rec:
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        rec.step(loss)


def _ddp_wrapper(out: dict[str, Any], strategy: str) -> None:
    """`capture(ddp, taps)`, with a parameter tap, then with an activation tap alone: the records and `.grad` after
    two micro-batches, the first under no_sync."""
    from torch.nn.parallel import DistributedDataParallel

    from gradrunner import capture

    out["grad"] = []
    for taps in (["module.0:weight"], ["module.0:output"]):
        model = mlp()
        ddp = DistributedDataParallel(model)
        with capture(ddp, taps, strategy=strategy) as cap:
            for micro in range(2):
                x, y = batch(1 + 2 * dist_rank() + micro)
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    cap.backward(nn.functional.mse_loss(ddp(x), y))
            recs = cap.records()
            out["rows"].append([recs.row(i) for i in range(len(recs))])
        out["grad"].append(model[0].weight.grad)


class Checkpointed(nn.Module):
    """`mlp()` with its middle (`b`: Linear, Tanh) run through `checkpoint(..., use_reentrant=True)`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.c(checkpoint(self.b, self.a(x), use_reentrant=True))


def _ddp_reentrant(out: dict[str, Any], strategy: str) -> None:
    """A tap inside a reentrant checkpoint under DDP: the records (hook), or the refusal (autograd_grad)."""
    from torch.nn.parallel import DistributedDataParallel

    from gradrunner import capture

    model = Checkpointed()
    ddp = DistributedDataParallel(model)
    synced = lambda: ddp.require_backward_grad_sync  # noqa: E731 (what record(ddp, ...) passes)
    with capture(model, ["a:output", "b.0:output", "b.0:weight"], strategy=strategy, params_synced=synced) as cap:
        x, y = batch(1 + dist_rank())
        cap.backward(nn.functional.mse_loss(ddp(x), y))
        recs = cap.records()
        out["rows"].append([recs.row(i) for i in range(len(recs))])


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from gradrunner import capture

    if case.startswith("unsharded_"):  # FSDP2's unsharded parameters left in their slots: in this group's ranks
        from fsdp_unsharded_ranks import run_case as run_unsharded

        run_unsharded(case, out_dir)
        return
    what, strategy = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    if what.startswith("ddp_"):
        out: dict[str, Any] = {"rows": []}
        try:
            if what == "ddp_gan":
                _ddp_gan(out)
            elif what == "ddp_inner":
                _ddp_inner(out, out_dir / "ddp_inner")
            else:
                (_ddp_wrapper if what == "ddp_wrapper" else _ddp_reentrant)(out, strategy)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        torch.save(out, out_dir / f"{case.replace(':', '-')}.rank{rank}.pt")
        return
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
    out = {"rows": [], "warned": []}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with capture(model, taps.get(what, ["2:weight"]), strategy=strategy, per_example=what == "tp_per_example",
                         edits=EDITS.get(what)) as cap:  # fmt: skip
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
