"""ATen ops gradrunner adds to a training step with many small taps: what becomes kernel launches on a GPU.

    python benchmarks/step_ops.py                   # 8, 32 and 128 taps
    PYTHONPATH=/path/to/other/checkout python benchmarks/step_ops.py --label before

An MLP of `depth` linear layers with widths that all differ (so no two tapped gradients share a
size), batch 4, every `Linear` output and weight tapped with the `hook` strategy, statistics only,
`GRADRUNNER_FUSED=0` (on CPU the C kernel would take every gradient; without it the statistics take
the path they take on an accelerator, where each ATen op is at least one kernel launch). Counted with
a `TorchDispatchMode` around forward, `cap.backward` and `cap.records` of the second captured step,
views (which launch nothing) left out, minus the ops of the same step without capture. Only
`capture(...)`, `cap.backward` and `cap.records` are used, so it runs against any checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ["GRADRUNNER_FUSED"] = "0"

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

from gradrunner import capture

_VIEWS = {"aten.detach.default", "aten.view.default", "aten._reshape_alias.default", "aten.alias.default",
          "aten.select.int", "aten.slice.Tensor", "aten.t.default", "aten.expand.default",
          "aten.unsqueeze.default", "aten.squeeze.dim", "aten.as_strided.default"}  # fmt: skip


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func) not in _VIEWS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def count(depth: int) -> tuple[int, int, int]:
    """(ops of the bare step, ops of the captured step, number of taps) for an MLP of `depth` layers."""
    torch.manual_seed(0)
    widths = [8 + i for i in range(depth + 1)]  # all different, every gradient under DEFER_NUMEL
    model = nn.Sequential(*[nn.Linear(widths[i], widths[i + 1]) for i in range(depth)])
    x = torch.randn(4, widths[0])

    def step(cap: Any) -> int:
        with _Count() as mode:
            loss = model(x).square().mean()
            if cap is None:
                loss.backward()
            else:
                cap.backward(loss)
                cap.records(loss)
        model.zero_grad(set_to_none=True)
        return mode.n

    step(None)
    bare = step(None)
    taps = ["*:output", "*:weight"]
    with capture(model, taps, strategy="hook", keep_grads=False) as cap:
        step(cap)
        captured = step(cap)
        n_taps = len(cap.taps)
    return bare, captured, n_taps


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--label", default="this checkout"))
    depths = [2] if args.tiny else [4, 16, 64]
    rows = []
    for depth in depths:
        bare, captured, n_taps = count(depth)
        rows.append({"label": args.label, "taps": n_taps, "bare_ops": bare, "captured_ops": captured,
                     "added_ops": captured - bare, "added_per_tap": (captured - bare) / n_taps})  # fmt: skip
    report("step_ops", rows, ["label", "taps", "bare_ops", "captured_ops", "added_ops", "added_per_tap"], args.out)


if __name__ == "__main__":
    main()
