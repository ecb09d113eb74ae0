"""`anomalies.parquet`: the values a run's spike detector flagged, its schema defined once, written whole, read verified.

Contents:
    ANOMALIES_FILE, ANOMALIES_SCHEMA       -- the file's name in the run dir and its columns
    RUN_ID_KEY, SETTINGS_KEY               -- its key-value metadata: the run id, the detector's settings (JSON)
    write_anomalies(run_dir, rows, run_id) -- the whole file, atomically (a reader sees the old file or the new)
    read_anomalies_table(run_dir)          -- the file, every page checked, refused (`rundir.Damaged`) if not this run's
    run_id_of(run_dir)                     -- the run's id: its `done.json`'s, else its steps (or grads) file's
    run_id_source(run_dir)                 -- that id and the name of the file it came from
    settings_of(schema)                    -- the detector's settings the file was written with (its metadata)

Example::

    write_anomalies(run_dir, [{"step": 40, "signal": "loss", "value": 9e3, "mean": 0.3, "std": 0.01, "z": 9e5,
                               "space": "linear", "streak": 1, "first_tap": "fc1:output", "lead": 0}], run_id="3f2a")
    read_anomalies_table(run_dir).column("signal").to_pylist()      # ['loss']

The rows come from `gradrunner.analysis.anomaly_summary.anomaly_rows` (the detection rule: `analysis.anomalies`); this
module knows only the file. Every row carries the run's `run_id`, and the file's metadata too (so that
a file without rows is checked as well): reading refuses a file of another run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.compute as pc

from gradrunner.records import rundir
from gradrunner.records.atomic import write_atomically
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE
from gradrunner.records.table_writer import write_whole

#: The file in the run dir.
ANOMALIES_FILE = "anomalies.parquet"
#: Metadata keys: the run id (checked even when the file has no rows) and the detector's settings (JSON).
RUN_ID_KEY = "gradrunner.run_id"
SETTINGS_KEY = "gradrunner.anomaly"

#: One row per flagged value (a run of consecutive flagged values of a signal: its first `warmup`).
#: `first_tap` and `lead` are set on loss and grad_norm rows only (null elsewhere, and where no tap moved
#: in the window before): the tap whose signal was flagged first, and how many steps before this row's step.
ANOMALIES_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string()),
        pa.field("step", pa.int64()),
        # `loss`, `grad_norm`, or `<tap>:<statistic>` (`fc1:output:norm`, `fc1:weight:update_ratio`).
        pa.field("signal", pa.string()),
        # The value as recorded; the mean and (floored) std of the window it was judged against, on the
        # signal's scale (`space`): z = (x - mean) / std with x the value (`linear`) or ln(value) (`log`);
        # z is +inf for a NaN or infinite value.
        pa.field("value", pa.float64()),
        pa.field("mean", pa.float64()),
        pa.field("std", pa.float64()),
        pa.field("z", pa.float64()),
        pa.field("space", pa.string()),
        # Its place in the run of consecutive flagged values of its signal (1, 2, ...); on the last row
        # written of a run that reached `warmup` values, `through` is the run's last flagged step.
        pa.field("streak", pa.int64()),
        pa.field("through", pa.int64()),
        pa.field("first_tap", pa.string()),
        pa.field("lead", pa.int64()),
    ]
)


def anomalies_table(
    rows: Sequence[Mapping[str, Any]], run_id: str, settings: Mapping[str, Any] | None = None
) -> pa.Table:
    """`rows` (dicts with the schema's columns but `run_id`) as a table of `ANOMALIES_SCHEMA`, `run_id` on every row.

    Example::

        anomalies_table([], "3f2a").schema.metadata[b"gradrunner.run_id"]     # b'3f2a'
    """
    columns: dict[str, list[Any]] = {f.name: [] for f in ANOMALIES_SCHEMA}
    for row in rows:
        for name in ANOMALIES_SCHEMA.names[1:]:
            columns[name].append(row.get(name))
    columns["run_id"] = [run_id] * len(rows)
    meta = {RUN_ID_KEY: run_id, SETTINGS_KEY: json.dumps(dict(settings or {}))}
    return pa.table(columns, schema=ANOMALIES_SCHEMA.with_metadata(meta))


#: The detector's settings `settings_of` reads back (`analysis.anomalies.Detector`'s arguments), with their types.
SETTINGS = {"z": float, "window": int, "warmup": int, "rel_floor": float}


def settings_of(schema: pa.Schema) -> dict[str, Any]:
    """The detector's settings an anomalies file's schema metadata holds (`Detector(**settings_of(s))` is that
    detector); {} where it holds none (the detector's defaults apply).

    Example::

        settings_of(read_anomalies_table(run_dir).schema)     # {'z': 6.0, 'window': 128, 'warmup': 20, 'rel_floor': 0.001}
    """
    raw = (schema.metadata or {}).get(SETTINGS_KEY.encode())
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        found = {}
    if not isinstance(found, dict):
        return {}
    return {k: cast(Any, kind)(found[k]) for k, kind in SETTINGS.items() if isinstance(found.get(k), int | float)}


def write_anomalies(
    run_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], run_id: str,
    settings: Mapping[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write `<run_dir>/anomalies.parquet` whole, through a temp file and a rename; its path.

    Example::

        write_anomalies(run_dir, anomaly_rows(det.anomalies, det.window, det.taps()), run_id,
                        settings={"z": det.z, "window": det.window, "warmup": det.warmup})

    Encoded as the other record files (`records.table_writer.write_whole`: codecs, page checksums); an
    existing file is replaced (the file is derived from the run's records: `analysis.anomaly_signals.detect_run`
    rebuilds it), never left half-written.
    """
    table = anomalies_table(rows, run_id, settings)
    sink = pa.BufferOutputStream()
    write_whole(table, cast(Any, sink))  # pq.write_table takes any sink; write_whole's hint names paths only
    return write_atomically(Path(run_dir) / ANOMALIES_FILE, sink.getvalue().to_pybytes())


def run_id_of(run_dir: str | os.PathLike[str]) -> str | None:
    """The run's id: from its `done.json`, else the one id its `steps.parquet` (else `grads.parquet`) holds; None without either.

    Example::

        run_id_of(run_dir)       # '3f2a...'

    A records file holding rows of several runs is `rundir.Damaged`. `run_id_source` also names the file.
    """
    found = run_id_source(run_dir)
    return found[0] if found is not None else None


def run_id_source(run_dir: str | os.PathLike[str]) -> tuple[str, str] | None:
    """`run_id_of(run_dir)` and the name of the file it came from (`done.json`, `steps.parquet`, `grads.parquet`).

    Example::

        run_id_source(run_dir)   # ('3f2a...', 'steps.parquet') for a run interrupted before its done.json
    """
    directory = Path(run_dir)
    marker = rundir.job_state(directory).marker
    if marker is not None:
        return str(marker["run_id"]), rundir.DONE
    for name in (STEPS_FILE, GRADS_FILE):
        path = directory / name
        if path.is_file():
            ids = pc.unique(rundir.read_verified(path, None, ["run_id"]).column("run_id")).to_pylist()
            if len(ids) > 1:
                raise rundir.Damaged(f"{name} holds rows of several runs ({', '.join(map(str, ids))})")
            if ids:
                return str(ids[0]), name
    return None


def read_anomalies_table(run_dir: str | os.PathLike[str]) -> pa.Table:
    """`<run_dir>/anomalies.parquet`, verified: every page's checksum, and every row and the metadata of this run.

    Example::

        read_anomalies_table(run_dir).to_pandas()

    The run's id is `run_id_of(run_dir)`; with a `done.json` that pins the file (its rows and footer
    digest), those are checked too (`rundir.read_verified`). Raises `FileNotFoundError` without the file,
    and `rundir.Damaged` (its message starts with the file's name) when it does not verify.
    """
    directory = Path(run_dir)
    path = directory / ANOMALIES_FILE
    if not path.is_file():
        raise FileNotFoundError(path)
    marker = rundir.job_state(directory).marker
    found = run_id_source(directory)
    run_id, source = found if found is not None else (None, rundir.DONE)
    check = marker if marker is not None else ({"run_id": run_id} if run_id is not None else None)
    table = rundir.read_verified(path, check, source=source)  # pages, and the run_id column against the run's
    meta = table.schema.metadata or {}
    own = meta.get(RUN_ID_KEY.encode(), b"").decode("utf-8", "replace")
    if run_id is not None and own != run_id:
        raise rundir.Damaged(f"{ANOMALIES_FILE} was written for run {own or '(none)'}, not for run {run_id}: "
                             "a file of another run")  # fmt: skip
    if table.schema.remove_metadata() != ANOMALIES_SCHEMA:
        raise rundir.Damaged(f"{ANOMALIES_FILE} does not have the columns of an anomalies file "
                             f"({', '.join(table.column_names)})")  # fmt: skip
    return table
