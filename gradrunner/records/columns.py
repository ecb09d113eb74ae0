"""The names of the record columns and the host-side records of one step: no torch, no pyarrow.

The capture layer fills `StepRecords`; the writer turns them into Parquet rows; analysis reads the
column names. Defined here once so that each side can import them without the other's libraries.

Example::

    from gradrunner.records.columns import STAT_COLUMNS, GRADS_FILE
    pd.read_parquet(job_dir / GRADS_FILE)[list(STAT_COLUMNS)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

#: The job's record files, in its run dir.
GRADS_FILE = "grads.parquet"
STEPS_FILE = "steps.parquet"
RECORD_FILES = (GRADS_FILE, STEPS_FILE)
#: The run dir's lock (see `gradrunner.run.books.RunLock`): hidden, so readers never see it.
LOCK_FILE = ".gradrunner.lock"
#: A resumed `record()` session keeps the interrupted session's record files under this prefix until its own are
#: closed (`run.record_books`): hidden, so readers never take them for records.
KEPT_PREFIX = ".resumed-"
#: Key of the records' Parquet metadata holding the job's own command-line overrides (a JSON list).
OVERRIDES_KEY = "gradrunner.overrides"
#: Every temp file ends so: neither pyarrow (leading ".") nor DuckDB (`*.parquet`) reads it.
TEMP_SUFFIX = ".tmp"


def temp_name(name: str, run_id: str) -> str:
    """The hidden temp name under which run `run_id` writes `name` before renaming it.

    Example::

        temp_name("grads.parquet", "3f2a")     # '.grads.parquet.3f2a.tmp'

    It carries the run id (characters other than letters, digits, "-" and "_" as "_"), so two runs into one dir never touch each other's temp files.
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id) or "_"
    return f".{name}.{safe}{TEMP_SUFFIX}"


def is_temp_of(filename: str, name: str) -> bool:
    """Whether `filename` is a temp file (of any run) for the final file `name`.

    Example::

        is_temp_of(".grads.parquet.3f2a.tmp", "grads.parquet")   # True
        is_temp_of(".grads.parquet.tmp", "grads.parquet")        # True (the name before run ids)
    """
    return (filename.startswith(f".{name}.") and filename.endswith(TEMP_SUFFIX)) or filename == f".{name}{TEMP_SUFFIX}"


#: Tap names (what follows a tap's last ":") that name a module's output or input, or an element of one (`output.0`,
#: `input.KEY`): the part before the first "." is one of these. Capture resolves them before parameters.
ACTIVATION_NAMES = ("output", "input")
#: `local.<name>` names a local variable of forward() explicitly: the way to tap one named `input` or `output`.
LOCAL_PREFIX = "local."


def activation_kind(tap: str) -> str | None:
    """What tap `tap` ("<module>:<name>") names by its name alone when that is never a parameter, else None.

    Example::

        activation_kind("fc1:output.0")    # "a module's output"
        activation_kind(":local.h")        # "a local variable of forward()"
        activation_kind("fc1:weight")      # None (a parameter, or a local variable named so)
    """
    name = tap.rpartition(":")[2]
    if name.startswith(LOCAL_PREFIX):
        return "a local variable of forward()"
    head = name.partition(".")[0]
    return f"a module's {head}" if head in ACTIVATION_NAMES else None


#: Columns repeated on every row of a job (taken from the writer's `constants`), then `rank`.
CONSTANT_COLUMNS = ("run_id", "experiment", "strategy", "device", "dtype")
#: Columns of `StepRecords` that hold one float64 statistic per record.
STAT_COLUMNS = ("norm", "mean", "std", "min", "max", "abs_max", "zero_frac")
#: Columns of `StepRecords` that hold one int64 count per record.
COUNT_COLUMNS = ("nan_count", "inf_count")

#: Columns on every record beside the gradient's statistics (float64, null where unknown): the tapped
#: tensor's own norm, and for parameter taps the norm of the optimiser step's change and its ratio.
EXTRA_FLOAT_COLUMNS = ("value_norm", "update_norm", "update_ratio")
#: Optional list columns: `capture.per_example` (list<float64>) and `capture.histogram` (list<int64>).
PER_EXAMPLE_COLUMN = "per_example_norm"
HIST_COLUMN = "hist_counts"
#: The key of the histogram's bin edges (a JSON list) in the file's key-value metadata.
HIST_EDGES_KEY = "gradrunner.hist_edges"
#: The captured elements: large (every element of every gradient), so read only when asked for.
VALUES_COLUMN = "values"


