"""Which Parquet settings move the write throughput of the `values` column, against `numpy.save`.

    python benchmarks/parquet_values.py            # a minute or so
    python benchmarks/parquet_values.py --tiny     # CI smoke run

The values of 20 steps of the 17-tap 8x512 MLP (17 x 131,072 float32 a step, 178 MB) as one
`list<float32>` column, written by pyarrow with one setting changed at a time from what
`RecordWriter` uses (no compression, no dictionary), each followed by an fsync, interleaved with
`numpy.save` of the same arrays. Also: building the list array from per-tap slices of one host
buffer by concatenating them (a copy) against wrapping the buffer (zero-copy).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fsync_file, median_ms, parse_args, report

BASE: dict[str, Any] = {"compression": "NONE", "use_dictionary": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "as RecordWriter (stats on, 1 MiB pages)": {},
    "no column statistics": {"write_statistics": False},
    "8 MiB pages": {"data_page_size": 8 << 20},
    "64 MiB pages, no statistics": {"data_page_size": 64 << 20, "write_statistics": False},
    "page index on": {"write_page_index": True},
    "dictionary on": {"use_dictionary": True},
    "no stats, 8 MiB pages, v2 pages": {"write_statistics": False, "data_page_size": 8 << 20, "data_page_version": "2.0"},
}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n_steps, n_taps, numel = (3, 4, 1024) if args.tiny else (20, 17, 256 * 512)
    repeats = args.repeats or (2 if args.tiny else 5)
    rng = np.random.default_rng(0)
    buffers = [(rng.standard_normal(n_taps * numel) * 1e-3).astype(np.float32) for _ in range(n_steps)]
    slices = [[b[i * numel : (i + 1) * numel] for i in range(n_taps)] for b in buffers]
    offsets = pa.array(np.arange(n_taps + 1, dtype=np.int32) * numel)

    def concatenated(step: list[np.ndarray]) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(step)))

    def zero_copy(step: list[np.ndarray]) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(step[0].base))

    tables = [pa.table({"values": zero_copy(s)}) for s in slices]
    raw = n_steps * n_taps * numel * 4

    def parquet(options: dict[str, Any]) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            with pq.ParquetWriter(path, tables[0].schema, **{**BASE, **options}) as w:
                for t in tables:
                    w.write_table(t)
            fsync_file(path)

        return write

    def numpy_save(path: Path) -> None:
        with open(path, "wb") as f:
            for step in slices:
                for v in step:
                    np.save(f, v)
            f.flush()
            os.fsync(f.fileno())

    writers: dict[str, Callable[[Path], None]] = {name: parquet(o) for name, o in VARIANTS.items()}
    writers["numpy.save"] = numpy_save
    times: dict[str, list[float]] = {n: [] for n in writers}
    builds: dict[str, list[float]] = {"concatenate": [], "zero-copy": []}
    names = list(writers)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                path = Path(tmp) / "out"
                start = time.perf_counter()
                writers[name](path)
                times[name].append(time.perf_counter() - start)
                path.unlink()
            for name, build in (("concatenate", concatenated), ("zero-copy", zero_copy)):
                start = time.perf_counter()
                for s in slices:
                    build(s)
                builds[name].append(time.perf_counter() - start)
    base = median_ms(times["numpy.save"])
    rows = [{"what": n, "ms": median_ms(t), "mb_per_s": raw / 1e6 / (median_ms(t) / 1e3), "vs_numpy": base / median_ms(t)}
            for n, t in times.items()]  # fmt: skip
    rows += [{"what": f"build list array: {n}", "ms": median_ms(t)} for n, t in builds.items()]
    report("parquet_values", rows, ["what", "ms", "mb_per_s", "vs_numpy"], args.out, raw_mb=raw / 1e6)


if __name__ == "__main__":
    main()
