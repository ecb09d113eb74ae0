"""A sweep at cluster scale: the re-run, the catalogue, the manifest, `load()`, DuckDB / polars and the report over N copied jobs.

A few real 2-step mlp jobs are run by the CLI as a sweep (seed=0,1,2), then copied into N job dirs
with distinct seeds and run ids: each record file rewritten with its new `run_id` column and
overrides metadata (the writer's encodings and page checksums), `.hydra/` given the job's number and
overrides, `done.json` re-pinned (run id, rows, footers, overrides, `config.seed`), so that every
job passes `verify_job`; the sweep catalogue gets each copy's row as its job would have written it
(the real jobs' config fingerprint). Then, once each (a cold run of a shared machine, not a median):

- `load(sweep)`, statistics only (the verified reader: every page's checksum, run id, footer);
- the manifest: `build_manifest` given the sweep's job list (a view of the catalogue), and finding
  the job dirs itself (no job list: every dir read);
- DuckDB and polars (lazy) over `sweep/*/grads.parquet`: rows and mean norm per tap;
- reading the catalogue;
- the CLI re-run of the whole sweep (seed=0..N-1, the same config): every job complete, none composed
  or launched; wall seconds from the command to its exit, the end-of-sweep books included;
- `python -m gradrunner.report <sweep>`, killed after `--report-timeout` seconds.

    python benchmarks/sweep_scale.py --jobs 10000
    python benchmarks/sweep_scale.py --tiny          # 5 jobs (CI smoke run)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

from gradrunner.analysis import load
from gradrunner.cli.sweep_books import build_manifest
from gradrunner.records import rundir
from gradrunner.records.catalogue import JobRow, read_jobs, record_jobs, stamps
from gradrunner.records.columns import OVERRIDES_KEY, RECORD_FILES
from gradrunner.records.table_writer import write_whole

#: The overrides every job shares; a job adds `seed=<i>`.
BASE = ["+experiment=mlp", "steps=2", "device=cpu"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "gradrunner", *args], capture_output=True, text=True, env=env)


def run_real_jobs(sweep: Path, n: int) -> list[Path]:
    """`n` real jobs run by the CLI as one sweep (seed=0..n-1), in `sweep/0`, `sweep/1`, ..."""
    result = cli("-m", f"hydra.sweep.dir={sweep}", *BASE, "seed=" + ",".join(map(str, range(n))))
    if result.returncode != 0:
        raise SystemExit(f"the real sweep failed:\n{result.stderr[-3000:]}")
    return [sweep / str(i) for i in range(n)]


def copy_job(source: Path, target: Path, num: int, run_id: str) -> None:
    """`source` as job `num` (seed=num, run `run_id`) of the sweep, in `target`: verifies as a completed job."""
    overrides = [*BASE, f"seed={num}"]
    target.mkdir(parents=True)
    shutil.copytree(source / ".hydra", target / ".hydra")
    (target / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    hydra = yaml.safe_load((target / ".hydra" / "hydra.yaml").read_text())
    hydra["hydra"]["job"]["num"] = num
    hydra["hydra"]["overrides"]["task"] = overrides
    (target / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(hydra))
    marker = json.loads((source / rundir.DONE).read_text())
    for name in RECORD_FILES:
        table = pq.read_table(source / name)
        table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                                 pa.array([run_id] * table.num_rows, pa.string()))  # fmt: skip
        meta = dict(table.schema.metadata or {})
        meta[OVERRIDES_KEY.encode()] = json.dumps(overrides).encode()
        table = table.replace_schema_metadata(meta)
        write_whole(table, target / name)
        marker["footers"][name] = rundir.footer_digest(target / name)
        marker["rows"][name] = table.num_rows
    _reseed(marker["config"], num)
    marker.update(run_id=run_id, overrides=overrides)
    (target / rundir.DONE).write_text(json.dumps(marker))


def catalogue_copies(real_sweep: Path, sweep: Path, jobs: int) -> None:
    """The copied sweep's catalogue, as its jobs would have written it: each copy's row, the real jobs' fingerprint."""
    real_rows = read_jobs(real_sweep)
    assert real_rows, f"the real sweep {real_sweep} has no catalogue"
    rows = []
    for i in range(jobs):
        marker = json.loads((sweep / str(i) / rundir.DONE).read_text())
        rows.append(JobRow(dir=str(i), num=i, overrides=marker["overrides"], status="completed", run_id=marker["run_id"],
                           rows=sum(marker["rows"].values()), files=marker["files"],
                           fingerprint=real_rows[0].fingerprint, finished=marker.get("finished"),
                           stamps=stamps(sweep / str(i), marker["files"])))  # fmt: skip
    record_jobs(sweep, rows)


