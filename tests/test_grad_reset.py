"""A parameter tap's record is the gradient accumulated in `.grad` since it was last reset: the one the optimiser uses.

A `zero_grad()` between a step's backwards (a GAN step's second optimiser, LBFGS's closure evaluating again,
Lightning's validation zeroing mid-window) leaves `.grad` None as the next backward begins: what arrived
before is in no `.grad`, and the record drops it (that parameter only). Before, the record summed every
gradient that arrived over the step's backwards, a gradient no optimiser stepped with (the hunt's repros
2, 4, 5). When every `.grad` was reset (LBFGS), the step starts again: its loss is the last evaluation's
(as Lightning reports it), activation taps keep the last backward's records, and `micro_step` is null.
References: plain torch, the `.grad` the optimiser steps with.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import regression_batches as _batches
from conftest import tanh_mlp as _mlp
from torch import nn

from gradrunner import capture, record

mse = nn.functional.mse_loss


def _rows(recs: Any) -> dict[str, dict[str, Any]]:
    return {r["tap"]: r for r in (recs.row(i) for i in range(len(recs)))}


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_a_zero_grad_between_backwards_drops_what_arrived_before(strategy: str) -> None:
    model = _mlp()
    (x1, y1), (x2, y2) = _batches(2)
    with capture(model, ["0:weight", "2:bias"], strategy=strategy, keep_grads=False, values="full") as cap:
        cap.backward(mse(model(x1), y1))
        model.zero_grad()  # set_to_none=True: the first backward's gradient is in no .grad
        cap.backward(mse(model(x2), y2))
        want = {"0:weight": model[0].weight.grad.clone(), "2:bias": model[2].bias.grad.clone()}
        recs = _rows(cap.records())
    for tap, g in want.items():
        assert recs[tap]["norm"] == pytest.approx(float(g.double().norm()), rel=1e-6), tap
        np.testing.assert_allclose(recs[tap]["values"], g.flatten().numpy(), rtol=1e-6, atol=1e-9)
        assert recs[tap]["micro_step"] is None


def test_only_the_parameters_reset_drop_their_earlier_gradients() -> None:
    """A GAN step: the generator's loss reaches both nets, only the discriminator's `.grad` is reset before its loss."""
    torch.manual_seed(0)
    g, d = nn.Linear(3, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"g": g, "d": d})
    gen = torch.Generator().manual_seed(1)
    x, real = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    with capture(model, ["g:weight", "d:weight"], keep_grads=False) as cap:
        g.zero_grad(), d.zero_grad()
        cap.backward(nn.functional.softplus(-d(g(x))).mean())  # reaches d too
        d.zero_grad()
        cap.backward(nn.functional.softplus(-d(real)).mean() + nn.functional.softplus(d(g(x).detach())).mean())
        want = {"g:weight": float(g.weight.grad.norm()), "d:weight": float(d.weight.grad.norm())}
        recs = _rows(cap.records())
    assert {t: recs[t]["norm"] for t in want} == pytest.approx(want, rel=1e-6)


def test_an_optimiser_that_stepped_before_the_reset_keeps_its_gradient(tmp_path: Path) -> None:
    """Lightning's GAN recipe: each optimiser steps and zeroes its own `.grad` before the other's backward, which
    reaches none of its parameters: every `.grad` is None as the second backward begins, yet the generator's
    record is what its optimiser used, and the step's loss and rows hold both backwards."""
    torch.manual_seed(0)
    g, d = nn.Linear(3, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"g": g, "d": d})
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    x, real = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    with record(model, ["g:output", "g:weight", "d:weight"], tmp_path / "run", anomaly=False) as rec:
        d.requires_grad_(False)  # toggle_optimizer(og)
        g_loss = nn.functional.softplus(-d(g(x))).mean()
        rec.backward(g_loss)
        want = {"g:weight": float(g.weight.grad.norm())}
        og.step(), og.zero_grad()
        d.requires_grad_(True), g.requires_grad_(False)  # toggle_optimizer(od)
        d_loss = nn.functional.softplus(-d(real)).mean() + nn.functional.softplus(d(g(x).detach())).mean()
        rec.backward(d_loss)
        want["d:weight"] = float(d.weight.grad.norm())
        od.step(), od.zero_grad()
        g.requires_grad_(True)
        result = rec.step()
    rows = pd.read_parquet(tmp_path / "run" / "grads.parquet")
    params = rows[rows["tap"] != "g:output"].set_index("tap")
    assert params["norm"].to_dict() == pytest.approx(want, rel=1e-6)
    assert result.loss == pytest.approx(float(g_loss.detach()) + float(d_loss.detach()), rel=1e-6)
    assert sorted(rows[rows["tap"] == "g:output"]["micro_step"].tolist()) == [0, 1]


