"""The edit-sweep panel's table reports exactly what was planted in hand-made sweep records."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gradrunner.report.plots_edits import edit_strength_column, edit_sweep


def _sweep() -> pd.DataFrame:
    """Two steps of three jobs, `edits.0.scale` = 0, 0.5, 1 on `b:output`; `a` fires before it, `c` after."""
    rows = []
    for job, scale in enumerate([0.0, 0.5, 1.0]):
        for step in (0, 1):
            base = {"run_id": f"r{job}", "job": job, "edits.0.scale": scale, "step": step, "call": 0,
                    "loss": 2.0 - scale - step * 0.1}  # fmt: skip
            rows += [
                {**base, "tap": "a:output", "module": "a", "norm": 1.0 + scale + step, "edited": False, "edited_norm": np.nan,
                 "update_norm": np.nan},
                {**base, "tap": "b:output", "module": "b", "norm": 2.0, "edited": True, "edited_norm": 2.0 * scale,
                 "update_norm": np.nan},
                {**base, "tap": "c:output", "module": "c", "norm": 3.0, "edited": False, "edited_norm": np.nan,
                 "update_norm": np.nan},
                {**base, "tap": "a:weight", "module": "a", "norm": 4.0 * scale, "edited": False, "edited_norm": np.nan,
                 "update_norm": 0.1},
            ]  # fmt: skip
    return pd.DataFrame(rows)


def test_the_sweep_table_places_taps_around_the_edit_and_averages_over_steps() -> None:
    df = _sweep()
    assert edit_strength_column(df) == "edits.0.scale"
    t = edit_sweep(df)
    side = dict(zip(t.tap, t.side, strict=False))
    assert side == {"a:output": "upstream", "a:weight": "upstream", "b:output": "edited", "c:output": "downstream"}
    at_half = t[t.strength == 0.5].set_index("tap")
    assert at_half.loc["a:output", "norm"] == pytest.approx(2.0)  # (1.5 + 2.5) / 2
    assert at_half.loc["b:output", "edited_norm"] == pytest.approx(1.0)
    assert t.drop_duplicates("strength").set_index("strength").loss.to_dict() == pytest.approx({0.0: 1.9, 0.5: 1.4, 1.0: 0.9})


def test_no_swept_edit_means_no_panel() -> None:
    df = _sweep()
    one = df[df["edits.0.scale"] == 0.5]
    assert edit_strength_column(one) is None and edit_sweep(one).empty
