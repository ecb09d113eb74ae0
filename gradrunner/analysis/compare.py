"""Do two runs' records agree? The parity certificate: sharded vs single process, fsdp2 vs ddp, eager vs compile.

`compare_runs(run_a, run_b)` reads both run dirs with `load` (so a damaged or foreign file is refused as
`load` refuses it) and compares every record both have, matched on (step, tap, call, rank, micro_step), over
the gradient's statistics, its `shape` (exactly) and, where both runs recorded them, its elements (`ELEMENTS`:
the captured `values`, `per_example_norm`, `hist_counts`, element by element; a list of another length
differs), and each step's loss and grad_norm; an element column, or a step column, only one run recorded (null
on every row) is named in a note, not compared, and so is a record whose element list is null in one run only:
null is unknown (`per_example_norm` where the shares could not be exact), never an empty list.
`python -m gradrunner.compare RUN_A RUN_B` prints the first difference in step order and the worst taps (`main`).

Example::

    c = compare_runs("outputs/fsdp2", "outputs/ddp")
    c.agree                    # True when every value is within the tolerance and no record is missing
    c.rel_error()              # tap x step: the largest relative difference (a heat map's data)
    print(c.summary())

A value of run B agrees with run A's when both are finite and |a - b| <= atol + rtol * |a| (numpy's
`isclose`, run A the reference), or both are NaN, or both are the same infinity (`agreement.agrees`): an infinity
against a finite value or the other infinity differs, however loose the tolerance. Counts (`EXACT`: `numel`,
`nan_count`, `inf_count`, `has_grad`, `hist_counts`) and `shape` must be equal, whatever the tolerance. The defaults, `RTOL`
1e-5 and `ATOL` 1e-8, are for float32 records: a run repeated gives identical records, and two runs
whose float32 gradients differ only in the order of their additions (an all-reduce against a
reduce-scatter, another kernel) differ by a few float32 roundings (2**-24, about 6e-8 each) per element,
far below 1e-5; a real change (a learning rate, a bug) moves the next step's statistics by far more.
`atol` keeps statistics that are zero up to rounding (the mean of a gradient whose elements cancel) from
failing on a relative test; 1e-8 is below the smallest gradient statistic worth reading in float32
training. Loosen both for bf16 runs or compiled kernels (`--rtol 1e-2`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from gradrunner.analysis.agreement import agrees, relative
from gradrunner.analysis.reading import load
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.columns import (
    COUNT_COLUMNS,
    GRADS_FILE,
    HIST_COLUMN,
    PER_EXAMPLE_COLUMN,
    STAT_COLUMNS,
    STEPS_FILE,
)
from gradrunner.records.writer import recorded_config

#: Default tolerances (see the module docstring for why).
RTOL, ATOL = 1e-5, 1e-8
#: What identifies a record in both runs (a missing `micro_step` or `rank` is taken as -1 and 0).
KEY = ("step", "tap", "call", "rank", "micro_step")
#: Compared on every record: the gradient's statistics, and whether it had one, and its size.
STATS = (*STAT_COLUMNS, *COUNT_COLUMNS, "numel", "has_grad")
#: Compared where both runs have the column. `update_norm` and `update_ratio` are left out on purpose: they
#: are the optimiser's step, which a setting (the learning rate) changes at once; its effect on the model
#: shows in the next step's gradients and `value_norm`s, which are compared.
OPTIONAL = ("value_norm", "edited_norm")
#: Compared element by element where both runs recorded them (a list per record), with the option recording each;
#: an element is named `values[i]` (the one differing most in its record), a length mismatch `len(values)`.
ELEMENTS = {"values": "capture.values", PER_EXAMPLE_COLUMN: "capture.per_example", HIST_COLUMN: "capture.histogram"}
#: Compared on every record, exactly: a gradient of another shape is another gradient, whatever the tolerance.
SHAPE = "shape"
#: Counts, compared exactly too: one NaN, one element or one histogram count more is never "within rounding".
EXACT = frozenset({*COUNT_COLUMNS, "numel", "has_grad", HIST_COLUMN})
#: Compared per (step, rank) from the steps table, where both runs have them.
STEP_STATS = ("loss", "grad_norm")
#: The order differences are told in: by step, a step's loss first, then taps in run A's order.
ORDER = ["step", "tap_order", "call", "rank", "micro_step", "stat_order"]


@dataclass(frozen=True)
class Comparison:
    """Two runs' records side by side (`compare_runs`' result).

    Example::

        c = compare_runs(a, b)
        c.values[c.values.differs]          # every value beyond the tolerance
        c.first()                           # the first difference in step order, or None
    """

    run_a: str
    run_b: str
    rtol: float
    atol: float
    #: One row per value compared: the key columns (`tap` null for a step's `loss`), `stat`, `a`, `b`,
    #: `rel` (|a - b| / |a|; 0 when they are equal, inf when a is 0 or one of them NaN) and `differs`. A list
    #: column gives a row per record: its element differing most (`values[3]`), or its lengths (`len(values)`).
    values: pd.DataFrame
    #: One row per record (or step's loss) only one run has: the key columns, `stat`, and `only_in` ("a" or "b").
    missing: pd.DataFrame
    #: Records (step x tap x call x rank x micro_step) both runs have.
    records: int
    #: What `load` warned of while reading either run (a failed run's partial records, ...).
    notes: tuple[str, ...] = ()

    @property
    def agree(self) -> bool:
        return not bool(self.values["differs"].any()) and self.missing.empty

    def rel_error(self) -> pd.DataFrame:
        """The largest relative difference per tap (rows, in run A's order) and step (columns): a heat map's data.

        Example::

            c.rel_error().loc["fc1:output", 1]     # the worst statistic of fc1:output at step 1
        """
        taps = self.values.dropna(subset=["tap"])
        table = taps.pivot_table(index="tap", columns="step", values="rel", aggfunc="max", sort=False)
        return table.reindex(index=list(dict.fromkeys(taps.sort_values("tap_order", kind="stable")["tap"])))

    def first(self) -> pd.Series | None:
        """The first difference in step order (a step's loss before its taps, taps in run A's order), or None."""
        both = pd.concat([self.values[self.values["differs"]], self.missing], ignore_index=True)
        return None if both.empty else both.sort_values(ORDER, kind="stable").iloc[0]

    def worst_taps(self, n: int = 5) -> pd.DataFrame:
        """The `n` taps with the largest relative difference: where, which statistic, both values."""
        taps = self.values.dropna(subset=["tap"])
        worst = _by_rel(taps[taps["differs"]] if taps["differs"].any() else taps).drop_duplicates("tap")
        return worst.head(n)[["tap", "step", "stat", "a", "b", "rel"]].reset_index(drop=True)

    def summary(self) -> str:
        """What `python -m gradrunner.compare` prints: the verdict, the first difference, the worst taps."""
        tol = f"rtol={self.rtol:g}, atol={self.atol:g}"
        notes = [f"note: {n}" for n in self.notes]
        losses, what = _losses(self.values[self.values["tap"].isna()])
        if self.agree:
            worst = _by_rel(self.values)
            largest = "" if worst.empty or worst["rel"].iloc[0] == 0 else f"; largest relative difference {_where(worst.iloc[0])}"
            return "\n".join([*notes, f"agree: {self.records} records and {losses} {what} within {tol}{largest}"])
        bad = self.values[self.values["differs"]]
        n_bad = bad.dropna(subset=["tap"])[list(KEY)].drop_duplicates().shape[0]
        bad_steps = bad[bad["tap"].isna()]  # what differs of them: the loss, grad_norm or both
        differing = _losses(self.values[self.values["tap"].isna()], list(dict.fromkeys(bad_steps["stat"])) or ["loss"])
        lines = [*notes, f"differ beyond {tol}: {n_bad} of {self.records} records and "
                 f"{_losses(bad_steps)[0]} of {losses} {differing[1]}; {len(self.missing)} only in one run"]  # fmt: skip
        first = self.first()
        assert first is not None
        lines.append(f"first difference: {_where(first)}")
        taps = bad.dropna(subset=["tap"])
        if not isinstance(first["tap"], str) and not taps.empty:  # a step's loss: and the first tap to move
            lines.append(f"first tap difference: {_where(taps.sort_values(ORDER, kind='stable').iloc[0])}")
        lines += _describe_missing(self.missing)
        worst = self.worst_taps()
        if not taps.empty:
            lines.append("worst taps (largest relative difference):")
            lines.append(worst.to_string(index=False, float_format=lambda v: f"{v:.6g}"))
        return "\n".join(lines)


def _by_rel(values: pd.DataFrame) -> pd.DataFrame:
    """Largest relative difference first; ties in step order."""
    return values.sort_values(["rel", *ORDER], ascending=[False] + [True] * len(ORDER), kind="stable")


def _where(row: pd.Series) -> str:
    """`step 1, tap fc1:output, norm: 0.0123 vs 0.0456 (rel 2.7)`; a missing record says which run has it."""
    at = f"step {int(row['step'])}"
    if isinstance(row["tap"], str):
        at += f", tap {row['tap']}"
        extra = [f"call {int(row['call'])}"] if row["call"] else []
        extra += [f"rank {int(row['rank'])}"] if row["rank"] else []
        extra += [f"micro_step {int(row['micro_step'])}"] if row["micro_step"] >= 0 else []
        at += f" ({', '.join(extra)})" if extra else ""
    elif row["rank"]:
        at += f", rank {int(row['rank'])}"
    if isinstance(row.get("only_in"), str):
        return f"{at}: {'the record' if isinstance(row['tap'], str) else row['stat']} is only in run {row['only_in'].upper()}"
    a, b = (bool(row["a"]), bool(row["b"])) if row["stat"] == "has_grad" else (f"{row['a']:.6g}", f"{row['b']:.6g}")
    return f"{at}, {row['stat']}: {a} vs {b} (rel {row['rel']:.2g})"


def _describe_missing(missing: pd.DataFrame, most: int = 6) -> list[str]:
    """One line per tap (or the steps table) that only one run has records of, with the steps; in the order
    differences are told (`ORDER`: a step's loss, then taps in run A's order), so the first difference leads."""
    lines = []
    missing = missing.sort_values(ORDER, kind="stable")
    for (only, tap), rows in missing.groupby(["only_in", missing["tap"].fillna("")], sort=False):
        steps = sorted(rows["step"].unique())
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} ({len(steps)})"
        lines.append(f"only in run {str(only).upper()}: {f'tap {tap}' if tap else 'loss'}, {span}")
    return lines[:most] + ([f"... and {len(lines) - most} more"] if len(lines) > most else [])


def check_tolerance(name: str, value: object) -> float:
    """`value` as a tolerance: a finite number >= 0, else a GradrunnerError naming it.

    Example::

        check_tolerance("rtol", "1e-4")      # 0.0001
    """
    try:
        tol = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        tol = math.nan
    if not math.isfinite(tol) or tol < 0:
        example = {"rtol": RTOL, "atol": ATOL}.get(name, RTOL)
        raise GradrunnerError(f"{name}={value!r} is not a tolerance; allowed: a finite number >= 0, e.g. {name}={example:g}")
    return tol


def compare_runs(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str], rtol: float = RTOL,
                 atol: float = ATOL) -> Comparison:  # fmt: skip
    """Compare the records of two run dirs (run A the reference); a GradrunnerError for bad input.

    Example::

        c = compare_runs("runs/fsdp2", "runs/ddp", rtol=1e-5)
        c.agree, c.first()

    Bad input, each one paragraph: a path that is not a run dir (a sweep dir: pass one of its jobs),
    records `load` refuses, two records with one key in a run, runs without a tap in common, a
    tolerance that is not a finite number >= 0.
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol)
    notes: list[str] = []
    grads_a, steps_a = _read(run_a, notes)
    grads_b, steps_b = _read(run_b, notes)
    common = set(grads_a["tap"]) & set(grads_b["tap"])
    if grads_a.empty and grads_b.empty:
        raise GradrunnerError(
            f"neither run recorded a gradient ({run_a} and {run_b} hold no tap's rows: taps=[], or no step captured); "
            "compare runs that record taps"
        )
    if not common:
        raise GradrunnerError(
            f"the runs have no tap in common ({run_a}: {_few(grads_a['tap'])}; {run_b}: {_few(grads_b['tap'])}); "
            "compare runs of the same taps"
        )
    tap_order = {t: i for i, t in enumerate(dict.fromkeys([*grads_a["tap"], *grads_b["tap"]]))}
    stats = [*STATS, *(c for c in OPTIONAL if c in grads_a.columns and c in grads_b.columns)]
    step_stats = [c for c in STEP_STATS if _recorded(steps_a, c) and _recorded(steps_b, c)]
    for column in STEP_STATS:  # a record() session given no grad_norm (or rec.step() no loss): null on every row
        only = [run for run, s in (("A", steps_a), ("B", steps_b)) if _recorded(s, column)]
        if len(only) == 1:
            notes.append(f"{column} recorded in run {only[0]} only: not compared")
    lists = [c for c in (SHAPE, *ELEMENTS) if _recorded(grads_a, c) and _recorded(grads_b, c)]
    for column, option in ELEMENTS.items():  # never an agreement claimed on what one run did not record
        only = [run for run, g in (("A", grads_a), ("B", grads_b)) if _recorded(g, column)]
        if len(only) == 1:
            notes.append(f"{column} recorded in run {only[0]} only ({option}): not compared")
    modes = _values_mode(Path(run_a)), _values_mode(Path(run_b))
    if "values" in lists and None not in modes and modes[0] != modes[1]:  # other elements: nothing to compare
        lists.remove("values")
        notes.append(f"values captured differently (capture.values={modes[0]} in run A, {modes[1]} in run B): "
                     "not compared")  # fmt: skip
    values_g, missing_g = _pair(grads_a, grads_b, list(KEY), stats, rtol, atol, lists, notes)
    values_s, missing_s = _pair(steps_a, steps_b, ["step", "rank"], step_stats, rtol, atol)
    values = pd.concat([values_s, values_g], ignore_index=True)
    missing = pd.concat([missing_s, missing_g], ignore_index=True)
    stat_order = {s: i for i, s in enumerate(["loss", *step_stats, *stats, *lists])}
    for frame in (values, missing):
        if "tap" not in frame.columns:
            frame["tap"] = None
        for col, fill in (("call", 0), ("micro_step", -1)):
            frame[col] = frame[col].fillna(fill) if col in frame.columns else fill
        frame["tap_order"] = frame["tap"].map(tap_order).fillna(-1)  # a step's loss comes before its taps
        frame["stat_order"] = frame["stat"].map(lambda s: stat_order.get(_column_of(s), len(stat_order)))
    records = int(values_g[list(KEY)].drop_duplicates().shape[0]) if not values_g.empty else 0
    return Comparison(os.fspath(run_a), os.fspath(run_b), rtol, atol, values, missing, records, tuple(notes))