def wanted_columns(names: Sequence[str], columns: Sequence[str] | None, values: bool) -> list[str]:
    """THE rule for which of a file's columns `names` a reader (`analysis.load`, a live load too) takes: `columns`
    (in their order) where given, else every one; `values` only when `values=True` or named in `columns`.

    Example::

        wanted_columns(["step", "norm", "values"], None, values=False)       # ['step', 'norm']
        wanted_columns(["step", "norm", "values"], ["values", "step"], False)   # ['values', 'step']
    """
    if columns is None:
        return [n for n in names if n != VALUES_COLUMN or values]
    return [n for n in dict.fromkeys([*columns, *([VALUES_COLUMN] if values else [])]) if n in names]


#: `capture.histogram`: edges of the log-spaced bins of |g|, four per decade from 1e-30 to 1e10 (the
#: same for every step, tap and strategy; also in the file's metadata under `gradrunner.hist_edges`).
HIST_EDGES = tuple(10.0 ** (k / 4) for k in range(-120, 41))
#: Counts per record: exact zeros, (0, edges[0]), one per pair of edges, >= edges[-1], non-finite.
HIST_BINS = len(HIST_EDGES) + 3


class TapKey(NamedTuple):
    """One firing of a tap: module path, tap name and call index within the step."""

    module: str
    name: str
    call: int

    @property
    def tap(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass
class StepRecords:
    """Columnar records of one captured step: one entry per (tap, call), in firing order."""

    keys: list[TapKey] = field(default_factory=list)
    shape: list[tuple[int, ...]] = field(default_factory=list)
    numel: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    has_grad: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    #: Row-major float32 elements per record (None where no gradient); None when values="none".
    values: list[np.ndarray | None] | None = None
    #: Element positions sampled per record when values="sample" (flat, row-major).
    positions: list[np.ndarray | None] | None = None
    #: The step's loss, when the caller handed it to `finish` (it rides in the same transfer).
    loss: float | None = None
    #: Why each record has no gradient ("module not called in this step", ...); None where it has one.
    reason: list[str | None] | None = None
    #: Norm of the tapped tensor itself (activation, input, local or parameter before the step); NaN where unknown.
    value_norm: np.ndarray | None = None
    #: Parameter taps: norm of the optimiser step's change, and its ratio to `value_norm`; NaN elsewhere.
    update_norm: np.ndarray | None = None
    update_ratio: np.ndarray | None = None
    #: `capture.per_example`: one norm per row of the gradient (None for parameters and 0-d gradients).
    per_example_norm: list[np.ndarray | None] | None = None
    #: `capture.histogram`: counts of |g| per `HIST_EDGES` bin (None where no gradient).
    hist_counts: list[np.ndarray | None] | None = None
    #: Gradient edits (`capturing.edits`): whether an edit changed this record's gradient (the statistics
    #: are of the gradient before it), and the norm after it (NaN where not edited).
    edited: np.ndarray | None = None
    edited_norm: np.ndarray | None = None
    #: Gradient accumulation: the number (0, 1, ...) of the step's backward each record comes from; None for a
    #: record of the whole step (a parameter's) and everywhere when the step had one backward.
    micro_step: list[int | None] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def row(self, i: int) -> dict[str, object]:
        """Record `i` as a plain dict (for tests and quick looks)."""
        out: dict[str, object] = {
            "tap": self.keys[i].tap,
            "module": self.keys[i].module,
            "name": self.keys[i].name,
            "call": self.keys[i].call,
            "shape": list(self.shape[i]),
            "numel": int(self.numel[i]),
            "has_grad": bool(self.has_grad[i]),
            "reason": None if self.reason is None else self.reason[i],
        }
        out.update({c: float(self.stats[c][i]) for c in STAT_COLUMNS})
        out.update({c: int(self.counts[c][i]) for c in COUNT_COLUMNS})
        out["values"] = None if self.values is None else self.values[i]
        for c in EXTRA_FLOAT_COLUMNS:
            col = getattr(self, c)
            out[c] = float("nan") if col is None else float(col[i])
        out[PER_EXAMPLE_COLUMN] = None if self.per_example_norm is None else self.per_example_norm[i]
        out[HIST_COLUMN] = None if self.hist_counts is None else self.hist_counts[i]
        out["edited"] = False if self.edited is None else bool(self.edited[i])
        out["edited_norm"] = float("nan") if self.edited_norm is None else float(self.edited_norm[i])
        out["micro_step"] = None if self.micro_step is None else self.micro_step[i]
        return out
