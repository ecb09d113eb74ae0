"""Records under accumulation, one per step (issue 36 items 7, 8): `combine_micro_steps` against plain torch.

The reference: the same MLP, the step's two micro-batches side by side as one batch, the loss the mean
of the two micro-batches' MSE (what `train.accumulate=2` optimises); the gradient of that loss with
respect to the whole batch's activations, and its statistics, computed with torch here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import compose_cfg
from torch import nn

from gradrunner.analysis import load, tap_summary
from gradrunner.analysis.micro import combine_micro_steps
from gradrunner.models import MLP
from gradrunner.run.loop import train

SHAPE = {"in_features": 8, "hidden": 8, "depth": 2, "out_features": 1}
TAPS = ["fc1:output", "relu1:output", "fc2:weight"]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("acc")
    torch.manual_seed(3)
    torch.save(MLP(**SHAPE).state_dict(), tmp / "init.pt")
    cfg = compose_cfg(
        "+experiment=mlp", "steps=3", f"+model.init_from={tmp / 'init.pt'}", "model.hidden=8", "model.depth=2",
        f"taps=[{','.join(TAPS)}]", "device=cpu", "data.batch_size=8", "data.num_samples=64", "train.accumulate=2",
        "optimizer.lr=0.1", "capture.histogram=true", "capture.per_example=true",
    )  # fmt: skip
    train(cfg, out_dir=tmp / "run")
    return tmp


def _reference(tmp: Path) -> list[dict[str, torch.Tensor]]:
    """Per step, the gradient of each activation tap over the whole batch (both micro-batches), plain torch."""
    model = MLP(**SHAPE)
    model.load_state_dict(torch.load(tmp / "init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((64, 8), generator=gen, dtype=torch.float64)
    teacher = torch.randn((8, 1), generator=gen, dtype=torch.float64) / math.sqrt(8)
    y = (x @ teacher + 0.1 * torch.randn((64, 1), generator=gen, dtype=torch.float64)).float()
    x = x.float()
    out = []
    for step in range(3):
        xb, yb = x[step * 16 : step * 16 + 16], y[step * 16 : step * 16 + 16]
        h1 = model.fc1(xb)
        h1.retain_grad()
        r1 = model.relu1(h1)
        r1.retain_grad()
        pred = model.head(model.relu2(model.fc2(r1)))
        loss = (nn.functional.mse_loss(pred[:8], yb[:8]) + nn.functional.mse_loss(pred[8:], yb[8:])) / 2
        opt.zero_grad()
        loss.backward()
        out.append({"fc1:output": h1.grad.clone(), "relu1:output": r1.grad.clone(), "fc2:weight": model.fc2.weight.grad.clone(),
                    "loss": loss.detach()})  # fmt: skip
        opt.step()
    return out


def test_combined_records_are_the_whole_batch_gradient(accumulated: Path) -> None:
    df = load(accumulated / "run")
    assert df.micro_step.notna().any()
    per_step = combine_micro_steps(df)
    assert len(per_step) == 3 * len(TAPS) and not per_step.duplicated(["step", "tap", "call"]).any()
    assert per_step.micro_step.isna().all()
    for step, ref in enumerate(_reference(accumulated)):
        for tap in TAPS:
            row = per_step[(per_step.step == step) & (per_step.tap == tap)].iloc[0]
            g = ref[tap].double()
            assert row.numel == g.numel() and list(row["shape"]) == list(g.shape)
            for stat, want in (("norm", g.norm()), ("mean", g.mean()), ("std", g.std()), ("min", g.min()),
                               ("max", g.max()), ("abs_max", g.abs().max()), ("zero_frac", (g == 0).double().mean())):  # fmt: skip
                assert row[stat] == pytest.approx(float(want), rel=1e-5, abs=1e-9), (step, tap, stat)
            if tap != "fc2:weight":
                np.testing.assert_allclose(row["per_example_norm"], g.norm(dim=1).numpy(), rtol=1e-5)
            assert int(np.sum(row["hist_counts"])) == g.numel()
        assert per_step[per_step.step == step].loss.iloc[0] == pytest.approx(float(ref["loss"]), rel=1e-6)
    assert (per_step.loc[per_step.tap == "fc1:output", "zero_frac"] > 0).any()  # dead units: zeros were counted


def test_tap_summary_counts_steps_not_micro_batches(accumulated: Path) -> None:
    summary = tap_summary(load(accumulated / "run")).set_index("tap")
    assert summary.loc[["fc1:output", "relu1:output", "fc2:weight"], "steps"].tolist() == [3, 3, 3]  # not 6 for activations
    ref = _reference(accumulated)
    assert summary.loc["fc1:output", "first"] == pytest.approx(float(ref[0]["fc1:output"].norm()), rel=1e-5)
    assert summary.loc["fc1:output", "last"] == pytest.approx(float(ref[2]["fc1:output"].norm()), rel=1e-5)


def test_without_micro_steps_nothing_changes() -> None:
    df = pd.DataFrame({"step": [0, 0], "tap": ["a:output", "b:output"], "call": [0, 0], "norm": [1.0, 2.0],
                       "has_grad": [True, True], "micro_step": [None, None]})  # fmt: skip
    assert combine_micro_steps(df) is df


def test_a_tap_one_micro_batch_did_not_reach_keeps_the_others_per_example_norms() -> None:
    """A branch taken in micro-batch 0 only ("module not called" in micro-batch 1): the combined record is that of
    the micro-batches with a gradient (norm, numel, shape: micro-batch 0's), but its per_example_norm was null (found
    2026-11-27), so per_example_spread and the report's per-example table left the tap out."""
    df = pd.DataFrame({"run_id": "r", "step": [0, 0], "tap": "side:output", "call": 0, "micro_step": [0, 1],
                       "has_grad": [True, False], "norm": [5.0, None], "numel": [2, 0], "mean": [1.0, None],
                       "shape": [np.array([2, 1]), np.array([], dtype=np.int64)],
                       "per_example_norm": [np.array([3.0, 4.0]), None]})  # fmt: skip
    row = combine_micro_steps(df).iloc[0]
    assert row.norm == 5.0 and row.numel == 2 and list(row["shape"]) == [2, 1]
    np.testing.assert_array_equal(row["per_example_norm"], [3.0, 4.0])


