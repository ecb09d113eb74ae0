"""Figures of a large sweep: a median line per swept value with a quantile band, never a panel per run.

Contents:
    plot_over_steps(table, layout, taps, ylabel)   -- a panel per tap (rows) and facet value (columns), x = step
    plot_loss_over_steps(tables, layout)           -- the loss (and grad_norm) over the steps, a panel per facet value
    plot_flow_over_runs(table, layout, order)      -- the gradient flow at a few steps: x = taps in forward order

Each takes the table `gradrunner.analysis.aggregate.over_runs` returns (the numbers drawn are in it) and
the `SweepLayout` that says which run column colours the lines and which splits the facets. Sizes
are bounded whatever the number of runs: at most `MAX_TAPS` rows of panels and `MAX_LEVELS` facet
columns, in a figure no larger than `plots.PAGE_INCHES`.

Example::

    layout = sweep_layout(df)
    table = over_runs(df, "norm", layout, ["tap", "call", "step"])
    plot_over_steps(table, layout, pick_taps(df, MAX_TAPS), "norm").savefig("norms.png")
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradrunner.analysis.aggregate import SweepLayout
from gradrunner.report.plots import PAGE_INCHES, short_labels

#: Rows of panels (taps) drawn at most; the report says which taps were picked.
MAX_TAPS = 8


def _levels(table: pd.DataFrame, column: str | None) -> list[object]:
    return [None] if column is None else list(pd.unique(table[column]))


def _hue_colors(levels: Sequence[object]) -> list[tuple[float, float, float, float]]:
    """Ordered values (numbers) on a sequential map, others on a qualitative one."""
    if len(levels) > 1 and all(isinstance(v, (int, float, np.number)) for v in levels):
        return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.85, len(levels))]
    return [colormaps["tab10"](i % 10) for i in range(len(levels))]


def _select(table: pd.DataFrame, column: str | None, value: object) -> pd.DataFrame:
    if column is None:
        return table
    return table[table[column].isna()] if value is None or value != value else table[table[column] == value]


def _band(ax: Axes, rows: pd.DataFrame, x: str, color: object, label: str, positive: bool = True) -> None:
    """The median as a line with markers, the band shaded; values <= 0 (a log axis) and NaN leave gaps."""
    rows = rows.sort_values(x, kind="stable")
    xs = rows[x].to_numpy(dtype=np.float64)

    def clean(c: str) -> np.ndarray:
        v = rows[c].to_numpy(dtype=np.float64)
        return np.where(np.isfinite(v) & ((v > 0) | (not positive)), v, np.nan)

    ax.plot(xs, clean("median"), color=color, marker=".", markersize=4, linewidth=1.2, label=label)
    ax.fill_between(xs, clean("lo"), clean("hi"), color=color, alpha=0.2, linewidth=0)


def _log(ax: Axes) -> None:
    """Log scale, tick labels small (a panel spanning less than a decade labels its minor ticks); a panel whose lines
    hold no positive value (a tap's gradient 0 or NaN in every run drawn there) stays linear and empty, since
    matplotlib cannot place log ticks without one (it raised at savefig)."""
    if not any(np.any(np.asarray(line.get_ydata(), dtype=np.float64) > 0) for line in ax.lines):
        return
    ax.set_yscale("log")
    ax.tick_params(axis="y", which="both", labelsize="x-small")


def _grid(rows: int, cols: int, row_height: float, col_width: float) -> tuple[Figure, np.ndarray]:
    """A rows x cols grid sized to fit the page (panels shrink rather than the page grow)."""
    width = min(PAGE_INCHES[0], 2.5 + col_width * cols)
    height = min(PAGE_INCHES[1], 1.0 + row_height * rows)
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _legend(fig: Figure, ax: Axes, layout: SweepLayout) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        title = layout.hue or "median"
        fig.legend(handles, labels, title=title, fontsize="small", title_fontsize="small", loc="outside right upper")


def plot_over_steps(
    table: pd.DataFrame, layout: SweepLayout, taps: pd.DataFrame, ylabel: str, guide: float | None = None
) -> Figure:
    """A panel per tap of `taps` (rows, forward order) and per facet value (columns): over the steps, a median
    line per hue value with its band, log scale.

    Example::

        t = over_runs(df, "norm", layout, ["tap", "call", "step"])
        fig = plot_over_steps(t, layout, pick_taps(df, 8), "norm")
        fig.axes[0].get_lines()[0].get_ydata()    # the first hue value's medians at the first tap

    `table` is `over_runs(..., by=["tap", "call", "step"])`; `guide` draws a dashed horizontal line
    (the update ratio's 1e-3). A tap with no finite value in some panel leaves it empty.
    """
    facets, hues = _levels(table, layout.facet), _levels(table, layout.hue)
    colors = _hue_colors(hues)
    # a row per tap and a column per facet value; without facets the taps fill two columns
    wrap = 2 if layout.facet is None and len(taps) > 2 else 1
    rows_n = -(-len(taps) // wrap)
    fig, grid = _grid(rows_n, len(facets) * wrap, 1.8, 3.6)
    labels, prefix = short_labels(taps["label"])
    for i, (tap, call, label) in enumerate(zip(taps["tap"], taps["call"], labels, strict=True)):
        row = i // wrap
        at_tap = table[(table["tap"] == tap) & (table["call"] == call)]
        for col, facet in enumerate(facets):
            ax = grid[row, col * wrap + i % wrap]
            panel = _select(at_tap, layout.facet, facet)
            for hue, color in zip(hues, colors, strict=True):
                rows = _select(panel, layout.hue, hue)
                if len(rows):
                    _band(ax, rows, "step", color, "all runs" if hue is None else str(hue))
            if guide is not None:
                ax.axhline(guide, color="gray", linestyle="--", linewidth=1)
            if ax.lines:
                _log(ax)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize="x-small")
            ax.set_title(label if facet is None else f"{label}, {layout.facet}={facet}", fontsize="small")
            if col * wrap + i % wrap == 0:
                ax.set_ylabel(ylabel, fontsize="small")
            if row == rows_n - 1 or i + wrap >= len(taps):
                ax.set_xlabel("step", fontsize="small")
    for ax in grid.ravel()[len(taps) :] if wrap > 1 else []:
        ax.set_visible(False)
    _legend(fig, grid[0, 0], layout)
    fig.suptitle(f"{ylabel} per tap over the steps: {layout.short()}" + (f" (taps after {prefix!r})" if prefix else ""),
                 fontsize="medium")  # fmt: skip
    return fig


def plot_loss_over_steps(tables: dict[str, pd.DataFrame], layout: SweepLayout) -> Figure:
    """The loss (and each other column of `tables`, e.g. grad_norm) over the steps: a row per column, a panel
    per facet value, a median line per hue value with its band.

    Example::

        tables = {"loss": over_runs(steps, "loss", layout, ["step"])}
        plot_loss_over_steps(tables, layout).axes[0].get_ylabel()    # 'loss'
    """
    first = next(iter(tables.values()))
    facets, hues = _levels(first, layout.facet), _levels(first, layout.hue)
    colors = _hue_colors(hues)
    fig, grid = _grid(len(tables), len(facets), 2.6, 4.0)
    for row, (column, table) in enumerate(tables.items()):
        positive = bool((table["median"].dropna() > 0).all())
        for col, facet in enumerate(facets):
            ax = grid[row, col]
            panel = _select(table, layout.facet, facet)
            for hue, color in zip(hues, colors, strict=True):
                rows = _select(panel, layout.hue, hue)
                if len(rows):
                    _band(ax, rows, "step", color, "all runs" if hue is None else str(hue), positive=positive)
            if positive and ax.lines:
                _log(ax)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(column.replace("_", " ") if col == 0 else "")
            if facet is not None and row == 0:
                ax.set_title(f"{layout.facet}={facet}", fontsize="small")
            if row == len(tables) - 1:
                ax.set_xlabel("step")
    _legend(fig, grid[0, 0], layout)
    fig.suptitle(f"Loss over the steps: {layout.short()}", fontsize="medium")
    return fig


def plot_flow_over_runs(table: pd.DataFrame, layout: SweepLayout, order: pd.DataFrame) -> Figure:
    """Gradient flow across a sweep: a row per step of `table`, a panel per facet value; x = the taps of
    `order` in forward order, a median line per hue value with its band, log scale.

    Example::

        t = over_runs(df[df.step.isin([0, 99])], "norm", layout, ["step", "tap", "call"])
        plot_flow_over_runs(t, layout, forward_order(df))

    Parameter taps (`weight`, `bias`) are drawn with dashed lines, apart from the activations'.
    """
    from gradrunner.report.plots import WEIGHTS, tap_kind

    steps = sorted(int(s) for s in pd.unique(table["step"]))
    facets, hues = _levels(table, layout.facet), _levels(table, layout.hue)
    colors = _hue_colors(hues)
    labels, prefix = short_labels(order["label"])
    kinds = np.array([tap_kind(str(t).split(":", 1)[-1]) for t in order["tap"]])
    t = table.merge(order[["tap", "call", "position"]], on=["tap", "call"], how="inner")
    fig, grid = _grid(len(steps), len(facets), 2.4, max(5.0, 0.45 * len(order)))
    for row, step in enumerate(steps):
        for col, facet in enumerate(facets):
            ax = grid[row, col]
            panel = _select(t[t["step"] == step], layout.facet, facet)
            for hue, color in zip(hues, colors, strict=True):
                rows = _select(panel, layout.hue, hue)
                for kind in dict.fromkeys(kinds):
                    part = rows[kinds[rows["position"].to_numpy()] == kind] if len(rows) else rows
                    if len(part):
                        label = ("all runs" if hue is None else str(hue)) if kind != WEIGHTS else "_"
                        _band(ax, part, "position", color, label)
                        if kind == WEIGHTS:
                            ax.lines[-1].set_linestyle("--")
            if ax.lines:
                _log(ax)
            ax.set_title(f"step {step}" + (f", {layout.facet}={facet}" if facet is not None else ""), fontsize="small")
            ax.set_xticks(range(len(order)), labels if row == len(steps) - 1 else [],
                          rotation=60, ha="right", fontsize="x-small")  # fmt: skip
            ax.grid(True, which="major", alpha=0.3)
            if col == 0:
                ax.set_ylabel("norm", fontsize="small")
    for ax in grid[-1]:
        ax.set_xlabel("tap, in forward order" + (f" (after {prefix!r})" if prefix else ""), fontsize="small")
    _legend(fig, grid[0, 0], layout)
    fig.suptitle(f"Gradient flow: {layout.short()}\n(dashed: weights and biases)", fontsize="medium")
    return fig
