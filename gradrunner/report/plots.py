"""Figures of gradrunner records, drawn with matplotlib (the optional `gradrunner[report]` extra).

Contents:
    plot_grad_flow(df, steps, measure_name)   -- taps in forward order, log scale, a line per step
    plot_norms(df, stat, heatmap)             -- a measure over steps per tap: lines, or a heatmap
    plot_strategy_agreement(cmp)              -- largest relative difference per statistic and per tap
    plot_strategy_cost(costs)                 -- step time, capture time and peak memory per strategy
    plot_value_distributions(df, steps)       -- histograms of the captured gradient values per tap
    plot_loss(steps_df)                       -- the loss (and grad_norm, when recorded) over the steps
    fit_page(fig), PAGE_INCHES                -- a figure shrunk to at most a page (what the report saves)
    plain_text(), plain_ticks(fig)            -- `$` in a label is a dollar, not mathtext; log ticks as plain numbers

Every function returns a `matplotlib.figure.Figure` built without pyplot: no GUI backend, no
global figure list, nothing to close; it works headless and in a notebook (the Figure displays
itself). Save one with `fig.savefig("flow.png")`. Runs of a sweep get a panel each (titled by
`analysis.run_columns`); a large sweep is drawn aggregated over its runs by `plots_sweep` instead.
Records of several ranks (torchrun) are drawn from rank 0's rows (`one_rank`), as the last word's loss
is rank 0's; the figure's title says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager

import numpy as np
import pandas as pd
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

from gradrunner.analysis.summaries import forward_order, grad_flow, lowest_rank, measure, pick_steps, run_columns
from gradrunner.errors import GradrunnerError

#: Above this many taps, `plot_norms` draws a heatmap instead of one line per tap.
HEATMAP_ABOVE = 12
#: The largest figure the report saves, (width, height) in inches: a page (1600 x 1100 px at its 100 dpi).
PAGE_INCHES = (16.0, 11.0)
# Log-scale bars cannot show 0 or inf: they are drawn at these heights and labelled "0" / "inf".
_ZERO_AT, _INF_AT = 1e-17, 1e3
_FLOAT32_EPS = float(np.finfo(np.float32).eps)


def one_rank(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Each run's lowest rank's rows (rank 0's under torchrun), and what to add to a title: "" for one rank.

    Example::

        rows, said = one_rank(load(ddp_run))      # said == " (rank 0's records, of 2 ranks)"
    """
    rows = lowest_rank(df)
    if len(rows) == len(df):
        return df, ""
    ranks = sorted(int(r) for r in rows["rank"].unique())
    return rows, f" (rank {', '.join(map(str, ranks))}'s records, of {df['rank'].nunique()} ranks)"


