"""One rank of `tests/test_record_resume_ranks.py`: `gradrunner.record()` interrupted and resumed in a user's own loop.

Run by torchrun (gloo, CPU): `python -m torch.distributed.run --standalone --nproc_per_node=2 record_resume_ranks.py
OUT CASE...`, a CASE being `ddp` or `fsdp2` (the model wrapped or sharded). Each rank trains `STEPS` steps (SGD) of
the same model twice: once uninterrupted into `OUT/<case>/ref`, once into `OUT/<case>/cut`, a session that raises
after the backward of step `CUT` and a second one with `resume=True` (its default start: the step after the last
one kept) from there. Then a session into the completed `ref` without `resume` or `overwrite`: what each rank raised,
into `OUT/<case>.rank<r>.json`. The test compares the two dirs' records and the ranks' refusals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sharded_ranks import rank_main
from torch import nn

import gradrunner

STEPS, CUT = 4, 2
TAPS = ["0:weight", "0:output"]


class Interrupted(RuntimeError):
    """The user's loop stopped mid-step (a crash, Ctrl-C)."""


def _model(case: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    if case == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)


def _train(run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, resume: bool = False,
           cut: int | None = None) -> None:  # fmt: skip
    with gradrunner.record(model, TAPS, run_dir, strategy="hook", resume=resume) as rec:
        for step in steps:
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == cut:
                raise Interrupted(f"stopped at step {step}")
            opt.step()
            opt.zero_grad()
            rec.step(loss)


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist

    model, opt = _model(case)
    _train(out_dir / case / "ref", model, opt, range(STEPS))
    model, opt = _model(case)
    try:
        _train(out_dir / case / "cut", model, opt, range(STEPS), cut=CUT)
    except Interrupted:
        opt.zero_grad()
    _train(out_dir / case / "cut", model, opt, range(CUT, STEPS), resume=True)
    said = None
    try:
        _train(out_dir / case / "ref", model, opt, range(1))  # completed records, neither resume nor overwrite
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    (out_dir / f"{case}.rank{dist.get_rank()}.json").write_text(json.dumps({"raised": said}))


def main(argv: list[str]) -> None:
    rank_main(argv, run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
