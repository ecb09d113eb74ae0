"""The report's entry points (`python -m gradrunner.report <run or sweep dir>`): figures and one HTML page.

Contents:
    write_report(path) -> Path   -- PNGs and `report.html` next to the records; returns the HTML path
    try_report(path) -> Path | None  -- the same, logging how to write it later instead of raising
    check_available() -> None    -- raise GradrunnerError (with the install hint) if matplotlib is missing
    main(argv) -> int            -- the command line
    REPORT_NAME, DPI             -- the page's file name; the PNGs' resolution (`page`)

The page embeds its images (base64 PNG) and its tables, loads nothing and runs no script, so it
can be mailed or archived on its own. A sweep of more than `AGGREGATE_ABOVE` runs is aggregated over its
runs (`analysis.aggregate`, `plots_sweep`): a median line and band per swept value, never a panel per
run; no PNG is larger than a page. A user mistake (a path without records, a dir it cannot write) or a missing
matplotlib prints one paragraph to stderr and exits with status 2; nothing is half-written.

This module holds the entry points and a run's sections (or those of a sweep of at most `AGGREGATE_ABOVE`
runs, a panel each); the rest of the report is listed in `gradrunner.report`'s table.

Example::

    page = write_report("multirun/2024-05-01/12-00-00")   # .../report.html
"""

from __future__ import annotations

import argparse
import html
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd

from gradrunner.analysis.aggregate import AGGREGATE_ABOVE
from gradrunner.analysis.agreement import agrees
from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.analysis.reading import IncompleteSweepWarning, load
from gradrunner.analysis.summaries import flow_steps, lowest_rank, run_columns, tap_summary, vanishing_boundary
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.records.columns import CONSTANT_COLUMNS
from gradrunner.report.page import (
    DPI,
    INSTALL_HINT,
    REPORT_NAME,
    figure_section,
    held_figures,
    html_section,
    html_table,
    import_plots,
    write_page,
)
from gradrunner.report.records import config_value, drawn_values, light_columns, loss_not_recorded
from gradrunner.report.sections import (
    NO_LOSS,
    Agreement,
    compare,
    edit_sections,
    extra_sections,
    findings_html,
    no_loss_section,
    run_label_columns,
    strategy_sections,
)
from gradrunner.report.spikes import spike_sections
from gradrunner.report.sweep import sweep_sections

__all__ = ["DPI", "INSTALL_HINT", "REPORT_NAME", "check_available", "main", "try_report", "write_report"]

log = logging.getLogger(__name__)


def check_available() -> None:
    """Raise GradrunnerError unless matplotlib can be imported (call it before a long run).

    Example::

        if cfg.report:
            check_available()      # fail before step 0, not after the last one
    """
    import_plots()


def write_report(path: str | Path) -> Path:
    """Write the report's PNGs and `report.html` next to the records of a run or sweep; return the HTML path.

    Example::

        page = write_report("multirun/2024-05-01/12-00-00")   # .../report.html
        write_report("outputs/2024-05-01/12-00-00")           # one run works too
        write_report(job_dir / "grads.parquet")               # a file: its directory

    The page holds: the runs, findings (vanishing, exploding, first NaN/Inf), the per-tap summary,
    gradient flow, the measure over the steps, and, when there are several strategies, their
    agreement and cost; value distributions when values were captured. Labels are plain text (a `$` in a
    tap name is drawn as written, never as mathtext). Every section is built before anything is written:
    a report that fails leaves no new file. The PNGs are
    `report-<figure>.png`, none larger than a page (`plots.PAGE_INCHES` at `DPI`); an existing report is
    overwritten (records never are). A sweep of more than `AGGREGATE_ABOVE` runs is aggregated over its runs
    (`sweep`): a median line and 10-90% band per swept value, a table row per swept value, never a
    panel per run; the page says what was aggregated.
    """
    plots = import_plots()
    # tap names and swept values are labels, never mathtext (`$` in a name); every section is built before a
    # file is written (the PNGs are held): a report that fails half-way leaves nothing new in the dir
    with plots.plain_text(), held_figures() as figures:
        return _write_report(plots, Path(path), figures)