def titled_runs(df: pd.DataFrame, columns: list[str], records: pd.DataFrame | None = None) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per run of `df`, in record order; the title names the run's distinguishing
    values, or for a single run its experiment and strategy (taken from `records`, default `df`)."""
    if not columns:
        first = (df if records is None else records).iloc[0]
        return [(" · ".join(str(first[c]) for c in ("experiment", "strategy") if c in first.index), df)]
    groups = df.groupby(columns, sort=False, dropna=False)
    return [(", ".join(f"{c}={v}" for c, v in zip(columns, key, strict=True)), rows) for key, rows in groups]


def _panels(
    n: int, width: float, height: float, sharey: bool = False, sharex: bool = True
) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width, height * n), layout="constrained")
    return fig, fig.subplots(n, 1, squeeze=False, sharex=sharex, sharey=sharey)[:, 0]


#: Flow panels: a tap named like a parameter (`weight`, `bias`, `in_proj_weight`) goes in the second.
ACTIVATIONS, WEIGHTS = "outputs, inputs and locals", "weights and biases"


def tap_kind(name: str) -> str:
    """`WEIGHTS` for a parameter tap name (`weight`, `bias`, `*_weight`, `*_bias`), else `ACTIVATIONS`."""
    return WEIGHTS if name in ("weight", "bias") or name.endswith(("_weight", "_bias")) else ACTIVATIONS


def short_labels(labels: Iterable[str]) -> tuple[list[str], str]:
    """Tap labels with their common dotted prefix removed (for axes), and that prefix ('' if none).

    Example::

        short_labels(["model.layers.0.mlp:output", "model.layers.1.mlp:output"])
        # (['0.mlp:output', '1.mlp:output'], 'model.layers.')
    """
    labels = [str(x) for x in labels]
    if len(labels) < 2:
        return labels, ""
    prefix = os.path.commonprefix(labels)  # noqa: RUF071 -- characters, cut back to the last "." below
    prefix = prefix[: prefix.rfind(".") + 1] if "." in prefix else ""
    return [x[len(prefix) :] for x in labels], prefix


def plot_grad_flow(
    df: pd.DataFrame, steps: Iterable[int] | Mapping[str, Iterable[int]] | None = None, measure_name: str = "norm"
) -> Figure:
    """Gradient flow: a measure of every tap in forward order (log scale), one line per step.

    Example::

        fig = plot_grad_flow(load("outputs/2024-05-01/12-00-00"))
        fig = plot_grad_flow(df[df.name == "weight"], steps=[0, 99], measure_name="rms")
        fig.savefig("flow.png")

    `steps` defaults to four spread over the run; `measure_name` is one of `analysis.measure`'s
    (norm, rms, abs_max, mean_abs). Outputs, inputs and locals get one column of panels, weights
    and biases (taps named `weight`, `bias`, `*_weight`, `*_bias`) another: a line never joins an
    output to a weight. A value of exactly 0
    has no place on a log scale: it is drawn as an x on the bottom edge (legend "exactly 0"); NaN
    leaves a gap. `steps` may map each `run_id` to its own steps (a sweep over `steps=5,50`).
    Tap labels lose their common dotted prefix (named under the axis); the legend sits outside the axes.
    """
    df, ranks = one_rank(df)
    if isinstance(steps, Mapping):
        per_run = {str(r): {int(s) for s in v} for r, v in steps.items()}
        flow = grad_flow(df, sorted(set().union(*per_run.values())), measure_name)
        keep = [int(s) in per_run.get(str(r), set()) for r, s in zip(flow["run_id"], flow["step"], strict=True)]
        flow = flow[np.asarray(keep, dtype=bool)]
    else:
        flow = grad_flow(df, steps, measure_name)
    order = forward_order(df)
    order["kind"] = [tap_kind(t.split(":", 1)[1]) for t in order["tap"]]
    kinds = [k for k in (ACTIVATIONS, WEIGHTS) if (order["kind"] == k).any()]
    flow = flow.merge(order[["tap", "call", "kind"]], on=["tap", "call"], how="left")
    runs = titled_runs(flow, run_columns(df), records=df)
    widths = [max(3.0, 0.45 * int((order["kind"] == k).sum()) + 1.5) for k in kinds]
    fig = Figure(figsize=(max(6.0, sum(widths)), 3.0 * len(runs)), layout="constrained")
    grid = fig.subplots(len(runs), len(kinds), squeeze=False, sharey=True, width_ratios=widths)
    for col, kind in enumerate(kinds):
        positions = order[order["kind"] == kind].reset_index(drop=True)
        x_of = {(t, c): i for i, (t, c) in enumerate(zip(positions["tap"], positions["call"], strict=True))}
        labels, prefix = short_labels(positions["label"])
        for row, (title, run) in enumerate(runs):
            ax = grid[row, col]
            part = run[run["kind"] == kind]
            zero_label = "exactly 0"
            for (step, rows), color in zip(part.groupby("step"), _colors(run["step"].nunique()), strict=False):
                x = [x_of[(t, c)] for t, c in zip(rows["tap"], rows["call"], strict=True)]
                ax.plot(x, rows[measure_name], marker="o", color=color, label=f"step {step}")
                zeros = [xi for xi, v in zip(x, rows[measure_name], strict=True) if v == 0]
                if zeros:  # no place on a log scale: an x at the bottom edge
                    ax.plot(zeros, np.full(len(zeros), 0.03), "x", color=color, markersize=9, label=zero_label,
                            transform=ax.get_xaxis_transform(), clip_on=False)  # fmt: skip
                    zero_label = "_exactly 0"  # one legend entry
            ax.set_yscale("log", nonpositive="mask")
            ax.set_ylabel((f"{title}\n" if title and len(runs) > 1 else "") + measure_name if col == 0 else "",
                          fontsize="small")  # fmt: skip
            if row == 0:  # the run's name goes in the figure's title: two long panel titles would overlap
                ax.set_title(kind, fontsize="medium")
            ax.grid(True, which="major", alpha=0.3)
            if col == len(kinds) - 1:  # outside the axes, right of the last column: it covers no point
                ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            ax.set_xticks(range(len(positions)), labels if row == len(runs) - 1 else [],
                          rotation=60, ha="right", fontsize="small")  # fmt: skip
        grid[-1, col].set_xlabel("tap, in forward order" + (f" (after {prefix!r})" if prefix else ""))
    single = runs[0][0] if len(runs) == 1 and runs[0][0] else ""
    fig.suptitle(f"Gradient flow ({measure_name} per tap)" + (f": {single}" if single else "") + ranks)
    return fig


def plain_text() -> AbstractContextManager[None]:
    """A context in which every text drawn is plain text: a tap named `blocks.$x$:output` is drawn as written,
    not as mathtext (which draws maths or raises on what it cannot parse). Build and save a figure inside it
    (a tick label is made when the figure is drawn).

    Example::

        with plain_text():
            plain_ticks(plot_norms(df)).savefig("norms.png")

    matplotlib labels a log axis's ticks in mathtext (`$\\mathdefault{10^{-2}}$`), which this context draws as
    written: pass each figure through `plain_ticks` before saving it (the report does).
    """
    return rc_context({"text.parse_math": False})


def plain_ticks(fig: Figure) -> Figure:
    """`fig` with the ticks of its log axes labelled in plain numbers ("0.01", "1e+05"), not mathtext, which
    `plain_text` would draw as written (`$\\mathdefault{10^{-2}}$`); the same ticks are labelled.

    Example::

        plain_ticks(plot_norms(df)).get_axes()[0].yaxis.get_major_formatter()    # a LogFormatter
    """
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":  # the ticks matplotlib labels (LogScale's choice), in plain numbers
                axis.set_major_formatter(_PlainLog())
                axis.set_minor_formatter(_PlainLog(labelOnlyBase=False))
    return fig


class _PlainLog(LogFormatter):
    """matplotlib's log tick labelling (which ticks get a label) with the value in 3 significant digits."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:.3g}" if super().__call__(x, pos) else ""


