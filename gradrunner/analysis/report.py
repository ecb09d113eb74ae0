"""`python -m gradrunner.report <run or sweep dir>`: the figures and one self-contained HTML page.

Contents:
    write_report(path) -> Path   -- PNGs and `report.html` next to the records; returns the HTML path
    check_available() -> None    -- raise GradrunnerError (with the install hint) if matplotlib is missing
    main(argv) -> int            -- the command line

The page embeds its images (base64 PNG) and its tables, loads nothing and runs no script, so it
can be mailed or archived on its own. A sweep of more than `AGGREGATE_ABOVE` runs is aggregated over its
runs (`analysis.aggregate`, `plots_sweep`): a median line and band per swept value, never a panel per
run; no PNG is larger than a page. A user mistake (a path without records) or a missing
matplotlib prints one paragraph to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from gradrunner import __version__
from gradrunner.analysis.aggregate import (
    AGGREGATE_ABOVE,
    SweepLayout,
    over_runs,
    per_run,
    pick_taps,
    runs_by_value,
    sweep_layout,
    taps_by_value,
)
from gradrunner.analysis.optional import UPDATE_RATIO_GUIDE, histograms_over_steps, per_example_spread, update_ratios
from gradrunner.analysis.reading import VALUES as VALUES_COLUMN
from gradrunner.analysis.reading import load
from gradrunner.analysis.summaries import (
    EXPLODE_ABOVE,
    VANISH_BELOW,
    compare_strategies,
    flow_steps,
    forward_order,
    pick_steps,
    run_columns,
    strategy_costs,
    tap_summary,
    vanishing_boundary,
)
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.records.atomic import write_atomically
from gradrunner.records.columns import CONSTANT_COLUMNS, GRADS_FILE, HIST_COLUMN, PER_EXAMPLE_COLUMN

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

#: The histogram panels drawn at most (their taps' `hist_counts` are the only ones read for every step).
_HIST_TAPS = 8
#: The page's file name, written next to the records (the run dir, or the sweep dir).
REPORT_NAME = "report.html"
INSTALL_HINT = "pip install 'gradrunner[report]'"
#: The PNGs' resolution: a page (`plots.PAGE_INCHES`) is 1600 x 1100 px.
DPI = 100

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { padding: 0.2em 0.6em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f4f4f4; } img { max-width: 100%; } code { background: #f4f4f4; padding: 0 0.2em; }
.findings li { margin: 0.2em 0; } .ok { color: #2a7; } .wide { overflow-x: auto; max-width: 100%; }
.headline { font-size: 1.1em; } .answer { font-size: 1.2em; font-weight: 600; } .bad { color: #fff; background: #c33; } h3 { font-size: 1em; margin-bottom: 0.2em; }
td:first-child, td code { word-break: break-all; }
summary { cursor: pointer; color: #555; }
"""


def check_available() -> None:
    """Raise GradrunnerError unless matplotlib can be imported (call it before a long run).

    Example::

        if cfg.report:
            check_available()      # fail before step 0, not after the last one
    """
    _import_plots()


def _import_plots() -> ModuleType:
    try:
        from gradrunner.analysis import plots
    except ImportError as e:
        if not (e.name or "").startswith("matplotlib"):
            raise
        message = f"the report draws its figures with matplotlib, which is not installed: {INSTALL_HINT}"
        raise GradrunnerError(message) from None
    return plots


def write_report(path: str | Path) -> Path:
    """Write the report's PNGs and `report.html` next to the records of a run or sweep; return the HTML path.

    Example::

        page = write_report("multirun/2024-05-01/12-00-00")   # .../report.html
        write_report("outputs/2024-05-01/12-00-00")           # one run works too
        write_report(job_dir / "grads.parquet")               # a file: its directory

    The page holds: the runs, findings (vanishing, exploding, first NaN/Inf), the per-tap summary,
    gradient flow, the measure over the steps, and, when there are several strategies, their
    agreement and cost; value distributions when values were captured. The PNGs are
    `report-<figure>.png`, none larger than a page (`plots.PAGE_INCHES` at `DPI`); an existing report is
    overwritten (records never are). A sweep of more than `AGGREGATE_ABOVE` runs is aggregated over its runs
    (`report_sweep`): a median line and 10-90% band per swept value, a table row per swept value, never a
    panel per run; the page says what was aggregated.
    """
    plots = _import_plots()
    root = Path(path)
    out_dir = root.parent if root.is_file() else root
    # every column but the per-element ones (`values`, `hist_counts`, `per_example_norm`): those are read
    # below for the rows drawn only (columns and row filters), never for every row
    grads = load(out_dir, columns=_light_columns(out_dir))
    if grads.empty:
        raise GradrunnerError(f"the records in {out_dir} hold no rows (no step was captured); nothing to report")
    steps = _load_steps(out_dir)
    summary = tap_summary(grads)
    if grads["run_id"].nunique() > AGGREGATE_ABOVE:  # a panel, a table row or a sentence per run would not be read
        sections, answer = _sweep_sections(out_dir, grads, steps, summary)
    else:
        sections, answer = _run_sections(plots, out_dir, grads, steps, summary)
    page = out_dir / REPORT_NAME
    write_atomically(page, _page(out_dir, grads, sections, answer))
    return page


