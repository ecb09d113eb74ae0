"""Where the capture time goes: each statistic's op timed inside real training steps.

    python benchmarks/stats_profile.py            # the 17-tap 8x512 MLP at batch 256
    python benchmarks/stats_profile.py --tiny     # CI smoke run

Runs the `hook` strategy on the MLP of capture_overhead.py and, in turn, replaces the per-gradient
reduction with one op of it alone (the rest of the capture unchanged), timing that op inside the
hooks of real steps. Prints per step: each op's milliseconds summed over the 17 taps, as a share of
the bare training step, next to the whole reduction and the bare step (interleaved, medians).

It profiles the torch reduction path (`GRADRUNNER_FUSED=0`, set below): the fused one-pass kernel
does the whole reduction in one call, so there are no separate ops to time (see fused_stats.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ["GRADRUNNER_FUSED"] = "0"  # read on each gradient: the torch path, whose ops this script times

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, report

import gradrunner.capturing.reductions as reductions
import gradrunner.capturing.stats as stats
from gradrunner import capture
from gradrunner.models import MLP

OpFn = Callable[[torch.Tensor, torch.Tensor], object]
OPS: dict[str, OpFn] = {
    "sum": lambda f, buf: f.sum(),
    "dot (sum of squares)": lambda f, buf: torch.dot(f, f),
    "aminmax": lambda f, buf: torch.aminmax(f),
    "abs into scratch": lambda f, buf: torch.abs(f, out=buf),
    "count_nonzero (int view)": lambda f, buf: torch.count_nonzero(buf.view(torch.int32)),
    "host read of sums (numpy)": lambda f, buf: float(f[:1].sum().numpy()),
}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    width, batch, steps = (32, 8, 3) if args.tiny else (512, 256, 25)
    torch.manual_seed(0)
    model = MLP(width, width, 8, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    taps = ["fc*:output", "relu*:output", "head:output"]
    real = stats.reduce_one
    if args.tiny:
        stats.DEFER_NUMEL = 0  # tiny gradients would be reduced in batches; profile the per-gradient path
    rows = []
    for name, op in {"whole reduction": None, **OPS}.items():
        spent: list[float] = []
        buf = torch.empty(batch * width)

        def timed(flat: torch.Tensor, scratch: torch.Tensor | None = None, op: OpFn | None = op) -> object:
            start = time.perf_counter()
            out = real(flat, scratch) if op is None else op(flat, buf)
            spent.append(time.perf_counter() - start)
            if op is None:
                return out
            return [flat[:1].sum()] * 4, [reductions._CPU_ZERO] * 3  # stand-in results: the op alone was timed

        stats.reduce_one = timed  # type: ignore[assignment]
        try:
            with capture(model, taps, strategy="hook", keep_grads=False) as cap:
                for _ in range(steps):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    cap.backward(loss)
                    cap.records(loss)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        finally:
            stats.reduce_one = real
        per_step = statistics.median(spent) * 17 * 1e3
        rows.append({"op": name, "ms_per_step": per_step})

    def plain() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    bare = median_ms(interleaved({"none": (no_context, plain)}, repeats=3 if args.tiny else 10)["none"])
    for r in rows:
        r["pct_of_bare_step"] = 100 * r["ms_per_step"] / bare
    rows.append({"op": "bare training step", "ms_per_step": bare, "pct_of_bare_step": 100.0})
    report("stats_profile", rows, ["op", "ms_per_step", "pct_of_bare_step"], args.out)


if __name__ == "__main__":
    main()