def _reseed(config: Any, seed: int) -> None:
    """Every `seed` key of the resolved config (`seed`, and `data.seed` interpolated from it) set to `seed`."""
    if isinstance(config, dict):
        for key, value in config.items():
            if key == "seed" and isinstance(value, int):
                config[key] = seed
            else:
                _reseed(value, seed)


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    print(f"  ({seconds:.3f} s)", file=sys.stderr, flush=True)  # a later failure does not lose the figures so far
    return seconds, value


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--jobs", type=int, default=1000, help="job dirs in the copied sweep")
        p.add_argument("--report-timeout", type=float, default=600, help="seconds before the report is killed; 0: skip it")

    args = parse_args(__doc__ or "", extra)
    jobs = 5 if args.tiny else args.jobs
    real = min(3, jobs)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        sources = run_real_jobs(Path(tmp) / "real", real)
        sweep = Path(tmp) / "sweep"
        build_s, _ = timed(lambda: [copy_job(sources[i % real], sweep / str(i), i, f"copy-{i:06d}")
                                    for i in range(jobs)])  # fmt: skip
        catalogue_copies(sources[0].parent, sweep, jobs)
        assert all(rundir.verify_job(sweep / str(i), json.loads((sweep / str(i) / rundir.DONE).read_text())) is None
                   for i in (0, jobs - 1))  # fmt: skip
        rows.append({"operation": "build the copied sweep (not a gradrunner operation)", "s": build_s})

        s, df = timed(lambda: load(sweep))
        assert df["job"].nunique() == jobs and df["seed"].nunique() == jobs, (df["job"].nunique(), jobs)
        rows.append({"operation": "load(sweep), statistics only", "s": s, "result": f"{len(df)} rows"})

        expected = [[*BASE, f"seed={i}"] for i in range(jobs)]
        s, manifest = timed(lambda: build_manifest(sweep, expected))
        assert manifest["counts"] == {"completed": jobs, "failed": 0, "missing": 0}, manifest["counts"]
        rows.append({"operation": "manifest, given the sweep's job list", "s": s, "result": f"{jobs} completed"})
        s, manifest = timed(lambda: build_manifest(sweep, None))
        assert manifest["counts"]["completed"] == jobs, manifest["counts"]
        rows.append({"operation": "manifest, job dirs found", "s": s, "result": f"{jobs} completed"})

        glob = str(sweep / "*" / "grads.parquet")
        try:
            import duckdb

            query = f"SELECT tap, count(*), avg(norm) FROM read_parquet('{glob}') GROUP BY tap"
            s, out = timed(lambda: duckdb.sql(query).fetchall())
            rows.append({"operation": "DuckDB over the tree (rows, mean norm per tap)", "s": s,
                         "result": f"{sum(r[1] for r in out)} rows"})  # fmt: skip
        except ImportError:
            rows.append({"operation": "DuckDB over the tree", "result": "duckdb not installed"})
        try:
            import polars as pl

            lazy = lambda: pl.scan_parquet(glob).group_by("tap").agg(pl.len(), pl.col("norm").mean()).collect()  # noqa: E731
            s, out = timed(lazy)
            rows.append({"operation": "polars lazy over the tree (rows, mean norm per tap)", "s": s,
                         "result": f"{int(out['len'].sum())} rows"})  # fmt: skip
        except ImportError:
            rows.append({"operation": "polars lazy over the tree", "result": "polars not installed"})

        s, listed = timed(lambda: read_jobs(sweep))
        assert listed is not None and sum(r.status == "completed" for r in listed) == jobs
        rows.append({"operation": "read the catalogue (every job's row)", "s": s, "result": f"{len(listed)} rows"})

        before = {f: f.stat().st_mtime_ns for f in sweep.glob("*/*.parquet")}
        s, result = timed(lambda: cli("-m", f"hydra.sweep.dir={sweep}", *BASE, "seed=" + ",".join(map(str, range(jobs)))))
        if result.returncode != 0:
            raise SystemExit(f"the re-run failed:\n{result.stderr[-3000:]}")
        out = result.stdout + result.stderr
        assert "Launching" not in out and f"{jobs} of {jobs} jobs completed before" in out, out[-3000:]
        assert all(f.stat().st_mtime_ns == t for f, t in before.items()), "the re-run rewrote a completed job"
        rows.append({"operation": f"CLI re-run of all {jobs} completed jobs (every one skipped, none composed)", "s": s,
                     "result": "0 launched"})  # fmt: skip

        if args.report_timeout > 0:
            start = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, "-m", "gradrunner.report", str(sweep)], capture_output=True,
                                      text=True, timeout=args.report_timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
                s = time.perf_counter() - start
                what = "written" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
            except subprocess.TimeoutExpired:
                s, what = time.perf_counter() - start, f"killed after {args.report_timeout} s"
            print(f"  ({s:.3f} s)", file=sys.stderr, flush=True)
            rows.append({"operation": "python -m gradrunner.report <sweep>", "s": s, "result": what})
    report("sweep_scale", rows, ["operation", "s", "result"], out=args.out, jobs=jobs, real_jobs=real)


if __name__ == "__main__":
    main()