def _write_report(plots: ModuleType, root: Path, figures: dict[Path, bytes]) -> Path:
    """`write_report`'s work, inside `plots.plain_text()` and `held_figures()` (`figures`)."""
    out_dir = root.parent if root.is_file() else root
    # every column but the per-element ones (`values`, `hist_counts`, `per_example_norm`): those are read
    # below for the rows drawn only (columns and row filters), never for every row
    # one record per step under accumulation: a step's micro-batches combined (the whole batch's gradient)
    with warnings.catch_warnings(record=True) as caught:  # both reads warn of the same failed jobs: said once
        warnings.simplefilter("always")
        grads = combine_micro_steps(load(out_dir, columns=light_columns(out_dir)))
        steps = _load_steps(out_dir)
    left_out = _left_out(caught)
    if grads.empty:
        raise GradrunnerError(_nothing_to_report(out_dir, steps))
    summary = tap_summary(grads)
    # every section draws through this module's `figure_section`, looked up at each call (a test may wrap it)
    if grads["run_id"].nunique() > AGGREGATE_ABOVE:  # a panel, a table row or a sentence per run would not be read
        sections, answer = sweep_sections(out_dir, grads, steps, summary, figure_section)
    else:
        sections, answer = _run_sections(plots, out_dir, grads, steps, summary, left_out)
    if left_out:  # the page says what it does not show, first
        answer = f'<span class="bad">{html.escape(left_out)}</span><br>{answer}'
    page = write_page(out_dir, grads, sections, answer, figures)
    if left_out:
        warnings.warn(left_out, IncompleteSweepWarning, stacklevel=3)  # once, for the caller (main prints it)
    return page


def _nothing_to_report(out_dir: Path, steps: pd.DataFrame | None) -> str:
    """Why records without a gradient row hold nothing to report: no step ran, none was captured, or no tap."""
    ran = 0 if steps is None else int(steps["step"].nunique())
    captured = 0
    if steps is not None and "captured" in steps.columns:
        captured = int(steps.loc[steps["captured"].fillna(False).astype(bool), "step"].nunique())
    if ran and captured:  # steps ran and were captured: there was no tap to record
        why = f"{ran} steps ran, {captured} captured, but no tap was recorded (taps=[]); name taps to report on"
    elif ran:
        why = f"{ran} steps ran, none captured (capture.every larger than the run?)"
    else:
        why = "no step was captured"
    return f"the records in {out_dir} hold no gradient rows ({why}); nothing to report"


def _left_out(caught: list[warnings.WarningMessage]) -> str:
    """The `IncompleteSweepWarning`s `load` gave (the failed and missing jobs), each once, as one text; any other
    warning is given again as it came."""
    said: dict[str, None] = {}
    for w in caught:
        if issubclass(w.category, IncompleteSweepWarning):
            said[str(w.message)] = None
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return " ".join(said)


def _run_sections(
    plots: ModuleType,
    out_dir: Path,
    grads: pd.DataFrame,
    steps: pd.DataFrame | None,
    summary: pd.DataFrame,
    left_out: str = "",
) -> tuple[list[str], str]:
    """The sections and the first paragraph of a run, or of a sweep of at most `AGGREGATE_ABOVE` runs (a panel each)."""
    agreement = compare(grads) if grads["strategy"].nunique() > 1 else None
    shown, once = grads, ""
    if agreement is not None and agreement.identical:  # the same figures N times say nothing more
        shown = grads[grads["run_id"] == grads["run_id"].iloc[0]]
        once = (f" Identical for the strategies {', '.join(dict.fromkeys(grads['strategy'].astype(str)))}: "
                f"shown once ({shown['strategy'].iloc[0]}).")  # fmt: skip
    flow_note = "Steps shown, per run: the first, the largest change, the last finite one and the first with NaN/Inf."
    sections = [html_section("Findings", findings_html(summary))]
    if grads["run_id"].nunique() == 1:  # one run: its spike detector's spikes, with the taps' z around each
        sections += spike_sections(out_dir)
    known = ~loss_not_recorded(out_dir, steps) if steps is not None else None  # a null loss is not a NaN one
    if steps is not None and len(steps):
        if any(c in steps.columns and steps[c].notna().any() for c in ("loss", "grad_norm")):
            sections.append(figure_section(out_dir, "loss", "Loss over the steps", plots.plot_loss(steps)))
        elif known is not None and not known.any():  # nothing to draw: say why
            sections.append(no_loss_section())
        sections += _training_sections(out_dir, steps)
    sections += [
        _runs_section(grads, steps, known, left_out),
        html_section("Per-tap summary", _summary_table(summary, agreement)),
        figure_section(out_dir, "grad_flow", "Gradient flow", plots.plot_grad_flow(shown, steps=_flow_steps(shown)),
                flow_note + once),
        figure_section(out_dir, "norms", "Gradient norm over the steps", plots.plot_norms(shown), once.strip()),
    ]  # fmt: skip
    if agreement is not None:
        sections += strategy_sections(plots, agreement, steps, out_dir, figure=figure_section)
    values = drawn_values(out_dir, grads)
    if values is not None:
        fig = plots.plot_value_distributions(values)
        sections.append(figure_section(out_dir, "values", "Gradient values", fig, "First and last captured step."))
    sections += extra_sections(shown, out_dir, figure=figure_section)  # once, like the flow, when strategies agree
    sections += edit_sections(grads, out_dir, figure=figure_section)
    return sections, _answer(grads, steps, summary, agreement, known)


