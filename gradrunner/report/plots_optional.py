"""Figures of the optional columns: |g| histograms over steps, update ratios, per-example norm spread.

Contents:
    plot_histograms(df, max_taps)       -- per tap, a heat map of the |g| histogram over steps (as TensorBoard's)
    plot_update_ratios(df)              -- update / weight norm per parameter tap over steps, with the 1e-3 guide
    plot_per_example_spread(df)         -- per tap, how much the largest example's norm exceeds the median
    plot_noise_scale(ns)                -- the smoothed gradient noise scale per parameter tap over steps

A sweep gets a panel (or a column of panels) per run that has the column, each with its own steps.

Like `plots`, each returns a pyplot-free `matplotlib.figure.Figure` built from one helper's DataFrame
(`gradrunner.analysis.optional`), so the numbers behind a picture are one call away.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradrunner.analysis.optional import (
    UPDATE_RATIO_GUIDE,
    hist_bin_labels,
    histograms_over_steps,
    per_example_spread,
    update_ratios,
)
from gradrunner.analysis.summaries import forward_order, run_columns
from gradrunner.report.plots import one_rank, titled_runs


def plot_histograms(df: pd.DataFrame, max_taps: int = 8) -> Figure:
    """One panel per tap (forward order, at most `max_taps`) and run: steps down, |g| bins across, colour = share of elements.

    Example::

        plot_histograms(load("outputs/2026-11-23/10-00-00")).savefig("hist.png")

    Only the bins that are ever non-empty are drawn (side by side, each labelled); exact zeros and NaN/Inf
    have bins of their own, first and last. A sweep gets a column of panels per run that has histograms
    (titled by its swept values), each with its own steps (integer ticks).
    """
    with_hist, ranks = one_rank(df[df["hist_counts"].notna()])
    order = forward_order(with_hist).head(max_taps)
    runs = titled_runs(with_hist, run_columns(with_hist)) if len(with_hist) else [("", with_hist)]
    n = max(len(order), 1)
    fig = Figure(figsize=(max(9.0, 6.0 * len(runs)), 2.2 * n), layout="constrained")
    grid = fig.subplots(n, len(runs), squeeze=False)
    labels = hist_bin_labels()
    taps = order[["tap", "call", "label"]].itertuples(index=False)
    for row, (tap, call, label) in enumerate(taps):
        for col, (title, run) in enumerate(runs):
            ax = grid[row, col]
            name = (f"{title}: {label}" if len(runs) > 1 and title else f"|g| histogram: {label}") + ranks
            ax.set_title(name, fontsize="medium")
            if not ((run["tap"] == tap) & (run["call"] == call)).any():
                ax.set_axis_off()
                continue
            h = histograms_over_steps(run, tap, call)
            used = np.flatnonzero(h.to_numpy().sum(axis=0))  # bins empty at every step are left out
            used = used if used.size else np.arange(len(labels))
            share = h.iloc[:, used].div(h.sum(axis=1).replace(0, 1), axis=0).to_numpy(dtype=np.float64)
            image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap=colormaps["magma"], vmin=0,
                              extent=(-0.5, len(used) - 0.5, h.index.max() + 0.5, h.index.min() - 0.5))  # fmt: skip
            ticks = list(range(0, len(used), max(1, len(used) // 8)))
            ax.set_xticks(ticks, [labels[used[t]] for t in ticks], rotation=30, ha="right", fontsize="x-small")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no half-step ticks
            ax.set_ylabel("step")
            fig.colorbar(image, ax=ax, label="share of elements")
    return fig


def plot_update_ratios(df: pd.DataFrame) -> Figure:
    """`update_norm / value_norm` per parameter tap over steps (log scale), with the usual 1e-3 guide line.

    Example::

        plot_update_ratios(load("outputs/2026-11-23/10-00-00")).savefig("updates.png")

    A sweep gets a panel per run that has update ratios (titled by its swept values), each with its own
    steps (a 2-step job and a 5-step job each span their own x axis, integer ticks); the legend sits
    outside the axes.
    """
    update_ratios(df)  # raises, naming the option, when no row has one
    rows_with, ranks = one_rank(df[df["update_ratio"].notna()])
    runs = [(t, rows) for t, rows in titled_runs(rows_with, run_columns(rows_with))]
    fig = Figure(figsize=(8, 3.2 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (title, run) in zip(axes, runs, strict=True):
        r = update_ratios(run)
        taps = list(dict.fromkeys(r["tap"]))
        colors = colormaps["viridis"](np.linspace(0, 0.9, max(len(taps), 1)))
        for tap, color in zip(taps, colors, strict=False):
            rows = r[r["tap"] == tap].sort_values("step", kind="stable")
            ax.plot(rows["step"], rows["update_ratio"].where(rows["update_ratio"] > 0), label=tap, color=color)
        ax.axhline(UPDATE_RATIO_GUIDE, color="gray", linestyle="--", linewidth=1, label="1e-3 guide")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("update norm / weight norm")
        if (len(runs) > 1 and title) or ranks:
            ax.set_title((title if len(runs) > 1 else "") + ranks, fontsize="medium")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no half-step ticks
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # off the lines
    return fig


def plot_per_example_spread(df: pd.DataFrame) -> Figure:
    """Per tap, the spread over steps of max/median per-example norm (1 means every example weighs the same).

    Example::

        plot_per_example_spread(load("outputs/2026-11-23/10-00-00")).savefig("examples.png")

    A sweep gets a panel per run that has per-example norms (titled by its swept values).
    """
    per_example_spread(df)  # raises, naming the option, when no row has one
    rows_with = df[df["per_example_norm"].notna()]
    runs = titled_runs(rows_with, run_columns(rows_with))
    taps = list(dict.fromkeys(rows_with["tap"]))
    fig = Figure(figsize=(max(5.0, 0.6 * len(taps) + 2), 4 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (title, run) in zip(axes, runs, strict=True):
        s = per_example_spread(run)
        shown = [t for t in taps if (s["tap"] == t).any()]
        data = [s.loc[s["tap"] == t, "dominance"].replace(np.inf, np.nan).dropna().to_numpy() for t in shown]
        ax.boxplot(data, tick_labels=shown)
        ax.set_yscale("log")
        ax.set_ylabel("max / median example norm")
        ax.tick_params(axis="x", rotation=45, labelsize="x-small")
        if len(runs) > 1 and title:
            ax.set_title(title, fontsize="medium")
    return fig


def plot_noise_scale(ns: pd.DataFrame) -> Figure:
    """`b_simple_ema` per parameter tap over steps (log scale), the whole model (`"*"`) in black; `ns` is
    `gradrunner.analysis.noise_scale(df, ema=...)`'s frame.

    Example::

        plot_noise_scale(noise_scale(load("outputs/2026-11-25/10-00-00"), ema=0.9)).savefig("noise.png")

    A sweep gets a panel per run (titled by its run id); non-positive estimates (a noisy g2 on a small
    batch) are left out of the log axis.
    """
    runs = list(ns.groupby("run_id", sort=False)) if "run_id" in ns.columns else [("", ns)]
    fig = Figure(figsize=(8, 3.2 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (run_id, run) in zip(axes, runs, strict=True):
        taps = [t for t in dict.fromkeys(run["tap"]) if t != "*"]
        colors = colormaps["viridis"](np.linspace(0, 0.9, max(len(taps), 1)))
        for tap, color in [*zip(taps, colors, strict=False), ("*", "black")]:
            rows = run[run["tap"] == tap].sort_values("step", kind="stable")
            y = rows["b_simple_ema"].where(rows["b_simple_ema"] > 0)
            ax.plot(rows["step"], y, label="whole model (*)" if tap == "*" else tap, color=color,
                    linewidth=2 if tap == "*" else 1)  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("B_simple (smoothed)")
        if len(runs) > 1:
            ax.set_title(str(run_id), fontsize="medium")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig
