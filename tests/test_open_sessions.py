"""Sessions open together: `hook` and `retain_grad` ones each record the true gradients; none beside `autograd_grad`.

Before the refusal, a `record()` opened inside `capture(..., strategy="autograd_grad")` (or the reverse) recorded
'takes no part in the loss' for a parameter whose `.grad` the step had just filled: `autograd_grad` calls each
parameter's accumulator itself, which runs no other session's hooks. The reference is the parameter's `.grad` of
the same step without gradrunner.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from gradrunner import capture, record
from gradrunner.errors import GradrunnerError

TAPS = ["0:output", "0:weight"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _true_weight_grad_norm() -> float:
    plain = _model()
    plain(_x()).pow(2).mean().backward()
    return plain[0].weight.grad.norm().item()  # type: ignore[union-attr]


def _weight_norm(run: Path) -> float:
    df = pd.read_parquet(run / "grads.parquet")
    row = df[df.tap == "0:weight"].iloc[0]
    assert row.has_grad, row.reason
    return float(row.norm)


@pytest.mark.parametrize("other", ["hook", "retain_grad", "autograd_grad"])
def test_record_inside_an_autograd_grad_capture_is_refused_naming_both(tmp_path: Path, other: str) -> None:
    model, run = _model(), tmp_path / "run"
    with capture(model, TAPS, strategy="autograd_grad") as cap:
        with pytest.raises(GradrunnerError) as refused, record(model, TAPS, run, strategy=other):
            pass
        loss = model(_x()).pow(2).mean()
        cap.backward(loss)  # the open session goes on as before
        recs = cap.records(loss)
    message = str(refused.value)
    assert f"record() into {str(run.resolve())!r} (strategy={other!r}) cannot be opened while " in message
    assert "capture(Sequential, strategy='autograd_grad') is open" in message and "\n" not in message
    assert not run.exists()  # refused before the run dir was looked at
    assert recs.has_grad.all() and recs.stats["norm"][1] == pytest.approx(_true_weight_grad_norm(), rel=1e-6)


@pytest.mark.parametrize("outer", ["hook", "retain_grad"])
def test_an_autograd_grad_capture_inside_record_is_refused_and_the_record_stays_true(
    tmp_path: Path, outer: str
) -> None:
    model = _model()
    with record(model, TAPS, tmp_path / "run", strategy=outer) as rec:
        with pytest.raises(GradrunnerError, match=r"capture\(Sequential, strategy='autograd_grad'\) cannot be opened"):
            with capture(model, TAPS, strategy="autograd_grad"):
                pass
        loss = model(_x()).pow(2).mean()
        loss.backward()
        rec.step(loss)
    assert _weight_norm(tmp_path / "run") == pytest.approx(_true_weight_grad_norm(), rel=1e-6)
    with capture(model, TAPS, strategy="autograd_grad"):  # alone again: opens
        pass


@pytest.mark.parametrize(("outer", "inner"), [("hook", "retain_grad"), ("retain_grad", "hook"), ("hook", "hook")])
def test_nested_hook_and_retain_grad_sessions_both_record_the_true_gradient(
    tmp_path: Path, outer: str, inner: str
) -> None:
    model = _model()
    with capture(model, TAPS, strategy=outer) as cap, record(model, TAPS, tmp_path / "run", strategy=inner) as rec:
        loss = model(_x()).pow(2).mean()
        loss.backward()
        rec.step(loss)
        recs = cap.records(loss)
    truth = _true_weight_grad_norm()
    assert recs.has_grad.all() and recs.stats["norm"][1] == pytest.approx(truth, rel=1e-6)
    assert _weight_norm(tmp_path / "run") == pytest.approx(truth, rel=1e-6)
