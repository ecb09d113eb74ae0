"""The report's sections shared by a run (`write`) and a large sweep (`sweep`).

Contents:
    findings_html(summary) -> str                    -- a headline, then the taps in trouble grouped by kind and step
    compare(grads) -> Agreement                 -- `compare_strategies`, or why not; the groups of runs not compared
    strategy_sections(plots, agreement, steps, ...) -- the strategies' agreement and cost
    extra_sections(grads, out_dir, ...)         -- histograms, update ratios, per-example norms (when recorded)
    edit_sections(grads, out_dir, ...)          -- gradient edits: the edited taps, an edit-strength sweep's panel

A section is HTML that starts with its <h2> (`page.html_section`); the figures are drawn through the
`figure` given (`page.FigureWriter`), so the caller decides how they are saved.

Example::

    sections = [html_section("Findings", findings_html(tap_summary(grads)))]
    sections += edit_sections(grads, out_dir, figure=figure_section)
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd

from gradrunner.analysis.aggregate import AGGREGATE_ABOVE
from gradrunner.analysis.optional import UPDATE_RATIO_GUIDE, histograms_over_steps, per_example_spread, update_ratios
from gradrunner.analysis.strategies import compare_strategies, strategy_costs, strategy_groups
from gradrunner.analysis.summaries import EXPLODE_ABOVE, VANISH_BELOW, forward_order, rank_columns, run_columns
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import HIST_COLUMN, PER_EXAMPLE_COLUMN
from gradrunner.report.page import FigureWriter, html_section, html_table
from gradrunner.report.records import runs_having, with_column

#: The histogram panels drawn at most (their taps' `hist_counts` are the only ones read for every step).
_HIST_TAPS = 8


_KINDS = (("first_nonfinite_step", "NaN or Inf", "from step"), ("first_vanishing_step", "vanishing",
          f"norm below {VANISH_BELOW:g} at the last step; since step"),
          ("first_exploding_step", "exploding", f"norm above {EXPLODE_ABOVE:g} from step"))  # fmt: skip


#: What the page says of a run whose steps table holds no loss (null: `rec.step()` without one), as the last word.
NO_LOSS = "loss not recorded"


def no_loss_section() -> str:
    """The loss section of a run or sweep none of whose steps recorded a loss, with nothing else to draw: why."""
    why = "every step's loss is null in steps.parquet (rec.step() without one): nothing to draw"
    return html_section("Loss over the steps", f"<p>{NO_LOSS.capitalize()}: {why}.</p>")


def run_label_columns(summary: pd.DataFrame) -> list[str]:
    """The columns of a tap summary before `tap`: those naming the run."""
    return list(summary.columns[: summary.columns.get_loc("tap")])


def findings_html(summary: pd.DataFrame) -> str:
    """A headline (how many taps in each kind of trouble), then the taps grouped by kind and step."""
    run_cols = run_label_columns(summary)
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


@dataclass(frozen=True)
class Agreement:
    """The strategies of the runs compared (`compare`): what `compare_strategies` found, and what it left out."""

    #: `compare_strategies`' rows (none when no group of runs has every strategy), or why it refused to compare.
    cmp: pd.DataFrame | str
    #: The groups of runs not compared, each with the strategies it lacks (`strategy_groups`): "seed=1 (no
    #: autograd_grad run)"; "" when every group has every strategy.
    left_out: str = ""

    @property
    def compared(self) -> bool:
        """Whether any record was compared."""
        return isinstance(self.cmp, pd.DataFrame) and not self.cmp.empty

    @property
    def differ(self) -> bool:
        """Whether a record compared differs (a statistic, or a record one strategy's run lacks)."""
        return isinstance(self.cmp, pd.DataFrame) and bool(self.cmp[["abs_diff", "rel_diff"]].to_numpy().any())

    @property
    def identical(self) -> bool:
        """Every run compared, and not one difference: the same figures once per strategy would say nothing more."""
        return self.compared and not self.differ and not self.left_out

    def left_out_rows(self, summary: pd.DataFrame, others: list[str]) -> np.ndarray:
        """Per row of a `tap_summary` (run columns `others` besides the strategy): whether its group was left out."""
        if not others or not self.left_out:
            return np.zeros(len(summary), dtype=bool)
        groups = strategy_groups(summary, keys=others)  # `compare`'s groups, as the summary's run columns name them
        return (summary[others].merge(groups, on=others, how="left")["missing"] != "").to_numpy()

    def sentence(self, n: int) -> str:
        """What the page's first paragraph says of the `n` strategies (nothing when `compare_strategies` refused)."""
        if isinstance(self.cmp, str):
            return ""
        left_out = f"not compared, lacking a strategy's run: {self.left_out}"
        if not self.compared:
            return f"The {n} strategies were not compared: no group of runs has every strategy ({self.left_out})."
        if not self.differ:
            return (f"All {n} strategies agree (largest relative difference 0)." if not self.left_out else
                    f"All {n} strategies agree where compared (largest relative difference 0); {left_out}.")  # fmt: skip
        worst = self.cmp.iloc[int(np.argmax(self.cmp["rel_diff"].to_numpy(dtype=np.float64)))]
        return (f"The {n} strategies differ: largest relative difference {worst['rel_diff']:.3g}, "
                f"in {worst['stat']} of {worst['tap']} at step {int(worst['step'])}."
                + (f" Also {left_out}." if self.left_out else ""))  # fmt: skip


def compare(grads: pd.DataFrame) -> Agreement:
    """`compare_strategies`, or why the runs could not be compared; and the groups of runs it left out."""
    try:
        cmp = compare_strategies(grads)
    except GradrunnerError as e:  # e.g. several runs per strategy that no swept value tells apart
        return Agreement(str(e))
    groups = strategy_groups(grads)
    keys = [c for c in groups.columns if c not in ("strategies", "missing")]
    lacking = groups[groups["missing"] != ""].to_dict("records")
    named = [", ".join(f"{c}={g[c]}" for c in keys) + f" (no {g['missing']} run)" for g in lacking]
    return Agreement(cmp, "; ".join(named))


def strategy_sections(
    plots: ModuleType, agreement: Agreement, steps: pd.DataFrame | None, out_dir: Path, *, figure: FigureWriter
) -> list[str]:
    """Agreement between the strategies (largest differences; the groups of runs not compared) and their cost."""
    title = "Do the strategies agree?"
    cmp = agreement.cmp
    if isinstance(cmp, str):
        return [html_section(title, f"<p>Not compared: {html.escape(cmp)}</p>")]
    if not agreement.compared:
        why = f"no group of runs has every strategy: {agreement.left_out}"
        sections = [html_section(title, f"<p>Not compared: {html.escape(why)}.</p>")]
    else:
        worst = cmp.groupby("stat", sort=False)[["abs_diff", "rel_diff"]].max().reset_index()
        verdict = "they differ" if agreement.differ else "identical records"
        note = f" Not compared, lacking a strategy's run: {agreement.left_out}." if agreement.left_out else ""
        sections = [
            html_section(title, f"<p>Largest difference over every step, tap and call: <b>{verdict}</b>."
                                f"{html.escape(note)}</p>\n{html_table(worst)}"),
        ]  # fmt: skip
    if agreement.differ:  # bars of zeros are an empty chart: the table above says it
        sections.append(figure(out_dir, "agreement", "Strategy agreement", plots.plot_strategy_agreement(cmp)))
    if steps is not None:
        costs = strategy_costs(steps)
        note = ("Medians over the captured steps. On CPU peak memory is the process's peak RSS, which "
                "never goes down: jobs of a sweep run in one process see the earlier jobs' peaks.")  # fmt: skip
        sections += [
            html_section("What each strategy costs", f"<p>{html.escape(note)}</p>\n{html_table(_cost_table(costs))}"),
            figure(out_dir, "cost", "Strategy cost", plots.plot_strategy_cost(costs)),
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


def extra_sections(
    grads: pd.DataFrame,
    out_dir: Path,
    only: tuple[str, ...] = (HIST_COLUMN, "update_ratio", PER_EXAMPLE_COLUMN),
    *,
    figure: FigureWriter,
) -> list[str]:
    """The panels of the optional columns (of `only`), when the records have them: histograms, update ratios,
    per-example norms."""
    from gradrunner.report import plots_optional

    sections = []
    having = runs_having(out_dir, grads, HIST_COLUMN) if HIST_COLUMN in only else []
    if having:
        every = pd.concat([run for run, _ in having])
        with_grad = every[every["has_grad"].fillna(False).astype(bool)]
        drawn = sorted(set(forward_order(with_grad if len(with_grad) else every).head(_HIST_TAPS)["tap"]))
        panels = pd.concat([with_column(run, f, HIST_COLUMN, [("tap", "in", drawn)]) for run, f in having])
        last = pd.concat(
            [with_column(run, f, HIST_COLUMN, [("step", "==", int(run["step"].max()))]) for run, f in having]
        )
        if panels[HIST_COLUMN].notna().any() and last[HIST_COLUMN].notna().any():
            runs = " (a column per run)" if len(having) > 1 else ""
            if len(having) < grads["run_id"].nunique():  # a sweep that turned histograms on in some jobs only
                runs += f" (the {len(having)} of {grads['run_id'].nunique()} runs that recorded them)"
            note = (f"Share of |g| per log-spaced bin{runs}: steps down, "
                    f"bins across; the first column counts exact zeros, the last NaN/Inf; at most {_HIST_TAPS} taps "
                    "are drawn. The table: every tap at each run's last captured step.")  # fmt: skip
            fig = plots_optional.plot_histograms(panels, max_taps=_HIST_TAPS)
            sections.append(figure(out_dir, "histograms", "Gradient histograms over steps", fig, note)
                            + html_table(_histogram_table(last)))  # fmt: skip
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
                "too fast). The table: each run's last step with a ratio (a NaN ratio, of a NaN step, is left out).")  # fmt: skip
        fig = plots_optional.plot_update_ratios(with_ratio)
        sections.append(figure(out_dir, "update_ratios", "Update-to-weight ratio", fig, note) + html_table(last))
    having = runs_having(out_dir, grads, PER_EXAMPLE_COLUMN) if PER_EXAMPLE_COLUMN in only else []  # one column read
    norms = pd.concat([with_column(run, f, PER_EXAMPLE_COLUMN, []) for run, f in having]) if having else None
    if norms is not None and norms[PER_EXAMPLE_COLUMN].notna().any():
        with_norms = norms[norms[PER_EXAMPLE_COLUMN].notna()]
        named = [c for c in run_columns(with_norms) if c != "run_id"]
        s = per_example_spread(with_norms).merge(with_norms[["run_id", *named]].drop_duplicates("run_id"), on="run_id")
        table = s.groupby([*named, "tap", "call", *rank_columns(s)], sort=False).agg(
            median_dominance=("dominance", "median"), max_dominance=("dominance", "max"),
            max_top_share=("top_share", "max"), most_often_top=("top_example", _most_often),
        ).reset_index()  # fmt: skip
        note = ("Per tap, the largest example's gradient norm over the median example's, over the steps"
                f"{' (a panel per run)' if len(having) > 1 else ''}: 1 means every example weighs the same. "
                "most_often_top is the batch row most often largest.")  # fmt: skip
        fig = plots_optional.plot_per_example_spread(with_norms)
        sections.append(figure(out_dir, "per_example", "Per-example gradient norms", fig, note) + html_table(table))
        sections += _noise_section(with_norms, out_dir, figure)
    return sections


def _most_often(top: pd.Series) -> object:
    """The batch row most often largest; null where no record of the tap says (its norms all NaN)."""
    seen = top.dropna().mode()
    return int(seen.iloc[0]) if len(seen) else pd.NA


#: The smoothing of the report's noise-scale panel (`noise_scale(..., ema=)`).
NOISE_EMA = 0.9


def _noise_section(norms: pd.DataFrame, out_dir: Path, figure: FigureWriter) -> list[str]:
    """The gradient noise scale per parameter tap over steps (issue 37), where parameter taps have per-example rows."""
    from gradrunner.analysis.noise import noise_scale
    from gradrunner.report import plots_optional

    if "update_norm" not in norms.columns:
        return []
    params = norms[norms["update_norm"].notna()]  # what records hold for parameter taps only
    whole = params.groupby("tap")[PER_EXAMPLE_COLUMN].apply(lambda s: bool(s.notna().all()))
    taps = sorted(whole[whole].index)
    if not taps:
        return []
    try:
        ns = noise_scale(norms, ema=NOISE_EMA, taps=taps)
    except GradrunnerError:  # rows that are not one batch's (taps of different batch sizes): no panel
        return []
    keys = [c for c in ("run_id", "tap") if c in ns.columns]
    last = ns[ns["step"] == ns.groupby(keys)["step"].transform("max")]
    note = ("McCandlish et al.'s simple noise scale B_simple = tr(Σ)/|G|² per parameter tap and for the taps "
            f"together (*), its two estimates smoothed over steps (EMA {NOISE_EMA}) before the ratio: about the "
            "batch size past which a larger batch stops buying fewer steps. README: how to read the noise scale. "
            "The table: each run's last step (b_simple is that step's own, noisy, estimate).")  # fmt: skip
    fig = plots_optional.plot_noise_scale(ns)
    return [figure(out_dir, "noise_scale", "Gradient noise scale", fig, note) + html_table(last)]


def _histogram_table(last: pd.DataFrame) -> pd.DataFrame:
    """Per run and tap (and rank) at its last captured step (the rows of `last`): the fullest bin, the shares of zeros
    and NaN/Inf."""
    rows = []
    named = [c for c in run_columns(last) if c != "run_id"]
    ranks = rank_columns(last)  # under torchrun a row per rank: each rank's own gradients
    for _, run in last.groupby("run_id", sort=False):
        keys = run.loc[run["hist_counts"].notna(), ["tap", "call", *ranks]].drop_duplicates()
        for tap, call, *rank in keys.itertuples(index=False):
            h = histograms_over_steps(run, tap, call, rank=int(rank[0]) if rank else None)
            counts = h.iloc[-1]
            total = max(int(counts.sum()), 1)
            rows.append({**{c: run[c].iloc[0] for c in named}, "tap": tap, "call": call,
                         **({"rank": int(rank[0])} if rank else {}), "step": int(h.index[-1]),
                         "fullest bin": str(counts.idxmax()), "zero share": counts.iloc[0] / total,
                         "nan/inf share": counts.iloc[-1] / total})  # fmt: skip
    return pd.DataFrame(rows)


def edit_sections(
    grads: pd.DataFrame, out_dir: Path, keys: list[str] | None = None, *, figure: FigureWriter
) -> list[str]:
    """Gradient edits: which taps were edited (a row per run and tap, or per value of `keys` and tap) and, for a
    sweep over an edit's strength, its panel."""
    if "edited" not in grads.columns or not grads["edited"].fillna(False).astype(bool).any():
        return []
    from gradrunner.report import plots_edits

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
    sections = [html_section("Gradient edits", f"<p>{html.escape(note)}</p>\n{html_table(table)}")]
    column = plots_edits.edit_strength_column(grads)
    if column is not None:
        note = (
            f"The sweep over {column}: loss at the last step, and gradient norms of the taps upstream of the edit "
            "(their gradient passes it, solid) and downstream (dashed)."
        )
        sections.append(
            figure(out_dir, "edit_sweep", "Edit strength", plots_edits.plot_edit_sweep(grads, column), note)
        )
    return sections
