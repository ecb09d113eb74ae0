"""`plot_training`: the lines it draws are the steps table's columns."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("matplotlib")

from gradrunner.report.plots_training import plot_training


def test_plot_training_draws_grad_norm_clip_line_and_lr() -> None:
    steps = pd.DataFrame({
        "step": np.arange(6), "grad_norm": [0.5, 2.0, 3.0, 0.8, 1.5, 0.9], "lr": [0.1, 0.2, 0.3, 0.3, 0.2, 0.1],
        "clipped": [False, True, True, False, True, False], "skipped": [None] * 6,
        "eval_loss": [np.nan, 1.0, np.nan, 0.9, np.nan, 0.8],
    })  # fmt: skip
    fig = plot_training(steps, clip=1.0)
    top, bottom = fig.axes[:2]
    assert list(top.lines[0].get_ydata()) == steps["grad_norm"].tolist()
    assert list(top.lines[1].get_ydata()) == [1.0, 1.0]  # the threshold
    assert len(top.collections[0].get_offsets()) == 3  # the clipped steps
    assert list(bottom.lines[0].get_ydata()) == steps["lr"].tolist()
    assert list(fig.axes[2].lines[0].get_ydata()) == [1.0, 0.9, 0.8]
