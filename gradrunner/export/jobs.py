"""The jobs of a run or sweep dir as an exporter needs them: a name, hyper-parameters, scalars, histograms.

Reading the records needs no torch (pyarrow and pandas only); each target (`tensorboard`, `mlflow`,
`wandb`) writes these `Job`s its own way.

Example::

    [j.name for j in jobs("multirun/2024-05-01/12-00-00")]     # ['0', '1', '2']
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from gradrunner.errors import GradrunnerError
from gradrunner.records import rundir
from gradrunner.records.columns import COUNT_COLUMNS, EXTRA_FLOAT_COLUMNS, HIST_COLUMN, HIST_EDGES_KEY, STAT_COLUMNS

#: Per-record columns exported as scalars, in this order.
SCALAR_COLUMNS = (*STAT_COLUMNS, *COUNT_COLUMNS, *EXTRA_FLOAT_COLUMNS)
#: `steps.parquet` columns that are not a scalar over steps.
_STEPS_SKIP = frozenset({"step", "rank", "run_id", "experiment", "strategy", "device", "dtype", "captured"})


@dataclass
class Job:
    """One job's records, ready for a target: its name, hyper-parameters, scalars and histograms."""

    name: str
    directory: Path
    params: dict[str, str]
    #: (tag, step, value), in step order.
    scalars: list[tuple[str, int, float]] = field(default_factory=list)
    #: (tag, step, bin right edges, counts), bins as the records count them (non-finite left out).
    histograms: list[tuple[str, int, list[float], list[int]]] = field(default_factory=list)


def jobs(path: str | os.PathLike[str]) -> list[Job]:
    """The jobs below `path` (a run dir or a sweep dir), each with what a target writes.

    Example::

        [j.name for j in jobs("multirun/2024-05-01/12-00-00")]     # ['0', '1', '2']
    """
    root = Path(path)
    if not root.is_dir():
        raise GradrunnerError(f"{root} is not a directory; pass a run dir (holding grads.parquet) or a sweep dir.")
    dirs = [root] if (root / "grads.parquet").is_file() else [d for d in rundir.job_dirs_below(root) if (d / "grads.parquet").is_file()]
    if not dirs:
        raise GradrunnerError(
            f"no grads.parquet found in {root} or its job dirs; pass a run dir (holding grads.parquet) or a sweep dir "
            "(holding job dirs 0/, 1/, ...). A job that is still running has not closed its records yet."
        )
    return [_job(root, d) for d in dirs]


def _job(root: Path, d: Path) -> Job:
    name = "run" if d == root else d.relative_to(root).as_posix()
    job = Job(name, d, _params(d))
    grads = pq.read_table(d / "grads.parquet", columns=[c for c in pq.read_schema(d / "grads.parquet").names
                                                        if c != "values"]).to_pandas()  # fmt: skip
    for row in grads.itertuples(index=False):
        prefix = tag_prefix(str(row.tap), int(row.call), int(row.rank))
        for c in SCALAR_COLUMNS:
            v = getattr(row, c, None)
            if v is not None and not pd.isna(v):
                job.scalars.append((f"{prefix}/{c}", int(row.step), float(v)))
    if HIST_COLUMN in grads.columns:
        edges = json.loads(pq.read_schema(d / "grads.parquet").metadata[HIST_EDGES_KEY.encode()])
        limits = [0.0, *edges, sys.float_info.max]  # exact zeros, (0, e0), ..., [e_last, inf)
        for row in grads.itertuples(index=False):
            counts = getattr(row, HIST_COLUMN)
            if counts is not None and len(counts):
                job.histograms.append((f"{tag_prefix(str(row.tap), int(row.call), int(row.rank))}/hist", int(row.step),
                                       limits, [int(c) for c in counts[: len(limits)]]))  # fmt: skip
    if (d / "steps.parquet").is_file():
        steps = pq.read_table(d / "steps.parquet").to_pandas()
        for col in steps.columns:
            if col in _STEPS_SKIP or not pd.api.types.is_numeric_dtype(steps[col]) or pd.api.types.is_bool_dtype(steps[col]):
                continue
            for step, rank, v in zip(steps.step, steps["rank"], steps[col], strict=True):
                if not pd.isna(v):
                    job.scalars.append((f"{'' if rank == 0 else f'rank{rank}/'}steps/{col}", int(step), float(v)))
    job.scalars.sort(key=lambda s: s[1])
    return job


def tag_prefix(tap: str, call: int, rank: int) -> str:
    """The tag prefix of a tap's records: `grads/<tap>`, `grads/<tap>@<call>`, `rank<N>/grads/...`.

    Example::

        tag_prefix("fc1:output", 1, 0)     # 'grads/fc1:output@1'
    """
    return f"{'' if rank == 0 else f'rank{rank}/'}grads/{tap}{'' if call == 0 else f'@{call}'}"


def _params(d: Path) -> dict[str, str]:
    """The job's overrides (Hydra's, or `done.json`'s), else the capture settings `record` wrote."""
    marker = rundir.read_json(d / rundir.DONE) or {}
    overrides = marker.get("overrides") or []
    f = d / ".hydra" / "overrides.yaml"
    if not overrides and f.is_file():
        import yaml

        overrides = yaml.safe_load(f.read_text()) or []
    params = {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        params[key.lstrip("+~")] = value
    if not params and isinstance(marker.get("config"), dict):
        cfg = marker["config"]
        params = {f"capture.{k}": str(v) for k, v in (cfg.get("capture") or {}).items()}
        params["experiment"] = str(cfg.get("experiment", ""))
    return params