def test_a_micro_batch_that_gave_an_expert_no_tokens_adds_nothing_to_its_statistics() -> None:
    """An expert given tokens in micro-batch 0 and none in micro-batch 1 (a (0, d) gradient: numel 0, mean/min/max/
    zero_frac without a value) was combined into NaN mean, std, min, max, abs_max and zero_frac (found 2026-11-27).
    The combined record is now the statistics of micro-batch 0's gradient, computed by torch."""
    from gradrunner.analysis.micro import combine_micro_steps

    g = torch.tensor([[0.0, -1.5], [2.0, 0.25]], dtype=torch.float64)
    stat = {"numel": 4, "norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std()), "min": float(g.min()),
            "max": float(g.max()), "abs_max": float(g.abs().max()), "zero_frac": float((g == 0).double().mean())}  # fmt: skip
    empty = {"numel": 0, "norm": 0.0, **dict.fromkeys(["mean", "std", "min", "max", "abs_max", "zero_frac"], np.nan)}
    df = pd.DataFrame([{"run_id": "r", "step": 0, "tap": "experts.2:output", "call": 0, "micro_step": m,
                        "has_grad": True, "nan_count": 0, "inf_count": 0, **s} for m, s in enumerate([stat, empty])])  # fmt: skip
    got = combine_micro_steps(df).iloc[0]
    for name, want in stat.items():
        assert got[name] == pytest.approx(want, rel=1e-12), name