def _run_sections(
    plots: ModuleType, out_dir: Path, grads: pd.DataFrame, steps: pd.DataFrame | None, summary: pd.DataFrame
) -> tuple[list[str], str]:
    """The sections and the first paragraph of a run, or of a sweep of at most `AGGREGATE_ABOVE` runs (a panel each)."""
    cmp = _compare(grads) if grads["strategy"].nunique() > 1 else None
    shown, once = grads, ""
    if isinstance(cmp, pd.DataFrame) and _identical(cmp):  # the same figures N times say nothing more
        shown = grads[grads["run_id"] == grads["run_id"].iloc[0]]
        once = (f" Identical for the strategies {', '.join(dict.fromkeys(grads['strategy'].astype(str)))}: "
                f"shown once ({shown['strategy'].iloc[0]}).")  # fmt: skip
    flow_note = "Steps shown, per run: the first, the largest change, the last finite one and the first with NaN/Inf."
    sections = [_section("Findings", _findings(summary))]
    if steps is not None and len(steps):
        sections.append(_figure(out_dir, "loss", "Loss over the steps", plots.plot_loss(steps)))
        sections += _training_sections(out_dir, steps)
    sections += [
        _runs_section(grads, steps),
        _section("Per-tap summary", _summary_table(summary)),
        _figure(out_dir, "grad_flow", "Gradient flow", plots.plot_grad_flow(shown, steps=_flow_steps(shown)),
                flow_note + once),
        _figure(out_dir, "norms", "Gradient norm over the steps", plots.plot_norms(shown), once.strip()),
    ]  # fmt: skip
    if cmp is not None:
        sections += _strategy_sections(plots, cmp, steps, out_dir)
    values = _drawn_values(out_dir, grads)
    if values is not None:
        fig = plots.plot_value_distributions(values)
        sections.append(_figure(out_dir, "values", "Gradient values", fig, "First and last captured step."))
    sections += _extra_sections(grads, out_dir)
    sections += _edit_sections(grads, out_dir)
    return sections, _answer(grads, steps, summary, cmp)


#: Runs named in the list of runs with NaN/Inf at most (a large sweep); the rest are counted.
_NAMED_RUNS = 10
#: The steps table's columns kept for a large sweep's strategy costs: per strategy over every run, not per value.
_COST_KEPT = frozenset(CONSTANT_COLUMNS) | {"step", "captured", "step_time_s", "capture_time_s", "peak_memory_bytes"}


def _sweep_sections(
    out_dir: Path, grads: pd.DataFrame, steps: pd.DataFrame | None, summary: pd.DataFrame
) -> tuple[list[str], str]:
    """The sections and first paragraph of a sweep of more than `AGGREGATE_ABOVE` runs: per value of the swept
    override(s) `sweep_layout` keeps apart, the median over the runs and a 10-90% band (`over_runs`); a table row
    per swept value (and tap), not per run; the page says what was aggregated. One run stands for the sweep in the
    figures of captured values, histograms and per-example norms (named)."""
    from gradrunner.analysis import plots_sweep

    layout = sweep_layout(grads)
    said = layout.describe()
    with_grad = grads[grads["has_grad"].fillna(False).astype(bool)]
    runs = per_run(grads, steps, summary, layout)
    sections = [_section("Findings", _findings(summary))]
    if steps is not None and len(steps):
        tables = {c: over_runs(steps, c, layout, ["step"]) for c in ("loss", "grad_norm")
                  if c in steps.columns and steps[c].notna().any()}  # fmt: skip
        sections.append(_figure(out_dir, "loss", "Loss over the steps", plots_sweep.plot_loss_over_steps(tables, layout),
                                said))  # fmt: skip
    bad = runs[runs["nan/inf"] | ~np.isfinite(runs["last loss"].to_numpy(dtype=np.float64))]
    named = ""
    if len(bad):
        names = ", ".join(str(n) for n in (bad["job"] if "job" in bad.columns else bad.index)[:_NAMED_RUNS])
        more = f" and {len(bad) - _NAMED_RUNS:,} more" if len(bad) > _NAMED_RUNS else ""
        named = f" Runs with NaN/Inf ({len(bad):,}): {names}{more}."
    chosen = flow_steps(grads)
    flow = over_runs(with_grad[with_grad["step"].isin(chosen)], "norm", layout, ["step", "tap", "call"])
    order, taps = forward_order(with_grad), pick_taps(with_grad, plots_sweep.MAX_TAPS)
    norms = over_runs(with_grad[with_grad["tap"].isin(taps["tap"])], "norm", layout, ["tap", "call", "step"])
    which = (f" {len(taps)} of {len(order)} taps, spread over the forward order (first and last included); the "
             "per-tap summary has every tap." if len(taps) < len(order) else "")  # fmt: skip
    note = "Gradient norm over the captured steps: per swept value and tap, the median over the runs of each run's "
    sections += [
        _section("Runs", f"<p>{html.escape(said + ' A row per swept value; load() gives every run.' + named)}</p>\n"
                         + _table(runs_by_value(runs, layout))),
        _section("Per-tap summary", f"<p>{html.escape(note)}first, last and largest norm, and how many runs had the "
                                    f"tap in trouble.</p>\n{_table(taps_by_value(summary, layout, grads))}"),
        _figure(out_dir, "grad_flow", "Gradient flow", plots_sweep.plot_flow_over_runs(flow, layout, forward_order(grads)),
                f"{said} Steps shown: the first, the largest change, the last finite one and the first with NaN/Inf."),
        _figure(out_dir, "norms", "Gradient norm over the steps", plots_sweep.plot_over_steps(norms, layout, taps, "norm"),
                said + which),
    ]  # fmt: skip
    if grads["strategy"].nunique() > 1:
        cost_steps = None if steps is None else steps[[c for c in steps.columns if c in _COST_KEPT]]
        sections += _strategy_sections(_import_plots(), _compare(grads), cost_steps, out_dir)
    sections += _sweep_update_ratios(out_dir, grads, layout)
    first = grads[grads["run_id"] == grads["run_id"].iloc[0]]
    name = f"job {first['job'].iloc[0]}" if "job" in first.columns else f"run {first['run_id'].iloc[0]}"
    values = _drawn_values(out_dir, first)
    if values is not None:
        fig = _import_plots().plot_value_distributions(values)
        sections.append(_figure(out_dir, "values", "Gradient values", fig, f"First and last captured step of {name}."))
    for section in _extra_sections(first, out_dir, only=(HIST_COLUMN, PER_EXAMPLE_COLUMN)):
        one = f"One run, {name}, of {layout.runs:,}. "
        sections.append(section.replace("</h2>\n<p>", f"</h2>\n<p>{html.escape(one)}", 1))
    sections += _edit_sections(grads, out_dir, keys=layout.keys)
    return sections, "<br>".join(html.escape(t) for t in [said, *_sweep_answer(runs, layout)])


