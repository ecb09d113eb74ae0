"""What the report reads of the records beyond `load`: the grads files, their light columns, the rows a figure draws.

Contents:
    _grads_files(out_dir) -> [Path]           -- the grads files of a run or sweep dir (hidden dirs skipped)
    light_columns(out_dir) -> [str] | None   -- every column but the per-element ones (`_HEAVY`)
    config_value(out_dir, keys) -> object    -- a value of the run's resolved config (the grads file's metadata)
    runs_having(out_dir, grads, column)      -- each run whose grads file has `column`, and that file
    with_column(run, file, column, filters)  -- a run's rows with `column` read for the filtered rows only
    drawn_values(out_dir, grads)             -- the first run's `values` at its first and last step, or None
    loss_not_recorded(out_dir, steps)        -- per steps row: its loss is null in the file (not NaN: not recorded)

The per-element columns (`values`, `hist_counts`, `per_example_norm`) are read with pyarrow filters for the
rows drawn, never for every row of a sweep.

Example::

    grads = load(out_dir, columns=light_columns(out_dir))
    values = drawn_values(out_dir, grads)     # None when no values were captured
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd

from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.analysis.reading import VALUES as VALUES_COLUMN
from gradrunner.analysis.summaries import pick_steps
from gradrunner.records.columns import GRADS_FILE, HIST_COLUMN, PER_EXAMPLE_COLUMN, STEPS_FILE
from gradrunner.records.writer import recorded_config

#: Columns with a list per row: read for the rows a figure draws, not with the rest of the records.
_HEAVY = (VALUES_COLUMN, HIST_COLUMN, PER_EXAMPLE_COLUMN)


def _grads_files(out_dir: Path) -> list[Path]:
    """The grads files of the run or sweep at `out_dir` (hidden dirs, e.g. a running job's temp files, skipped)."""
    if (out_dir / GRADS_FILE).is_file():
        return [out_dir / GRADS_FILE]
    found = []
    for here, dirs, files in os.walk(out_dir):  # hidden dirs pruned, not walked (a sweep's 10,000 .hydra/)
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        if GRADS_FILE in files:
            found.append(Path(here) / GRADS_FILE)
    return sorted(found)


def light_columns(out_dir: Path) -> list[str] | None:
    """Every column of the grads files but the per-element ones (None: let `load` say what is missing)."""
    import pyarrow.parquet as pq

    files = _grads_files(out_dir) if out_dir.is_dir() else []
    if not files:
        return None
    try:  # footers read on a few threads: a sweep's 10,000 files wait on the disk more than on Python
        with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
            names = dict.fromkeys(n for schema in pool.map(pq.read_schema, files) for n in schema.names)
    except Exception:  # a damaged footer: `load` names the file and why
        return None
    return [n for n in names if n not in _HEAVY]


def config_value(out_dir: Path, keys: tuple[str, ...]) -> object:
    """A value of the run's resolved config, as its grads file's metadata holds it (None where absent)."""
    files = _grads_files(out_dir) if out_dir.is_dir() else []
    node: object = (recorded_config(files[0]) if files else None) or {}
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _run_file(out_dir: Path, run: pd.DataFrame) -> Path:
    job = str(run["job"].iloc[0]) if "job" in run.columns else ""
    return (out_dir / job if job else out_dir) / GRADS_FILE


def runs_having(out_dir: Path, grads: pd.DataFrame, column: str) -> list[tuple[pd.DataFrame, Path]]:
    """The rows of each run whose grads file has `column` (a sweep may turn an option on in some jobs), and that file."""
    import pyarrow.parquet as pq

    found = []
    for _, run in grads.groupby("run_id", sort=False):
        file = _run_file(out_dir, run)
        if file.is_file() and column in pq.read_schema(file).names:
            found.append((run, file))
    return found


def with_column(run: pd.DataFrame, file: Path, column: str, filters: list[tuple[str, str, object]]) -> pd.DataFrame:
    """`run`'s rows that match `filters`, with `column` read from `file` for those rows only (pyarrow filters)."""
    import pyarrow.parquet as pq

    names = pq.read_schema(file).names
    keys = [k for k in ("run_id", "step", "tap", "call", "rank") if k in names and k in run.columns]
    micro = [c for c in ("micro_step", "has_grad") if c in names]  # combined per step, as `run`'s rows are
    read = pq.read_table(file, columns=[*keys, *micro, column], filters=filters or None).to_pandas()
    read = combine_micro_steps(read).drop(columns=micro)
    rows = run
    for name, op, value in filters:
        rows = rows[rows[name].isin(value)] if op == "in" else rows[rows[name] == value]  # type: ignore[arg-type]
    return rows.drop(columns=[column], errors="ignore").merge(read, on=keys, how="inner", validate="one_to_one")


def drawn_values(out_dir: Path, grads: pd.DataFrame) -> pd.DataFrame | None:
    """The `values` of the first run at its first and last captured step only (row groups filtered), or None.

    A row per record of `grads` (one per step, tap, call and rank): under accumulation a step's micro-batches'
    values side by side, in micro-batch order, as `combine_micro_steps` puts their statistics together.
    """
    import pyarrow.parquet as pq

    first = grads[grads["run_id"] == grads["run_id"].iloc[0]]
    job = str(first["job"].iloc[0]) if "job" in first.columns else ""
    file = (out_dir / job if job else out_dir) / GRADS_FILE
    if not file.is_file() or "values" not in pq.read_schema(file).names:
        return None
    chosen = pick_steps(first["step"], n=2)
    names = pq.read_schema(file).names
    keys = [k for k in ("step", "tap", "call", "rank") if k in names and k in first.columns]
    micro = ["micro_step"] if "micro_step" in names else []
    table = pq.read_table(file, columns=[*keys, *micro, "values"], filters=[("step", "in", chosen)])
    if table.num_rows == 0 or table.column("values").null_count == table.num_rows:
        return None
    read = table.to_pandas()
    if micro and read["micro_step"].notna().any():  # a record per micro-batch: one per step, values side by side
        read = read.sort_values(micro, kind="stable", na_position="first")
        read = read.groupby(keys, sort=False, dropna=False)["values"].agg(_side_by_side).reset_index()
    rows = first[first["step"].isin(chosen)].drop(columns=["values"], errors="ignore")
    return rows.merge(read[[*keys, "values"]], on=keys, how="left", validate="one_to_one")


def _side_by_side(values: pd.Series) -> object:
    """The micro-batches' values of one record, concatenated (None where none was captured)."""
    import numpy as np

    arrays = [np.asarray(v) for v in values if v is not None]
    return np.concatenate(arrays) if arrays else None


def loss_not_recorded(out_dir: Path, steps: pd.DataFrame) -> pd.Series:
    """Per row of `steps`: True where its file holds a null loss (`rec.step()` without one: not recorded), False
    for a recorded one, NaN included. pandas reads both as NaN; the files tell them apart (as the last word does).

    Example::

        steps[~loss_not_recorded(out_dir, steps)]["loss"]      # the losses the run recorded
    """
    import pyarrow.parquet as pq

    out = pd.Series(False, index=steps.index)
    if "loss" not in steps.columns:
        return out
    for _, run in steps[steps["loss"].isna()].groupby("run_id", sort=False):  # only runs with a NaN are read
        file = _run_file(out_dir, run).with_name(STEPS_FILE)
        if not file.is_file():
            continue
        names = pq.read_schema(file).names
        keys = [k for k in ("run_id", "step", "rank") if k in names and k in run.columns]
        table = pq.read_table(file, columns=[*keys, "loss"])
        read = table.select(keys).to_pandas().assign(_null=table.column("loss").is_null().to_numpy(zero_copy_only=False))
        found = run[keys].reset_index().merge(read.drop_duplicates(keys), on=keys, how="left")
        out.loc[found["index"].to_numpy()] = found["_null"].fillna(False).to_numpy(dtype=bool)
    return out
