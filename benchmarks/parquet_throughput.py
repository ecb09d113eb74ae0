"""Parquet throughput and size for full gradient values, against `numpy.save` of the same bytes.

    python benchmarks/parquet_throughput.py            # full sizes
    python benchmarks/parquet_throughput.py --tiny     # CI smoke run

Records of the 17-tap 8x512 MLP at batch 256 (17 x 131,072 float32 values a step) are written by
`RecordWriter`, interleaved with `numpy.save` of the same values to the same disk, each followed by
an fsync so both pay for the disk, not only the page cache. A third writer, pyarrow alone writing
just the values column with the same encoding, shows how much of the gap is Parquet's own. The
cost of page checksums: `RecordWriter` without them, and reading the file back with and without
verifying them (as a resume does).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fsync_file, median_ms, parse_args, report

from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import StepRecords, TapKey
from gradrunner.records.writer import RecordWriter


def make_steps(n_steps: int, n_taps: int, numel: int) -> list[StepRecords]:
    torch.manual_seed(0)
    steps = []
    for _ in range(n_steps):
        col = Collector(values="full")
        for i in range(n_taps):
            col.add(TapKey(f"fc{i}", "output", 0), torch.randn(numel) * 1e-3)
        steps.append(col.finish(torch.tensor(1.0)))
    return steps


class _NoChecksums(RecordWriter):
    page_checksums = False


def write_parquet(path: Path, steps: list[StepRecords], writer: type[RecordWriter] = RecordWriter) -> None:
    constants = {"run_id": "bench", "experiment": "bench", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    with writer(path, constants=constants, metadata={}) as w:
        for i, recs in enumerate(steps):
            w.write_step(i, recs)
    fsync_file(path)


def write_parquet_no_checksums(path: Path, steps: list[StepRecords]) -> None:
    write_parquet(path, steps, _NoChecksums)


def read_times(path: Path, repeats: int) -> dict[str, list[float]]:
    """Reading `path` whole, without and with page checksum verification (from the page cache)."""
    import pyarrow.parquet as pq

    out: dict[str, list[float]] = {"read": [], "read, checksums verified": []}
    for _ in range(repeats):
        for name, verify in (("read", False), ("read, checksums verified", True)):
            start = time.perf_counter()
            pq.ParquetFile(path, page_checksum_verification=verify).read()
            out[name].append(time.perf_counter() - start)
    return out


def write_arrow_only(path: Path, steps: list[StepRecords]) -> None:
    """The same values column written by pyarrow alone, same encoding: the floor for any Parquet writer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = [v for recs in steps for v in (recs.values or [])]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays)))
    pq.write_table(pa.table({"values": column}), path, compression="NONE", use_dictionary=False)
    fsync_file(path)


def write_numpy(path: Path, steps: list[StepRecords]) -> None:
    with open(path, "wb") as f:
        for recs in steps:
            assert recs.values is not None
            for v in recs.values:
                np.save(f, v)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n_steps, n_taps, numel = (3, 4, 1024) if args.tiny else (20, 17, 256 * 512)
    repeats = args.repeats or (2 if args.tiny else 7)
    steps = make_steps(n_steps, n_taps, numel)
    raw_bytes = n_steps * n_taps * numel * 4
    times: dict[str, list[float]] = {"parquet": [], "parquet, no page checksums": [], "pyarrow alone": [],
                                     "numpy.save": []}  # fmt: skip
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        for r in range(repeats):
            for name, fn, fname in (
                ("parquet", write_parquet, "grads.parquet"),
                ("parquet, no page checksums", write_parquet_no_checksums, "nocrc.parquet"),
                ("pyarrow alone", write_arrow_only, "values.parquet"),
                ("numpy.save", write_numpy, "v.npy"),
            ):
                path = Path(tmp) / f"{r}-{fname}"
                start = time.perf_counter()
                fn(path, steps)
                times[name].append(time.perf_counter() - start)
                sizes[name] = path.stat().st_size
                if name == "parquet" and r == repeats - 1:
                    reads = read_times(path, repeats)
                    times.update(reads)
                    sizes.update(dict.fromkeys(reads, sizes[name]))
                path.unlink()
    rows = [{
        "writer": name, "median_ms": median_ms(t), "mb_per_s": raw_bytes / 1e6 / (median_ms(t) / 1e3),
        "file_mb": sizes[name] / 1e6, "vs_numpy_throughput": median_ms(times["numpy.save"]) / median_ms(t),
    } for name, t in times.items()]  # fmt: skip
    report("parquet_throughput", rows, ["writer", "median_ms", "mb_per_s", "file_mb", "vs_numpy_throughput"],
           args.out, raw_mb=raw_bytes / 1e6)  # fmt: skip


if __name__ == "__main__":
    main()
