"""`load()` of a sweep of N copied jobs: wall time and peak memory, each load in a fresh process.

The sweep is N copies of real 2-step mlp jobs run by the CLI (`sweep_scale.copy_job`: each its own
run id, seed and `done.json`, so every file verifies), built once into `--sweep DIR` (reused when it
holds N jobs already; a temporary dir otherwise). Each measurement is a fresh Python process that
imports gradrunner, then times `load(sweep)` statistics-only (every column but `values`) or
`load(sweep, columns=["step", "tap", "norm"])`: wall seconds, the process's RSS before the load,
and its peak RSS during the load (Linux: the peak is reset before the load through
`/proc/self/clear_refs`; elsewhere `ru_maxrss`, which counts the imports' peak too). `--code DIR ...` reads with the gradrunner
package found in each DIR (e.g. an export of an older commit) instead of this checkout's, and
`--sweep DIR ...` times each sweep given (e.g. one built by an older commit's writer); the variants
run interleaved, `--repeats` times each. Each row names the codecs of the sweep's record files.

    python benchmarks/load_scale.py --jobs 10000 --sweep /tmp/sweep10k
    python benchmarks/load_scale.py --jobs 10000 --sweep /tmp/sweep10k --code /tmp/before . --repeats 2
    python benchmarks/load_scale.py --jobs 10000 --sweep /tmp/sweep10k-zstd /tmp/sweep10k --repeats 2
    python benchmarks/load_scale.py --tiny
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report
from sweep_scale import copy_job, run_real_jobs

CHECKOUT = Path(__file__).resolve().parents[1]

#: What the child process runs: argv = code dir, sweep dir, columns (JSON).
CHILD = """
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
from gradrunner.analysis import load
import gradrunner
columns = json.loads(sys.argv[3])

def status(key):  # kB figures of /proc/self/status, as MiB; None off Linux
    try:
        lines = open("/proc/self/status").read().splitlines()
    except OSError:
        return None
    return next(int(l.split()[1]) / 1024 for l in lines if l.startswith(key + ":"))

rss0 = status("VmRSS")
try:  # reset the peak RSS to the current one: VmHWM after the load is the load's own peak
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
start = time.perf_counter()
df = load(sys.argv[2], columns=columns)
s = time.perf_counter() - start
peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"s": s, "rss_before_mib": rss0, "rss_peak_mib": peak, "peak_is_the_loads": reset,
                  "rows": len(df), "columns": df.shape[1], "package": os.path.dirname(gradrunner.__file__),
                  "loadavg": os.getloadavg()[0]}))
"""

VARIANTS: dict[str, list[str] | None] = {"statistics only": None, "step, tap, norm": ["step", "tap", "norm"]}


def build(sweep: Path, jobs: int) -> None:
    """`jobs` copied jobs in `sweep` (0/, 1/, ...), unless it holds them already."""
    if sweep.is_dir() and all((sweep / str(i) / "done.json").is_file() for i in (0, jobs - 1)) \
            and not (sweep / str(jobs)).exists():  # fmt: skip
        return
    real = min(3, jobs)
    with tempfile.TemporaryDirectory() as tmp:
        sources = run_real_jobs(Path(tmp) / "real", real)
        for i in range(jobs):
            copy_job(sources[i % real], sweep / str(i), i, f"copy-{i:06d}")


def codecs(sweep: Path) -> str:
    """The codecs of job 0's `grads.parquet` (a sweep written before or after small files became snappy)."""
    meta = pq.ParquetFile(sweep / "0" / "grads.parquet").metadata
    return "+".join(sorted({meta.row_group(0).column(i).compression for i in range(meta.num_columns)}))


def measure(code: Path, sweep: Path, columns: list[str] | None) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-c", CHILD, str(code), str(sweep), json.dumps(columns)],
                            capture_output=True, text=True, env=env, cwd=code)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"load() failed with the code in {code}:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--jobs", type=int, default=10000, help="job dirs in the copied sweep")
        p.add_argument("--sweep", type=Path, nargs="+", default=None,
                       help="build the sweep here, or reuse it (default: a temp dir); several: each timed, interleaved")
        p.add_argument("--code", type=Path, nargs="+", default=[CHECKOUT], help="dirs holding the gradrunner package to time")

    args = parse_args(__doc__ or "", extra)
    jobs = 5 if args.tiny else args.jobs
    repeats = 1 if args.tiny else (args.repeats or 1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sweeps = [Path(tmp) / "sweep"] if args.sweep is None or args.tiny else [s.resolve() for s in args.sweep]
        for sweep in sweeps:
            build(sweep, jobs)
        codec = {sweep: codecs(sweep) for sweep in sweeps}
        for repeat in range(repeats):
            for name, columns in VARIANTS.items():
                for code in args.code:
                    for sweep in sweeps:
                        m = measure(code.resolve(), sweep, columns)
                        print(f"  {name} of {sweep} with {m['package']}: {m['s']:.2f} s, peak {m['rss_peak_mib']:.0f} MiB",
                              file=sys.stderr)  # fmt: skip
                        rows.append({"load": name, "sweep": str(sweep), "code": str(code), "repeat": repeat,
                                     "codecs": codec[sweep], **m})  # fmt: skip
    report("load_scale", rows, ["load", "sweep", "codecs", "code", "repeat", "s", "rss_before_mib", "rss_peak_mib", "rows", "loadavg"],
           out=args.out, jobs=jobs)  # fmt: skip


if __name__ == "__main__":
    main()
