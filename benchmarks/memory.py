"""Peak memory per strategy: retain_grad keeps every tapped gradient alive until the step ends.

    python benchmarks/memory.py            # full sizes
    python benchmarks/memory.py --tiny     # CI smoke run

Each variant runs in a fresh process (the same 8x512 MLP, batch 2048, 17 taps, statistics only,
a few steps) and reports its peak resident memory (ru_maxrss) above the no-capture process, with
glibc's mmap threshold fixed so that freed tensors leave the resident set. The bytes of one step's
tapped gradients are printed alongside, to read the growth against.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

VARIANTS = ("none", "hook", "retain_grad", "autograd_grad")
#: A fixed glibc mmap threshold: every block of 128 KiB or more is mapped on allocation and returned
#: on free, so peak RSS follows the peak of live tensors instead of what the heap kept for reuse.
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def child(variant: str, width: int, batch: int, steps: int) -> None:
    import torch

    from gradrunner import capture
    from gradrunner.models import MLP

    torch.manual_seed(0)
    model = MLP(width, width, 8, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    taps = ["fc*:output", "relu*:output", "head:output"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        if variant == "none":
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            with capture(model, taps, strategy=variant, keep_grads=False) as cap:
                loss = torch.nn.functional.mse_loss(model(x), y)
                cap.backward(loss)
                cap.records(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"before_kib": before, "peak_kib": peak}))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    width, batch, steps = (32, 16, 2) if args.tiny else (512, 2048, 5)
    tapped_bytes = 17 * batch * width * 4
    peaks = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, str(width), str(batch), str(steps)],
            capture_output=True, text=True, check=True, env={**os.environ, **FIXED_MMAP},
        )  # fmt: skip
        peaks[variant] = json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"] * 1024
    rows = [{
        "variant": v, "peak_mib": peaks[v] / 2**20, "above_none_mib": (peaks[v] - peaks["none"]) / 2**20,
        "above_none_in_tapped_grads": (peaks[v] - peaks["none"]) / tapped_bytes,
    } for v in VARIANTS]  # fmt: skip
    report("memory", rows, ["variant", "peak_mib", "above_none_mib", "above_none_in_tapped_grads"], args.out,
           tapped_grad_mib_per_step=tapped_bytes / 2**20)  # fmt: skip
    print(f"one step's tapped gradients: {tapped_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
