"""Warnings while a run goes on: values=full records that will be huge, a run whose loss or gradients stay 0."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import compose_cfg

from gradrunner.records.columns import StepRecords, TapKey
from gradrunner.run import watch
from gradrunner.run.loop import train

WATCH = "gradrunner.run.watch"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings while the run goes on (the run summary at its end is tested in test_last_word.py)."""
    messages = [r.getMessage() for r in caplog.records if r.name == WATCH and r.levelno == logging.WARNING]
    return [m for m in messages if not m.startswith("run summary:")]


def test_a_loss_that_is_always_zero_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # cross-entropy over a single output is log_softmax of one logit: exactly 0, whatever the weights
    cfg = compose_cfg("+experiment=mlp", "loss=cross_entropy", "steps=12")
    with caplog.at_level(logging.INFO):
        train(cfg, out_dir=tmp_path)
    assert (pd.read_parquet(tmp_path / "steps.parquet").loss == 0).all()
    (message,) = warnings_of(caplog)
    assert message.startswith("The loss has been exactly 0 for the first 5 step(s): this run learns nothing")
    assert "loss=mse" in message


def test_a_run_that_learns_gives_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=6", "capture.values=full"), out_dir=tmp_path)
    assert warnings_of(caplog) == []


def test_every_gradient_zero_warns_even_with_a_nonzero_loss() -> None:
    recs = StepRecords(keys=[TapKey("a", "output", 0), TapKey("b", "output", 0)], numel=np.array([3, 4]),
                       has_grad=np.array([True, False]), stats={"norm": np.array([0.0, np.nan])})  # fmt: skip
    zeros = watch.ZeroWatch(total_steps=3)
    for step in range(3):
        zeros.step(step, 0.5, recs)
    assert zeros.warned
    moving = watch.ZeroWatch(total_steps=3)
    for step, norm in enumerate([0.0, 0.0, 1e-30]):
        moving.step(step, 0.5, StepRecords(keys=recs.keys, numel=recs.numel, has_grad=np.array([True, True]),
                                           stats={"norm": np.array([0.0, norm])}))  # fmt: skip
    assert not moving.warned


def test_values_full_warns_with_the_estimate_and_how_to_sample(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "VALUES_WARN_BYTES", 10_000)
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=10", "capture.every=2", "capture.values=full"), out_dir=tmp_path)
    records = pd.read_parquet(tmp_path / "grads.parquet")
    per_step = int(records[records.step == 0].numel.sum()) * 4  # float32 elements, counted from the records
    assert per_step * 5 == int(records["values"].map(len).sum()) * 4  # 5 captured steps, as estimated
    (message,) = warnings_of(caplog)
    assert message.startswith(f"capture.values=full will write about {watch._size(per_step * 5)} of gradient values")
    assert f"({watch._size(per_step)} per captured step x 5 captured steps)" in message
    assert "capture.values=sample capture.sample_size=64" in message
