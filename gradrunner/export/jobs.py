"""The jobs of a run or sweep dir as an exporter needs them: a name, hyper-parameters, scalars, histograms.

Records are read through `gradrunner.analysis.load`, so they are verified as `load` verifies them
(page checksums; run id, rows and footer against `done.json`): a damaged, foreign or partial job is
refused by name, or left out with a warning under `on_damaged="skip"`, never exported wrong; a completed
job that recorded no rows (its `done.json` says 0) is left out with a note saying so. Then

- under gradient accumulation a step's micro-batch records are combined into one per (step, tap,
  call, rank): the whole batch's gradient (`analysis.micro.combine_micro_steps`);
- a statistic is exported where the record has a gradient (`has_grad`), NaN and Inf included as
  they are; `value_norm`, `update_norm`, `update_ratio` where not null; `nan_count`, `inf_count` always;
- `steps.parquet`'s numeric columns (`STEPS_SCALARS`, derived from the schema) where not null, NaN kept.

Reading the records needs no torch (pyarrow and pandas only); each target (`tensorboard`, `mlflow`,
`wandb`) writes these `Job`s its own way.

Example::

    [j.name for j in jobs("multirun/2024-05-01/12-00-00")]     # ['0', '1', '2']
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gradrunner.analysis.labels import job_overrides, parse_overrides
from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.analysis.reading import ON_DAMAGED, DamagedRecordsWarning, IncompleteSweepWarning, load
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.columns import (
    CONSTANT_COLUMNS,
    COUNT_COLUMNS,
    EXTRA_FLOAT_COLUMNS,
    GRADS_FILE,
    HIST_COLUMN,
    HIST_EDGES_KEY,
    OVERRIDES_KEY,
    PER_EXAMPLE_COLUMN,
    STAT_COLUMNS,
    STEPS_FILE,
)
from gradrunner.records.locking import EXPORT_LOCK, FileLock, Held
from gradrunner.records.schema import STEPS_SCHEMA, grads_schema

#: Per-record columns exported as scalars, in this order.
SCALAR_COLUMNS = (*STAT_COLUMNS, *COUNT_COLUMNS, *EXTRA_FLOAT_COLUMNS)
#: Which row of `steps.parquet` it is, not a value over steps.
STEPS_ROW_KEYS = ("step", "rank")
#: `steps.parquet`'s columns exported as scalars over steps: the schema's numbers (not bools, lists or
#: strings), less the run's constant columns and the row keys. Derived here, the one place.
STEPS_SCALARS = tuple(
    f.name for f in STEPS_SCHEMA
    if f.name not in (*CONSTANT_COLUMNS, *STEPS_ROW_KEYS) and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))
)  # fmt: skip
#: What an exporter reads of `grads.parquet` (the per-element columns `values`, `per_example_norm` are not exported).
_GRADS_READ = [n for n in grads_schema(histogram=True).names if n not in ("values", PER_EXAMPLE_COLUMN)]
#: The name a run dir (the root itself, not a sweep's job) is exported by.
ROOT_NAME = "run"
#: The root's key among the jobs' names (their dirs below the root): no job dir is named ".", so a job dir
#: named "run" is a job like any other.
_ROOT = "."
#: The file in a job's export (its TensorBoard dir, its W&B offline run) naming the job dir it was exported from
#: (`source_of`): a re-export of that dir replaces it, whichever run the dir held then.
MARKER = ".gradrunner-export.json"


@dataclass
class Job:
    """One job's records, ready for a target: its name, hyper-parameters, scalars and histograms."""

    name: str
    directory: Path
    params: dict[str, str]
    #: (tag, step, value), in step order; one per (tag, step).
    scalars: list[tuple[str, int, float]] = field(default_factory=list)
    #: (tag, step, bin right edges, counts), bins as the records count them (non-finite left out).
    histograms: list[tuple[str, int, list[float], list[int]]] = field(default_factory=list)
    #: The run id of its records (an exporter keys its own runs by it, so a re-export replaces them).
    run_id: str = ""


