"""The helpers over the optional columns report exactly what was planted in hand-made records."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest

from gradrunner.analysis.optional import (
    UPDATE_RATIO_GUIDE,
    hist_bin_labels,
    histograms_over_steps,
    per_example_spread,
    update_ratios,
)
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import HIST_BINS


def _rows(**columns: list[object]) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {"run_id": ["r"] * n, "call": [0] * n}
    return pd.DataFrame({**base, **columns})


def test_histograms_over_steps_returns_the_planted_counts_per_step() -> None:
    counts = [np.arange(HIST_BINS) * (s + 1) for s in range(3)]
    df = _rows(step=[0, 1, 2, 0], tap=["a:output"] * 3 + ["b:output"], hist_counts=[*counts, np.zeros(HIST_BINS)])
    h = histograms_over_steps(df, "a:output")
    assert list(h.index) == [0, 1, 2] and list(h.columns) == hist_bin_labels() and len(h.columns) == HIST_BINS
    assert h.loc[2].tolist() == (np.arange(HIST_BINS) * 3).tolist()
    with pytest.raises(GradrunnerError, match="no histogram rows for tap 'c:output'.*a:output, b:output"):
        histograms_over_steps(df, "c:output")


def test_update_ratios_flags_the_layer_above_the_guide() -> None:
    df = _rows(step=[0, 0, 0], tap=["fast:weight", "slow:weight", "x:output"],
               update_norm=[1.0, 1e-5, None], value_norm=[10.0, 1.0, 3.0], update_ratio=[0.1, 1e-5, None])  # fmt: skip
    r = update_ratios(df)
    assert r["tap"].tolist() == ["fast:weight", "slow:weight"]
    assert r["above_guide"].tolist() == [True, False] and UPDATE_RATIO_GUIDE == 1e-3
    np.testing.assert_allclose(r["log10_ratio"], [-1.0, -5.0])


def test_per_example_spread_names_the_dominant_example() -> None:
    df = _rows(step=[0, 0], tap=["h:output", "g:output"],
               per_example_norm=[np.array([1.0, 1.0, 10.0, 1.0]), np.array([2.0, 2.0])])  # fmt: skip
    s = per_example_spread(df).set_index("tap")
    assert s.loc["h:output", "top_example"] == 2 and s.loc["h:output", "dominance"] == 10.0
    assert s.loc["h:output", "top_share"] == pytest.approx(100 / 103)
    assert s.loc["g:output", "dominance"] == 1.0 and s.loc["g:output", "n_examples"] == 2


def test_per_example_spread_of_nan_norms_names_no_example() -> None:
    """A NaN norm (a NaN gradient) read as dominance inf, top_example = the NaN row (0 when all are NaN) and
    top_share 0 (found 2026-11-27): which row is largest is unknown there, and the report's most_often_top
    counted those rows."""
    nan = float("nan")
    df = _rows(step=[0, 1, 2, 3], tap=["h:output"] * 4,
               per_example_norm=[np.array([1.0, 4.0, 1.0]), np.array([nan, nan, nan]), np.array([nan, nan, nan]),
                                 np.array([1.0, nan, 8.0])])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning either
        s = per_example_spread(df).set_index("step")
    assert s.loc[0, "top_example"] == 1 and s.loc[0, "dominance"] == 4.0
    assert s.loc[0, "top_share"] == pytest.approx(16 / 18)
    for step in (1, 2, 3):
        assert pd.isna(s.loc[step, "top_example"]) and np.isnan(s.loc[step, ["dominance", "top_share"]]).all()
    assert s["top_example"].dropna().mode().tolist() == [1]


def test_per_example_spread_of_zero_norms_names_no_example() -> None:
    """Every row's norm exactly 0 (a dead ReLU layer): dominance inf, top_example 0 and top_share 0 (found
    2026-11-27), as if row 0 dominated; no row contributes, so none is named. Most rows 0 and one not: that one."""
    df = _rows(step=[0, 1], tap=["h:output"] * 2, per_example_norm=[np.zeros(3), np.array([0.0, 0.0, 3.0])])
    s = per_example_spread(df).set_index("step")
    assert pd.isna(s.loc[0, "top_example"]) and np.isnan(s.loc[0, ["dominance", "top_share"]]).all()
    assert s.loc[0, "max_norm"] == 0.0 and s.loc[0, "n_examples"] == 3
    assert s.loc[1, "top_example"] == 2 and s.loc[1, "dominance"] == np.inf and s.loc[1, "top_share"] == 1.0


def test_per_example_spread_under_accumulation_is_one_row_per_step_over_the_whole_batch() -> None:
    """train.accumulate=2: an activation tap's micro-batches gave two rows per (step, tap, call), nothing telling
    them apart, and `top_example` a row of the micro-batch (found 2026-11-27). One row per step now, over the step's
    rows in micro-batch order, as a parameter tap's record holds them: micro-batch 1's row 0 is row 2."""
    df = _rows(step=[0, 0, 0], tap=["h:output", "h:output", "p:weight"], micro_step=[0, 1, None],
               has_grad=[True, True, True],
               per_example_norm=[np.array([1.0, 2.0]), np.array([8.0, 1.0]), np.array([0.5, 1.0, 4.0, 0.5])])  # fmt: skip
    s = per_example_spread(df).set_index("tap")
    assert len(s) == 2 and s.loc["h:output", "n_examples"] == 4 and s.loc["h:output", "top_example"] == 2
    assert s.loc["h:output", "dominance"] == pytest.approx(8.0 / 1.5)
    assert s.loc["h:output", "top_share"] == pytest.approx(64 / 70)
    assert s.loc["p:weight", "top_example"] == 2 and s.loc["p:weight", "n_examples"] == 4


def test_missing_optional_column_names_the_option() -> None:
    df = _rows(step=[0], tap=["a:output"])
    with pytest.raises(GradrunnerError, match=r"no 'per_example_norm' values; run with capture.per_example=true"):
        per_example_spread(df)
    with pytest.raises(GradrunnerError, match=r"capture.histogram=true"):
        histograms_over_steps(df, "a:output")


def _planted_records() -> pd.DataFrame:
    rows = []
    for step in range(3):
        for tap in ("a:output", "b:weight"):
            counts = np.zeros(HIST_BINS, np.int64)
            counts[80 + step] = 3
            counts[90] = 1
            rows.append({"run_id": "r", "step": step, "tap": tap, "call": 0, "module": tap.split(":")[0],
                         "name": tap.split(":")[1], "has_grad": True, "hist_counts": counts,
                         "per_example_norm": np.array([1.0, 4.0]), "value_norm": 2.0,
                         "update_norm": 2e-3 * (step + 1) if tap == "b:weight" else None,
                         "update_ratio": 1e-3 * (step + 1) if tap == "b:weight" else None})  # fmt: skip
    return pd.DataFrame(rows)


def test_figures_show_the_helpers_numbers() -> None:
    pytest.importorskip("matplotlib")
    from gradrunner.report.plots_optional import plot_histograms, plot_per_example_spread, plot_update_ratios

    df = _planted_records()
    hist = plot_histograms(df)
    image = hist.axes[0].images[0].get_array()
    assert image.shape == (3, 4)  # steps x the bins ever non-empty (80, 81, 82, 90): empty ones are dropped
    ticks = [t.get_text() for t in hist.axes[0].get_xticklabels()]
    assert ticks == [hist_bin_labels()[b] for b in (80, 81, 82, 90)]
    np.testing.assert_allclose(image[1, 1], 0.75) and np.testing.assert_allclose(image[:, -1], 0.25)
    line = plot_update_ratios(df).axes[0].lines[0]
    np.testing.assert_allclose(line.get_ydata(), [1e-3, 2e-3, 3e-3])
    assert plot_update_ratios(df).axes[0].lines[-1].get_ydata()[0] == 1e-3  # the guide
    box = plot_per_example_spread(df).axes[0]
    assert [t.get_text() for t in box.get_xticklabels()] == ["a:output", "b:weight"]