def _flow_steps(grads: pd.DataFrame) -> dict[str, list[int]] | list[int]:
    """`flow_steps` of each run (a 5-step job and a 50-step job each get their own)."""
    if grads["run_id"].nunique() < 2:
        return flow_steps(grads)
    return {str(r): flow_steps(rows) for r, rows in grads.groupby("run_id", sort=False)}


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
    """The steps table, a row per step: under torchrun rank 0's (its loss is the step's, as the last word says)."""
    try:
        return lowest_rank(load(out_dir, table="steps"))
    except GradrunnerError:  # records written without a steps table (by hand, or by an older gradrunner)
        return None



def _runs_section(
    grads: pd.DataFrame, steps: pd.DataFrame | None, known: pd.Series | None = None, left_out: str = ""
) -> str:
    """One row per run: what distinguishes it, what ran, how many steps, the last loss (`known`: recorded); then
    the jobs left out (`left_out`: failed or missing jobs of a sweep), when there are any."""
    columns = [c for c in ["job", *run_columns(grads), *CONSTANT_COLUMNS] if c in grads.columns]
    g = grads.groupby("run_id", sort=False)
    runs = g[list(dict.fromkeys(columns))].first().reset_index(drop=True)
    runs["captured steps"] = g["step"].nunique().to_numpy()
    runs["taps"] = g["tap"].nunique().to_numpy()
    # NaN stays NaN (.last() skips it); under torchrun rank 0's, as the steps table's
    runs["last loss"] = lowest_rank(grads).groupby("run_id", sort=False)["loss"].agg(lambda s: s.iloc[-1]).to_numpy()
    if steps is not None:
        by_run = steps.groupby("run_id", sort=False)
        runs["steps run"] = by_run["step"].nunique().reindex(g.size().index).to_numpy()
        recorded = steps if known is None else steps[known]
        last = recorded.groupby("run_id", sort=False)["loss"].agg(lambda s: s.iloc[-1])
        runs["last loss"] = last.reindex(g.size().index).to_numpy()  # a run without a recorded loss: NaN, said below
        said = [r in last.index for r in g.size().index]
    else:
        said = [True] * len(runs)
    runs["last loss"] = [(f"{v:.6g}" if v == v else "NaN") if s else NO_LOSS  # NaN shown, not blank
                         for v, s in zip(runs["last loss"], said, strict=True)]  # fmt: skip
    note = f'\n<p class="bad">{html.escape(left_out)}</p>' if left_out else ""
    return html_section("Runs", html_table(runs) + note)


#: The per-tap summary's columns as the page shows them (the rest stay in `tap_summary`).
_SHOWN = {"tap": "tap", "call": "call", "steps": "steps", "first": "first", "last": "last", "max": "max",
          "first_nonfinite_step": "NaN/Inf from", "first_vanishing_step": "vanishing from",
          "first_exploding_step": "exploding from"}  # fmt: skip