def jobs(path: str | os.PathLike[str], on_damaged: str = "raise", notes: list[str] | None = None) -> list[Job]:
    """The jobs below `path` (a run dir or a sweep dir), each with what a target writes.

    Example::

        [j.name for j in jobs("multirun/2024-05-01/12-00-00")]     # ['0', '1', '2']
        notes: list[str] = []
        jobs(sweep, on_damaged="skip", notes=notes)                 # notes: what was left out, and why

    A job whose files do not verify is refused (`on_damaged="raise"`: one GradrunnerError naming each
    file), or left out with its reason appended to `notes` (`"skip"`); so are the failed or unfinished
    jobs of a sweep (`load`'s rule) and a job whose other table did not verify.
    """
    if on_damaged not in ON_DAMAGED:
        raise GradrunnerError(f"--on-damaged {on_damaged!r} is not allowed; allowed: {', '.join(ON_DAMAGED)}")
    root = Path(path)
    if not root.is_dir():
        raise GradrunnerError(f"{root} is not a directory; pass a run dir (holding grads.parquet) or a sweep dir.")
    said = notes if notes is not None else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = load(root, columns=_GRADS_READ, on_damaged=on_damaged)
        steps = _load_steps(root, on_damaged)
    # Both reads warn of the same jobs: each warning once, in order.
    said += list(dict.fromkeys(one_paragraph(w.message) for w in caught
                               if issubclass(w.category, (DamagedRecordsWarning, IncompleteSweepWarning))))  # fmt: skip
    grads, steps = _same_jobs(root, grads, steps, on_damaged, said)
    by_job = dict(_by_job(grads))
    steps_by_job = dict(_by_job(steps)) if steps is not None else {}
    found = []
    for name in dict.fromkeys([*by_job, *steps_by_job]):  # a job that recorded losses but no gradient too
        d = root if name == _ROOT else root / name
        rows, step_rows = by_job.get(name), steps_by_job.get(name)
        run_id = str(next(r for r in (rows, step_rows) if r is not None)["run_id"].iloc[0])
        job = Job(ROOT_NAME if name == _ROOT else name, d, _params(d, said), run_id=run_id)
        if rows is not None:
            per_step = combine_micro_steps(rows)
            job.scalars = grad_scalars(per_step)
            job.histograms = _histograms(d, per_step)
        if step_rows is not None:
            job.scalars += _steps_scalars(d, step_rows)
        job.scalars.sort(key=lambda s: s[1])
        found.append(job)
    return found


def _load_steps(root: Path, on_damaged: str) -> pd.DataFrame | None:
    """`load(root, table="steps")`, or None when no job has a steps table (records written without one)."""
    if not any(p.name == STEPS_FILE for p in _record_files(root)):
        return None
    return load(root, table="steps", on_damaged=on_damaged)


def _record_files(root: Path) -> list[Path]:
    return [d / n for d in [root, *rundir.job_dirs_below(root)] for n in (GRADS_FILE, STEPS_FILE) if (d / n).is_file()]


def _job_names(df: pd.DataFrame) -> pd.Series:
    """Each row's job: its dir below the root (load's `job` column), `_ROOT` for the root itself (a run dir)."""
    return df["job"].astype(str) if "job" in df.columns else pd.Series(_ROOT, index=df.index)


