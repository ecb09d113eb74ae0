"""One rank of `tests/test_tensor_parallel_capture.py`: capture under sequence and tensor parallel (hunt S, 2026-11-27).

Run by torchrun (gloo, CPU, 2 ranks): `tensor_parallel_ranks.py OUT CASE...`, a CASE being `<what>:<strategy>`:

- `sp`: `{"norm": SequenceParallel(), "fc": ColwiseParallel(input_layouts=Shard(1))}`, each rank its half of
  the sequence; taps `norm:output` (its gradient's local piece comes from a reduce-scatter, still waiting: an
  `AsyncCollectiveTensor`) and `norm:weight`, `norm:bias` (their `.grad` is `Partial(sum)`);
- `rows`: `per_example=True` on activation `DTensor`s: `norm` sequence-parallel along dim 0 (the batch: its
  gradient is sharded by rows) and `fc1` column-parallel kept a `DTensor` (its gradient sharded by features);
  the model is `Side`: a column-parallel `side` branch kept a `DTensor` takes no part in the loss, so its output
  and parameters get no gradient (their `value_norm`s, `side.weight`'s `update_norm` after `SIDE_STEP`);
- `edits`: `rows`' model and plan with `EDITS` (no per-example norms): `dropout` on `fc1`'s `Shard(-1)` output,
  `noise_std` on `fc2`'s `Replicate` output, `clip_norm` on the sequence-parallel LayerNorm's weight
  (`Partial(sum)`); every parameter's whole `.grad` after the step is kept.

Each rank writes `OUT/<case>.rank<r>.pt`: the records' rows (or the error), the warnings, the placements of
`.grad` and the whole `.grad` of the tapped parameters after the step (the capture must leave them as torch
made them). The test computes every reference in one process, without gradrunner, from `sp_model`/`rows_model`.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class SP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class Rows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


class Side(Rows):
    """`Rows` with a branch whose output takes no part in the loss (no gradient reaches it nor its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)
        return super().forward(x)


#: The `rows` case's taps, and the factor its step multiplies `side.weight` by (an update without a gradient).
SIDE_TAPS, SIDE_STEP = ["norm:output", "fc1:output", "side:output", "side:weight", "side:bias"], 0.5
#: The `edits` case's edits: a DTensor gradient of each placement tensor parallel gives.
EDITS = [{"tap": "fc1:output", "dropout": 0.5}, {"tap": "fc2:output", "noise_std": 0.01},
         {"tap": "norm:weight", "clip_norm": 0.01}]  # fmt: skip


def sp_model() -> SP:
    torch.manual_seed(0)
    return SP().double()


def rows_model() -> Rows:
    torch.manual_seed(0)
    return Rows().double()


def side_model() -> Side:
    torch.manual_seed(0)  # `Rows`' parameters first: the same as `rows_model()`'s
    return Side().double()


def sp_data() -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3)).double()


def rows_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(4, 8, generator=g).double(), torch.randn(4, 4, generator=g).double()


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from gradrunner import capture

    what, strategy = case.split(":")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"rows": [], "warned": []}
    model: nn.Module
    if what == "sp":
        model = sp_model()
        parallelize_module(model, mesh, {"norm": SequenceParallel(), "fc": ColwiseParallel(input_layouts=Shard(1))})
        x = sp_data()
        part = x.shape[1] // world
        taps, per_example = ["norm:output", "norm:weight", "norm:bias"], False
    else:
        rows = what == "rows"
        model = side_model() if rows else rows_model()
        plan = {"norm": SequenceParallel(sequence_dim=0),
                "fc1": ColwiseParallel(input_layouts=Shard(0), use_local_output=False),
                "fc2": RowwiseParallel(use_local_output=False)}  # fmt: skip
        if rows:
            plan["side"] = ColwiseParallel(input_layouts=Shard(0), use_local_output=False)
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
        x, y = rows_data()
        part = x.shape[0] // world
        taps, per_example = (SIDE_TAPS if rows else [e["tap"] for e in EDITS]), rows
    placements: dict[str, str] = {}

    def seen(name: str) -> Any:
        return lambda g: placements.__setitem__(name, str(getattr(g, "placements", "plain")))

    model.norm.register_forward_hook(lambda m, a, o: o.register_hook(seen("norm:output")) and None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with capture(model, taps, strategy=strategy, per_example=per_example,
                         edits=EDITS if what == "edits" else None) as cap:  # fmt: skip
                if what == "sp":
                    loss = model(x[:, rank * part : (rank + 1) * part]).square().sum()
                else:
                    loss = nn.functional.mse_loss(model(x[rank * part : (rank + 1) * part]).full_tensor(), y)
                cap.backward(loss)
                before = cap.snapshot_params() if what == "rows" else None
                if before is not None:  # an update of a parameter no gradient reached
                    with torch.no_grad():
                        model.side.weight.mul_(SIDE_STEP)
                recs = cap.records(None, before)
                out["rows"].append([recs.row(i) for i in range(len(recs))])
        out["warned"] = [str(w.message) for w in caught]
        if what == "sp":
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.norm.named_parameters()}
            placements.update({n: str(p.grad.placements) for n, p in model.norm.named_parameters()})
        if what == "edits":
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    except Exception as e:  # what the hunt saw: a crash inside the backward
        out["error"] = f"{type(e).__name__}: {e}"
    out["placements"] = placements
    torch.save(out, out_dir / f"{case.replace(':', '-')}.rank{rank}.pt")


def main(argv: list[str]) -> None:
    from sharded_ranks import rank_main  # this dir is on sys.path: torchrun runs the script from it

    rank_main(argv, run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
