"""The step engine (issue 33) and what it changed for `record()` (issue 36 items 4, 5, 13).

- a user's own `loss.backward()` under `hook` and `retain_grad` gives the records `cap.backward(loss)` /
  `rec.backward(loss)` give, also with autograd's end-of-backward callbacks forced off; `autograd_grad`
  refuses it in one paragraph;
- a session that saw backwards but closed no step says so and is not marked complete;
- `record(..., scaler=scaler)`: true gradients and loss under a GradScaler, against plain torch;
- `record()` on CPU writes `peak_memory_bytes` as the runner does; `load(dir, live=True)` reads a runner job;
- a parameter whose gradient accumulator changes (`model.double()`) or whose `.data` is replaced between
  steps is still read right.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import compose_cfg
from torch import nn

import gradrunner
from gradrunner import capture
from gradrunner.analysis import load
from gradrunner.capturing import torch_compat
from gradrunner.data import Batch, Synthetic, as_batches
from gradrunner.errors import GradrunnerError

TAPS = ["0:output", "1:output", "0:weight", "2:bias"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64))
            for _ in range(n)]  # fmt: skip


def _steps(strategy: str, own_backward: bool, accumulate: int = 2, **kw: Any) -> list[Any]:
    """Two optimiser steps of `accumulate` micro-batches each, under `capture`; each step's records."""
    model, batches = _model(), _batches(2 * accumulate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    with capture(model, TAPS, strategy=strategy, keep_grads=False, **kw) as cap:
        for s in range(2):
            for m in range(accumulate):
                x, y = batches[s * accumulate + m]
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                loss.backward() if own_backward else cap.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(cap.records())
    return out


def _same(a: list[Any], b: list[Any]) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys == rb.keys and ra.micro_step == rb.micro_step and ra.reason == rb.reason
        for c in ra.stats:
            np.testing.assert_array_equal(ra.stats[c], rb.stats[c], err_msg=c)
        np.testing.assert_array_equal(ra.value_norm, rb.value_norm)


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
@pytest.mark.parametrize("edits", [None, [{"tap": "0:weight", "scale": 0.5}, {"tap": "1:output", "noise_std": 0.1}]],
                         ids=["plain", "edited"])  # fmt: skip
def test_the_users_own_backward_gives_the_records_of_cap_backward(strategy: str, edits: Any) -> None:
    ours = _steps(strategy, own_backward=False, edits=edits)
    theirs = _steps(strategy, own_backward=True, edits=edits)
    _same(theirs, ours)
    assert ours[0].micro_step == [0, 0, 1, 1, None, None]  # activations per backward, parameters per step
    if edits:
        np.testing.assert_array_equal(ours[1].edited_norm, theirs[1].edited_norm)


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_without_end_of_backward_callbacks_the_backward_ends_lazily_with_the_same_records(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _steps(strategy, own_backward=True)
    monkeypatch.setitem(torch_compat.FEATURES, "queue_callback", False)
    _same(_steps(strategy, own_backward=True), want)


def test_autograd_grad_refuses_a_backward_it_did_not_run() -> None:
    model, [(x, y)] = _model(), _batches(1)
    with capture(model, TAPS, strategy="autograd_grad") as cap:
        loss = nn.functional.mse_loss(model(x), y)
        with pytest.raises(GradrunnerError, match=r"autograd_grad.*cannot read a loss.backward\(\) it did not run.*"
                                                  r"cap.backward\(loss\).*hook or retain_grad") as err:  # fmt: skip
            loss.backward()
        assert "\n" not in str(err.value)
        cap.backward(nn.functional.mse_loss(model(x), y))  # its own call works, the refused forward forgotten
        assert cap.records().has_grad.all()


def test_record_with_the_users_own_backward_equals_rec_backward(tmp_path: Path) -> None:
    runs = {}
    for own in (False, True):
        model, batches = _model(), _batches(4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradrunner.record(model, TAPS, tmp_path / str(own), histogram=True) as rec:
            for s in range(2):
                total = torch.zeros((), dtype=torch.float64)
                for x, y in batches[2 * s : 2 * s + 2]:
                    loss = nn.functional.mse_loss(model(x), y) / 2
                    total = total + loss.detach()
                    loss.backward() if own else rec.backward(loss)
                opt.step()
                opt.zero_grad()
                rec.step(total if own else None)  # rec.backward: the losses it was given, summed
        runs[own] = pd.read_parquet(tmp_path / str(own) / "grads.parquet")
    cols = ["step", "tap", "call", "micro_step", "norm", "mean", "max", "has_grad", "value_norm", "loss"]
    pd.testing.assert_frame_equal(runs[True][cols], runs[False][cols])
    assert runs[True].hist_counts.map(list).tolist() == runs[False].hist_counts.map(list).tolist()


@pytest.mark.parametrize("close_steps", [0, 1], ids=["no step closed", "a step left open"])
def test_backwards_that_no_step_closed_are_said_and_the_run_is_not_complete(
    tmp_path: Path, close_steps: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 36 item 4: the user's own loss.backward() is captured; forgetting rec.step() is no silent success."""
    model, batches = _model(), _batches(3)
    with caplog.at_level(logging.WARNING), gradrunner.record(model, TAPS, tmp_path / "r") as rec:
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if i < close_steps:
                rec.step(loss)
    assert "backward(s) were captured after the last rec.step() but no step closed them" in caplog.text
    assert "is not marked complete" in caplog.text
    assert not (tmp_path / "r" / "done.json").exists()
    assert len(load(tmp_path / "r", table="steps")) == close_steps


def test_record_with_the_users_own_backward_writes_its_steps(tmp_path: Path) -> None:
    """Issue 36 item 4: the most natural loop (loss.backward(), rec.step(loss)) records every step, complete."""
    model, batches = _model(), _batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, TAPS, tmp_path / "r") as rec:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "r")
    assert sorted(set(df.step)) == [0, 1, 2] and df.has_grad.all() and len(df) == 3 * len(TAPS)
    assert (tmp_path / "r" / "done.json").is_file()


def test_record_with_a_grad_scaler_holds_the_true_gradients_and_loss(tmp_path: Path) -> None:
    """Issue 36 item 5: `record(..., scaler=scaler)` with the loop the README shows for a GradScaler."""
    def loop(rec: Any | None) -> tuple[nn.Module, list[dict[str, float]]]:
        model, batches = _model().float(), _batches(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        seen: list[dict[str, float]] = []
        run = gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "r", scaler=scaler) if rec else None
        with run if run is not None else _nothing():
            for x, y in batches:
                loss = nn.functional.mse_loss(model(x.float()), y.float())
                if run is not None:
                    run.backward(scaler.scale(loss))  # the scaled loss: the records divide by the scale
                else:
                    scaler.scale(loss).backward()
                scaler.unscale_(opt)
                seen.append({"loss": float(loss.detach()), "0:weight": float(model[0].weight.grad.norm())})
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                if run is not None:
                    run.step()  # the step's loss: what rec.backward was given, divided by the scale
        return model, seen

    _, plain = loop(None)
    _, _ = loop(True)
    df = load(tmp_path / "r")
    weight = df[df.tap == "0:weight"].sort_values("step")
    np.testing.assert_allclose(weight.norm, [s["0:weight"] for s in plain], rtol=1e-5)
    steps = load(tmp_path / "r", table="steps")
    np.testing.assert_allclose(steps.loss, [s["loss"] for s in plain], rtol=1e-5)
    assert (weight.norm < 100).all()  # a scaled gradient would be about 1024 times larger


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_record_on_cpu_writes_peak_memory_as_the_runner_does(tmp_path: Path) -> None:
    model, batches = _model(), _batches(2)
    with gradrunner.record(model, TAPS, tmp_path / "r") as rec:
        for x, y in batches:
            rec.backward(nn.functional.mse_loss(model(x), y))
            rec.step()
    steps = load(tmp_path / "r", table="steps")
    assert steps.peak_memory_bytes.notna().all() and (steps.peak_memory_bytes > 10_000_000).all()  # RSS, bytes


class PeekLive:
    """Synthetic batches that read the running job's records live (`load(dir, live=True)`) at batch `at_batch`."""

    seen: ClassVar[dict[str, Any]] = {}

    def __init__(self, run_dir: str, at_batch: int, **synthetic: Any) -> None:
        self.run_dir, self.at_batch, self.inner = run_dir, at_batch, Synthetic(**synthetic)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.inner, device, dtype)):
            if i == self.at_batch:
                PeekLive.seen["grads"] = load(self.run_dir, live=True)
                PeekLive.seen["steps"] = load(self.run_dir, table="steps", live=True)
            yield batch


