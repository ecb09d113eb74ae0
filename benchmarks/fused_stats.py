"""The one-pass statistics kernel against the torch path and the one-read floor, per step's gradients.

    python benchmarks/fused_stats.py            # seconds
    python benchmarks/fused_stats.py --tiny     # CI smoke run

17 float32 gradients of 256x512 (one 8x512 MLP step's tapped outputs), reduced by: the fused CPU
kernel (`fused_stats`, one read, float64 sums), the torch path `reductions.reduce_one` (four reductions and
an `abs` pass), and `torch.sum` alone (one read, float32: the floor any statistics pay). Variants
interleaved, medians, at torch's thread count and at one thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

from gradrunner.capturing import fused_stats, reductions
from gradrunner.capturing.extras import histogram_counts
from gradrunner.records.columns import HIST_BINS


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n, size, repeats = (3, 1024, 5) if args.tiny else (17, 256 * 512, 200)
    grads = [torch.randn(size) for _ in range(n)]
    out = torch.empty(7, dtype=torch.float64)
    scratch = torch.empty(size)
    kernels = fused_stats.cpu_kernels()
    fn = kernels.get(torch.float32)

    def fused() -> None:
        for g in grads:
            fn(g.data_ptr(), g.numel(), out.data_ptr())  # type: ignore[misc]

    def torch_path() -> None:
        for g in grads:
            reductions.reduce_one(g, scratch)

    def floor() -> None:
        for g in grads:
            g.sum()

    def torch_hist() -> None:
        for g in grads:
            histogram_counts(g)

    hist_fn = fused_stats.cpu_hist_kernels().get(torch.float32)
    counts = torch.zeros(HIST_BINS, dtype=torch.int64)

    def fused_hist() -> None:
        for g in grads:
            hist_fn(g.data_ptr(), g.numel(), out.data_ptr(), counts.data_ptr())  # type: ignore[misc]

    variants: dict[str, Callable[[], None]] = {"torch path (reductions.reduce_one)": torch_path, "torch.sum only": floor,
                                               "torch histogram (extras.histogram_counts)": torch_hist}  # fmt: skip
    if fn is not None:
        variants = {"fused kernel": fused, **variants}
    if hist_fn is not None:
        variants = {"fused kernel + histogram": fused_hist, **variants}
    rows = []
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        floor_ms = statistics.median(times["torch.sum only"]) * 1e3
        for name, t in times.items():
            ms = statistics.median(t) * 1e3
            rows.append({"threads": threads, "variant": name, "ms_per_step": ms, "vs_floor": ms / floor_ms,
                         "gb_per_s": n * size * 4 / 1e9 / (ms / 1e3)})  # fmt: skip
    report("fused_stats", rows, ["threads", "variant", "ms_per_step", "vs_floor", "gb_per_s"], args.out)


if __name__ == "__main__":
    main()