def test_an_edited_parameter_reset_keeps_only_the_last_backwards_gradient() -> None:
    model = _mlp()
    (x1, y1), (x2, y2) = _batches(2)
    ref = _mlp()
    mse(ref(x2), y2).backward()
    arrived = float(ref[0].weight.grad.norm())  # the second backward's gradient before the edit
    with capture(model, ["0:weight"], keep_grads=False, edits=[{"tap": "0:weight", "scale": 0.5}]) as cap:
        cap.backward(mse(model(x1), y1))
        model.zero_grad()
        cap.backward(mse(model(x2), y2))
        after = float(model[0].weight.grad.norm())
        rec = _rows(cap.records())["0:weight"]
    assert rec["norm"] == pytest.approx(arrived, rel=1e-6)
    assert rec["edited_norm"] == pytest.approx(after, rel=1e-6)
    assert after == pytest.approx(arrived / 2, rel=1e-6)


def test_per_example_norms_of_a_parameter_reset_mid_step_are_null_with_why() -> None:
    model = _mlp()
    (x1, y1), (x2, y2) = _batches(2)
    with capture(model, ["0:weight"], keep_grads=False, per_example=True) as cap:
        cap.backward(mse(model(x1), y1))
        model.zero_grad()
        cap.backward(mse(model(x2), y2))
        with pytest.warns(UserWarning, match=r"0:weight is null: its \.grad was reset \(zero_grad\)"):
            rec = _rows(cap.records())["0:weight"]
    assert rec["per_example_norm"] is None
    assert rec["norm"] == pytest.approx(float(model[0].weight.grad.norm()), rel=1e-6)


def test_an_in_place_zero_is_not_seen_as_a_reset() -> None:
    """The documented limit: `zero_grad(set_to_none=False)` leaves a `.grad`; the record sums what arrived."""
    model = _mlp()
    (x1, y1), (x2, y2) = _batches(2)
    ref = _mlp()
    mse(ref(x1), y1).backward()
    mse(ref(x2), y2).backward()
    with capture(model, ["0:weight"], keep_grads=False) as cap:
        cap.backward(mse(model(x1), y1))
        model.zero_grad(set_to_none=False)
        cap.backward(mse(model(x2), y2))
        rec = _rows(cap.records())["0:weight"]
    assert rec["norm"] == pytest.approx(float(ref[0].weight.grad.norm()), rel=1e-6)


def _lbfgs_reference(steps: int) -> list[dict[str, Any]]:
    """Per step: each closure evaluation's loss, `0:output` gradient norm, `0:weight` `.grad` norm and total `.grad` norm."""
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    out = []
    for x, y in _batches(steps):
        seen: dict[str, list[float]] = {"loss": [], "out": [], "w": [], "total": []}

        def closure(x: torch.Tensor = x, y: torch.Tensor = y, seen: dict[str, list[float]] = seen) -> torch.Tensor:
            opt.zero_grad()
            h = model[0](x)
            h.retain_grad()
            loss = mse(model[2](model[1](h)), y)
            loss.backward()
            seen["loss"].append(float(loss.detach()))
            seen["out"].append(float(h.grad.norm()))
            seen["w"].append(float(model[0].weight.grad.norm()))
            seen["total"].append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).double().norm()))
            return loss

        opt.step(closure)
        out.append(seen)
    return out


def test_lbfgs_closures_record_the_last_evaluation(tmp_path: Path) -> None:
    """Each closure evaluation resets every `.grad`: the step's records and loss are its last evaluation's."""
    want = _lbfgs_reference(2)
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    with record(model, ["0:output", "0:weight"], tmp_path / "run", anomaly=False) as rec:
        for x, y in _batches(2):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = mse(model(x), y)
                rec.backward(loss)
                return loss

            opt.step(closure)
            rec.step()
    grads = pd.read_parquet(tmp_path / "run" / "grads.parquet").sort_values(["step", "tap"])
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet").sort_values("step")
    assert [len(w["loss"]) for w in want] == [3, 3]  # three evaluations a step: the case under test
    assert steps["loss"].tolist() == pytest.approx([w["loss"][-1] for w in want], rel=1e-6)
    assert grads["micro_step"].isna().all()
    for tap, key in (("0:output", "out"), ("0:weight", "w")):
        got = grads[grads["tap"] == tap]
        assert got["step"].tolist() == [0, 1], tap
        assert got["norm"].tolist() == pytest.approx([w[key][-1] for w in want], rel=1e-5), tap