def fit_page(fig: Figure) -> Figure:
    """`fig`, shrunk where it is wider or taller than `PAGE_INCHES` (its panels get smaller, the page does not grow).

    Example::

        fit_page(plot_norms(df)).savefig("norms.png", dpi=100)    # at most 1600 x 1100 px
    """
    width, height = fig.get_size_inches()
    if width > PAGE_INCHES[0] or height > PAGE_INCHES[1]:
        fig.set_size_inches(min(width, PAGE_INCHES[0]), min(height, PAGE_INCHES[1]))
    return fig


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    """Early steps light, late steps dark."""
    return [colormaps["viridis_r"](x) for x in np.linspace(0.15, 0.95, max(n, 1))]


def plot_norms(df: pd.DataFrame, stat: str = "norm", heatmap: bool | None = None) -> Figure:
    """A measure of every tap over the steps: a line per tap, or a heatmap (taps x steps, log10).

    Example::

        fig = plot_norms(df)                       # lines up to 12 taps, a heatmap above
        fig = plot_norms(df, stat="rms", heatmap=True)
        fig.axes[0].get_lines()                    # one Line2D per tap (line mode)

    `heatmap` defaults to more than `HEATMAP_ABOVE` taps. In the heatmap a gradient of exactly 0
    is black, a NaN/Inf one red, and a tap without gradient white; lines just leave gaps for them.
    Tap labels lose their common dotted prefix (named as the legend's title, or the heatmap's y label);
    the legend sits outside the axes.
    """
    df, ranks = one_rank(df)
    order = forward_order(df)
    heatmap = len(order) > HEATMAP_ABOVE if heatmap is None else heatmap
    d = df.assign(_v=measure(df, stat), _g=df["has_grad"].fillna(False).astype(float))
    runs = titled_runs(d, run_columns(df))
    # each run's panel spans its own steps (a 2-step job is not drawn on a 5-step job's axis)
    if heatmap:
        fig, axes = _panels(len(runs), 10.0, max(2.5, 0.22 * len(order) + 1), sharex=False)
    else:
        fig, axes = _panels(len(runs), 9.0, 3.2, sharex=False)
    labels, prefix = short_labels(order["label"])  # long HF names: the common prefix is said once
    after = f"after {prefix!r}" if prefix else None
    for ax, (title, run) in zip(axes, runs, strict=True):
        values = _by_tap_and_step(run, order, "_v")
        if heatmap:
            _heatmap(fig, ax, values, _by_tap_and_step(run, order, "_g"), labels, stat)
            ax.set_ylabel(f"tap ({after})" if after else "tap", fontsize="small")
        else:
            for i, (label, row) in enumerate(zip(labels, values.to_numpy(), strict=True)):
                ax.plot(values.columns, row, label=label, color=colormaps["tab20"](i % 20))
            ax.set_yscale("log")
            ax.set_ylabel(stat)
            # outside the axes, right of the panel: it covers no line
            ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                      title=after, title_fontsize="x-small")  # fmt: skip
        ax.set_title(title, fontsize="medium")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no half-step ticks
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{stat} per tap over the steps{ranks}")
    return fig


