"""A sweep's jobs labelled in what `load` returns: the `job` column and each swept override as a typed column.

A job's own overrides come from its records (the files' metadata), else its `done.json`, else
`.hydra/overrides.yaml`; a key whose value differs between the sweep's jobs (those `load` leaves out
too: a failed job's value makes its key a column) becomes a column (int64, else float64, else string),
named `override.<key>` where it would clash with a column (`RESERVED_COLUMNS`).

Example::

    parse_overrides(["+experiment=mlp", "optimizer.lr=0.1", "~seed"])   # {'experiment': 'mlp', 'optimizer.lr': '0.1', 'seed': None}
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

from gradrunner.records import rundir
from gradrunner.records.schema import STEPS_SCHEMA, grads_schema

#: Columns of `load`'s results besides the records' own, and of the helpers in `gradrunner.analysis.summaries`
#: and `strategies` (measures, tap_summary, grad_flow/forward_order, compare_strategies, strategy_groups, strategy_costs).
HELPER_COLUMNS = frozenset({
    "job", "rms", "mean_abs", "steps", "first", "last", "median", "first_nonfinite_step", "first_vanishing_step",
    "first_exploding_step", "vanishing", "exploding", "position", "label", "stat", "abs_diff", "rel_diff",
    "strategies", "missing", "captured_steps", "capture_share", "index", "level_0",
})  # fmt: skip
#: Every column a record table can hold (`records.schema`: both tables, the optional columns too) and the
#: helpers' (`HELPER_COLUMNS`): a swept override with one of these names (`steps=5,10`, `lr=0.1,0.2`; `seed` is
#: fine) becomes the column `override.<key>`. Derived from the schema, so a new record column is reserved with it.
RESERVED_COLUMNS = frozenset(
    {*grads_schema(per_example=True, histogram=True).names, *STEPS_SCHEMA.names, *HELPER_COLUMNS}
)


@dataclass(frozen=True)
class FileRead:
    """What `load` keeps of a file that verified once its rows joined the others': their count, its columns, its overrides."""

    rows: int
    columns: tuple[str, ...]
    #: The overrides the file's metadata holds (`OVERRIDES_KEY`, JSON), if any.
    overrides: bytes | None


def natural_key(rel: Path) -> list[tuple[int, int | str]]:
    """Sort key putting job 2 before job 10."""
    return [(0, int(t)) if t.isdigit() else (1, t) for part in rel.parts for t in re.split(r"(\d+)", part) if t]


#: libyaml's safe loader where PyYAML has it (about 10x faster over 10,000 job dirs), else the pure-Python one.
YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def job_overrides(job_dir: Path, raw: bytes | None = None, marker: dict[str, Any] | None = None) -> list[str]:
    """THE rule for a job's own overrides: its records' (the file's metadata `raw`), else its `done.json`'s, else
    `.hydra/overrides.yaml`'s. `load`, the sweep manifest and the exporters read them here.

    Example::

        job_overrides(sweep / "3")      # ['+experiment=mlp', 'seed=3']

    `.hydra/overrides.yaml` is read last: Hydra rewrites it for any later run into the dir, while the
    records (and `done.json`, which pins them) keep what this job was run with. `marker` is the job's
    `done.json` when the caller has read it already (`rundir.read_marker`); else it is read here.
    """
    if raw is not None:  # the file's metadata
        with contextlib.suppress(ValueError):
            found = json.loads(raw)
            if isinstance(found, list):
                return [str(o) for o in found]
    if marker is None:
        marker, _ = rundir.read_marker(job_dir)
    if marker is not None and isinstance(marker.get("overrides"), list):
        return [str(o) for o in marker["overrides"]]
    try:
        items = yaml.load((job_dir / ".hydra" / "overrides.yaml").read_text(), Loader=YAML_LOADER)
    except (OSError, ValueError, yaml.YAMLError):
        return []
    return [str(o) for o in items] if isinstance(items, list) else []


def parse_overrides(items: list[str]) -> dict[str, str | None]:
    """THE parse of a job's Hydra overrides into `key -> value`: `+key=v`, `++key=v` -> `key`; `~key`, `~key=v` -> None.

    Example::

        parse_overrides(["++optimizer.lr=0.1", "~seed"])    # {'optimizer.lr': '0.1', 'seed': None}
    """
    out: dict[str, str | None] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        out[key.lstrip("+~")] = value if sep and not key.startswith("~") else None
    return out