def test_live_load_reads_a_runner_job_while_it_runs(tmp_path: Path) -> None:
    """Issue 36 item 13: the runner writes live segments through the step engine, as record() does. Run with the
    run dir's books (`run.job.run`, as the CLI does): the live run is the one whose lock holds the dir."""
    from gradrunner.run.job import run as run_job

    run = tmp_path / "run"
    cfg = compose_cfg("+experiment=mlp", "steps=25", "data._target_=test_engine.PeekLive", f"+data.run_dir={run}",
                      "+data.at_batch=23")  # fmt: skip
    run_job(cfg, out_dir=run)
    grads, steps = PeekLive.seen["grads"], PeekLive.seen["steps"]
    assert list(steps.step) == list(range(20)) and sorted(set(grads.step)) == list(range(20))  # 2 segments of 10
    final = load(run)
    pd.testing.assert_frame_equal(grads.reset_index(drop=True), final[final.step < 20].reset_index(drop=True))
    assert not (run / ".live").exists()


@pytest.mark.parametrize("change", ["double", "data"])
def test_a_parameter_changed_between_steps_is_read_from_its_new_accumulator(strategy: str, change: str) -> None:
    """`model.double()` gives every parameter a new gradient accumulator; `p.data = ...` of the same dtype keeps
    it. The held edges follow: each step's parameter records equal `.grad` of a plain backward."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    with capture(model, ["0:weight", "2:bias", "0:output"], strategy=strategy, keep_grads=False) as cap:
        for step in range(2):
            if step == 1:
                if change == "double":
                    model.double()
                    x = x.double()
                else:
                    model[0].weight.data = torch.randn(4, 3)
            model.zero_grad(set_to_none=True)
            cap.backward(model(x).pow(2).sum())
            recs = cap.records()
            rows = {k.tap: i for i, k in enumerate(recs.keys)}
            for tap, p in (("0:weight", model[0].weight), ("2:bias", model[2].bias)):
                assert p.grad is not None
                assert recs.stats["norm"][rows[tap]] == pytest.approx(float(p.grad.double().norm()), rel=1e-6), (step, tap)


def test_the_run_id_goes_to_every_rank_in_one_place() -> None:
    """Issue 33 item 6: the runner, record() under DDP and both callbacks take the run id from
    `Distributed.joined` (rank 0's, broadcast); no second copy of the broadcast."""
    package = Path(gradrunner.__file__).parent
    users = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                   if "broadcast_object_list" in p.read_text() or "urandom" in p.read_text())  # fmt: skip
    assert users == ["run/distributed.py"]
    for name in ("integrations/lightning.py", "integrations/hf.py", "run/distributed.py"):
        assert "Distributed.joined(" in (package / name).read_text(), name
