"""The report of a sweep of more than `AGGREGATE_ABOVE` runs: its sections drawn across the runs, never a panel per run.

Contents:
    sweep_sections(out_dir, grads, steps, summary, figure) -> (sections, answer)
        -- per value of the swept override(s) `aggregate.sweep_layout` keeps apart: the median over the runs
           and a 10-90% band (`aggregate.over_runs`, drawn by `plots_sweep`); a table row per swept value

`write.write_report` calls it for a large sweep; a run, or a smaller sweep, gets `write`'s own sections.
The sections a run and a sweep share come from `sections`, the page helpers from `page`.

Example::

    grads = load(sweep_dir)
    sections, answer = sweep_sections(sweep_dir, grads, load(sweep_dir, table="steps"), tap_summary(grads), figure_section)
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd

from gradrunner.analysis.aggregate import (
    SweepLayout,
    over_runs,
    per_run,
    pick_taps,
    runs_by_value,
    sweep_layout,
    taps_by_value,
)
from gradrunner.analysis.optional import UPDATE_RATIO_GUIDE, update_ratios
from gradrunner.analysis.summaries import flow_steps, forward_order
from gradrunner.records.columns import CONSTANT_COLUMNS, HIST_COLUMN, PER_EXAMPLE_COLUMN
from gradrunner.report.page import FigureWriter, html_section, html_table, import_plots
from gradrunner.report.records import drawn_values, loss_not_recorded
from gradrunner.report.sections import (
    NO_LOSS,
    compare,
    edit_sections,
    extra_sections,
    findings_html,
    no_loss_section,
    strategy_sections,
)

#: Runs named in the list of runs with NaN/Inf at most (a large sweep); the rest are counted.
_NAMED_RUNS = 10


#: The steps table's columns kept for a large sweep's strategy costs: per strategy over every run, not per value.
_COST_KEPT = frozenset(CONSTANT_COLUMNS) | {"step", "captured", "step_time_s", "capture_time_s", "peak_memory_bytes"}


def sweep_sections(
    out_dir: Path, grads: pd.DataFrame, steps: pd.DataFrame | None, summary: pd.DataFrame, figure: FigureWriter
) -> tuple[list[str], str]:
    """The sections and first paragraph of a sweep of more than `AGGREGATE_ABOVE` runs: per value of the swept
    override(s) `sweep_layout` keeps apart, the median over the runs and a 10-90% band (`over_runs`); a table row
    per swept value (and tap), not per run; the page says what was aggregated. One run stands for the sweep in the
    figures of captured values, histograms and per-example norms (named)."""
    from gradrunner.report import plots_sweep

    layout = sweep_layout(grads)
    said = layout.describe()
    with_grad = grads[grads["has_grad"].fillna(False).astype(bool)]
    runs = per_run(grads, steps, summary, layout)
    runs["loss recorded"] = _last_loss_recorded(out_dir, runs, steps)  # a null loss (rec.step() without one) is no NaN
    sections = [html_section("Findings", findings_html(summary))]
    if steps is not None and len(steps):
        tables = {c: over_runs(steps, c, layout, ["step"]) for c in ("loss", "grad_norm")
                  if c in steps.columns and steps[c].notna().any()}  # fmt: skip
        if tables:
            fig = plots_sweep.plot_loss_over_steps(tables, layout)
            sections.append(figure(out_dir, "loss", "Loss over the steps", fig, said))
        elif not runs["loss recorded"].any():  # nothing to draw: say why
            sections.append(no_loss_section())
    bad = runs[runs["nan/inf"] | (runs["loss recorded"] & ~np.isfinite(runs["last loss"].to_numpy(dtype=np.float64)))]
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
        html_section("Runs", f"<p>{html.escape(said + ' A row per swept value; load() gives every run.' + named)}</p>\n"
                         + html_table(runs_by_value(runs, layout))),
        html_section("Per-tap summary", f"<p>{html.escape(note)}first, last and largest norm, and how many runs had the "
                                    f"tap in trouble.</p>\n{html_table(taps_by_value(summary, layout, grads))}"),
        figure(out_dir, "grad_flow", "Gradient flow", plots_sweep.plot_flow_over_runs(flow, layout, forward_order(grads)),
               f"{said} Steps shown: the first, the largest change, the last finite one and the first with NaN/Inf."),
        figure(out_dir, "norms", "Gradient norm over the steps", plots_sweep.plot_over_steps(norms, layout, taps, "norm"),
               said + which),
    ]  # fmt: skip
    if grads["strategy"].nunique() > 1:
        cost_steps = None if steps is None else steps[[c for c in steps.columns if c in _COST_KEPT]]
        sections += strategy_sections(import_plots(), compare(grads), cost_steps, out_dir, figure=figure)
    sections += _sweep_update_ratios(out_dir, grads, layout, figure)
    first = grads[grads["run_id"] == grads["run_id"].iloc[0]]
    name = f"job {first['job'].iloc[0]}" if "job" in first.columns else f"run {first['run_id'].iloc[0]}"
    values = drawn_values(out_dir, first)
    if values is not None:
        fig = import_plots().plot_value_distributions(values)
        sections.append(figure(out_dir, "values", "Gradient values", fig, f"First and last captured step of {name}."))
    for section in extra_sections(first, out_dir, only=(HIST_COLUMN, PER_EXAMPLE_COLUMN), figure=figure):
        one = f"One run, {name}, of {layout.runs:,}. "
        sections.append(section.replace("</h2>\n<p>", f"</h2>\n<p>{html.escape(one)}", 1))
    sections += edit_sections(grads, out_dir, keys=layout.keys, figure=figure)
    return sections, "<br>".join(html.escape(t) for t in [said, *_sweep_answer(runs, layout)])


def _last_loss_recorded(out_dir: Path, runs: pd.DataFrame, steps: pd.DataFrame | None) -> pd.Series:
    """Per run of `runs` (by run_id): whether its last step's loss was recorded (a NaN one too), as the files say."""
    if steps is None or not len(steps):
        return pd.Series(True, index=runs.index)  # the loss is the records' (`per_run`)
    null = steps.assign(_null=loss_not_recorded(out_dir, steps)).sort_values("step", kind="stable")
    last = null.drop_duplicates("run_id", keep="last").set_index("run_id")["_null"]
    return ~last.reindex(runs.index, fill_value=True).astype(bool)


