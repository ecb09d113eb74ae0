"""What spike detection costs in a real step path: `record()` (the step engine) with detection on against off.

    python benchmarks/anomaly_overhead.py               # 60 repetitions x 5 steps per variant, interleaved
    python benchmarks/anomaly_overhead.py --repeats 200

Variants (medians of per-step time, blocks interleaved, `_common.interleaved`), for two sizes of the mlp
experiment's model (MLP 8-32-32-32-1 at batch 32: a tiny step, the worst case; 64-512x3-1 at batch 256):
forward, `loss.backward()`, the total grad norm, SGD step, `zero_grad`, `rec.step(loss, extra={"grad_norm":
...})` with taps `fc*:output`, `relu*:output`, `head:output`, `*:weight` (`hook`), every step captured and
written (grads and steps rows). `anomaly=False` against the default (`anomaly=True`: `step_signals` and
`Detector.observe` on the step's host values, no device sync of its own). Each block is one `record()`
session into a fresh dir (opening and closing it, the anomalies file included, are not timed).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report

from gradrunner import record
from gradrunner.models.mlp import MLP

TAPS = ["fc*:output", "relu*:output", "head:output", "*:weight"]


def variant(width: int, hidden: int, batch: int, anomaly: bool, root: Path) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A context factory (a `record()` session into a new dir) and one training step inside it."""
    torch.manual_seed(0)
    model = MLP(in_features=width, hidden=hidden, depth=3, out_features=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    held: dict[str, Any] = {}
    count = iter(range(10**9))

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        with record(model, TAPS, root / f"{'on' if anomaly else 'off'}-{hidden}-{next(count)}", anomaly=anomaly,
                    live_every=0) as rec:  # fmt: skip
            held["rec"] = rec
            yield

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=True)
        held["rec"].step(loss, extra={"grad_norm": grad_norm})

    return session, step


def main() -> None:
    args = parse_args(__doc__ or "")
    repeats = args.repeats or (2 if args.tiny else 60)
    sizes = [(8, 32, 32)] if args.tiny else [(8, 32, 32), (64, 512, 256)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width, hidden, batch in sizes:
            variants = {f"detection {'on' if on else 'off'}": variant(width, hidden, batch, on, Path(tmp)) for on in (False, True)}
            times = interleaved(variants, repeats)
            off = median_ms(times["detection off"])
            for name, samples in times.items():
                ms = median_ms(samples)
                rows.append({"model": f"MLP {width}-{hidden}x3-1, batch {batch}", "variant": name,
                             "ms_per_step": round(ms, 3), "vs_off": round(ms / off, 3), "steps": len(samples)})  # fmt: skip
    report("anomaly_overhead", rows, ["model", "variant", "ms_per_step", "vs_off", "steps"], args.out)


if __name__ == "__main__":
    main()
