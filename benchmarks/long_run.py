"""A long run (10,000 steps, statistics only) through the real CLI: does memory stay flat?

    python benchmarks/long_run.py            # 10,000 steps
    python benchmarks/long_run.py --tiny     # CI smoke run (300 steps)

Runs `python -m gradrunner +experiment=mlp steps=N` in a temporary directory and reads the process
peak RSS that `steps.parquet` records every step; peak RSS only grows, so equal values at step
1,000 and step 10,000 mean nothing accumulated in between.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps = 300 if args.tiny else 10_000
    early = steps // 10
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "gradrunner", "+experiment=mlp", f"steps={steps}", "hydra.run.dir=run"],
            cwd=tmp, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        wall = time.perf_counter() - start
        df = pd.read_parquet(Path(tmp) / "run" / "steps.parquet")
        grads_rows = len(pd.read_parquet(Path(tmp) / "run" / "grads.parquet", columns=["step"]))
    at = df.set_index("step")["peak_memory_bytes"]
    rows = [{"step": s, "peak_rss_mib": at[s] / 2**20} for s in (early - 1, steps // 2 - 1, steps - 1)]
    growth = at[steps - 1] / at[early - 1] - 1
    report("long_run", rows, ["step", "peak_rss_mib"], args.out, steps=steps, wall_s=wall,
           growth_pct_after_early_step=100 * growth, grads_rows=grads_rows)  # fmt: skip
    print(f"{steps} steps in {wall:.1f} s; peak RSS grew {100 * growth:.2f}% from step {early} to step {steps}")


if __name__ == "__main__":
    main()