def _sweep_update_ratios(out_dir: Path, grads: pd.DataFrame, layout: SweepLayout, figure: FigureWriter) -> list[str]:
    """A large sweep's update-to-weight ratios: per swept value and parameter tap, the median over runs and its band."""
    from gradrunner.report import plots_sweep

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
        f"{UPDATE_RATIO_GUIDE:g} per step is the usual guide (dashed). The table: the last step with a ratio (NaN ones left out)."
    )
    return [figure(out_dir, "update_ratios", "Update-to-weight ratio", fig, note) + html_table(last.drop(columns="call"))]


def _sweep_answer(runs: pd.DataFrame, layout: SweepLayout) -> list[str]:
    """A sentence per swept value: the median loss from the first to the last step, and how many runs were in trouble."""
    lines = []
    groups = runs.groupby(layout.keys, sort=True, dropna=False) if layout.keys else [((), runs)]
    for key, rows in groups:
        values = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{c}={v}" for c, v in zip(layout.keys, values, strict=True))
        recorded = (
            rows["loss recorded"].to_numpy(dtype=bool) if "loss recorded" in rows.columns else np.ones(len(rows), bool)
        )
        if recorded.any():
            parts = [f"median loss {rows['first loss'].median():.4g} → {rows['last loss'].median():.4g} "
                     f"over {len(rows):,} runs"]  # fmt: skip
        else:
            parts = [f"{NO_LOSS} over {len(rows):,} runs"]
        bad_loss = int((recorded & ~np.isfinite(rows["last loss"].to_numpy(dtype=np.float64))).sum())
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