def _summary_table(summary: pd.DataFrame, agreement: Agreement | None = None) -> str:
    """One table: a row per tap; strategies side by side (differences marked) unless they all agree. Rows of a group
    of runs that lacks a strategy's run (`agreement.left_out`: a failed job) are marked not compared."""
    run_cols = run_label_columns(summary)
    note = "Gradient norm over the captured steps" + (", per rank." if "rank" in summary.columns else ".")
    shown = dict(_SHOWN)
    if "rank" in summary.columns:  # torchrun: a row per tap and rank (`tap_summary`)
        shown = {"tap": "tap", "call": "call", "rank": "rank", **_SHOWN}
    if "strategy" not in run_cols or summary["strategy"].nunique() < 2:
        return f"<p>{note}</p>\n{html_table(summary[run_cols + list(shown)].rename(columns=shown))}"
    strategies = list(dict.fromkeys(summary["strategy"]))
    others = [c for c in run_cols if c != "strategy"]
    keys = others + [c for c in ("tap", "call", "rank") if c in shown]
    numeric = [c for c in _SHOWN if c not in ("tap", "call")]
    g = summary.astype({c: "float64" for c in numeric}).groupby(keys, sort=False, dropna=False)[numeric]
    lo, hi = g.min(), g.max()
    # compare's rule (an infinity agrees with the same infinity only), within 1e-6 of the larger magnitude
    same = agrees(hi.to_numpy(), lo.to_numpy(), 1e-6, 0.0) | agrees(lo.to_numpy(), hi.to_numpy(), 1e-6, 0.0)
    agree = pd.DataFrame(same, index=hi.index, columns=hi.columns) & (g.count().eq(g.size(), axis=0) | g.count().eq(0))
    lacking = pd.Series(agreement.left_out_rows(summary, others) if agreement else False, index=summary.index)
    compared = ~lacking.groupby(pd.MultiIndex.from_frame(summary[keys]), sort=False).any().reindex(hi.index)
    first = summary.drop_duplicates(keys).set_index(keys)[numeric]
    if agree.to_numpy().all() and compared.all():
        table = first.reset_index()[keys + numeric].rename(columns=shown)
        return f"<p>{note} Identical for the strategies {', '.join(strategies)}.</p>\n{html_table(table)}"
    wide = summary.pivot_table(index=keys, columns="strategy", values="last", sort=False, dropna=False)
    table = first.drop(columns="last").join(wide.reindex(columns=strategies).rename(columns=lambda c: f"last ({c})"))
    marks = np.where(compared, np.where(agree.all(axis=1), "yes", "DIFFER"), "not compared")
    table.insert(0, "agree", pd.Series(marks, index=hi.index).reindex(table.index))
    body = html_table(table.reset_index().rename(columns=shown)).replace("<td>DIFFER</td>", '<td class="bad">differ</td>')
    if (marks == "DIFFER").any():
        note += " The strategies disagree on the rows marked <b>differ</b>."
    if agreement is not None and not compared.all():
        note += f" Not compared, lacking a strategy's run: {html.escape(agreement.left_out)}."
    return f"<p>{note}</p>\n{body}"


def _answer(
    grads: pd.DataFrame,
    steps: pd.DataFrame | None,
    summary: pd.DataFrame,
    agreement: Agreement | None,
    known: pd.Series | None = None,
) -> str:
    """The page's first paragraph: the strategies' agreement (a strategies sweep), then what happened in each run."""
    lines = [agreement.sentence(grads["strategy"].nunique())] if agreement is not None else []
    lines = [line for line in lines if line]  # nothing when compare_strategies refused (the section says why)
    run_cols = run_label_columns(summary)
    runs = list(summary.groupby(run_cols, sort=False, dropna=False)) if run_cols else [((), summary)]
    said: list[tuple[str, str]] = []
    for key, rows in runs:
        values = dict(zip(run_cols, key if isinstance(key, tuple) else (key,), strict=True))
        label = ", ".join(f"{c} not set" if _missing(v) else f"{c}={v}" for c, v in values.items())
        said.append((label, _run_sentence(rows, grads, steps, values, known)))
    if len({text for _, text in said}) == 1:  # one run, or runs that read the same (agreeing strategies)
        lines.append(said[0][1])
    else:
        lines += [f"{label}: {text}" for label, text in said]
    return "<br>".join(html.escape(t) for t in lines)


