"""Whole-step ratio of each strategy to no capture, interleaved: for comparing two checkouts.

    python benchmarks/strategy_ratios.py --repeats 25                      # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/strategy_ratios.py --label before

The 8x512 MLP at batch 256, every module output tapped (17 taps), statistics only, one torch
thread. Only `capture(...)`, `cap.backward` and `cap.records` are used, so it runs against any
version of gradrunner since the first, which is what comparing two checkouts needs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradrunner import capture
from gradrunner.models import MLP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and 2 repeats (CI smoke run)")
    args = parser.parse_args()
    width, batch = (16, 4) if args.tiny else (512, 256)
    repeats = 2 if args.tiny else args.repeats
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(in_features=width, hidden=width, depth=8, out_features=10)
    x, y = torch.randn(batch, width), torch.randn(batch, 10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(cap: object | None) -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        if cap is None:
            loss.backward()
        else:
            cap.backward(loss)  # type: ignore[attr-defined]
            cap.records(loss)  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()

    variants = ["none", "hook", "retain_grad", "autograd_grad"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            if v == "none":
                t = time.perf_counter()
                step(None)
                times[v].append(time.perf_counter() - t)
                continue
            with capture(model, ["*:output"], v, keep_grads=False) as cap:
                step(cap)  # untimed: the first step of a session sets things up
                t = time.perf_counter()
                step(cap)
                times[v].append(time.perf_counter() - t)
    base = statistics.median(times["none"])
    ratios = ", ".join(f"{v} {statistics.median(times[v]) / base:.3f}x" for v in variants[1:])
    print(f"{args.label}: bare step {base * 1e3:.2f} ms; {ratios}")


if __name__ == "__main__":
    main()