def _by_tap_and_step(run: pd.DataFrame, order: pd.DataFrame, column: str) -> pd.DataFrame:
    """`column` as a (tap, call) x step table, rows in forward order."""
    table = run.pivot_table(index=["tap", "call"], columns="step", values=column, dropna=False)
    return table.reindex(pd.MultiIndex.from_frame(order[["tap", "call"]]))


def _heatmap(fig: Figure, ax: Axes, values: pd.DataFrame, has_grad: pd.DataFrame, labels: list[str], stat: str) -> None:
    v = values.to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(v)
    finite = np.isfinite(logs)
    lo, hi = (float(logs[finite].min()), float(logs[finite].max())) if finite.any() else (0.0, 1.0)
    hi = max(hi, lo + 1e-9)
    logs = np.where(v == 0, lo - 1, np.where(np.isfinite(v), logs, hi + 1))  # 0: under, NaN/Inf: over
    logs[has_grad.to_numpy(dtype=np.float64) != 1] = np.nan  # no gradient (or no record): blank
    cmap = colormaps["viridis"].with_extremes(under="black", over="red", bad="white")
    steps = values.columns.to_numpy()
    extent = (steps.min() - 0.5, steps.max() + 0.5, len(labels) - 0.5, -0.5)
    image = ax.imshow(logs, aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi, extent=extent)
    ax.set_yticks(range(len(labels)), labels, fontsize="x-small")
    fig.colorbar(image, ax=ax, extend="both", label=f"log10 {stat}\n(black: 0, red: NaN/Inf, white: none)")


def _bars(ax: Axes, labels: list[str], values: np.ndarray, title: str) -> None:
    """Log-scale bars of relative differences, 0 and inf drawn at fixed heights and labelled."""
    heights = np.where(values == 0, _ZERO_AT, np.where(np.isinf(values), _INF_AT, values))
    bars = ax.bar(range(len(labels)), heights, color="tab:blue")
    texts = ["0" if v == 0 else "inf" if np.isinf(v) else f"{v:.1e}" for v in values]
    ax.bar_label(bars, texts, fontsize="x-small")
    ax.axhline(_FLOAT32_EPS, color="gray", linestyle="--", linewidth=1, label="float32 eps")
    ax.set_yscale("log")
    ax.set_ylim(_ZERO_AT / 10, _INF_AT * 100)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize="small")
    ax.set_ylabel("largest relative difference")
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")


