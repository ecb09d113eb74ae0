"""Start-up: seconds until `python -m gradrunner` answers a tap typo, and a 3-step mlp run.

    python benchmarks/startup.py --repeats 5                        # this tree
    python benchmarks/startup.py --repeats 5 --before /work/main    # and another checkout, interleaved
    python benchmarks/startup.py --tiny                             # CI smoke run (the typo only, once)

Each command runs in a fresh process with `PYTHONPATH` set to the tree's root; trees and
commands are interleaved; medians and minimums reported.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

COMMANDS = {"tap typo": ["+experiment=mlp", "taps=[fc9:output]"], "3 steps": ["+experiment=mlp", "steps=3"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--before", default=None))
    repeats = args.repeats or (1 if args.tiny else 5)
    trees = {"this tree": str(Path(__file__).resolve().parents[1])}
    if args.before:
        trees["before"] = args.before
    commands = {"tap typo": COMMANDS["tap typo"]} if args.tiny else COMMANDS
    times: dict[tuple[str, str], list[float]] = {}
    runs = 0  # each command its own run dir: a second run into one is refused
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for cname, cargs in commands.items():
                for tname, tree in trees.items():
                    runs += 1
                    start = time.perf_counter()
                    done = subprocess.run(
                        [sys.executable, "-m", "gradrunner", *cargs, f"hydra.run.dir={tmp}/{runs}"],
                        cwd=tmp, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True,
                    )  # fmt: skip
                    times.setdefault((cname, tname), []).append(time.perf_counter() - start)
                    assert done.returncode == (2 if cname == "tap typo" else 0), done.stderr[-2000:]
    rows = [{"command": c, "tree": t, "median_s": statistics.median(v), "min_s": min(v)} for (c, t), v in times.items()]
    report("startup", rows, ["command", "tree", "median_s", "min_s"], args.out)


if __name__ == "__main__":
    main()
