"""The report of a sweep at cluster scale: `write_report` over N copied jobs, wall seconds and PNG sizes.

A few real mlp jobs are run by the CLI (seed=0,1,2), then copied into N job dirs by `sweep_scale`'s
`copy_job` (each a completed job that verifies), with two swept overrides: `optimizer.lr` (a few
values) and `seed` (one per job). The copies' records repeat the real jobs' (3 distinct runs), which
is what the report's cost depends on: runs, rows and taps, not the values. Then, once each (a cold
run of a shared machine, not a median):

- `load(sweep)` alone, and `load(sweep, table="steps")` (the report calls both);
- `write_report(sweep)`: the aggregated page (median and band per swept value, never a panel per run);
- the tallest and widest PNG written, in pixels.

    python benchmarks/report_scale.py --jobs 1000
    python benchmarks/report_scale.py --jobs 1000 --sweep /tmp/sweep1000 --profile   # keep the tree, cProfile
    python benchmarks/report_scale.py --tiny        # 15 jobs (CI smoke run)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_scale
from _common import parse_args, report
from sweep_scale import copy_job, run_real_jobs, timed

from gradrunner.analysis import load
from gradrunner.report.write import write_report

#: The learning rates of the copied sweep (a job's is `LRS[num % len(LRS)]`).
LRS = ("0.1", "0.05", "0.02", "0.01")


@contextmanager
def base(overrides: list[str]) -> Iterator[None]:
    """`sweep_scale`'s shared overrides replaced by `overrides` for the calls inside (its helpers read `BASE`)."""
    saved = sweep_scale.BASE
    sweep_scale.BASE = overrides
    try:
        yield
    finally:
        sweep_scale.BASE = saved


def build(sweep: Path, jobs: int, steps: int) -> None:
    """`jobs` copied jobs in `sweep/0..jobs-1` (seed=num, lr=LRS[num % 4]) from 3 real ones run in `sweep.real`."""
    shared = ["+experiment=mlp", f"steps={steps}", "device=cpu"]
    with base(shared):
        sources = run_real_jobs(sweep.with_name(sweep.name + ".real"), 3)
    for i in range(jobs):
        with base([*shared, f"optimizer.lr={LRS[i % len(LRS)]}"]):
            copy_job(sources[i % 3], sweep / str(i), i, f"copy-{i:06d}")


def png_sizes(sweep: Path) -> dict[str, tuple[int, int]]:
    """(width, height) in pixels of each `report-*.png` (read from the PNG header)."""
    sizes = {}
    for png in sorted(sweep.glob("report-*.png")):
        head = png.read_bytes()[16:24]
        sizes[png.name] = (int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big"))
    return sizes


def measure(sweep: Path, jobs: int, profile: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    s, df = timed(lambda: load(sweep))
    assert df["job"].nunique() == jobs, (df["job"].nunique(), jobs)
    rows.append({"operation": "load(sweep)", "s": s, "result": f"{len(df)} rows"})
    s, steps = timed(lambda: load(sweep, table="steps"))
    rows.append({"operation": "load(sweep, table='steps')", "s": s, "result": f"{len(steps)} rows"})
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    s, page = timed(lambda: write_report(sweep))
    if profiler is not None:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
        print(out.getvalue(), file=sys.stderr)
    sizes = png_sizes(sweep)
    tallest = max(sizes.items(), key=lambda kv: kv[1][1])
    widest = max(sizes.items(), key=lambda kv: kv[1][0])
    rows.append({"operation": "write_report(sweep), load included", "s": s,
                 "result": f"{page.stat().st_size / 2**20:.1f} MiB page, {len(sizes)} PNGs"})  # fmt: skip
    rows.append({"operation": "tallest PNG (px)", "result": f"{tallest[1][1]} ({tallest[0]})"})
    rows.append({"operation": "widest PNG (px)", "result": f"{widest[1][0]} ({widest[0]})"})
    return rows


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--jobs", type=int, default=1000, help="job dirs in the copied sweep")
        p.add_argument("--steps", type=int, default=10, help="steps of each real job (the copies repeat them)")
        p.add_argument("--sweep", type=Path, default=None,
                       help="build the sweep here and keep it (reused when it has --jobs jobs already)")  # fmt: skip
        p.add_argument("--profile", action="store_true", help="cProfile write_report, top 40 to stderr")

    args = parse_args(__doc__ or "", extra)
    jobs = 15 if args.tiny else args.jobs
    steps = 2 if args.tiny else args.steps
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sweep = args.sweep or Path(tmp) / "sweep"
        if not (sweep / str(jobs - 1)).is_dir():
            s, _ = timed(lambda: build(sweep, jobs, steps))
            rows.append({"operation": "build the copied sweep (not a gradrunner operation)", "s": s})
        rows += measure(sweep, jobs, args.profile)
    report("report_scale", rows, ["operation", "s", "result"], out=args.out, jobs=jobs, steps=steps,
           real_jobs=3, lrs=len(LRS))  # fmt: skip


if __name__ == "__main__":
    main()
