"""Figures of the optional columns: |g| histograms over steps, update ratios, per-example norm spread.

Contents:
    plot_histograms(df, max_taps)       -- per tap, a heat map of the |g| histogram over steps (as TensorBoard's)
    plot_update_ratios(df)              -- update / weight norm per parameter tap over steps, with the 1e-3 guide
    plot_per_example_spread(df)         -- per tap, how much the largest example's norm exceeds the median

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
from gradrunner.analysis.summaries import forward_order


def _first_run(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows of the first run in `rows`, and its taps in the order they appear."""
    rows = rows[rows["run_id"] == rows["run_id"].iloc[0]]
    return rows, list(dict.fromkeys(rows["tap"]))


def plot_histograms(df: pd.DataFrame, max_taps: int = 8) -> Figure:
    """One panel per tap (forward order, at most `max_taps`): steps down, |g| bins across, colour = share of elements.

    Example::

        plot_histograms(load("outputs/2026-11-23/10-00-00")).savefig("hist.png")

    Only the bins that are ever non-empty are drawn (side by side, each labelled); exact zeros and NaN/Inf
    have bins of their own, first and last.
    """
    run = df[df["run_id"] == df["run_id"].iloc[0]]
    order = forward_order(run[run["hist_counts"].notna()]).head(max_taps)
    fig = Figure(figsize=(9, 2.2 * max(len(order), 1)), layout="constrained")
    axes = fig.subplots(max(len(order), 1), 1, squeeze=False)[:, 0]
    labels = hist_bin_labels()
    for ax, (tap, call, label) in zip(axes, order[["tap", "call", "label"]].itertuples(index=False), strict=False):
        h = histograms_over_steps(run, tap, call)
        used = np.flatnonzero(h.to_numpy().sum(axis=0))  # bins empty at every step are left out
        used = used if used.size else np.arange(len(labels))
        share = h.iloc[:, used].div(h.sum(axis=1).replace(0, 1), axis=0).to_numpy(dtype=np.float64)
        image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap=colormaps["magma"], vmin=0,
                          extent=(-0.5, len(used) - 0.5, h.index.max() + 0.5, h.index.min() - 0.5))  # fmt: skip
        ticks = list(range(0, len(used), max(1, len(used) // 8)))
        ax.set_xticks(ticks, [labels[used[t]] for t in ticks], rotation=30, ha="right", fontsize="x-small")
        ax.set_ylabel("step")
        ax.set_title(f"|g| histogram: {label}", fontsize="medium")
        fig.colorbar(image, ax=ax, label="share of elements")
    return fig


def plot_update_ratios(df: pd.DataFrame) -> Figure:
    """`update_norm / value_norm` per parameter tap over steps (log scale), with the usual 1e-3 guide line.

    Example::

        plot_update_ratios(load("outputs/2026-11-23/10-00-00")).savefig("updates.png")
    """
    r, taps = _first_run(update_ratios(df))
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    colors = colormaps["viridis"](np.linspace(0, 0.9, max(len(taps), 1)))
    for tap, color in zip(taps, colors, strict=False):
        rows = r[r["tap"] == tap]
        ax.plot(rows["step"], rows["update_ratio"].where(rows["update_ratio"] > 0), label=tap, color=color)
    ax.axhline(UPDATE_RATIO_GUIDE, color="gray", linestyle="--", linewidth=1, label="1e-3 guide")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("update norm / weight norm")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no half-step ticks
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # off the lines
    return fig


def plot_per_example_spread(df: pd.DataFrame) -> Figure:
    """Per tap, the spread over steps of max/median per-example norm (1 means every example weighs the same).

    Example::

        plot_per_example_spread(load("outputs/2026-11-23/10-00-00")).savefig("examples.png")
    """
    s, taps = _first_run(per_example_spread(df))
    fig = Figure(figsize=(max(5.0, 0.6 * len(taps) + 2), 4), layout="constrained")
    ax = fig.subplots()
    data = [s.loc[s["tap"] == t, "dominance"].replace(np.inf, np.nan).dropna().to_numpy() for t in taps]
    ax.boxplot(data, tick_labels=taps)
    ax.set_yscale("log")
    ax.set_ylabel("max / median example norm")
    ax.tick_params(axis="x", rotation=45, labelsize="x-small")
    return fig
