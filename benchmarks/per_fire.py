"""What one tap firing costs, in microseconds, in the forward and in the backward pass.

    python benchmarks/per_fire.py            # a minute or so on 2 cores
    python benchmarks/per_fire.py --tiny     # CI smoke run

A 200-block MLP of width 4 at batch 1 (401 module outputs, every one tapped; each gradient has
4 elements, so reading gradients costs nothing and what is left is the per-fire machinery: forward
hook, element lookup, slot bookkeeping, hook registration; in backward the tensor hook, delivery
and the reduction call; at the end of the step the one transfer and deriving the statistics).
Forward, backward and `records()` are timed separately against the same model uncaptured,
repetitions of both interleaved; µs per fire = (captured - bare) / taps. `plain_hooks` is plain
PyTorch (a forward hook registering a tensor hook on each output) feeding gradrunner's `Collector`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import forward_hooks, parse_args, report

from gradrunner import capture
from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import TapKey

Phase = tuple[Callable[[], AbstractContextManager[Any]], Callable[[], dict[str, float]]]


def plain_tensor_hooks(model: nn.Module, col: Collector) -> AbstractContextManager[None]:
    """Plain PyTorch: a tensor hook on every submodule's output, gradrunner's statistics."""

    def register(path: str, out: torch.Tensor) -> None:
        key = TapKey(path, "output", 0)
        out.register_hook(lambda g: col.add(key, g))

    return forward_hooks([(n, m) for n, m in model.named_modules() if n], register)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    depth, repeats = (10, 3) if args.tiny else (200, 40)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    x = torch.randn(1, 4)
    taps = ["*:output"]
    n_taps = 2 * depth + 1 - 1  # every submodule's output (the root is not matched by "*")
    col = Collector(values="none")

    def bare() -> dict[str, float]:
        t0 = time.perf_counter()
        loss = model(x).square().sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        loss.detach().clone()  # what records() returns for the loss: a float
        t3 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return {"forward": t1 - t0, "backward": t2 - t1, "records": t3 - t2}

    def captured(cap: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = model(x).square().sum()
        t1 = time.perf_counter()
        cap.backward(loss)
        t2 = time.perf_counter()
        cap.records(loss)
        t3 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return {"forward": t1 - t0, "backward": t2 - t1, "records": t3 - t2}

    def plain() -> dict[str, float]:
        t0 = time.perf_counter()
        loss = model(x).square().sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        col.finish(loss)
        t3 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return {"forward": t1 - t0, "backward": t2 - t1, "records": t3 - t2}

    variants: dict[str, Phase] = {"none": (nullcontext, bare), "plain_hooks": (lambda: plain_tensor_hooks(model, col), plain)}
    for strategy in ("hook", "retain_grad", "autograd_grad"):
        cap = capture(model, taps, strategy=strategy, keep_grads=False)
        variants[strategy] = (lambda cap=cap: cap, lambda cap=cap: captured(cap))
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(repeats + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ctx, step = variants[name]
            with ctx():
                step()  # untimed: the block's first step
                for _ in range(5):
                    if r:
                        samples[name].append(step())
                    else:
                        step()
    med = {v: {p: statistics.median(s[p] for s in samples[v]) * 1e6 for p in ("forward", "backward", "records")}
           for v in variants}  # fmt: skip
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v, "taps": n_taps}
        for p in ("forward", "backward", "records"):
            row[f"{p}_us"] = med[v][p]
            row[f"{p}_us_per_fire"] = (med[v][p] - med["none"][p]) / n_taps
        row["total_us_per_fire"] = sum(row[f"{p}_us_per_fire"] for p in ("forward", "backward", "records"))
        rows.append(row)
    cols = ["variant", "taps", "forward_us", "backward_us", "records_us", "forward_us_per_fire",
            "backward_us_per_fire", "records_us_per_fire", "total_us_per_fire"]
    report("per_fire", rows, cols, args.out)


if __name__ == "__main__":
    main()
