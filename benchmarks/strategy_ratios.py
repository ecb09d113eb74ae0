"""Whole-step ratio of each strategy to no capture, interleaved: for comparing two checkouts.

    python benchmarks/strategy_ratios.py --repeats 25                      # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/strategy_ratios.py --label before

The 8x512 MLP at batch 256, every module output tapped (17 taps), statistics only, one torch
thread. Only `capture(...)`, `cap.backward` and `cap.records` are used, so it runs against any
version of gradrunner since the first, which is what comparing two checkouts needs.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import parse_args, report

from gradrunner import capture
from gradrunner.models import MLP


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--label", default="this checkout"))
    width, batch = (16, 4) if args.tiny else (512, 256)
    repeats = args.repeats or (2 if args.tiny else 25)
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
    rows = [{"label": args.label, "variant": v, "step_ms": 1e3 * statistics.median(times[v]),
             "ratio": statistics.median(times[v]) / base} for v in variants]  # fmt: skip
    report("strategy_ratios", rows, ["label", "variant", "step_ms", "ratio"], args.out)


if __name__ == "__main__":
    main()
