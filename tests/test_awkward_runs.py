"""Awkward runs through `train(cfg)`: half precision, a loss that turns NaN part-way (recorded, or
`capture.on_nonfinite=stop`), infinite gradients under a finite loss, and a compiled model in a
user's `--config-dir` captured by the CLI (`python -m gradrunner`, inside the test's process: `conftest.python_m`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TESTS, compose_cfg, gradrunner_in_process

from gradrunner.errors import GradrunnerError
from gradrunner.run.guards import NonFinite
from gradrunner.run.loop import train


def records(directory: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    return pd.read_parquet(directory / "grads.parquet"), pd.read_parquet(directory / "steps.parquet")


# -- half precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, rtol", [("bfloat16", 5e-2), ("float16", 1e-2)])
def test_half_precision_runs_record_float32_statistics_close_to_float32(
    tmp_path: Path, dtype: str, rtol: float
) -> None:
    for name in ("float32", dtype):
        cfg = compose_cfg("+experiment=mlp", "steps=2", f"dtype={name}", "capture.values=full")
        train(cfg, out_dir=tmp_path / name)
    ref, _ = records(tmp_path / "float32")
    half, steps = records(tmp_path / dtype)
    assert set(half.dtype) == {dtype} and half.has_grad.all()
    assert np.isfinite(half.norm).all() and (half.nan_count == 0).all() and steps.loss.notna().all()
    assert all(v.dtype == np.float32 and len(v) == n for v, n in zip(half["values"], half.numel, strict=True))
    first = half[half.step == 0].set_index(["tap", "call"]).norm
    expected = ref[ref.step == 0].set_index(["tap", "call"]).norm
    np.testing.assert_allclose(first.sort_index(), expected.sort_index(), rtol=rtol)


# -- non-finite values -----------------------------------------------------------------------------
def test_a_loss_that_turns_nan_is_recorded_by_default(tmp_path: Path) -> None:
    train(compose_cfg("loss=nan_after", "steps=4"), out_dir=tmp_path)
    grads, steps = records(tmp_path)
    assert sorted(grads.step.unique()) == [0, 1, 2, 3] and steps.step.tolist() == [0, 1, 2, 3]
    first, later = grads[grads.step == 0], grads[grads.step >= 1]
    assert (first.nan_count == 0).all() and np.isfinite(first.loss).all()
    assert (later.nan_count > 0).all() and later.loss.isna().all()  # (ReLU's backward zeroes some)
    head = later[later.tap == "head:output"]
    assert (head.nan_count == head.numel).all()
    assert math.isnan(steps.loss.iloc[1]) and not math.isnan(steps.loss.iloc[0])


def test_on_nonfinite_stop_ends_the_run_at_that_step_and_keeps_what_was_written(tmp_path: Path) -> None:
    with pytest.raises(NonFinite) as info:
        train(compose_cfg("loss=nan_after", "steps=5", "capture.on_nonfinite=stop"), out_dir=tmp_path)
    message = str(info.value)
    assert message.startswith("capture.on_nonfinite=stop: stopped at step 1, where the loss is nan and 5 tap(s)")
    assert "(first: fc1:output, relu1:output, fc2:output)" in message and str(tmp_path) in message
    assert isinstance(info.value, GradrunnerError) and info.value.step == 1
    grads, steps = records(tmp_path)
    assert sorted(grads.step.unique()) == [0, 1] and steps.step.tolist() == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anomalies.parquet", "grads.parquet", "steps.parquet"]


def test_on_nonfinite_stop_checks_the_loss_of_steps_it_does_not_capture(tmp_path: Path) -> None:
    cfg = compose_cfg("loss=nan_after", "steps=5", "capture.every=2", "capture.on_nonfinite=stop")
    with pytest.raises(NonFinite, match=r"stopped at step 1, where the loss is nan\. "):
        train(cfg, out_dir=tmp_path)
    grads, steps = records(tmp_path)
    assert sorted(grads.step.unique()) == [0] and steps.step.tolist() == [0, 1]


def test_on_nonfinite_stop_sees_infinite_gradients_under_a_finite_loss(tmp_path: Path) -> None:
    cfg = compose_cfg("loss=sqrt_at_zero", "steps=3", "capture.on_nonfinite=stop", "taps=['*:output',head:weight]")
    with pytest.raises(NonFinite, match=r"stopped at step 0, where 6 tap\(s\) have NaN or Inf gradient elements "
                       r"\(first: fc1:output, relu1:output, fc2:output\)"):  # fmt: skip
        train(cfg, out_dir=tmp_path)
    grads, _ = records(tmp_path)
    assert grads.loss.tolist() == [0.0] * len(grads)
    head = grads[grads.tap == "head:output"].iloc[0]
    assert head.inf_count == head.numel


# -- a user's compiled model, through the real CLI -------------------------------------------------
@pytest.mark.slow
def test_the_cli_captures_a_compiled_model_from_a_config_dir(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "--config-dir", str(TESTS / "conf"), "model=compiled", "steps=2")
    assert result.returncode == 0, result.stderr
    (path,) = tmp_path.rglob("grads.parquet")
    grads = pd.read_parquet(path)
    assert sorted(grads.step.unique()) == [0, 1] and grads.has_grad.all() and np.isfinite(grads.norm).all()
    assert not grads.tap.str.contains("_orig_mod").any()  # the eager model's paths
