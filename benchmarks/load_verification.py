"""What verifying costs `analysis.load` on a sweep of many jobs: checksums, run ids, footers against `done.json`.

One real job is run by the CLI, then copied into N job dirs with their run ids rewritten (each
file rewritten with the writer's encodings and page checksums, each `done.json` re-pinned), so
every job verifies. `load(sweep)` is timed as it is now (verifying) and with the unverified read
it replaced (`pq.read_schema` + `pq.read_table`, no checksums, no `done.json` checks), repetitions
interleaved; medians reported, with and without the `values` column.

    python benchmarks/load_verification.py                 # 1,000 jobs
    python benchmarks/load_verification.py --jobs 200 --repeats 5
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report

from gradrunner.analysis import reading
from gradrunner.records import rundir
from gradrunner.records.columns import RECORD_FILES
from gradrunner.records.table_writer import write_whole


def run_one_job(directory: Path, steps: int) -> None:
    cmd = [sys.executable, "-m", "gradrunner", "+experiment=mlp", f"steps={steps}", "device=cpu",
           "capture.values=sample", f"hydra.run.dir={directory}"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def copy_job(source: Path, target: Path, run_id: str, seed: int) -> None:
    """`source` as job `target` of run `run_id`: files rewritten with the new id, done.json re-pinned."""
    shutil.copytree(source / ".hydra", target / ".hydra")
    (target / ".hydra" / "overrides.yaml").write_text(f"- +experiment=mlp\n- seed={seed}\n")
    marker = json.loads((source / rundir.DONE).read_text())
    for name in RECORD_FILES:
        table = pq.read_table(source / name)
        table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                                 pa.array([run_id] * table.num_rows, pa.string()))  # fmt: skip
        write_whole(table, target / name)
        marker["footers"][name] = rundir.footer_digest(target / name)
    marker.update(run_id=run_id, overrides=["+experiment=mlp", f"seed={seed}"])
    (target / rundir.DONE).write_text(json.dumps(marker))


def unverified_read(root: Path, f: Any, columns: Sequence[str] | None, values: bool, **_: Any) -> pa.Table:
    """`reading._read` before verification (commit 815a200): schema, then the columns, nothing checked.

    `f` is the file to read (`reading._File`: its `path`); the keywords `load` passes (whether it checks
    the run ids itself, threads) change nothing here.
    """
    names = pq.read_schema(f.path).names
    wanted = [n for n in names if n != reading.VALUES or values] if columns is None else list(columns)
    return pq.read_table(f.path, columns=wanted)


@contextmanager
def patched(read: Callable[..., pa.Table] | None) -> Iterator[None]:
    original = reading._read
    if read is not None:
        reading._read = read  # type: ignore[assignment]
    try:
        yield
    finally:
        reading._read = original  # type: ignore[assignment]


def main() -> None:
    args = parse_args(__doc__ or "", lambda p: p.add_argument("--jobs", type=int, default=1000))
    jobs = 5 if args.tiny else args.jobs
    repeats = args.repeats or (1 if args.tiny else 3)
    with tempfile.TemporaryDirectory() as tmp:
        source, sweep = Path(tmp) / "source", Path(tmp) / "sweep"
        run_one_job(source, steps=2 if args.tiny else 20)
        for i in range(jobs):
            copy_job(source, sweep / str(i), f"run-{i:04d}", seed=i)
        size = sum(f.stat().st_size for f in sweep.rglob("*.parquet"))
        variants: dict[str, Callable[..., pa.Table] | None] = {"verified": None, "unverified": unverified_read}
        times: dict[tuple[str, bool], list[float]] = {(v, x): [] for v in variants for x in (False, True)}
        for r in range(repeats):
            for values in (False, True):
                order = list(variants)[r % 2 :] + list(variants)[: r % 2]
                for name in order:
                    with patched(variants[name]):
                        start = time.perf_counter()
                        df = reading.load(sweep, values=values)
                        times[(name, values)].append(time.perf_counter() - start)
                    assert df.job.nunique() == jobs, df.job.nunique()
        rows = []
        for values in (False, True):
            base = statistics.median(times[("unverified", values)])
            for name in variants:
                t = statistics.median(times[(name, values)])
                rows.append({"read": name, "values": values, "s": t, "vs_unverified": t / base, "rows": len(df)})
        report("load_verification", rows, ["read", "values", "s", "vs_unverified", "rows"], out=args.out,
               jobs=jobs, repeats=repeats, parquet_bytes=size)  # fmt: skip


if __name__ == "__main__":
    main()
