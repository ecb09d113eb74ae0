"""Capture overhead and memory per strategy on CUDA: one command, a compact table at the end.

    python benchmarks/cuda_overhead.py            # on a GPU: about a minute
    python benchmarks/cuda_overhead.py --tiny     # smoke run (on CPU when no GPU is present)

Overhead: the workloads of `capture_overhead.py` (17-tap MLP, tiny transformer, CNN), statistics
only, every variant interleaved, each step ending in `torch.cuda.synchronize()`; `plain_hooks` is
plain PyTorch tensor hooks feeding gradrunner's own `Collector`. Memory: a wide MLP (8x4096,
batch 4096, 17 taps), peak bytes allocated by the CUDA caching allocator during one step of each
variant above the no-capture step's, and host transfers per step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report
from capture_overhead import STRATEGIES, variants_for, workloads

import gradrunner.capturing.stats as stats
from gradrunner import capture
from gradrunner.capturing.taps import resolve_taps
from gradrunner.models import MLP


def overhead(device: str, tiny: bool, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, (model, x, y, taps) in workloads(tiny, device).items():
        times = interleaved(variants_for(model, x, y, taps, "none"), repeats=repeats)
        base = median_ms(times["none"])
        for variant, samples in times.items():
            ms = median_ms(samples)
            rows.append({"table": "overhead", "model": name, "taps": len(resolve_taps(model, taps)),
                         "variant": variant, "step_ms": ms, "ratio": ms / base})
    return rows


def memory(device: str, tiny: bool) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    width, batch = (64, 32) if tiny else (4096, 4096)
    model = MLP(width, width, 8, width).to(device)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    taps = ["fc*:output", "relu*:output", "head:output"]
    rows = []
    calls: list[int] = []
    real = stats.to_host

    def counting(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(t)

    stats.to_host = counting  # type: ignore[assignment]
    try:
        for variant in ("none", *STRATEGIES):
            for measured in (False, True):  # a first step warms caches and compiles kernels
                model.zero_grad(set_to_none=True)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                calls.clear()
                if variant == "none":
                    nn.functional.mse_loss(model(x), y).backward()
                else:
                    with capture(model, taps, strategy=variant, keep_grads=False) as cap:
                        loss = nn.functional.mse_loss(model(x), y)
                        cap.backward(loss)
                        cap.records(loss)
                if measured:
                    peak = torch.cuda.max_memory_allocated() - start if device.startswith("cuda") else 0
                    rows.append({"table": "memory", "model": f"mlp_8x{width}_b{batch}", "taps": 17,
                                 "variant": variant, "peak_mib": peak / 2**20, "transfers": len(calls)})
    finally:
        stats.to_host = real  # type: ignore[assignment]
    base = rows[0]["peak_mib"]
    for r in rows:
        r["above_none_mib"] = r["peak_mib"] - base
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--device", default="cuda"))
    device = args.device if torch.cuda.is_available() or not args.device.startswith("cuda") else "cpu"
    repeats = args.repeats or (2 if args.tiny else 20)
    rows = overhead(device, args.tiny, repeats) + memory(device, args.tiny)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    report("cuda_overhead", rows, ["table", "model", "taps", "variant", "step_ms", "ratio", "peak_mib",
                                   "above_none_mib", "transfers"], args.out, gpu=name)
    print(f"device: {name}")


if __name__ == "__main__":
    main()
