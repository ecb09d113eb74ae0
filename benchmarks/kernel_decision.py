"""Whole training steps with the C statistics kernel and with the torch path, interleaved.

    python benchmarks/kernel_decision.py --repeats 20       # MLP and transformer, one torch thread
    python benchmarks/kernel_decision.py --tiny             # CI smoke run

For issue 23's item 5 (keep or drop the run-time-built kernel): every strategy and plain tensor
hooks with gradrunner's statistics, each once with the fused kernel and once with
`GRADRUNNER_FUSED=0` (the torch path), on `capture_overhead`'s MLP (17 taps) and transformer
workloads, statistics only; `--histogram` adds `hook+histogram` both ways. All variants of a
model are interleaved (`_common.interleaved`); ratios are to the same step without capture.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report
from capture_overhead import STRATEGIES, _captured_step, plain_tensor_hooks, variants_for, workloads

from gradrunner import capture
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.taps import resolve_taps

Variant = tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]


@contextmanager
def fused_setting(on: bool, inner: AbstractContextManager[Any] | None = None) -> Iterator[None]:
    """`GRADRUNNER_FUSED` set for the block (collectors read it when they are made), then restored."""
    old = os.environ.get("GRADRUNNER_FUSED")
    os.environ["GRADRUNNER_FUSED"] = "1" if on else "0"
    try:
        if inner is None:
            yield
        else:
            with inner:
                yield
    finally:
        if old is None:
            del os.environ["GRADRUNNER_FUSED"]
        else:
            os.environ["GRADRUNNER_FUSED"] = old


def both_ways(model: nn.Module, x: torch.Tensor, y: torch.Tensor, taps: list[str], histogram: bool) -> dict[str, Variant]:
    """Each capture variant twice: `<name>` with the kernel, `<name> [torch]` without it."""
    base = variants_for(model, x, y, taps, "none")
    out: dict[str, Variant] = {"none": base["none"]}
    loss_fn = nn.functional.cross_entropy if y.dtype == torch.int64 else nn.functional.mse_loss
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    for on in (True, False):
        tag = "" if on else " [torch]"
        names = [*STRATEGIES, "hook+histogram"] if histogram else list(STRATEGIES)
        for name in names:
            with fused_setting(on):  # the session makes its collector now and after each step
                cap = capture(model, taps, strategy="hook" if name == "hook+histogram" else name, values="none",
                              keep_grads=False, histogram=name == "hook+histogram")  # fmt: skip
            out[name + tag] = (lambda cap=cap, on=on: fused_setting(on, cap), partial(_captured_step, cap, model, x, y, loss_fn, opt))
        with fused_setting(on):
            col = Collector(values="none")

        def plain_step(col: Collector = col) -> None:
            loss = loss_fn(model(x), y)
            loss.backward()
            col.finish(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["plain_hooks" + tag] = (lambda col=col, on=on: fused_setting(on, plain_tensor_hooks(model, taps, col)), plain_step)
    return out


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
        p.add_argument("--only", nargs="*", default=["mlp_8x512_b256", "transformer"], help="workloads")
        p.add_argument("--histogram", action="store_true", help="also hook+histogram, both ways")

    args = parse_args(__doc__.splitlines()[0], extra)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.tiny else 20)
    rows = []
    for name, (model, x, y, taps) in workloads(args.tiny).items():
        if name not in args.only:
            continue
        times = interleaved(both_ways(model, x, y, taps, args.histogram), repeats=repeats)
        base = median_ms(times["none"])
        for variant, samples in times.items():
            rows.append({"model": name, "taps": len(resolve_taps(model, taps)), "variant": variant,
                         "step_ms": median_ms(samples), "ratio": median_ms(samples) / base})  # fmt: skip
    report("kernel_decision", rows, ["model", "taps", "variant", "step_ms", "ratio"], args.out)


if __name__ == "__main__":
    main()