def _missing(value: object) -> bool:
    """A run column's value for a run that did not set it (a sweep dir of runs with different overrides): NaN/None."""
    return value is None or value is pd.NA or (isinstance(value, float) and value != value)


def _run_sentence(
    rows: pd.DataFrame,
    grads: pd.DataFrame,
    steps: pd.DataFrame | None,
    values: dict[str, object],
    known: pd.Series | None = None,
) -> str:
    """One run's loss and health, as the run's last word says them (a tap in trouble on any of its ranks counts once)."""
    if "rank" in rows.columns:  # torchrun: `tap_summary`'s row per tap and rank, one per tap here
        rows = rows.assign(first_vanishing_step=rows["first_vanishing_step"].where(rows["vanishing"]))
        rows = rows.groupby(["tap", "call"], sort=False).agg(
            first_nonfinite_step=("first_nonfinite_step", "min"), vanishing=("vanishing", "any"),
            first_vanishing_step=("first_vanishing_step", "min"), exploding=("exploding", "any"),
            first_exploding_step=("first_exploding_step", "min"), steps=("steps", "max"),
        ).reset_index()  # fmt: skip
    mask = np.ones(len(grads), dtype=bool)
    for c, v in values.items():  # a run without the override another run sets: NaN, matched as missing (NaN != NaN)
        mask &= (grads[c].isna() if _missing(v) else grads[c] == v).to_numpy(dtype=bool)
    run_ids = set(grads.loc[mask, "run_id"])
    parts = []
    if steps is not None:
        s = steps[steps["run_id"].isin(run_ids)].sort_values("step", kind="stable")
        loss = s["loss"] if known is None else s.loc[known.reindex(s.index).to_numpy(dtype=bool), "loss"]
        if len(loss):
            parts.append(f"loss {loss.iloc[0]:.4g} → {loss.iloc[-1]:.4g} over {len(s)} steps")
        elif len(s):
            parts.append(f"{NO_LOSS} over {len(s)} steps")
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
    said_loss = steps is not None and bool(parts) and parts[0].startswith(("loss", NO_LOSS))
    if len(parts) == int(said_loss):  # nothing but the loss: no trouble
        parts.append("no NaN/Inf, no vanishing or exploding gradient")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] + "."


def _training_sections(out_dir: Path, steps: pd.DataFrame) -> list[str]:
    """One run's training step as `steps.parquet` records it: grad norm with the clipping threshold and the
    clipped steps, the learning rate, skipped fp16 steps, eval loss. Only where one of those says more than
    the loss figure (a scheduler, clipping, a loss scaler or evaluation); a sweep's runs share the loss figure."""
    if steps["run_id"].nunique() != 1 or not {"lr", "grad_norm"} <= set(steps.columns):
        return []

    def has(column: str) -> bool:
        values = steps[column] if column in steps.columns else pd.Series(dtype=bool)
        return bool(values[values.notna()].astype(bool).any())  # NaN (a step without the column) is False

    value = config_value(out_dir, ("train", "clip_grad_norm"))
    clip = float(value) if isinstance(value, (int, float)) else None
    lr_varies = steps["lr"].nunique(dropna=True) > 1
    if not (lr_varies or clip is not None or has("clipped") or has("skipped") or has("eval_loss")):
        return []
    from gradrunner.report import plots_training

    threshold = "the threshold dashed" if clip is not None else "no threshold drawn: the records do not hold it"
    note = (f"The total gradient norm before clipping (log scale; clipped steps marked, {threshold}) and "
            "the learning rate each step used (skipped fp16 steps marked; eval loss where evaluated).")  # fmt: skip
    fig = plots_training.plot_training(steps.sort_values("step"), clip=clip)
    return [figure_section(out_dir, "training", "Training: grad norm and learning rate", fig, note)]


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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            page = write_report(args.path)
    except GradrunnerError as e:
        print(f"gradrunner.report: error: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    for w in caught:  # a failed job of a sweep: one clean line, not a warning with its source line
        if issubclass(w.category, IncompleteSweepWarning):
            print(f"gradrunner.report: warning: {one_paragraph(str(w.message))}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
