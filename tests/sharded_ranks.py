"""One rank of `tests/test_sharded_stats.py`: shard a small model, one backward, merge its gradients' statistics.

Run by torchrun (gloo, CPU): `python -m torch.distributed.run --standalone --nproc_per_node=N sharded_ranks.py
OUT CASE...`, a CASE being `<parallel>:<model>:<dtype>` (`fsdp2` · `hsdp` · `tp` · `accum`, `mlp` · `gpt2` ·
`tp_mlp`, `float32` · `float64`). Each rank writes `OUT/<case>.rank<r>.pt`: the merged records (values none,
full and sample), the collectives each merge issued, the hooks' hand-outs, its batch, and (for the test's
check of the merge alone) the gathered whole gradients and parameters. The test computes every reference.
The models and batches are built here and by the test from the same seeds (`build_model`, `batch`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import procs
import torch
from torch import nn

SAMPLE = 5


class TPMLP(nn.Module):
    """fc1 column-parallel, fc2 row-parallel over 2 ranks (6 hidden units: TP in torch 2.13 needs even shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build_model(name: str, dtype: torch.dtype) -> nn.Module:
    """The unsharded model of a case, from seed 0 (3 output rows first: uneven over 2 and 4 ranks)."""
    torch.manual_seed(0)
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, 2))
    elif name == "tp_mlp":
        model = TPMLP()
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = GPT2LMHeadModel(cfg)
    return model.to(dtype)


def batch(model: str, rank: int, dtype: torch.dtype, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's batch: its own under FSDP2/HSDP (seeded by rank and micro-batch), the same on every rank under TP."""
    g = torch.Generator().manual_seed(100 + 10 * rank + micro)
    if model == "gpt2":
        ids = torch.randint(0, 11, (2, 6), generator=g)
        return ids, ids
    width, out = (5, 2) if model == "mlp" else (4, 3)
    return torch.randn(4, width, generator=g).to(dtype), torch.randn(4, out, generator=g).to(dtype)


def loss_of(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt2":
        return model(input_ids=x, labels=y).loss
    return nn.functional.mse_loss(model(x), y)


def _shard(model: nn.Module, parallel: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if parallel == "tp":
        parallelize_module(
            model, init_device_mesh("cpu", (world,)), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        return
    if parallel == "hsdp":  # FSDP2 asks for the dim names of a 2-D mesh
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    blocks = model.transformer.h if hasattr(model, "transformer") else [m for m in model if isinstance(m, nn.Linear)]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sharded_records(
    keys: list[Any], grads: list[torch.Tensor | None], *, tensors: list[torch.Tensor | None] | None = None,
    values: str = "none", sample_size: int = 64, seed: int = 0, histogram: bool = False,
) -> Any:  # fmt: skip
    """`Collector` over a list of (possibly DTensor) parameter gradients: the records of the whole ones."""
    from gradrunner.capturing.recorded_norms import record_value_norm
    from gradrunner.capturing.stats import Collector

    col = Collector(values, sample_size, seed, histogram=histogram)
    for i, (key, g) in enumerate(zip(keys, grads, strict=True)):
        t = None if tensors is None else tensors[i]
        col.add(key, g, batched=False, value_norm=None if t is None else record_value_norm(t))
    return col.finish()


class Counting:
    """Every collective issued inside the block, from the process groups' sequence numbers, and the all-reduce ops."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.ops, self.total = dist, [], 0

    def _seqs(self) -> dict[int, int]:
        return {id(g): g._get_sequence_number_for_group() for g in self.dist.distributed_c10d._world.pg_map}

    def __enter__(self) -> Counting:
        self.before, self.real = self._seqs(), self.dist.all_reduce

        def counted(t: torch.Tensor, op: Any = None, **kw: Any) -> Any:
            self.ops.append(str(op).rsplit(".", 1)[-1])  # "SUM", "MAX"
            return self.real(t, op=op, **kw)

        self.dist.all_reduce = counted  # this test process only: the module function, no class
        return self

    def __exit__(self, *exc: object) -> None:
        self.dist.all_reduce = self.real
        after = self._seqs()
        self.total = sum(after[k] - self.before.get(k, 0) for k in after)


def run_case(case: str, out: Path) -> None:
    import torch.distributed as dist

    from gradrunner.capturing.sharded import placement_of
    from gradrunner.capturing.sharded_hooks import on_sharded_grads
    from gradrunner.records.columns import TapKey

    parallel, name, dtype_name = case.split(":")
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, dtype)
    _shard(model, "fsdp2" if parallel == "accum" else parallel, world)
    handed: list[tuple[str, tuple[int, ...], bool]] = []
    grads: dict[str, torch.Tensor] = {}

    def got(g: Any) -> None:
        handed.append((g.name, tuple(g.local.shape), g.piece.counted))
        grads[g.name] = g.grad

    data_rank = 0 if parallel == "tp" else rank
    batches = [batch(name, data_rank, dtype, m) for m in range(2 if parallel == "accum" else 1)]
    with on_sharded_grads(model.named_parameters(), got):
        for m, (x, y) in enumerate(batches):
            if parallel == "accum":
                model.set_requires_gradient_sync(m == len(batches) - 1)  # type: ignore[operator]
            loss_of(model, name, x, y).backward()
            if m == 0:
                handed_before_sync = len(handed)
    params = dict(model.named_parameters())
    names = list(params)
    keys = [TapKey(*(n.rsplit(".", 1) if "." in n else ("", n)), 0) for n in names]  # type: ignore[arg-type]
    result: dict[str, Any] = {"handed": handed, "handed_before_sync": handed_before_sync, "names": names,
                              "batches": batches, "local_is_grad": all(
                                  g.to_local().data_ptr() == params[n].grad.to_local().data_ptr()  # type: ignore[union-attr]
                                  for n, g in grads.items())}  # fmt: skip
    for values in ("none", "full", "sample"):
        with Counting() as c:
            recs = sharded_records(keys, [grads.get(n) for n in names], tensors=[params[n] for n in names],
                                   values=values, sample_size=SAMPLE, seed=3, histogram=True)  # fmt: skip
        result[values] = recs
        result[f"collectives_{values}"] = (c.total, c.ops)
    plain = sharded_records([TapKey("", "plain", 0)], [torch.arange(6.0)])  # the same on every rank: a replica
    result["plain_norm"] = float(plain.stats["norm"][0])
    if parallel == "tp":
        from torch.distributed.tensor import DTensor, Partial

        partial = DTensor.from_local(torch.ones(2), params["fc1.weight"].device_mesh, [Partial()])
        try:
            placement_of(partial)
        except ValueError as e:
            result["partial_refused"] = str(e)
    result["full_grads"] = {n: g.full_tensor() for n, g in grads.items()}
    result["full_params"] = {n: p.full_tensor().detach() for n, p in params.items()}
    torch.save(result, out / f"{case.replace(':', '-')}.rank{rank}.pt")


def rank_main(argv: list[str], run_case: Callable[[str, Path], None]) -> None:
    """One torchrun rank: `argv` = [out dir, case, ...]; each case run by `run_case(case, out dir)`, then a barrier."""

    import torch.distributed as dist

    # torchrun starts each rank in a session of its own: the test kills leftovers by these pids
    procs.mark(argv[0])
    dist.init_process_group("gloo")
    try:
        for case in argv[1:]:
            run_case(case, Path(argv[0]))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    rank_main(argv, run_case)


if __name__ == "__main__":
    main(sys.argv[1:])
