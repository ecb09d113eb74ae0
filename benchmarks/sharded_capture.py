"""Capture under FSDP2 on 2 ranks: the cost of a captured step against no capture, and its collectives.

A GPT-2 (transformers, random init: 2 layers, n_embd 64, vocab 100, 16 tokens, batch 4 per rank),
each block `fully_shard`ed then the root (gradrunner.run.parallel), SGD. Variants, interleaved
(the order rotating, `_common.interleaved`), each step forward + backward + optimiser step:

- `none`: no capture;
- `activations`: `capture()` statistics of every block's MLP output gradient (per rank, no collective);
- `params`: statistics of every weight's gradient, merged over the ranks (capture's one SUM and one MAX
  all-reduce per captured step); reported as not run when this gradrunner's capture refuses
  sharded parameters (before issue 34's capture side).

Collectives per step are counted from every process group's sequence number (FSDP2's all-gathers and
reduce-scatters included), before and after one step of each variant.

Run directly (it starts `torchrun` with 2 ranks itself, CPU, gloo):

    OMP_NUM_THREADS=1 python benchmarks/sharded_capture.py
    # on a machine with 2 GPUs (nccl, each rank on cuda:<LOCAL_RANK>):
    python benchmarks/sharded_capture.py --device cuda
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report, synced


def _args() -> Any:
    return parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--device", default="cpu"))


def launch() -> int:
    """Start this script under torchrun, 2 ranks, with the same arguments (each rank by this interpreter, named
    with `--no-python`: what torchrun does by default, and the tests' warm Python starts its ranks too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           sys.executable, __file__, *sys.argv[1:]]  # fmt: skip
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode


def collectives() -> int:
    """Collectives issued so far on every process group (None-safe: 0 where torch does not say)."""
    groups = getattr(dist.distributed_c10d, "_world", None)
    total = 0
    for g in getattr(groups, "pg_map", {}) or {}:
        seq = getattr(g, "_get_sequence_number_for_group", None)
        with contextlib.suppress(RuntimeError):
            total += int(seq()) if callable(seq) else 0
    return total


def build(tiny: bool, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from gradrunner.run import parallel

    torch.manual_seed(0)
    width = 16 if tiny else 64
    config = transformers.GPT2Config(n_layer=1 if tiny else 2, n_embd=width, n_head=2 if tiny else 4, vocab_size=100,
                                     n_positions=16, bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallel.shard_model(model, parallel.shard_targets(model, ["transformer.h.*"]), mesh)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 100, (4, 16), generator=g).to(device)
    return model, ids, torch.optim.SGD(model.parameters(), lr=1e-3)


def variants(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from gradrunner import capture

    def step_with(cap: Any) -> Callable[[], None]:
        def step() -> None:
            loss = model(ids, labels=ids).loss
            if cap is None:
                loss.backward()
            else:
                cap.backward(loss)
                cap.records()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    out: dict[str, Any] = {"none": (contextlib.nullcontext, step_with(None))}
    for name, taps in (("activations", ["transformer.h.*.mlp:output"]), ("params", ["*:weight"])):
        holder: dict[str, Any] = {}

        @contextlib.contextmanager
        def session(taps: list[str] = taps, holder: dict[str, Any] = holder) -> Iterator[None]:
            with capture(model, taps, strategy="hook", keep_grads=False) as cap:
                holder["cap"] = cap
                yield

        def step(holder: dict[str, Any] = holder) -> None:
            step_with(holder["cap"])()

        try:  # a capture that refuses sharded parameters: this variant is not run
            with session():
                step()
        except Exception as e:
            out[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            continue
        out[name] = (session, step)
    return out


def count_per_step(run: tuple[Any, Callable[[], None]]) -> int:
    ctx, step = run
    with ctx():
        step()
        before = collectives()
        step()
        return collectives() - before


def main() -> None:
    args = _args()
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        model, ids, opt = build(args.tiny, device)
        runs = variants(model, ids, opt)
        ok = {k: v for k, v in runs.items() if isinstance(v, tuple)}
        if cuda:
            ok = {k: (ctx, synced(step)) for k, (ctx, step) in ok.items()}
        counts = {k: count_per_step(v) for k, v in ok.items()}
        times = interleaved(ok, repeats=args.repeats or (2 if args.tiny else 15), steps_per_block=3)
        medians = {k: median_ms(v) for k, v in times.items()}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, medians)
        if dist.get_rank() == 0:
            rows = []
            for name, run in runs.items():
                if not isinstance(run, tuple):
                    rows.append({"variant": name, "not_run": run})
                    continue
                ms = max(g[name] for g in gathered)  # the step ends when the slowest rank's does
                rows.append({"variant": name, "ms": ms, "ratio": ms / max(g["none"] for g in gathered),
                             "collectives_per_step": counts[name], "extra_collectives": counts[name] - counts["none"]})  # fmt: skip
            report("sharded_capture", rows, ["variant", "ms", "ratio", "collectives_per_step", "extra_collectives",
                                             "not_run"], out=args.out, device=str(device), world=2)  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit(launch())
    main()
    # The work is done and reported, the group destroyed: end here. In interpreter finalization a gloo rank has
    # aborted ("terminate called without an active exception", no Python frame) in 3 of about 12 full test runs
    # here (twice this script's --tiny run under test_benchmarks), failing torchrun after a complete run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