def _typed_array(values: list[str | None]) -> pa.Array:
    """Override values as int64, else float64, else string: the first type every value parses as."""
    present = [v for v in values if v is not None]
    for parse, typ in ((int, pa.int64()), (float, pa.float64())):
        try:
            parsed = [parse(v) for v in present]
        except ValueError:
            continue
        it = iter(parsed)
        return pa.array([None if v is None else next(it) for v in values], typ)
    return pa.array(values, pa.string())


def _swept_columns(overrides: list[dict[str, str | None]], others: list[dict[str, str | None]]) -> dict[str, pa.Array]:
    """One value per job of `overrides` for each key whose value differs between all the jobs (`others` too: the
    sweep's jobs not read), typed over all of them, as the column of the whole sweep would be."""
    every = [*overrides, *others]
    columns: dict[str, pa.Array] = {}
    for key in sorted({k for o in every for k in o}):
        values = [o.get(key) for o in every]
        if len(set(values)) > 1:
            columns[key] = _typed_array(values)[: len(overrides)]
    return columns


def with_job_columns(
    root: Path, job_dirs: list[Path], read: list[FileRead], joined: pa.Table, others: Sequence[list[str]] = ()
) -> pa.Table:
    """`joined` (the rows of the files `read`, in order, each in its job dir of `job_dirs`) with `job` and the swept override columns, constant within each file's rows.

    `others` are the overrides of the sweep's jobs whose records are not read (failed, unfinished, damaged, without
    a dir): a key that differs between any of the sweep's jobs gets its column, whichever jobs completed.

    The columns come last, after each file's own (a column only later files have comes after them, as
    when each file's table carried them); a swept key named like a column only some files have is
    `override.<key>` in those files' rows only (`_override_name`), which takes a table per file.
    """
    unique_dirs = sorted(set(job_dirs), key=lambda d: natural_key(d.relative_to(root)))
    first = {d: r for d, r in reversed(list(zip(job_dirs, read, strict=True)))}
    own = [parse_overrides(job_overrides(d, first[d].overrides)) for d in unique_dirs]
    swept = _swept_columns(own, [parse_overrides(o) for o in others])
    index = {d: i for i, d in enumerate(unique_dirs)}
    names_of = {names: [_override_name(key, names) for key in swept] for names in {r.columns for r in read}}
    names = names_of[read[0].columns]
    clash = {*names, "job"} & set(joined.column_names) or len(set(names)) < len(names)
    if clash or any(names_of[r.columns] != names for r in read):
        return _per_file_job_columns(root, job_dirs, read, joined, swept, index)
    row_dir = np.repeat(np.array([index[d] for d in job_dirs], np.int64), [r.rows for r in read])
    jobs = pa.array([d.relative_to(root).as_posix() for d in unique_dirs], pa.string())
    added = {"job": jobs.take(row_dir), **{n: c.take(row_dir) for n, c in zip(names, swept.values(), strict=True)}}
    order: dict[str, None] = {}
    for columns in dict.fromkeys(r.columns for r in read):  # each file's columns, then the added ones
        order.update(dict.fromkeys([*columns, *added]))
    for name, column in added.items():
        joined = joined.append_column(name, column)
    return joined.select(list(order))


def _override_name(key: str, columns: Sequence[str]) -> str:
    """The column of a swept override `key` in a file with `columns`: `override.<key>` when it would clash."""
    return f"override.{key}" if key in RESERVED_COLUMNS or key in columns else key


def _per_file_job_columns(
    root: Path, job_dirs: list[Path], read: list[FileRead], joined: pa.Table, swept: dict[str, pa.Array], index: dict[Path, int]
) -> pa.Table:
    """`job` and the swept override columns appended to each file's rows (a key's column name differs between files)."""
    out, offset = [], 0
    for job_dir, r in zip(job_dirs, read, strict=True):
        i, t = index[job_dir], joined.slice(offset, r.rows).select(list(r.columns))
        offset += r.rows
        t = t.append_column("job", pa.repeat(pa.scalar(job_dir.relative_to(root).as_posix()), t.num_rows))
        for key, column in swept.items():
            t = t.append_column(_override_name(key, t.column_names), pa.repeat(column[i], t.num_rows))
        out.append(t)
    return concat(out)


def concat(tables: list[pa.Table]) -> pa.Table:
    """Concatenate tables whose schemas differ: a column some lack is null there, types are promoted; tables without
    a column (`load(sweep, columns=["job"])`: nothing to read but the rows) keep their rows, which pyarrow's drops."""
    if tables and not any(t.num_columns for t in tables):
        return pa.table({"rows": pa.nulls(sum(t.num_rows for t in tables))}).drop_columns(["rows"])
    return pa.concat_tables([t.replace_schema_metadata(None) for t in tables], promote_options="permissive")