def test_accumulation_without_a_reset_still_sums(tmp_path: Path) -> None:
    """Two micro-batches into one `.grad` (no zero_grad between): the record and loss are the sums, as before."""
    model, ref = _mlp(), _mlp()
    batches = _batches(2)
    for x, y in batches:
        (mse(ref(x), y) / 2).backward()
    with record(model, ["0:weight"], tmp_path / "run", anomaly=False) as rec:
        for x, y in batches:
            rec.backward(mse(model(x), y) / 2)
        result = rec.step()
    with torch.no_grad():
        losses = [float(mse(ref(x), y)) / 2 for x, y in batches]
    assert result.loss == pytest.approx(sum(losses), rel=1e-6)
    got = pd.read_parquet(tmp_path / "run" / "grads.parquet")
    assert got["norm"].tolist() == pytest.approx([float(ref[0].weight.grad.norm())], rel=1e-6)


def test_lightning_lbfgs_records_the_last_closure_evaluation(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradrunner.integrations.lightning import GradientCapture

    class LBFGSModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            return mse(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=3)

    want = _lbfgs_reference(2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.cat, zip(*_batches(2), strict=True))),
                                       batch_size=5)  # fmt: skip
    trainer = pl.Trainer(max_steps=2, callbacks=[GradientCapture(taps=["net.0:weight"], dir=tmp_path / "run")],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LBFGSModule(), data)
    grads = pd.read_parquet(tmp_path / "run" / "grads.parquet").sort_values("step")
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet").sort_values("step")
    assert grads["norm"].tolist() == pytest.approx([w["w"][-1] for w in want], rel=1e-5)
    assert steps["loss"].tolist() == pytest.approx([w["loss"][-1] for w in want], rel=1e-6)
    assert grads["micro_step"].isna().all()
    # grad_norm: the last evaluation's too (Lightning's on_before_optimizer_step follows each evaluation)
    assert steps["grad_norm"].tolist() == pytest.approx([w["total"][-1] for w in want], rel=1e-5)


def test_optimizer_steps_in_a_row_within_one_record_step_add_up_from_the_first_step_on(tmp_path: Path) -> None:
    """A WGAN step: three critic updates (zero_grad, backward, step), then the generator's, then one `rec.step()`.
    Every backward is part of the step, at step 0 too, where the generator has no `.grad` yet so that every `.grad`
    is None before the second and third critic backwards: they are steps in a row, not a closure evaluated again
    (they ran outside `optimizer.step()`). Step 0 kept only the last of them (a regression of the LBFGS rule)."""
    torch.manual_seed(0)
    g, d = nn.Linear(3, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    softplus = nn.functional.softplus
    want: list[tuple[float, int, float]] = []
    with record(nn.ModuleDict({"g": g, "d": d}), ["d:output", "d:weight"], tmp_path / "run", anomaly=False) as rec:
        for _ in range(2):
            total, calls = 0.0, 0
            for _ in range(3):
                d.zero_grad()
                x, real = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
                critic = softplus(d(g(x).detach())).mean() + softplus(-d(real)).mean()
                rec.backward(critic)
                opt_d.step()
                total, calls = total + float(critic), calls + 2
            g.zero_grad()
            gen_loss = softplus(-d(g(torch.randn(5, 3, generator=gen)))).mean()
            rec.backward(gen_loss)
            opt_g.step()
            want.append((total + float(gen_loss), calls + 1, float(d.weight.grad.double().norm())))
            rec.step()
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet").sort_values("step")
    grads = pd.read_parquet(tmp_path / "run" / "grads.parquet")
    assert steps["loss"].tolist() == pytest.approx([w[0] for w in want], rel=1e-6)
    assert grads[grads["tap"] == "d:output"].groupby("step").size().tolist() == [w[1] for w in want]
    weight = grads[grads["tap"] == "d:weight"].sort_values("step")["norm"].tolist()
    assert weight == pytest.approx([w[2] for w in want], rel=1e-6)  # the .grad after the generator's backward
