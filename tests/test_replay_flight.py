"""Replay's kept checkpoints and starts (defects a hunt of the flight recorder found, 2026-11-27).

Runs are `run.job.run` in-process: the MLP experiment on tests/conf/data/spiky_batch (batch 30's inputs x 30,
a loss spike at step 30), SGD at lr 0.1, 34 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import compose_cfg

from gradrunner.run.autopsy import find_spike
from gradrunner.run.job import run

pytestmark = pytest.mark.slow

SPIKY = ("+experiment=mlp", "steps=34", "data=spiky_batch")


def _run(out: Path, *overrides: str) -> Path:
    run(compose_cfg(*overrides), out_dir=out)
    return out


def _kept(run_dir: Path) -> list[int]:
    return [s["step"] for s in json.loads((run_dir / "checkpoints" / "kept.json").read_text())["states"]]


def test_a_spike_before_its_replays_first_checkpoint_keeps_the_autopsys(tmp_path: Path) -> None:
    """S-K = 24 before the first checkpoint (25): the replay starts from the seed (step 0), and the checkpoint the
    autopsy branches from (25, the last at or before S) is kept; every one was removed."""
    out = _run(tmp_path / "run", *SPIKY, "train.checkpoint_every=25", "anomaly.replay=6")
    verdict = json.loads((out / "replay" / "step30" / "replay.json").read_text())
    assert verdict["start"] == 0 and verdict["exact"] is True
    again = pd.read_parquet(out / "replay" / "step30" / "steps.parquet").set_index("step")["loss"]
    original = pd.read_parquet(out / "steps.parquet").set_index("step")["loss"]
    pd.testing.assert_series_equal(again, original.loc[0:30], check_exact=True)
    assert _kept(out) == [25]
    spike = find_spike(out, None, 2)
    assert (spike.step, spike.start) == (30, 25)


def test_a_branch_runs_spike_is_replayed_from_where_it_branched(tmp_path: Path) -> None:
    """A branch run (first step 25) whose spike's S-K is before 25 was replayed from step 0: a false 'transient'.
    (Batch 30's inputs NaN: a NaN is flagged without warm-up, and the branch sees 9 steps.)"""
    nan = (*SPIKY, "data.scale=nan", "train.checkpoint_every=5")
    source = _run(tmp_path / "source", *nan, "anomaly.replay=3")
    out = _run(tmp_path / "branch", *nan, "anomaly.replay=6", f"train.branch_from={source}:25")
    verdict = json.loads((out / "replay" / "step30" / "replay.json").read_text())
    assert verdict["start"] == 25 and verdict["exact"] is True and verdict["first_difference"] is None
    again = pd.read_parquet(out / "replay" / "step30" / "steps.parquet").set_index("step")["loss"]
    original = pd.read_parquet(out / "steps.parquet").set_index("step")["loss"]
    pd.testing.assert_series_equal(again, original.loc[25:30], check_exact=True)


def test_an_unflagged_steps_threshold_leaves_the_flagged_spikes_out(tmp_path: Path) -> None:
    """--step 32 after a one-step spike at 30 (inputs x 5): the band took in the spike's value, as the rule does not."""
    import numpy as np

    out = _run(tmp_path / "run", *SPIKY, "data.scale=5.0")
    flagged = pd.read_parquet(out / "anomalies.parquet").query("signal == 'loss'")["step"].tolist()
    assert flagged == [30]
    losses = pd.read_parquet(out / "steps.parquet").set_index("step")["loss"]
    window = losses.loc[0:31].drop(index=30).to_numpy()
    expected = window.mean() + 6.0 * max(window.std(), 1e-3 * abs(window.mean()))
    assert np.isclose(find_spike(out, 32, 1).threshold, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scheduler", ["onecycle", "cosine"])
def test_a_branch_with_half_the_rate_has_half_the_runs_rate_at_every_step(tmp_path: Path, scheduler: str) -> None:
    """OneCycleLR recomputes lr from max_lr/min_lr: lr_half halved the branch's first step only."""
    import numpy as np

    src = (*SPIKY, "data.scale=nan", f"scheduler={scheduler}", "train.checkpoint_every=5")  # a NaN spike: kept 25
    if scheduler == "cosine":
        src = (*src, "scheduler.eta_min=0.01")  # a floor of its own: halved too
    source = _run(tmp_path / "source", *src, "anomaly.replay=3")
    out = _run(tmp_path / "branch", *src, f"train.branch_from={source}:25", "optimizer.lr=0.05")
    theirs = pd.read_parquet(source / "steps.parquet").set_index("step")["lr"].loc[25:]
    ours = pd.read_parquet(out / "steps.parquet").set_index("step")["lr"]
    assert ours.index.tolist() == list(range(25, 34))
    np.testing.assert_allclose(ours.to_numpy(), theirs.to_numpy() / 2, rtol=1e-12, atol=0)
