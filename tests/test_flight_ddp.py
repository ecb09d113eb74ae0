"""The spike detector under DDP (two gloo ranks under torchrun): the loss signal is the mean of the ranks' losses.

The data (tests/conf/data/spiky_batch) corrupts batch 61 only; rank r takes every 2nd batch from r, so rank 1
draws it at step 30 and rank 0 never does. The detector used to see rank 0's loss alone: the spike on rank 1
was flagged a step late (when it reached rank 0 through the averaged gradient), or not at all.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import SEARCHPATH, check_ok
from rank_launch import gradrunner_torchrun

from gradrunner.analysis.anomaly_signals import detect_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("flight_ddp")
    check_ok(gradrunner_torchrun(cwd, "+experiment=mlp", "data=spiky_batch", "data.at_batch=61", "steps=34", SEARCHPATH,
                       "hydra.run.dir=run"))  # fmt: skip
    return cwd / "run"


def _reference_first_flag(values: list[float], z: float = 6.0, window: int = 128, warmup: int = 20) -> int | None:
    """The documented rule on a linear signal, naively: the index of the first flagged value."""
    kept: list[float] = []
    for i, x in enumerate(values):
        if not math.isfinite(x):
            return i
        if len(kept) >= warmup:
            w = np.array(kept[-window:])
            sd = max(float(w.std()), 1e-3 * abs(float(w.mean())))
            if (x - w.mean()) / sd > z:
                return i
        kept.append(x)
    return None


def test_a_spike_on_rank_1_is_flagged_at_its_step_with_the_mean_loss(run_dir: Path) -> None:
    steps = pd.read_parquet(run_dir / "steps.parquet", columns=["step", "rank", "loss"])
    per_rank = steps.pivot(index="step", columns="rank", values="loss")
    assert per_rank.loc[30, 1] > 100 * per_rank.loc[30, 0]  # the planted spike, on rank 1 only
    mean = ((per_rank[0] + per_rank[1]) / 2).tolist()
    assert _reference_first_flag(mean) == 30
    assert _reference_first_flag(per_rank[0].tolist()) != 30  # rank 0's loss alone does not flag step 30
    got = pd.read_parquet(run_dir / "anomalies.parquet")
    loss = got[got["signal"] == "loss"].sort_values("step")
    assert int(loss["step"].iloc[0]) == 30
    assert loss["value"].iloc[0] == mean[30]  # the ranks' mean, bit for bit
    # offline (detect_run over the records) agrees with the run, value for value
    offline = detect_run(run_dir).anomalies
    assert [a.step for a in offline if a.signal == "loss"] == loss["step"].astype(int).tolist()
    np.testing.assert_array_equal([a.value for a in offline if a.signal == "loss"], loss["value"])  # NaN-equal