def plot_strategy_agreement(cmp: pd.DataFrame) -> Figure:
    """How far the strategies disagree: the largest relative difference per statistic and per tap.

    Example::

        cmp = compare_strategies(load("multirun/2024-05-01/12-00-00"))
        fig = plot_strategy_agreement(cmp)
        [t.get_text() for t in fig.axes[0].texts]   # bar labels: '0' where the strategies agree exactly

    Bars are on a log scale; 0 (identical) and inf (NaN or a record in some strategies only) are
    drawn at fixed heights and labelled. The dashed line is float32's machine epsilon.
    """
    fig = Figure(figsize=(11, 4), layout="constrained")
    by_stat, by_tap = fig.subplots(1, 2, width_ratios=[1, 2])
    worst_stat = cmp.groupby("stat", sort=False)["rel_diff"].max()
    _bars(by_stat, worst_stat.index.tolist(), worst_stat.to_numpy(), "per statistic (all taps, steps)")
    labelled = cmp.merge(forward_order(cmp)[["tap", "call", "label"]], on=["tap", "call"])
    worst_tap = labelled.groupby("label", sort=False)["rel_diff"].max()
    _bars(by_tap, worst_tap.index.tolist(), worst_tap.to_numpy(), "per tap (all statistics, steps)")
    fig.suptitle("Agreement between capture strategies")
    return fig


def plot_strategy_cost(costs: pd.DataFrame) -> Figure:
    """What each strategy costs: median step and capture time (ms), and peak memory (MiB).

    Example::

        fig = plot_strategy_cost(strategy_costs(load(sweep_dir, table="steps")))
        [t.get_text() for t in fig.axes[0].get_xticklabels()]   # the strategies
        fig.axes[1].get_ylabel()                                  # 'peak memory (MiB)'
    """
    label_columns = [c for c in costs.columns if c not in _COST_COLUMNS]
    labels = [", ".join(str(v) for v in row) for row in costs[label_columns].itertuples(index=False)]
    x = np.arange(len(labels))
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    time_ax, memory_ax = fig.subplots(1, 2)
    step = time_ax.bar(x - 0.2, costs["step_time_s"] * 1e3, width=0.4, label="step (median)")
    capture = time_ax.bar(x + 0.2, costs["capture_time_s"] * 1e3, width=0.4, label="capture (median)")
    time_ax.set_ylabel("time (ms)")
    time_ax.legend(fontsize="small", ncols=2, loc="upper left")
    memory = memory_ax.bar(x, costs["peak_memory_bytes"] / 2**20, color="tab:green")
    memory_ax.set_ylabel("peak memory (MiB)")
    for ax, bars in ((time_ax, step), (time_ax, capture), (memory_ax, memory)):
        ax.bar_label(bars, fmt="%.3g", fontsize="x-small")
        ax.margins(y=0.2)  # room for the labels and the legend
        ax.set_xticks(x, labels, rotation=20, ha="right")
    fig.suptitle("Cost per capture strategy")
    return fig


_COST_COLUMNS = ("captured_steps", "step_time_s", "capture_time_s", "peak_memory_bytes", "capture_share")


