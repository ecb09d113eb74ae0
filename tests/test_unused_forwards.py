"""A forward with gradients on that no backward of the step uses (a metric computed in eval mode after the
backward, a step skipped on a bad loss before its backward) belongs to that step: it is not carried into the
next step's records, where it used to take call 0 ("takes no part in the loss") and push the next training
forward to call 1. Reference: plain tensor hooks, which number every step's training forward call 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import regression_batches as _batches
from conftest import tanh_mlp as _model
from torch import nn

from gradrunner import capture, record
from gradrunner.analysis import load


def _reference(batches: list[tuple[torch.Tensor, torch.Tensor]], skip: int | None = None) -> list[float]:
    """Each trained step's gradient norm of layer 0's output, by a plain tensor hook (no gradrunner)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list[float] = []
    for i, (x, y) in enumerate(batches):
        if i == skip:
            continue
        h = model[0](x)
        h.register_hook(lambda g: norms.append(float(g.norm())))
        nn.functional.mse_loss(model[2](model[1](h)), y).backward()
        opt.step()
        opt.zero_grad()
    return norms


def test_a_metric_forward_after_the_backward_is_not_the_next_steps_call_0(strategy: str) -> None:
    batches = _batches(3)
    expected = _reference(batches)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    with capture(model, ["0:output"], strategy=strategy) as cap:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            model.eval()
            model(x)  # a metric, gradients on, no backward
            model.train()
            opt.step()
            opt.zero_grad()
            recs = cap.records(loss)
            got.append([(r["call"], r["has_grad"], r["norm"]) for r in map(recs.row, range(len(recs)))])
    for step, (rows, norm) in enumerate(zip(got, expected, strict=True)):
        assert [r[:2] for r in rows] == [(0, True)], f"step {step}: {rows}"
        assert rows[0][2] == pytest.approx(norm, rel=1e-6), f"step {step}"


@pytest.mark.parametrize("variant", ["metric_after_backward", "skipped_step"])
def test_record_numbers_each_steps_training_forward_call_0(tmp_path: Path, strategy: str, variant: str) -> None:
    batches = _batches(3)
    skip = 1 if variant == "skipped_step" else None
    expected = _reference(batches, skip)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, ["0:output"], tmp_path / "run", strategy=strategy) as rec:
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            if i == skip:  # a bad batch: its step closes without a backward
                rec.step(loss)
                continue
            rec.backward(loss)
            if skip is None:
                with torch.enable_grad():
                    model(x)  # a metric forward with gradients on
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "run").sort_values("step")
    trained = [s for s in range(len(batches)) if s != skip]
    assert df.step.tolist() == trained
    assert df.call.tolist() == [0] * len(trained)
    assert df.has_grad.tolist() == [True] * len(trained)
    assert df.norm.tolist() == pytest.approx(expected, rel=1e-6)
