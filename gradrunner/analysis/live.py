"""Records of a job that is still running: `load(run_dir, live=True)`.

A running job's `grads.parquet` has no footer yet (see `gradrunner.records.segments`); what it
has completed so far lies in closed segments under `<run dir>/.live/<run id>/`. `load_live` reads
those; once the job's record files exist, `load` reads the record files themselves.

Example::

    df = load("runs/mine", live=True)              # the steps completed so far, while it runs
    steps = load("runs/mine", table="steps", live=True)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import LOCK_FILE, is_temp_of
from gradrunner.records.segments import LIVE_DIR, SEGMENT_SUFFIX


def load_live(
    path: str | os.PathLike[str], table: str = "grads", columns: Sequence[str] | None = None, values: bool = False
) -> pd.DataFrame | None:
    """The running job's `table` from its segments; None when `path` is no running job (then `load` reads it).

    Example::

        load_live("runs/mine").groupby("step").norm.mean()
    """
    d = Path(path)
    # A run started here (its lock file, its temp file) whose record file is not closed yet.
    running = d.is_dir() and any(f.name == LOCK_FILE or is_temp_of(f.name, f"{table}.parquet") for f in d.iterdir())
    if (d / f"{table}.parquet").is_file() or not (running or (d / LIVE_DIR).is_dir()):
        return None
    live = d / LIVE_DIR
    runs = sorted((r for r in live.iterdir() if r.is_dir()), key=lambda r: r.stat().st_mtime) if live.is_dir() else []
    files = sorted(runs[-1].glob(f"{table}-*{SEGMENT_SUFFIX}")) if runs else []
    if not files:
        raise GradrunnerError(
            f"{d} has no {table}.parquet and its running job has not completed a segment yet (one is written every "
            "few steps); try again in a moment, or lower the segment length (record(..., live_every=1))."
        )
    parts = [pq.read_table(f) for f in files]
    t = pa.concat_tables(parts)
    keep = [n for n in t.column_names if (columns is None or n in columns) and (n != "values" or values)]
    return t.select(keep).to_pandas()