def plot_value_distributions(df: pd.DataFrame, steps: Iterable[int] | None = None, max_taps: int = 12) -> Figure:
    """Histograms of the captured gradient values, a panel per tap, a line per step.

    Example::

        fig = plot_value_distributions(df)                # first and last captured step
        fig = plot_value_distributions(df[df.strategy == "hook"], steps=[0, 10, 20])
        fig.axes[0].get_title()                           # the first tap in forward order

    Needs `capture.values=full` or `sample` (raises GradrunnerError otherwise). With several runs in
    `df` only the first is drawn (named in the title): select one first. Densities (y unlabelled).
    At most `max_taps` panels, in forward order; the title says when taps were left out.
    """
    measure(df, "mean_abs")  # the check that values were captured, with its message
    df, ranks = one_rank(df)
    title, run = titled_runs(df, run_columns(df))[0]
    title += ranks
    chosen = pick_steps(run["step"], n=2) if steps is None else [int(s) for s in steps]
    everything = forward_order(run)
    order = everything.head(max_taps)
    if len(everything) > max_taps:  # say so: a tap silently missing reads as a tap without values
        title = f"{title}; the first {max_taps} of {len(everything)} taps (max_taps=)" if title else \
            f"the first {max_taps} of {len(everything)} taps (max_taps=)"  # fmt: skip
    cols = min(4, len(order))
    fig = Figure(figsize=(3.2 * cols, 2.6 * -(-len(order) // cols)), layout="constrained")
    axes = fig.subplots(-(-len(order) // cols), cols, squeeze=False).ravel()
    rows_of_taps = order[["tap", "call", "label"]].itertuples(index=False)
    for ax, (tap, call, label) in zip(axes[: len(order)], rows_of_taps, strict=True):
        rows = run[(run["tap"] == tap) & (run["call"] == call)]
        for step, color in zip(chosen, _colors(len(chosen)), strict=True):
            values = [v for v in rows.loc[rows["step"] == step, "values"] if v is not None and len(v)]
            if values:
                flat = np.concatenate(values)
                bins = int(np.clip(np.sqrt(flat.size), 5, 50))
                ax.hist(flat, bins=bins, density=True, histtype="step", color=color, label=f"step {step}")
        ax.set_title(label, fontsize="small")
        ax.set_yticks([])  # densities: the shape matters, not the numbers
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.tick_params(labelsize="x-small")
    for ax in axes[len(order) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize="x-small")
    fig.suptitle(f"Gradient values ({title})" if title else "Gradient values")
    return fig


def plot_loss(steps: pd.DataFrame) -> Figure:
    """The loss over the steps, a line per run; a second panel with `grad_norm` when the steps table has it.

    Example::

        fig = plot_loss(load("outputs/2026-11-23/10-00-00-000000", table="steps"))
        fig.axes[0].get_ylabel()     # 'loss'

    A NaN/Inf loss leaves a gap from its first step, marked with a red line and named in the legend.
    Log scale when every finite loss is positive. The legend goes outside the axes (it never covers a line).
    GradrunnerError when neither column holds a value (`rec.step()` without a loss).
    """
    steps, ranks = one_rank(steps)
    columns = [c for c in ("loss", "grad_norm") if c in steps.columns and steps[c].notna().any()]
    if not columns:
        raise GradrunnerError("the steps table holds no loss and no grad_norm (not recorded): nothing to draw")
    fig, axes = _panels(len(columns), 8, 2.6)
    runs = titled_runs(
        steps, [c for c in run_columns(steps) if c != "run_id"] or ([] if steps["run_id"].nunique() < 2 else ["run_id"])
    )
    for ax, column in zip(axes, columns, strict=True):
        for (title, run), color in zip(runs, _colors(len(runs)), strict=True):
            run = run.sort_values("step", kind="stable")
            y = run[column].to_numpy(dtype=np.float64)
            ax.plot(run["step"], np.where(np.isfinite(y), y, np.nan), color=color, label=title or column)
            bad = run.loc[~np.isfinite(y), "step"]
            if len(bad):
                ax.axvline(int(bad.iloc[0]), color="tab:red", linestyle=":", linewidth=1,
                           label=f"{title + ': ' if title else ''}{column} NaN/Inf from step {int(bad.iloc[0])}")  # fmt: skip
        finite = steps[column].to_numpy(dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        if finite.size and (finite > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel(column.replace("_", " "))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ranks:
            ax.set_title(ranks.strip(" ()"), fontsize="small")
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("step")
    return fig