def _sweep_update_ratios(out_dir: Path, grads: pd.DataFrame, layout: SweepLayout) -> list[str]:
    """A large sweep's update-to-weight ratios: per swept value and parameter tap, the median over runs and its band."""
    from gradrunner.analysis import plots_sweep

    if "update_ratio" not in grads.columns or not grads["update_ratio"].notna().any():
        return []
    ratios = update_ratios(grads[grads["update_ratio"].notna()])
    ratios = ratios.merge(grads.drop_duplicates("run_id")[["run_id", *layout.keys]], on="run_id").assign(call=0)
    taps = pick_taps(ratios, plots_sweep.MAX_TAPS)
    table = over_runs(ratios, "update_ratio", layout, ["tap", "call", "step"])
    fig = plots_sweep.plot_over_steps(table[table["tap"].isin(taps["tap"])], layout, taps, "update norm / weight norm",
                                      guide=UPDATE_RATIO_GUIDE)  # fmt: skip
    last = table[table["step"] == table.groupby([*layout.keys, "tap"], dropna=False)["step"].transform("max")]
    note = (
        f"{layout.describe()} Norm of each optimiser step's change over the parameter's norm; about "
        f"{UPDATE_RATIO_GUIDE:g} per step is the usual guide (dashed). The table: the last captured step."
    )
    return [_figure(out_dir, "update_ratios", "Update-to-weight ratio", fig, note) + _table(last.drop(columns="call"))]


def _sweep_answer(runs: pd.DataFrame, layout: SweepLayout) -> list[str]:
    """A sentence per swept value: the median loss from the first to the last step, and how many runs were in trouble."""
    lines = []
    groups = runs.groupby(layout.keys, sort=True, dropna=False) if layout.keys else [((), runs)]
    for key, rows in groups:
        values = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{c}={v}" for c, v in zip(layout.keys, values, strict=True))
        parts = [f"median loss {rows['first loss'].median():.4g} → {rows['last loss'].median():.4g} "
                 f"over {len(rows):,} runs"]  # fmt: skip
        bad_loss = int((~np.isfinite(rows["last loss"].to_numpy(dtype=np.float64))).sum())
        if bad_loss:
            parts.append(f"last loss NaN/Inf in {bad_loss:,} run{'s' * (bad_loss > 1)} (left out of the median)")
        for column, what in (("nan/inf", "NaN/Inf"), ("vanishing", "vanishing taps"), ("exploding", "exploding taps")):
            n = int(rows[column].sum())
            if n:
                parts.append(f"{what} in {n:,} run{'s' * (n > 1)}")
        if len(parts) == 1:
            parts.append("no NaN/Inf, no vanishing or exploding gradient")
        text = "; ".join(parts)
        lines.append(f"{label}: {text}." if label else text[0].upper() + text[1:] + ".")
    return lines


def _compare(grads: pd.DataFrame) -> pd.DataFrame | str:
    """`compare_strategies`, or why the runs could not be compared."""
    try:
        return compare_strategies(grads)
    except GradrunnerError as e:  # e.g. several runs per strategy that no swept value tells apart
        return str(e)


def _identical(cmp: pd.DataFrame) -> bool:
    return not cmp[["abs_diff", "rel_diff"]].to_numpy().any()


def _flow_steps(grads: pd.DataFrame) -> dict[str, list[int]] | list[int]:
    """`flow_steps` of each run (a 5-step job and a 50-step job each get their own)."""
    if grads["run_id"].nunique() < 2:
        return flow_steps(grads)
    return {str(r): flow_steps(rows) for r, rows in grads.groupby("run_id", sort=False)}


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


def _light_columns(out_dir: Path) -> list[str] | None:
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


