"""Where the `hook` strategy's extra time per step goes on the 17-tap MLP (CPU), in real training steps.

    python benchmarks/overhead_profile.py --repeats 30
    python benchmarks/overhead_profile.py --tiny           # CI smoke run

The 8x512 MLP at batch 256 (`capture_overhead`'s workload, 17 taps, statistics only, one thread),
`none` and `hook` steps interleaved. During the `hook` steps the three pieces gradrunner adds are
timed where they run, by wrapping them: the statistics kernel (`Collector._cpu_reduce`, or the torch
path's `Collector.add`), the tapped values' own norm (`firing.record_value_norm`, always on), and the
step's records (`Collector.finish`: one transfer, deriving the statistics). What the wrappers do not
cover (module and tensor hooks, slots, the strategy's bookkeeping) is the rest: `hook` minus
`none` minus the three. Each piece is reported in ms per step and as a fraction of the bare step.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial, wraps
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, plain_step, report
from capture_overhead import _captured_step, workloads

import gradrunner.capturing.firing as firing
from gradrunner import capture
from gradrunner.capturing.stats import Collector


def _timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket[0] += time.perf_counter() - start

    return run


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    repeats = args.repeats or (2 if args.tiny else 30)
    model, x, y, taps = workloads(args.tiny)["mlp_8x512_b256"]
    loss_fn = torch.nn.functional.mse_loss
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    plain = plain_step(model, x, y, loss_fn, opt)

    cap = capture(model, taps, strategy="hook", values="none", keep_grads=False)
    pieces = {"statistics kernel": [0.0], "value_norm": [0.0], "records (finish)": [0.0]}
    reduce_name = "_cpu_reduce" if hasattr(Collector, "_cpu_reduce") else "add"
    originals = (getattr(Collector, reduce_name), firing.record_value_norm, Collector.finish)
    setattr(Collector, reduce_name, _timed(originals[0], pieces["statistics kernel"]))
    firing.record_value_norm = _timed(originals[1], pieces["value_norm"])  # type: ignore[assignment]
    Collector.finish = _timed(originals[2], pieces["records (finish)"])  # type: ignore[method-assign]
    per_step: dict[str, list[float]] = {k: [] for k in pieces}
    hook_step = partial(_captured_step, cap, model, x, y, loss_fn, opt)

    def measured() -> None:
        for b in pieces.values():
            b[0] = 0.0
        hook_step()
        for k, b in pieces.items():
            per_step[k].append(b[0])

    try:
        times = interleaved({"none": (no_context, plain), "hook": (lambda: cap, measured)}, repeats=repeats)
    finally:
        setattr(Collector, reduce_name, originals[0])
        firing.record_value_norm = originals[1]  # type: ignore[assignment]
        Collector.finish = originals[2]  # type: ignore[method-assign]
    none, hook = median_ms(times["none"]), median_ms(times["hook"])
    rows = [{"part": "bare step (none)", "ms": none, "of_bare_step": 1.0},
            {"part": "hook step", "ms": hook, "of_bare_step": hook / none}]  # fmt: skip
    covered = 0.0
    for k, samples in per_step.items():
        ms = statistics.median(samples) * 1e3
        covered += ms
        rows.append({"part": k, "ms": ms, "of_bare_step": ms / none})
    rest = hook - none - covered
    rows.append({"part": "rest: hooks, slots, strategy", "ms": rest, "of_bare_step": rest / none})
    report("overhead_profile", rows, ["part", "ms", "of_bare_step"], args.out)


if __name__ == "__main__":
    main()
