"""Your own data: any iterable of (inputs, targets) or of dicts (a DataLoader given as `_target_`), forward_kwargs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from awkward import DictDataset, KwargsModel
from conftest import compose_cfg

from gradrunner.data import as_batches, call
from gradrunner.run.loop import train

CPU = torch.device("cpu")


def reference_grads(scale: float, steps: int) -> list[float]:
    """Plain torch: the norm of d loss / d fc.weight per step, SGD lr 0.1, batches of 4 in order, cycled."""
    torch.manual_seed(0)  # the runner seeds with seed=0 before building the model
    model = KwargsModel()
    data = DictDataset(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(steps):
        i = (step % 4) * 4
        x, y = data.x[i : i + 4], data.y[i : i + 4]
        loss = torch.nn.functional.mse_loss(model(x, scale=scale), y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(model.fc.weight.grad.norm()))
        opt.step()
    return norms


def test_a_dataloader_of_dicts_as_target_trains_with_the_labels_as_targets(tmp_path: Path) -> None:
    cfg = compose_cfg("model=kwargs", "data=loader_of_dicts", "loss=mse", "taps=[fc:weight]", "steps=6",
                      "optimizer.lr=0.1", "device=cpu")  # fmt: skip
    train(cfg, out_dir=tmp_path)
    got = pd.read_parquet(tmp_path / "grads.parquet").sort_values("step")["norm"].tolist()
    assert got == pytest.approx(reference_grads(1.0, 6), rel=1e-5)


def test_forward_kwargs_reach_every_forward_call(tmp_path: Path) -> None:
    cfg = compose_cfg("model=kwargs", "data=loader_of_dicts", "loss=mse", "taps=[fc:weight]", "steps=3",
                      "optimizer.lr=0.1", "device=cpu", "+forward_kwargs={scale: 2.0}")  # fmt: skip
    train(cfg, out_dir=tmp_path)
    got = pd.read_parquet(tmp_path / "grads.parquet").sort_values("step")["norm"].tolist()
    assert got == pytest.approx(reference_grads(2.0, 3), rel=1e-5)


def test_tensor_inputs_get_forward_kwargs_as_keywords() -> None:
    x, y = torch.randn(2, 8), torch.randn(2, 1)
    model = KwargsModel()
    inputs, targets = next(as_batches([(x, y)], CPU, torch.float32, {"scale": 3.0}))
    torch.testing.assert_close(call(model, inputs), model.fc(x) * 3.0)
    assert torch.equal(targets, y)


def test_a_list_of_dict_batches_is_cycled_and_cast() -> None:
    batches = [{"x": [[1.0] * 8], "labels": [[0.5]], "ids": [[1, 2]]}]
    it = as_batches(batches, CPU, torch.float64)
    for _ in range(2):
        inputs, targets = next(it)
        assert inputs["x"].dtype == torch.float64 and inputs["ids"].dtype == torch.int64
        assert targets.tolist() == [[0.5]]