def _run_file(out_dir: Path, run: pd.DataFrame) -> Path:
    job = str(run["job"].iloc[0]) if "job" in run.columns else ""
    return (out_dir / job if job else out_dir) / GRADS_FILE


def _runs_having(out_dir: Path, grads: pd.DataFrame, column: str) -> list[tuple[pd.DataFrame, Path]]:
    """The rows of each run whose grads file has `column` (a sweep may turn an option on in some jobs), and that file."""
    import pyarrow.parquet as pq

    found = []
    for _, run in grads.groupby("run_id", sort=False):
        file = _run_file(out_dir, run)
        if file.is_file() and column in pq.read_schema(file).names:
            found.append((run, file))
    return found


def _with_column(run: pd.DataFrame, file: Path, column: str, filters: list[tuple[str, str, object]]) -> pd.DataFrame:
    """`run`'s rows that match `filters`, with `column` read from `file` for those rows only (pyarrow filters)."""
    import pyarrow.parquet as pq

    keys = [k for k in ("run_id", "step", "tap", "call") if k in pq.read_schema(file).names]
    table = pq.read_table(file, columns=[*keys, column], filters=filters or None)
    rows = run
    for name, op, value in filters:
        rows = rows[rows[name].isin(value)] if op == "in" else rows[rows[name] == value]  # type: ignore[arg-type]
    return rows.drop(columns=[column], errors="ignore").merge(table.to_pandas(), on=keys, how="inner")


def _drawn_values(out_dir: Path, grads: pd.DataFrame) -> pd.DataFrame | None:
    """The `values` of the first run at its first and last captured step only (row groups filtered), or None."""
    import pyarrow.parquet as pq

    first = grads[grads["run_id"] == grads["run_id"].iloc[0]]
    job = str(first["job"].iloc[0]) if "job" in first.columns else ""
    file = (out_dir / job if job else out_dir) / GRADS_FILE
    if not file.is_file() or "values" not in pq.read_schema(file).names:
        return None
    chosen = pick_steps(first["step"], n=2)
    keys = ["step", "tap", "call"]
    table = pq.read_table(file, columns=[*keys, "values"], filters=[("step", "in", chosen)])
    if table.num_rows == 0 or table.column("values").null_count == table.num_rows:
        return None
    rows = first[first["step"].isin(chosen)].drop(columns=["values"], errors="ignore")
    return rows.merge(table.to_pandas(), on=keys, how="left")


def try_report(path: Path) -> Path | None:
    """Write the report of the run or sweep at `path`; on failure log how to write it later, never raise.

    Example::

        try_report(run_dir)      # run_dir/report.html, or None and a warning naming the command
    """
    try:
        page = write_report(path)
    except Exception as e:  # the records are safe; the report can be written again at any time
        log.warning("could not write the report (%s: %s); write it with: python -m gradrunner.report %s",
                    type(e).__name__, one_paragraph(e), path)  # fmt: skip
        return None
    log.info("report: %s", page)
    return page


def _load_steps(out_dir: Path) -> pd.DataFrame | None:
    try:
        return load(out_dir, table="steps")
    except GradrunnerError:  # records written without a steps table (by hand, or by an older gradrunner)
        return None


def _anchor(title: str) -> str:
    return "-".join(title.lower().replace("?", "").split())


def _section(title: str, body: str) -> str:
    return f'<h2 id="{_anchor(title)}">{html.escape(title)}</h2>\n{body}'


def _table(df: pd.DataFrame, fold_above: int = 40) -> str:
    """The table as HTML, scrolling sideways if wide, folded (<details>) when it has many rows."""
    df = df.apply(lambda c: c.astype("float64") if str(c.dtype) == "Int64" else c)  # <NA> shown as ""
    table = df.to_html(index=False, border=0, na_rep="", float_format=lambda x: f"{x:.4g}")
    table = f'<div class="wide">{table}</div>'
    if len(df) > fold_above:
        return f"<details><summary>{len(df)} rows</summary>{table}</details>"
    return table


