"""A figure of what the training step did (`steps.parquet`): grad norm with the clipping threshold, and lr.

Example::

    steps = pd.read_parquet("runs/pre/steps.parquet")
    plot_training(steps, clip=1.0).savefig("training.png")

Built without pyplot, like every figure of `gradrunner.report.plots` (the `gradrunner[report]` extra).
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure


def plot_training(steps: pd.DataFrame, clip: float | None = None) -> Figure:
    """Two panels over the steps: `grad_norm` (log scale; clipped steps marked, `clip` as a dashed line),
    and `lr` (with `eval_loss` on a second axis where there is one; skipped fp16 steps marked)."""
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps["step"], steps["grad_norm"], lw=1, label="grad_norm (before clipping)")
    if "clipped" in steps and steps["clipped"].any():
        hit = steps[steps["clipped"].fillna(False).astype(bool)]
        top.scatter(hit["step"], hit["grad_norm"], s=8, color="tab:red", label=f"clipped ({len(hit)} steps)")
    if clip is not None:
        top.axhline(clip, ls="--", color="black", lw=1, label=f"clip_grad_norm={clip:g}")
    top.set_yscale("log")
    top.set_ylabel("total gradient norm")
    top.legend(loc="best", fontsize="small")
    bottom.plot(steps["step"], steps["lr"], color="tab:green", lw=1, label="lr")
    if "skipped" in steps and steps["skipped"].fillna(False).astype(bool).any():
        skipped = steps[steps["skipped"].fillna(False).astype(bool)]
        bottom.scatter(skipped["step"], skipped["lr"], marker="x", color="tab:red", label="skipped (fp16 inf/NaN)")
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper left", fontsize="small")
    if "eval_loss" in steps and steps["eval_loss"].notna().any():
        ev = steps[steps["eval_loss"].notna()]
        twin = bottom.twinx()
        twin.plot(ev["step"], ev["eval_loss"], "o-", color="tab:purple", ms=3, lw=1, label="eval_loss")
        twin.set_ylabel("eval loss")
        twin.legend(loc="upper right", fontsize="small")
    return fig
