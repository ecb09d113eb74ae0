"""How capture overhead grows with the number of taps (1, 10, 50, 200), against the naive baseline.

    python benchmarks/tap_scaling.py            # full sizes
    python benchmarks/tap_scaling.py --tiny     # CI smoke run

One deep MLP (100 Linear+ReLU blocks, width 256, batch 128: 201 module outputs); the first N
module outputs in forward order are tapped. For each N, steps with no capture, with each strategy
(statistics only) and with the naive tutorial baseline are interleaved. Also counts device-to-host
transfers per captured step (calls to `gradrunner.capturing.stats.to_host`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report
from capture_overhead import variants_for

import gradrunner.capturing.stats as stats
from gradrunner import STRATEGIES, capture
from gradrunner.models import MLP


def count_transfers(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, taps: list[str], strategy: str) -> int:
    """Calls to the one device-to-host exit (`stats.to_host`) during one captured step."""
    calls = 0
    original = stats.to_host

    def counting(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(t)

    stats.to_host = counting
    try:
        with capture(model, taps, strategy=strategy, keep_grads=False) as cap:
            loss = torch.nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            cap.records(loss)
    finally:
        stats.to_host = original
    model.zero_grad(set_to_none=True)
    return calls


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    depth, width, batch = (20, 16, 4) if args.tiny else (100, 256, 128)
    counts = (1, 10, 40) if args.tiny else (1, 10, 50, 200)
    repeats = args.repeats or (2 if args.tiny else 10)
    torch.manual_seed(0)
    model = MLP(width, width, depth, width)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    paths = [p for p, _ in model.named_modules() if p]
    rows = []
    for n in counts:
        taps = [f"{p}:output" for p in paths[:n]]
        elements = n * batch * width
        times = interleaved(variants_for(model, x, y, taps, "none"), repeats=repeats)
        base = median_ms(times["none"])
        naive_extra = median_ms(times["naive"]) - base
        for variant, samples in times.items():
            if variant == "none":
                continue
            extra = median_ms(samples) - base
            rows.append({
                "taps": n, "elements": elements, "variant": variant, "step_ms": median_ms(samples),
                "none_ms": base, "overhead_pct": 100 * extra / base, "extra_us_per_tap": 1e3 * extra / n,
                "extra_ns_per_element": 1e6 * extra / elements,
                "naive_over_this": naive_extra / extra if variant != "naive" and extra > 0 else None,
                "host_transfers_per_step": count_transfers(model, x, y, taps, variant) if variant in STRATEGIES else n * 9 if variant == "naive" else None,
            })  # fmt: skip
    report("tap_scaling", rows, ["taps", "elements", "variant", "step_ms", "none_ms", "overhead_pct",
                                 "extra_us_per_tap", "extra_ns_per_element", "naive_over_this",
                                 "host_transfers_per_step"], args.out)  # fmt: skip


if __name__ == "__main__":
    main()