def _figure(out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str:
    """Save `fig`, at most a page (`plots.PAGE_INCHES` at `DPI`), as `report-<name>.png`; a section embedding the same PNG bytes."""
    buffer = io.BytesIO()
    _import_plots().fit_page(fig).savefig(buffer, format="png", dpi=DPI)
    write_atomically(out_dir / f"report-{name}.png", buffer.getvalue())
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    body = f'<img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'
    return _section(title, f"<p>{html.escape(note)}</p>\n{body}" if note else body)


def _runs_section(grads: pd.DataFrame, steps: pd.DataFrame | None) -> str:
    """One row per run: what distinguishes it, what ran, how many steps, the last loss."""
    columns = [c for c in ["job", *run_columns(grads), "run_id", "experiment", "strategy", "device", "dtype"]
               if c in grads.columns]  # fmt: skip
    g = grads.groupby("run_id", sort=False)
    runs = g[list(dict.fromkeys(columns))].first().reset_index(drop=True)
    runs["captured steps"] = g["step"].nunique().to_numpy()
    runs["taps"] = g["tap"].nunique().to_numpy()
    runs["last loss"] = g["loss"].agg(lambda s: s.iloc[-1]).to_numpy()  # NaN stays NaN (.last() skips it)
    if steps is not None:
        by_run = steps.groupby("run_id", sort=False)
        runs["steps run"] = by_run["step"].size().reindex(g.size().index).to_numpy()
        runs["last loss"] = by_run["loss"].agg(lambda s: s.iloc[-1]).reindex(g.size().index).to_numpy()
    runs["last loss"] = [f"{v:.6g}" if v == v else "NaN" for v in runs["last loss"]]  # NaN shown, not blank
    return _section("Runs", _table(runs))


#: The per-tap summary's columns as the page shows them (the rest stay in `tap_summary`).
_SHOWN = {"tap": "tap", "call": "call", "steps": "steps", "first": "first", "last": "last", "max": "max",
          "first_nonfinite_step": "NaN/Inf from", "first_vanishing_step": "vanishing from",
          "first_exploding_step": "exploding from"}  # fmt: skip
_KINDS = (("first_nonfinite_step", "NaN or Inf", "from step"), ("first_vanishing_step", "vanishing",
          f"norm below {VANISH_BELOW:g} at the last step; since step"),
          ("first_exploding_step", "exploding", f"norm above {EXPLODE_ABOVE:g} from step"))  # fmt: skip


def _run_cols(summary: pd.DataFrame) -> list[str]:
    return list(summary.columns[: summary.columns.get_loc("tap")])


def _findings(summary: pd.DataFrame) -> str:
    """A headline (how many taps in each kind of trouble), then the taps grouped by kind and step."""
    run_cols = _run_cols(summary)
    runs = summary[run_cols].drop_duplicates() if run_cols else pd.DataFrame(index=[0])
    summary = summary.assign(vanishing_at=summary["first_vanishing_step"].where(summary["vanishing"]))
    headline, details = [], []
    for column, kind, how in _KINDS:
        column = "vanishing_at" if column == "first_vanishing_step" else column
        rows = summary[summary[column].notna()]
        if rows.empty:
            continue
        taps = rows.drop_duplicates(["tap", "call"])
        headline.append(f"<b>{len(taps)} tap{'s' * (len(taps) > 1)} {kind}</b> (from step {int(rows[column].min())})")
        items = []
        for (step, tap, call), group in rows.groupby([column, "tap", "call"], sort=True):
            label = f"<code>{html.escape(str(tap))}</code>" + (f" call {call}" if call else "")
            if run_cols and len(group) < len(runs) and len(runs) > AGGREGATE_ABOVE:  # too many to name: count them
                label += f" (in {len(group):,} of {len(runs):,} runs)"
            elif run_cols and len(group) < len(runs):  # only some runs: say which
                label += " (" + html.escape("; ".join(", ".join(f"{c}={r[c]}" for c in run_cols)
                                                      for r in group.to_dict("records"))) + ")"  # fmt: skip
            items.append((int(step), label))  # type: ignore[call-overload]
        by_step = pd.DataFrame(items, columns=["step", "label"]).groupby("step", sort=True)["label"]
        lines = [f"<li>{how} {step}: {', '.join(labels)}</li>" for step, labels in by_step]
        details.append(f'<h3>{kind[0].upper() + kind[1:]}</h3>\n<ul class="findings">\n' + "\n".join(lines) + "\n</ul>")
    if not headline:
        return (f'<p class="ok">No NaN or Inf; no vanishing (norm below {VANISH_BELOW:g} at the last step) '
                f"or exploding (norm above {EXPLODE_ABOVE:g}) gradient.</p>")  # fmt: skip
    return f'<p class="headline">{" · ".join(headline)}.</p>\n' + "\n".join(details)


def _summary_table(summary: pd.DataFrame) -> str:
    """One table: a row per tap; strategies side by side (differences marked) unless they all agree."""
    run_cols = _run_cols(summary)
    note = "Gradient norm over the captured steps."
    if "strategy" not in run_cols or summary["strategy"].nunique() < 2:
        return f"<p>{note}</p>\n{_table(summary[run_cols + list(_SHOWN)].rename(columns=_SHOWN))}"
    strategies = list(dict.fromkeys(summary["strategy"]))
    keys = [c for c in run_cols if c != "strategy"] + ["tap", "call"]
    numeric = [c for c in _SHOWN if c not in ("tap", "call")]
    g = summary.astype({c: "float64" for c in numeric}).groupby(keys, sort=False, dropna=False)[numeric]
    lo, hi = g.min(), g.max()
    scale = pd.DataFrame(np.maximum(hi.abs(), lo.abs()), index=hi.index, columns=hi.columns).fillna(0)
    agree = ((hi - lo).abs().fillna(0) <= 1e-6 * scale) & (g.count().eq(g.size(), axis=0) | g.count().eq(0))
    first = summary.drop_duplicates(keys).set_index(keys)[numeric]
    if agree.to_numpy().all():
        table = first.reset_index()[keys + numeric].rename(columns=_SHOWN)
        return f"<p>{note} Identical for the strategies {', '.join(strategies)}.</p>\n{_table(table)}"
    wide = summary.pivot_table(index=keys, columns="strategy", values="last", sort=False, dropna=False)
    wide = wide.reindex(columns=strategies).rename(columns=lambda c: f"last ({c})")
    table = first.drop(columns="last").join(wide)
    table.insert(0, "agree", np.where(agree.all(axis=1).reindex(table.index), "yes", "DIFFER"))
    body = _table(table.reset_index().rename(columns=_SHOWN)).replace("<td>DIFFER</td>", '<td class="bad">differ</td>')
    return f"<p>{note} The strategies disagree on the rows marked <b>differ</b>.</p>\n{body}"


def _strategy_sections(
    plots: ModuleType, cmp: pd.DataFrame | str, steps: pd.DataFrame | None, out_dir: Path
) -> list[str]:
    """Agreement between the strategies (largest differences) and their cost."""
    if isinstance(cmp, str):
        return [_section("Do the strategies agree?", f"<p>Not compared: {html.escape(cmp)}</p>")]
    worst = cmp.groupby("stat", sort=False)[["abs_diff", "rel_diff"]].max().reset_index()
    verdict = "identical records" if _identical(cmp) else "they differ"
    sections = [
        _section("Do the strategies agree?",
                 f"<p>Largest difference over every step, tap and call: <b>{verdict}</b>.</p>\n{_table(worst)}"),
    ]  # fmt: skip
    if not _identical(cmp):  # bars of zeros are an empty chart: the table above says it
        sections.append(_figure(out_dir, "agreement", "Strategy agreement", plots.plot_strategy_agreement(cmp)))
    if steps is not None:
        costs = strategy_costs(steps)
        note = ("Medians over the captured steps. On CPU peak memory is the process's peak RSS, which "
                "never goes down: jobs of a sweep run in one process see the earlier jobs' peaks.")  # fmt: skip
        sections += [
            _section("What each strategy costs", f"<p>{html.escape(note)}</p>\n{_table(_cost_table(costs))}"),
            _figure(out_dir, "cost", "Strategy cost", plots.plot_strategy_cost(costs)),
        ]
    return sections


def _cost_table(costs: pd.DataFrame) -> pd.DataFrame:
    """`strategy_costs` in units a reader takes in: ms, MiB, a percentage."""
    out = costs.drop(columns=["step_time_s", "capture_time_s", "peak_memory_bytes", "capture_share"])
    out["step (ms)"] = costs["step_time_s"] * 1e3
    out["capture (ms)"] = costs["capture_time_s"] * 1e3
    out["capture share"] = [f"{v:.0%}" if v == v else "" for v in costs["capture_share"]]
    out["peak memory (MiB)"] = costs["peak_memory_bytes"] / 2**20
    return out


def _answer(
    grads: pd.DataFrame, steps: pd.DataFrame | None, summary: pd.DataFrame, cmp: pd.DataFrame | str | None
) -> str:
    """The page's first paragraph: the strategies' agreement (a strategies sweep), then what happened in each run."""
    lines = []
    if isinstance(cmp, pd.DataFrame):
        n = grads["strategy"].nunique()
        if _identical(cmp):
            lines.append(f"All {n} strategies agree (largest relative difference 0).")
        else:
            worst = cmp.iloc[int(np.argmax(cmp["rel_diff"].to_numpy(dtype=np.float64)))]
            lines.append(f"The {n} strategies differ: largest relative difference {worst['rel_diff']:.3g}, "
                         f"in {worst['stat']} of {worst['tap']} at step {int(worst['step'])}.")  # fmt: skip
    run_cols = _run_cols(summary)
    runs = list(summary.groupby(run_cols, sort=False, dropna=False)) if run_cols else [((), summary)]
    said: list[tuple[str, str]] = []
    for key, rows in runs:
        values = dict(zip(run_cols, key if isinstance(key, tuple) else (key,), strict=True))
        said.append((", ".join(f"{c}={v}" for c, v in values.items()), _run_sentence(rows, grads, steps, values)))
    if len({text for _, text in said}) == 1:  # one run, or runs that read the same (agreeing strategies)
        lines.append(said[0][1])
    else:
        lines += [f"{label}: {text}" for label, text in said]
    return "<br>".join(html.escape(t) for t in lines)


def _run_sentence(
    rows: pd.DataFrame, grads: pd.DataFrame, steps: pd.DataFrame | None, values: dict[str, object]
) -> str:
    """One run's loss and health, as the run's last word says them."""
    mask = np.ones(len(grads), dtype=bool)
    for c, v in values.items():
        mask &= (grads[c] == v).to_numpy()
    run_ids = set(grads.loc[mask, "run_id"])
    parts = []
    if steps is not None:
        s = steps[steps["run_id"].isin(run_ids)].sort_values("step", kind="stable")
        if len(s):
            parts.append(f"loss {s['loss'].iloc[0]:.4g} → {s['loss'].iloc[-1]:.4g} over {len(s)} steps")
    nonfinite = rows["first_nonfinite_step"].dropna()
    if len(nonfinite):
        first = rows[rows["first_nonfinite_step"] == nonfinite.min()].iloc[0]
        parts.append(f"NaN/Inf from step {int(nonfinite.min())} (first in {first['tap']})")
    boundary = vanishing_boundary(rows)
    if boundary is not None:
        parts.append(f"gradients vanish below {boundary[0]} from step {boundary[2]}")
    elif rows["vanishing"].any():
        v = rows[rows["vanishing"]]
        parts.append(f"{len(v)} of {len(rows)} taps vanishing from step {int(v['first_vanishing_step'].min())}")
    if rows["exploding"].any():
        e = rows[rows["exploding"]]
        parts.append(f"{len(e)} of {len(rows)} taps exploding from step {int(e['first_exploding_step'].min())}")
    never = rows[rows["steps"] == 0]
    if len(never):
        parts.append(f"{len(never)} tap{'s' * (len(never) > 1)} never had a gradient")
    if len(parts) == (1 if steps is not None else 0):
        parts.append("no NaN/Inf, no vanishing or exploding gradient")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def _training_sections(out_dir: Path, steps: pd.DataFrame) -> list[str]:
    """One run's training step as `steps.parquet` records it: grad norm with the clipping threshold and the
    clipped steps, the learning rate, skipped fp16 steps, eval loss. Only where one of those says more than
    the loss figure (a scheduler, clipping, a loss scaler or evaluation); a sweep's runs share the loss figure."""
    if steps["run_id"].nunique() != 1 or not {"lr", "grad_norm"} <= set(steps.columns):
        return []

    def has(column: str) -> bool:
        values = steps[column] if column in steps.columns else pd.Series(dtype=bool)
        return bool(values[values.notna()].astype(bool).any())  # NaN (a step without the column) is False

    value = _config_value(out_dir, ("train", "clip_grad_norm"))
    clip = float(value) if isinstance(value, (int, float)) else None
    lr_varies = steps["lr"].nunique(dropna=True) > 1
    if not (lr_varies or clip is not None or has("clipped") or has("skipped") or has("eval_loss")):
        return []
    from gradrunner.analysis import plots_training

    note = ("The total gradient norm before clipping (log scale; clipped steps marked, the threshold dashed) and "
            "the learning rate each step used (skipped fp16 steps marked; eval loss where evaluated).")  # fmt: skip
    fig = plots_training.plot_training(steps.sort_values("step"), clip=clip)
    return [_figure(out_dir, "training", "Training: grad norm and learning rate", fig, note)]


def _config_value(out_dir: Path, keys: tuple[str, ...]) -> object:
    """A value of the run's resolved config, as its grads file's metadata holds it (None where absent)."""
    import pyarrow.parquet as pq
    import yaml

    files = _grads_files(out_dir) if out_dir.is_dir() else []
    try:
        meta = (pq.read_schema(files[0]).metadata or {}) if files else {}
        node: object = yaml.safe_load(meta.get(b"gradrunner.config", b"") or "{}")
    except Exception:  # a damaged footer: `load` has named it already
        return None
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _extra_sections(
    grads: pd.DataFrame, out_dir: Path, only: tuple[str, ...] = (HIST_COLUMN, "update_ratio", PER_EXAMPLE_COLUMN)
) -> list[str]:
    """The panels of the optional columns (of `only`), when the records have them: histograms, update ratios,
    per-example norms."""
    from gradrunner.analysis import plots_optional

    sections = []
    having = _runs_having(out_dir, grads, HIST_COLUMN) if HIST_COLUMN in only else []
    if having:
        every = pd.concat([run for run, _ in having])
        with_grad = every[every["has_grad"].fillna(False).astype(bool)]
        drawn = sorted(set(forward_order(with_grad if len(with_grad) else every).head(_HIST_TAPS)["tap"]))
        panels = pd.concat([_with_column(run, f, HIST_COLUMN, [("tap", "in", drawn)]) for run, f in having])
        last = pd.concat(
            [_with_column(run, f, HIST_COLUMN, [("step", "==", int(run["step"].max()))]) for run, f in having]
        )
        if panels[HIST_COLUMN].notna().any() and last[HIST_COLUMN].notna().any():
            runs = " (a column per run)" if len(having) > 1 else ""
            if len(having) < grads["run_id"].nunique():  # a sweep that turned histograms on in some jobs only
                runs += f" (the {len(having)} of {grads['run_id'].nunique()} runs that recorded them)"
            note = (f"Share of |g| per log-spaced bin{runs}: steps down, "
                    f"bins across; the first column counts exact zeros, the last NaN/Inf; at most {_HIST_TAPS} taps "
                    "are drawn. The table: every tap at each run's last captured step.")  # fmt: skip
            fig = plots_optional.plot_histograms(panels, max_taps=_HIST_TAPS)
            sections.append(_figure(out_dir, "histograms", "Gradient histograms over steps", fig, note)
                            + _table(_histogram_table(last)))  # fmt: skip
    if "update_ratio" in only and "update_ratio" in grads.columns and grads["update_ratio"].notna().any():
        with_ratio = grads[grads["update_ratio"].notna()]
        r = update_ratios(with_ratio)
        named = [c for c in run_columns(with_ratio) if c != "run_id"]
        r = r.merge(with_ratio[["run_id", *named]].drop_duplicates("run_id"), on="run_id")
        last = r[r["step"] == r.groupby("run_id")["step"].transform("max")]  # each run's own last step
        shown = [*named, *(["run_id"] if "run_id" in run_columns(with_ratio) else [])]
        last = last[shown + [c for c in r.columns if c not in ("run_id", "log10_ratio", *named)]]
        note = ("Norm of each optimiser step's change over the parameter's norm, a panel per run; about "
                f"{UPDATE_RATIO_GUIDE:g} per step is the usual guide (far below: learning too slowly, far above: "
                "too fast). The table: each run's last captured step.")  # fmt: skip
        fig = plots_optional.plot_update_ratios(with_ratio)
        sections.append(_figure(out_dir, "update_ratios", "Update-to-weight ratio", fig, note) + _table(last))
    having = _runs_having(out_dir, grads, PER_EXAMPLE_COLUMN) if PER_EXAMPLE_COLUMN in only else []  # one column read
    norms = pd.concat([_with_column(run, f, PER_EXAMPLE_COLUMN, []) for run, f in having]) if having else None
    if norms is not None and norms[PER_EXAMPLE_COLUMN].notna().any():
        with_norms = norms[norms[PER_EXAMPLE_COLUMN].notna()]
        named = [c for c in run_columns(with_norms) if c != "run_id"]
        s = per_example_spread(with_norms).merge(with_norms[["run_id", *named]].drop_duplicates("run_id"), on="run_id")
        table = s.groupby([*named, "tap", "call"], sort=False).agg(
            median_dominance=("dominance", "median"), max_dominance=("dominance", "max"),
            max_top_share=("top_share", "max"), most_often_top=("top_example", lambda t: int(t.mode().iloc[0])),
        ).reset_index()  # fmt: skip
        note = ("Per tap, the largest example's gradient norm over the median example's, over the steps"
                f"{' (a panel per run)' if len(having) > 1 else ''}: 1 means every example weighs the same. "
                "most_often_top is the batch row most often largest.")  # fmt: skip
        fig = plots_optional.plot_per_example_spread(with_norms)
        sections.append(_figure(out_dir, "per_example", "Per-example gradient norms", fig, note) + _table(table))
    return sections


def _edit_sections(grads: pd.DataFrame, out_dir: Path, keys: list[str] | None = None) -> list[str]:
    """Gradient edits: which taps were edited (a row per run and tap, or per value of `keys` and tap) and, for a
    sweep over an edit's strength, its panel."""
    if "edited" not in grads.columns or not grads["edited"].fillna(False).astype(bool).any():
        return []
    from gradrunner.analysis import plots_edits

    edited = grads[grads["edited"].fillna(False).astype(bool)]
    table = (
        edited.groupby([*(run_columns(edited) if keys is None else keys), "tap"], sort=False, dropna=False)
        .agg(rows=("edited", "size"), norm_before=("norm", "mean"), norm_after=("edited_norm", "mean"))
        .reset_index()
    )
    note = (
        "Edited taps (edits=...): their records hold the gradient as it arrived (norm_before, mean over the "
        "captured steps); norm_after is what the edit let through to the rest of backward."
    )
    sections = [_section("Gradient edits", f"<p>{html.escape(note)}</p>\n{_table(table)}")]
    column = plots_edits.edit_strength_column(grads)
    if column is not None:
        note = (
            f"The sweep over {column}: loss at the last step, and gradient norms of the taps upstream of the edit "
            "(their gradient passes it, solid) and downstream (dashed)."
        )
        sections.append(
            _figure(out_dir, "edit_sweep", "Edit strength", plots_edits.plot_edit_sweep(grads, column), note)
        )
    return sections


def _histogram_table(last: pd.DataFrame) -> pd.DataFrame:
    """Per run and tap at its last captured step (the rows of `last`): the fullest bin, the shares of zeros and NaN/Inf."""
    rows = []
    named = [c for c in run_columns(last) if c != "run_id"]
    for _, run in last.groupby("run_id", sort=False):
        keys = run.loc[run["hist_counts"].notna(), ["tap", "call"]].drop_duplicates()
        for tap, call in keys.itertuples(index=False):
            h = histograms_over_steps(run, tap, call)
            counts = h.iloc[-1]
            total = max(int(counts.sum()), 1)
            rows.append({**{c: run[c].iloc[0] for c in named}, "tap": tap, "call": call, "step": int(h.index[-1]),
                         "fullest bin": str(counts.idxmax()), "zero share": counts.iloc[0] / total,
                         "nan/inf share": counts.iloc[-1] / total})  # fmt: skip
    return pd.DataFrame(rows)


def _page(out_dir: Path, grads: pd.DataFrame, sections: list[str], answer: str = "") -> str:
    experiments = ", ".join(sorted(grads["experiment"].astype(str).unique()))
    titles = [s[s.index(">") + 1 : s.index("</h2>")] for s in sections]
    nav = " · ".join(f'<a href="#{_anchor(html.unescape(t))}">{t}</a>' for t in titles)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>gradrunner report: {html.escape(experiments)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>gradrunner report: {html.escape(experiments)}</h1>
<p class="answer">{answer}</p>
<p>Records in <code>{html.escape(str(out_dir.resolve()))}</code>, written by gradrunner {__version__}.</p>
<nav>{nav}</nav>
{chr(10).join(sections)}
</body>
</html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    """The command: write the report of the run or sweep dir given, print the page's path.

    Example::

        python -m gradrunner.report multirun/2024-05-01/12-00-00
    """
    parser = argparse.ArgumentParser(
        prog="python -m gradrunner.report",
        description="Write PNG figures and one self-contained report.html next to gradrunner records.",
    )
    parser.add_argument("path", help="a run dir, a sweep dir (Hydra multirun) or a grads.parquet file")
    args = parser.parse_args(argv)
    try:
        page = write_report(args.path)
    except GradrunnerError as e:
        print(f"gradrunner.report: error: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
