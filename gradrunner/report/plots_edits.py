"""The edit-sweep panel: a sweep over an edit's strength, and what it did to the loss and the gradients around it.

Contents:
    edit_strength_column(df)   -- the swept `edits.N.<operation>` column of a sweep, or None
    edit_sweep(df)             -- per strength and tap: the mean gradient norm, where the tap lies (upstream,
                                  downstream or the edited tap itself), and the last step's loss
    plot_edit_sweep(df)        -- loss and gradient norms against the edit's strength

"Upstream" taps fire before the edited one in the forward pass: backward reaches them after the
edit, so the edit changes their gradients. "Downstream" taps fire after it: on the first step their
gradients are the same at every strength, later ones differ only through the weights. Parameter taps
take the place of their module's first non-parameter tap; without one they are left out.

Example::

    df = load("multirun/mlp-path")           # python -m gradrunner -m ... 'edits.0.scale=0,0.5,1'
    edit_sweep(df)                            # columns strength, tap, call, side, norm, edited_norm, loss
    plot_edit_sweep(df).savefig("edit.png")
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradrunner.analysis.summaries import forward_order

#: At most this many taps are drawn besides the edited one (the nearest to it in forward order).
MAX_TAPS = 8


def edit_strength_column(df: pd.DataFrame) -> str | None:
    """The swept override column of an edit's value (`edits.0.scale`, ...) with several numeric values, or None.

    Example::

        edit_strength_column(load("multirun/mlp-path"))   # 'edits.0.scale'
    """
    for column in df.columns:
        if str(column).startswith("edits.") and "edited" in df.columns:
            values = pd.to_numeric(df[column], errors="coerce")
            if values.notna().all() and values.nunique() > 1:
                return str(column)
    return None


def _sides(run: pd.DataFrame) -> pd.DataFrame:
    """(tap, call, position, side) for one run: upstream, edited or downstream of its first edited tap.

    Parameter taps (those with an `update_norm`) take the position of their module's first other tap.
    """
    order = forward_order(run)
    params = set(run.loc[run["update_norm"].notna(), "tap"]) if "update_norm" in run.columns else set()
    module = run.drop_duplicates("tap").set_index("tap")["module"]
    first_of_module: dict[str, float] = {}
    for tap, position in zip(order["tap"], order["position"], strict=True):
        if tap not in params:
            first_of_module.setdefault(str(module[tap]), float(position))
    order["position"] = [first_of_module.get(str(module[t]), np.nan) if t in params else float(p)
                         for t, p in zip(order["tap"], order["position"], strict=True)]  # fmt: skip
    edited = run.loc[run["edited"].fillna(False).astype(bool), "tap"]
    order["side"] = None
    if not edited.empty:
        at = order.loc[order["tap"] == edited.iloc[0], "position"].min()
        first = str(edited.iloc[0])
        order["side"] = [
            "edited" if t == first else "upstream" if p < at else "downstream" if p > at else None
            for t, p in zip(order["tap"], order["position"], strict=True)
        ]
    return order


def edit_sweep(df: pd.DataFrame, column: str | None = None) -> pd.DataFrame:
    """Per strength (the swept `column`) and tap: mean `norm` and `edited_norm` over the captured steps, the side, the last loss.

    Example::

        t = edit_sweep(load("multirun/mlp-path"))
        t[t.side == "upstream"].pivot(index=["tap", "call"], columns="strength", values="norm")

    Jobs that share a strength (a sweep over it and another key) are averaged. Empty without a swept edit.
    """
    column = column or edit_strength_column(df)
    if column is None:
        return pd.DataFrame(columns=["strength", "tap", "call", "side", "norm", "edited_norm", "loss"])
    rows = df.assign(strength=pd.to_numeric(df[column]))
    sides = _sides(rows[rows["run_id"] == rows["run_id"].iloc[0]])[["tap", "call", "side", "position"]]
    table = rows.groupby(["strength", "tap", "call"], sort=False).agg(norm=("norm", "mean"),
                                                                      edited_norm=("edited_norm", "mean")).reset_index()  # fmt: skip
    last = rows[rows["step"] == rows["step"].max()].groupby("strength")["loss"].mean().rename("loss")
    table = table.merge(sides, on=["tap", "call"], how="left").merge(last, on="strength", how="left")
    return table.sort_values(["strength", "position"], kind="stable").reset_index(drop=True)


def plot_edit_sweep(df: pd.DataFrame, column: str | None = None) -> Figure:
    """Left: the last step's loss against the edit's strength. Right: mean gradient norm per tap against it.

    Example::

        plot_edit_sweep(load("multirun/mlp-path")).savefig("edit.png")

    Upstream taps (their gradient passes the edit) are solid, downstream ones dashed; the edited tap is
    drawn twice, black: the gradient that arrived (solid) and the one the edit let through (dotted).
    """
    column = column or edit_strength_column(df)
    table = edit_sweep(df, column)
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_loss, ax_norm = fig.subplots(1, 2)
    loss = table.drop_duplicates("strength").sort_values("strength")
    ax_loss.plot(loss["strength"], loss["loss"], marker="o")
    ax_loss.set_xlabel(column or "edit strength")
    ax_loss.set_ylabel("loss at the last step")
    ax_loss.set_title("Loss", fontsize="medium")
    placed = table.dropna(subset=["side"])
    edited = placed[placed["side"] == "edited"]
    others = placed[placed["side"] != "edited"]
    at = edited["position"].min() if not edited.empty else 0.0
    keys = (others.drop_duplicates(["tap", "call"]).assign(distance=lambda t: (t["position"] - at).abs())
            .sort_values("distance", kind="stable").head(MAX_TAPS))  # fmt: skip
    for tap, call, side in keys[["tap", "call", "side"]].itertuples(index=False):
        line = others[(others.tap == tap) & (others.call == call)].sort_values("strength")
        label = f"{tap} [{call}]" if others[others.tap == tap]["call"].nunique() > 1 else tap
        ax_norm.plot(line["strength"], line["norm"], marker=".", linestyle="-" if side == "upstream" else "--",
                     label=f"{label} ({side})")  # fmt: skip
    for tap, line in edited.sort_values("strength").groupby("tap", sort=False):
        ax_norm.plot(line["strength"], line["norm"], color="black", marker="o", label=f"{tap!s}: arrived")
        ax_norm.plot(line["strength"], line["edited_norm"], color="black", linestyle=":", marker="o",
                     label=f"{tap!s}: after the edit")  # fmt: skip
    ax_norm.set_xlabel(column or "edit strength")
    ax_norm.set_ylabel("gradient norm, mean over captured steps")
    ax_norm.set_title("Gradients around the edit", fontsize="medium")
    if ax_norm.lines:
        ax_norm.legend(fontsize="x-small")
    return fig
