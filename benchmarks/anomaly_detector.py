"""What spike detection costs per step: the detector with ~200 signals, next to a tiny training step of the mlp experiment.

    python benchmarks/anomaly_detector.py            # 200 repetitions x 5 steps per variant, interleaved
    python benchmarks/anomaly_detector.py --signals 1000

Variants (medians of per-step time, blocks interleaved, `_common.interleaved`):

- `mlp step`: the mlp experiment's captured step as the loop takes it, without a detector: MLP
  8-32-32-32-1, batch 32, SGD, taps `fc*:output`, `relu*:output`, `head:output`, `*:weight` (`hook`),
  forward, `cap.backward`, parameter snapshot, optimiser step, `cap.records`, the host transfer.
- `mlp step + detector`: the same, then `step_signals(loss, grad_norm, [records])` and `observe` (17 signals).
- `detector N`: `observe` alone with N signals (loss, grad_norm, and half tap norms, half update
  ratios), a fresh dict of lognormal values each step, as the loop would build it.
- `signals+detector N`: `step_signals` from a `StepRecords` of N/2 parameter taps (norm and update
  ratio each) and `observe`: the whole host cost the loop adds per captured step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, report

from gradrunner import capture
from gradrunner.analysis.anomalies import Detector
from gradrunner.analysis.anomaly_signals import step_signals
from gradrunner.models.mlp import MLP
from gradrunner.records.columns import StepRecords, TapKey


def mlp_step(with_detector: bool) -> tuple[Any, Any]:
    """The mlp experiment's captured step (a context factory holding the capture, and the step)."""
    torch.manual_seed(0)
    model = MLP(in_features=8, hidden=32, depth=3, out_features=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    taps = ["fc*:output", "relu*:output", "head:output", "*:weight"]
    cap = capture(model, taps, strategy="hook", keep_grads=False)
    det = Detector()

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        cap.backward(loss)
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        before = cap.snapshot_params()
        opt.step()
        recs = cap.records(loss.detach(), before)
        opt.zero_grad(set_to_none=True)
        host = torch.stack([loss.detach(), grad_norm]).tolist()  # the step's one transfer
        if with_detector:
            det.observe(step.n, step_signals(host[0], host[1], [recs]))  # type: ignore[attr-defined]
        step.n += 1  # type: ignore[attr-defined]

    step.n = 0  # type: ignore[attr-defined]
    return (lambda: cap), step


def detector_only(n_signals: int) -> Any:
    det = Detector()
    half = (n_signals - 2) // 2
    names = ["loss", "grad_norm", *[f"layer{i}.mlp:weight:norm" for i in range(half)],
             *[f"layer{i}.mlp:weight:update_ratio" for i in range(half)]]  # fmt: skip
    rng = np.random.default_rng(0)
    pool = rng.lognormal(0.0, 0.1, (4096, len(names)))

    def step() -> None:
        row = pool[step.n % len(pool)].tolist()  # type: ignore[attr-defined]
        det.observe(step.n, dict(zip(names, row, strict=True)))  # type: ignore[attr-defined]
        step.n += 1  # type: ignore[attr-defined]

    step.n = 0  # type: ignore[attr-defined]
    return step


def signals_and_detector(n_signals: int) -> Any:
    det = Detector()
    taps = (n_signals - 2) // 2
    rng = np.random.default_rng(1)
    pool = rng.lognormal(0.0, 0.1, (4096, 2 * taps + 2))
    keys = [TapKey(f"layer{i}.mlp", "weight", 0) for i in range(taps)]

    def step() -> None:
        row = pool[step.n % len(pool)]  # type: ignore[attr-defined]
        recs = StepRecords(keys=keys, has_grad=np.ones(taps, bool), stats={"norm": row[2 : 2 + taps]},
                           update_ratio=row[2 + taps :])  # fmt: skip
        det.observe(step.n, step_signals(float(row[0]), float(row[1]), [recs]))  # type: ignore[attr-defined]
        step.n += 1  # type: ignore[attr-defined]

    step.n = 0  # type: ignore[attr-defined]
    return step


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--signals", type=int, default=200))
    repeats = args.repeats or (3 if args.tiny else 200)
    torch.set_num_threads(1)
    n = args.signals
    variants = {
        "mlp step": mlp_step(False),
        "mlp step + detector": mlp_step(True),
        f"detector {n}": (no_context, detector_only(n)),
        f"signals+detector {n}": (no_context, signals_and_detector(n)),
    }
    times = interleaved(variants, repeats=repeats)
    base = median_ms(times["mlp step"])
    rows = [{"variant": name, "signals": 17 if name.startswith("mlp step +") else (0 if name == "mlp step" else n),
             "us_per_step": median_ms(t) * 1e3, "share_of_mlp_step": median_ms(t) / base} for name, t in times.items()]  # fmt: skip
    report("anomaly_detector", rows, ["variant", "signals", "us_per_step", "share_of_mlp_step"], args.out)


if __name__ == "__main__":
    main()