def _few(taps: pd.Series) -> str:
    names = list(dict.fromkeys(taps))
    if not names:
        return "no tap recorded (taps=[])"
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _losses(rows: pd.DataFrame, stats: Sequence[str] = ("loss",)) -> tuple[int, str]:
    """How many losses `rows` (the steps table's compared values) hold, and what they are: a loss per step, or
    under torchrun a loss per step and rank ("6 (step, rank) losses: 3 steps on 2 ranks"); `stats` names the step
    values meant where they are not the loss ("steps' grad_norm": those that differ)."""
    pairs = rows[["step", "rank"]].drop_duplicates() if "rank" in rows.columns else rows[["step"]].drop_duplicates()
    ranks = int(pairs["rank"].nunique()) if "rank" in pairs.columns else 1
    name = " and ".join(stats)
    if ranks < 2:
        return len(pairs), f"steps' {name}"
    plural = "losses" if list(stats) == ["loss"] else f"{name} values"
    return len(pairs), f"(step, rank) {plural} ({pairs['step'].nunique()} steps on {ranks} ranks)"


def _read(run: str | os.PathLike[str], notes: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run dir's records and steps, keyed: refused as `load` refuses them, or when it is no single run.

    What `load` warns of (a failed run's records are partial) is added to `notes`.
    """
    path = Path(run)
    why = ("a file" if path.exists() else "it does not exist") if not path.is_dir() else None
    if why is None and not (path / GRADS_FILE).is_file():
        runs = sorted((f.parent.name for f in path.glob(f"*/{GRADS_FILE}")), key=lambda n: (len(n), n))
        why = f"no {GRADS_FILE} in it" + (
            f"; its subdirs {_few(pd.Series(runs))} hold runs: pass one of them" if runs else ""
        )
    if why is not None:
        raise GradrunnerError(f"{run} is not a run dir ({why}); pass the dir a run wrote its {GRADS_FILE} and "
                              f"{STEPS_FILE} into")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads, steps = load(path, values=True), load(path, table="steps")
    notes.extend(dict.fromkeys(one_paragraph(str(w.message)) for w in caught))
    if "job" in grads.columns:
        raise GradrunnerError(f"{run} holds several jobs ({_few(grads['job'])}): a sweep; compare one job dir "
                              "with another")  # fmt: skip
    for frame in (grads, steps):
        if "rank" not in frame.columns:
            frame["rank"] = 0
    grads["micro_step"] = grads["micro_step"].fillna(-1) if "micro_step" in grads.columns else -1
    twice = grads.duplicated(list(KEY))
    if twice.any():
        row = grads[twice].iloc[0]
        raise GradrunnerError(f"{run} holds {int(twice.sum())} records twice (e.g. step {row['step']}, tap {row['tap']}): "
                              "not the records of one run")  # fmt: skip
    return grads, steps


def _pair(a: pd.DataFrame, b: pd.DataFrame, key: list[str], stats: list[str], rtol: float,
          atol: float, lists: Sequence[str] = (), notes: list[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """Long frames of the values both have (with `rel`, `differs`) and of the keys only one has; `lists` are list
    columns, compared element by element (`_elementwise`) where both records hold them (`_known`; `notes` names
    the others)."""
    cols = [*key, *stats, *lists]
    both = a[cols].merge(b[cols], on=key, how="outer", suffixes=("@a", "@b"), indicator=True, sort=False)
    only = both[both["_merge"] != "both"]
    missing = only[key].assign(stat="record" if "tap" in key else "loss",
                               only_in=np.where(only["_merge"] == "left_only", "a", "b"))  # fmt: skip
    matched = both[both["_merge"] == "both"]
    parts = []
    for stat in stats:
        r, t = (0.0, 0.0) if stat in EXACT else (rtol, atol)
        va = pd.to_numeric(matched[f"{stat}@a"], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        vb = pd.to_numeric(matched[f"{stat}@b"], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        parts.append(matched[key].assign(stat=stat, a=va, b=vb, rel=relative(va, vb), differs=~agrees(va, vb, r, t)))
    for column in lists:
        r, t = (0.0, 0.0) if column in EXACT else (rtol, atol)
        elements = _elementwise(_known(matched, key, column, notes), key, column, r, t)
        parts += [] if elements.empty else [elements]
    values = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*key, "stat", "a", "b", "rel", "differs"])
    return values, missing.reset_index(drop=True)


def _known(matched: pd.DataFrame, key: list[str], column: str, notes: list[str] | None) -> pd.DataFrame:
    """The matched records whose element column `column` is not null in one run only. A null is unknown, not an
    empty list (`per_example_norm` where the shares could not be exact): such a record's elements are not compared,
    and a note in `notes` says how many records each run left unknown, and the first. `shape` is kept whole."""
    if column not in ELEMENTS:
        return matched
    null_a, null_b = matched[f"{column}@a"].isna(), matched[f"{column}@b"].isna()
    for run, only in (("A", null_a & ~null_b), ("B", null_b & ~null_a)):
        if only.any() and notes is not None:
            first = matched[only].sort_values("step", kind="stable").iloc[0]  # within a step: run A's order
            notes.append(f"{column} is null (unknown) in run {run} only on {int(only.sum())} record(s), the first "
                         f"at step {int(first['step'])}, tap {first['tap']}: those are not compared")  # fmt: skip
    return matched[~(null_a ^ null_b)]


def _recorded(grads: pd.DataFrame, column: str) -> bool:
    """Whether a run's records hold `column` (a list column of an option that was on: not null on every row)."""
    return column in grads.columns and bool(grads[column].notna().any())


def _values_mode(run: Path) -> str | None:
    """Which elements a run's `values` hold (`full`; `sample` with its size and the seed placing it), from the config
    its `done.json` records, else the one its `grads.parquet` was written with (a run that stopped or failed has no
    `done.json`); None without either (records written by hand, or by an older gradrunner)."""
    marker, _ = rundir.read_marker(run)
    config = marker.get("config") if marker is not None else None
    if not isinstance(config, dict):
        config = recorded_config(run / GRADS_FILE)
    capture = config.get("capture") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(capture, dict) or "values" not in capture:
        return None
    if capture["values"] == "sample":
        return f"sample ({capture.get('sample_size')} positions, seed {config.get('seed')})"
    return str(capture["values"])


def _column_of(stat: str) -> str:
    """The column a compared value comes from: `values` for `values[3]` and `len(values)`, else `stat` itself."""
    return stat[4:-1] if stat.startswith("len(") else stat.split("[", 1)[0]


def _length(cell: object) -> int:
    """The number of elements of a list cell (null: none recorded)."""
    return len(cell) if isinstance(cell, (np.ndarray, list)) else 0


def _elementwise(matched: pd.DataFrame, key: list[str], column: str, rtol: float, atol: float) -> pd.DataFrame:
    """A row per matched record holding elements of list `column` in either run: its lengths (`len(values)`) where
    they differ, else the element that differs most (`values[i]`: a differing one first, then the largest `rel`).

    Elements agree by `agrees` (`SHAPE`'s exactly); a record differs when one of its elements does.
    """
    cells_a, cells_b = matched[f"{column}@a"].to_numpy(), matched[f"{column}@b"].to_numpy()
    len_a = np.fromiter((_length(c) for c in cells_a), np.int64, len(cells_a))
    len_b = np.fromiter((_length(c) for c in cells_b), np.int64, len(cells_b))
    parts = []
    odd = np.flatnonzero(len_a != len_b)
    if odd.size:
        la, lb = len_a[odd].astype(np.float64), len_b[odd].astype(np.float64)
        rel = relative(la, lb)
        parts.append(matched[key].iloc[odd].assign(stat=f"len({column})", a=la, b=lb, rel=rel, differs=True))
    both = np.flatnonzero((len_a == len_b) & (len_a > 0))
    if both.size:
        n = len_a[both]
        fa = np.concatenate([np.asarray(cells_a[i], dtype=np.float64).ravel() for i in both])
        fb = np.concatenate([np.asarray(cells_b[i], dtype=np.float64).ravel() for i in both])
        ok = fa == fb if column == SHAPE else agrees(fa, fb, rtol, atol)
        rel = relative(fa, fb)
        record = np.repeat(np.arange(both.size), n)
        order = np.lexsort((-rel, ok, record))  # per record: differing elements first, the largest rel first
        pick = order[np.searchsorted(record[order], np.arange(both.size))]
        start = np.concatenate([[0], np.cumsum(n)[:-1]])
        stat = [f"{column}[{i}]" for i in pick - start]
        differs = np.logical_or.reduceat(~ok, start)
        parts.append(matched[key].iloc[both].assign(stat=stat, a=fa[pick], b=fb[pick], rel=rel[pick], differs=differs))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