def _by_job(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    names = _job_names(df)
    return [(str(n), rows) for n, rows in df.groupby(names, sort=False)]


def _same_jobs(
    root: Path, grads: pd.DataFrame, steps: pd.DataFrame | None, on_damaged: str, notes: list[str]
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Only jobs whose every table was read: a job missing from a table it has (or, completed, that its
    `done.json` lists), the file gone or skipped as damaged, is refused under "raise", left out with a note
    under "skip". A table its `done.json` says has 0 rows was read, and holds none: a job with no rows at all
    (a completed run of 0 steps) is left out with a note saying so."""
    read = {GRADS_FILE: set(_job_names(grads)), STEPS_FILE: set(_job_names(steps)) if steps is not None else set()}
    dirs = {d.relative_to(root).as_posix(): d for d in rundir.job_dirs_below(root) if d != root} | {_ROOT: root}
    markers = {n: rundir.read_marker(d)[0] for n, d in dirs.items()}
    lacking, empty = {}, []
    for name in sorted(read[GRADS_FILE] | read[STEPS_FILE] | {n for n, m in markers.items() if m is not None}):
        d = dirs.get(name, root / name)
        none = _no_rows(markers.get(name))
        missing = [f for f in _expected(d, markers.get(name)) if name not in read[f] and f not in none]
        if missing:
            lacking[name] = f"{d}: its {' and '.join(missing)} could not be read"
        elif not any(name in r for r in read.values()):
            empty.append(str(d))
    if lacking and on_damaged == "raise":
        raise GradrunnerError(
            f"cannot export {len(lacking)} job(s) whose records are missing or do not verify: {'; '.join(lacking.values())}"
            ". Re-run them (resume=true), move their dirs away, or pass --on-damaged skip to export the rest."
        )
    left_out = [*lacking.values(), *(f"{d}: recorded no rows (a completed run of 0 steps)" for d in empty)]
    kept = (read[GRADS_FILE] | read[STEPS_FILE]) - set(lacking)
    if not kept and empty and not lacking:
        raise GradrunnerError(f"nothing to export: {'; '.join(left_out)}. Export a run that recorded steps.")
    if not kept:
        raise GradrunnerError(f"no job in {root} has records that verify ({'; '.join([*notes, *left_out])}); nothing exported.")
    notes += [f"not exported: {why}" for why in left_out]
    kept_grads = grads[_job_names(grads).isin(kept)]
    return kept_grads, None if steps is None else steps[_job_names(steps).isin(kept)]


def _no_rows(marker: dict[str, Any] | None) -> set[str]:
    """The tables a completed job's `done.json` says hold 0 rows (`load` verified the files against it)."""
    rows = (marker or {}).get("rows")
    return {f for f, n in rows.items() if n == 0} if isinstance(rows, dict) else set()


def _expected(d: Path, marker: dict[str, Any] | None) -> list[str]:
    """The tables a job has: those its `done.json` lists (a completed job), else grads and those present."""
    listed = (marker or {}).get("files")
    if isinstance(listed, list) and listed:
        return [f for f in (GRADS_FILE, STEPS_FILE) if f in listed]
    return [f for f in (GRADS_FILE, STEPS_FILE) if f == GRADS_FILE or (d / f).is_file()]


def grad_scalars(rows: pd.DataFrame) -> list[tuple[str, int, float]]:
    """(tag, step, value) of each record's statistics: where it has a gradient, NaN and Inf kept.

    Example::

        grad_scalars(combine_micro_steps(load(run_dir)))[:1]    # [('grads/fc1:output/norm', 0, 0.0427)]
    """
    prefixes = [tag_prefix(t, c, r) for t, c, r in zip(rows["tap"].astype(str), rows["call"].astype(int),
                                                          rows["rank"].fillna(0).astype(int), strict=True)]  # fmt: skip
    steps = rows["step"].astype(int).tolist()
    has_grad = rows["has_grad"].fillna(False).to_numpy(dtype=bool)
    out: list[tuple[str, int, float]] = []
    for c in SCALAR_COLUMNS:
        if c not in rows.columns:
            continue
        v = rows[c].to_numpy(dtype=np.float64, na_value=np.nan)
        keep = has_grad if c in STAT_COLUMNS else ~np.isnan(v) if c in EXTRA_FLOAT_COLUMNS else np.ones(len(v), bool)
        out += [(f"{prefixes[i]}/{c}", steps[i], float(v[i])) for i in np.flatnonzero(keep)]
    return out


def _histograms(d: Path, rows: pd.DataFrame) -> list[tuple[str, int, list[float], list[int]]]:
    if HIST_COLUMN not in rows.columns or rows[HIST_COLUMN].isna().all():
        return []
    edges = json.loads((pq.read_schema(d / GRADS_FILE).metadata or {})[HIST_EDGES_KEY.encode()])
    limits = [0.0, *edges, sys.float_info.max]  # exact zeros, (0, e0), ..., [e_last, inf)
    out = []
    for row in rows.itertuples(index=False):
        counts = getattr(row, HIST_COLUMN)
        if counts is not None and len(counts):
            out.append((f"{tag_prefix(str(row.tap), int(row.call), int(row.rank))}/hist", int(row.step), limits,  # type: ignore[arg-type]
                        [int(c) for c in counts[: len(limits)]]))  # fmt: skip
    return out


def _steps_scalars(d: Path, rows: pd.DataFrame) -> list[tuple[str, int, float]]:
    """(tag, step, value) of `steps.parquet`'s `STEPS_SCALARS`: where not null (a NaN loss is kept, a column a
    loop does not fill is left out). Null is told from NaN in the file itself, which `load` just verified."""
    names = pq.read_schema(d / STEPS_FILE).names
    wanted = [c for c in STEPS_SCALARS if c in names]
    table = pq.read_table(d / STEPS_FILE, columns=wanted)
    if table.num_rows != len(rows):
        raise GradrunnerError(f"{d / STEPS_FILE} changed while it was exported (a job still writing?); export again.")
    prefixes = ["" if r == 0 else f"rank{r}/" for r in rows["rank"].fillna(0).astype(int)]
    steps = rows["step"].astype(int).tolist()
    out = []
    for c in wanted:
        valid = table.column(c).is_valid().to_numpy(zero_copy_only=False)
        v = rows[c].to_numpy(dtype=np.float64, na_value=np.nan)
        out += [(f"{prefixes[i]}steps/{c}", steps[i], float(v[i])) for i in np.flatnonzero(valid)]
    return out


def source_of(job: Job) -> str:
    """The job dir a target names as the source of `job`'s export (resolved): what a re-export replaces by.

    Example::

        source_of(job)     # '/home/me/multirun/2024-05-01/12-00-00/0'
    """
    return str(job.directory.resolve())


def tag_prefix(tap: str, call: int, rank: int) -> str:
    """The tag prefix of a tap's records: `grads/<tap>`, `grads/<tap>@<call>`, `rank<N>/grads/...`.

    Example::

        tag_prefix("fc1:output", 1, 0)     # 'grads/fc1:output@1'
    """
    return f"{'' if rank == 0 else f'rank{rank}/'}grads/{tap}{'' if call == 0 else f'@{call}'}"


def _params(d: Path, notes: list[str]) -> dict[str, str]:
    """The job's overrides (its records' metadata, else `done.json`, else Hydra's), else the capture settings `record` wrote."""
    try:
        raw = (pq.read_schema(d / GRADS_FILE).metadata or {}).get(OVERRIDES_KEY.encode())
    except (OSError, pa.ArrowException):
        raw = None
    marker = rundir.read_json(d / rundir.DONE) or {}
    overrides = job_overrides(d, raw, marker if isinstance(marker, dict) else None)  # unreadable ones: []
    # A removed key (`~key`) is a hyper-parameter without a value, as `load` reads it.
    params = {k: "" if v is None else v for k, v in parse_overrides(overrides).items()}
    if not params and isinstance(marker.get("config"), dict):
        cfg = marker["config"]
        capture = cfg.get("capture") if isinstance(cfg.get("capture"), dict) else {}
        params = {f"capture.{k}": str(v) for k, v in capture.items()}
        params["experiment"] = str(cfg.get("experiment", ""))
    return params


@contextmanager
def exclusive(directory: Path, target: str, option: str = "--out") -> Iterator[None]:
    """Hold the export lock of `directory` (the dir an exporter writes) while the body writes there.

    Example::

        with exclusive(Path("runs/mine/tensorboard"), "TensorBoard"):   # GradrunnerError while another export writes it
            ...

    One export at a time writes a target dir: a second one is refused (nothing written) in one paragraph naming
    the first, and `option` to write elsewhere. The lock (`records.locking.FileLock`, on
    `<directory>/.gradrunner-export.lock`) dies with its process, so a killed export never blocks the next.
    """
    lock = FileLock(directory / EXPORT_LOCK)
    try:
        lock.__enter__()
    except Held as e:
        who = f"pid {e.owner.get('pid', '?')} on {e.owner.get('host', '?')}, started {e.owner.get('started', '?')}"
        raise GradrunnerError(f"{directory} is being written by another {target} export ({who}); one export at a time "
                              f"writes there, and this one wrote nothing. Wait for it to end (or stop it: kill "
                              f"{e.owner.get('pid', '<pid>')}) and export again, or export elsewhere (another {option}).") from None  # fmt: skip
    try:
        yield
    finally:
        lock.__exit__()
