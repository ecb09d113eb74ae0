"""`gradrunner.record`: a user's own loop writes a run dir like a runner job's, checked against plain torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import by_micro_batch
from torch import nn

import gradrunner
from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]


def _train(
    rec: Any, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], opt: torch.optim.Optimizer
) -> None:
    """The README's loop: forward, `rec.backward`, the optimiser step, `rec.step`."""
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        rec.backward(loss)
        opt.step()
        opt.zero_grad()
        rec.step(loss)


#: Clipping in the loops below: small enough to clip every step (the records hold the gradients before it).
CLIP = 1e-2


def _reference(steps: int, accumulate: int = 1) -> list[dict[str, list[torch.Tensor]]]:
    """Plain torch: each step's gradients of the first layer's output (one per micro-batch) and weight
    (one per step: the accumulated `.grad` the optimiser uses, before clipping)."""
    model, batches = _model(), _batches(steps * accumulate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: list[dict[str, list[torch.Tensor]]] = []
    for s in range(steps):
        grads: dict[str, list[torch.Tensor]] = {"0:output": [], "0:weight": []}
        for m in range(accumulate):
            x, y = batches[s * accumulate + m]
            h = model[0](x)
            h.retain_grad()
            loss = nn.functional.mse_loss(model[2](model[1](h)), y) / accumulate
            loss.backward()
            grads["0:output"].append(h.grad.clone())
        grads["0:weight"].append(model[0].weight.grad.clone())
        assert float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP  # it clipped
        opt.step()
        opt.zero_grad()
        out.append(grads)
    return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_record_statistics_equal_plain_torch(tmp_path: Path, strategy: str, accumulate: int) -> None:
    model, batches = _model(), _batches(3 * accumulate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", strategy=strategy) as rec:
        for s in range(3):
            for m in range(accumulate):
                x, y = batches[s * accumulate + m]
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                rec.backward(loss)
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "run")
    ref = _reference(3, accumulate)
    assert len(df) == 3 * (accumulate + 1)
    for s in range(3):
        acts = df[(df.step == s) & (df.tap == "0:output")].pipe(by_micro_batch)
        weight = df[(df.step == s) & (df.tap == "0:weight")]
        assert len(acts) == accumulate and len(weight) == 1  # activations per micro-batch, parameters per step
        if accumulate > 1:
            assert acts.micro_step.tolist() == list(range(accumulate)) and weight.micro_step.isna().all()
        for tap, rows in (("0:output", acts), ("0:weight", weight)):
            for call, g in enumerate(ref[s][tap]):
                row = rows.iloc[call]
                assert row.norm == pytest.approx(float(g.norm()), rel=1e-5)
                assert row["max"] == pytest.approx(float(g.max()), rel=1e-5)
                assert row["mean"] == pytest.approx(float(g.mean()), rel=1e-5, abs=1e-9)
    assert set(df.strategy) == {strategy} and set(df["rank"]) == {0}


def test_record_run_dir_is_a_runner_job(tmp_path: Path) -> None:
    model, batches = _model(), _batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "mine"
    with gradrunner.record(model, ["*:output"], run, every=2, histogram=True) as rec:
        assert (run / ".gradrunner.lock").exists()
        _train(rec, model, batches, opt)
        assert not (run / "done.json").exists()
    marker = json.loads((run / "done.json").read_text())
    assert marker["files"] == ["grads.parquet", "steps.parquet"] and marker["rows"]["steps.parquet"] == 4
    steps = load(run, table="steps")
    assert list(steps.captured) == [True, False, True, False]
    grads = pd.read_parquet(run / "grads.parquet")
    assert sorted(set(grads.step)) == [0, 2] and set(grads.tap) == {"0:output", "1:output", "2:output"}
    assert grads.hist_counts.map(sum).eq(grads.numel).all()
    # the report reads it as it reads a runner job
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, "-m", "gradrunner.report", str(run)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (run / "report.html").is_file()


def test_record_keeps_completed_steps_without_done_on_error(tmp_path: Path) -> None:
    model, batches = _model(), _batches(2)
    with pytest.raises(RuntimeError, match="boom"), gradrunner.record(model, ["0:output"], tmp_path / "r") as rec:
        x, y = batches[0]
        loss = nn.functional.mse_loss(model(x), y)
        rec.backward(loss)
        rec.step(loss)
        raise RuntimeError("boom")
    assert not (tmp_path / "r" / "done.json").exists()
    assert len(pd.read_parquet(tmp_path / "r" / "steps.parquet")) == 1


def test_record_refuses_existing_records_and_bad_options(tmp_path: Path) -> None:
    model = _model()
    with gradrunner.record(model, ["0:output"], tmp_path / "r"):
        pass
    with pytest.raises(GradrunnerError, match="already holds records"):
        gradrunner.record(model, ["0:output"], tmp_path / "r").__enter__()
    with pytest.raises(GradrunnerError, match="values='all' is not allowed; allowed: none, full, sample"):
        gradrunner.record(model, ["0:output"], tmp_path / "s", values="all")
    with pytest.raises(GradrunnerError, match="every=0"):
        gradrunner.record(model, ["0:output"], tmp_path / "s", every=0)
    with pytest.raises(GradrunnerError, match="outside"):
        gradrunner.record(model, ["0:output"], tmp_path / "s").step(1.0)
    assert not (tmp_path / "s").exists()


def test_unscaled_records_are_the_true_gradients(tmp_path: Path) -> None:
    model, (x, y) = _model(), _batches(1)[0]
    scale = torch.tensor(1024.0)
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "r", loss_scale=lambda: scale) as rec:
        loss = nn.functional.mse_loss(model(x), y)
        rec.backward(loss * scale)
        rec.step(loss)
    ref = _reference(1)[0]
    df = load(tmp_path / "r").set_index("tap")
    for tap in ("0:output", "0:weight"):
        assert df.loc[tap, "norm"] == pytest.approx(float(ref[tap][0].norm()), rel=1e-5)
    np.testing.assert_allclose(model[0].weight.grad, ref["0:weight"][0] * 1024, rtol=1e-5)  # .grad is untouched


def test_accumulated_scaled_clipped_parameter_records_are_the_optimisers_gradient(tmp_path: Path) -> None:
    """Two micro-batches, a loss scale, `unscale_`-like division, clipping and `zero_grad` before `rec.step`:
    the weight's one row is the accumulated, unscaled, pre-clip `.grad`; activations one row per micro-batch."""
    model, batches = _model(), _batches(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = torch.tensor(512.0)
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "r", loss_scale=lambda: scale) as rec:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y) / 2
            rec.backward(loss * scale)
        for p in model.parameters():
            assert p.grad is not None
            p.grad.div_(scale)  # what scaler.unscale_ does
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)  # .grad zeroed in place before rec.step
        rec.step(loss)
    ref = _reference(1, accumulate=2)[0]
    df = load(tmp_path / "r")
    weight = df[df.tap == "0:weight"]
    assert len(weight) == 1 and weight.micro_step.isna().all()
    g = ref["0:weight"][0]
    assert weight.norm.iloc[0] == pytest.approx(float(g.norm()), rel=1e-5)
    assert weight["max"].iloc[0] == pytest.approx(float(g.max()), rel=1e-5)
    acts = df[df.tap == "0:output"].sort_values("micro_step")
    assert acts.micro_step.tolist() == [0, 1]
    for row, g in zip(acts.itertuples(), ref["0:output"], strict=True):
        assert row.norm == pytest.approx(float(g.norm()), rel=1e-5)


def test_live_load_reads_the_columns_asked_for_as_load_does(tmp_path: Path) -> None:
    """`values` named in `columns` was dropped from a live load (found 2026-11-27), and a str `columns` read one
    column per letter; a live load reads what `load` reads once the session closed, in the order asked for."""
    model, run = _model(), tmp_path / "live"
    asked = ["values", "step", "tap"]
    with gradrunner.record(model, ["0:output"], run, values="full", live_every=1) as rec:
        for x, y in _batches(2):
            rec.backward(nn.functional.mse_loss(model(x), y))
            model.zero_grad()
            rec.step()
        live = load(run, live=True, columns=asked)
        with pytest.raises(GradrunnerError, match=r"columns='norm' is one name; pass a list.*columns=\['norm'\]"):
            load(run, live=True, columns="norm")
    pd.testing.assert_frame_equal(live, load(run, columns=asked))
    assert live.columns.tolist() == asked and live["values"].map(len).tolist() == [5 * 8, 5 * 8]


def test_live_load_reads_completed_steps_while_the_job_runs(tmp_path: Path) -> None:
    model, batches = _model(), _batches(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "live"
    seen = []
    with gradrunner.record(model, ["0:output"], run, live_every=2) as rec:
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
            assert not (run / "grads.parquet").exists()  # the record file has no footer yet
            if i == 0:
                with pytest.raises(GradrunnerError, match="has not completed a segment yet"):
                    load(run, live=True)
            else:
                partial = load(run, live=True)
                seen.append((sorted(set(partial.step)), list(load(run, table="steps", live=True).step)))
    assert seen == [([0, 1], [0, 1]), ([0, 1], [0, 1]), ([0, 1, 2, 3], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1, 2, 3])]
    final = load(run)
    assert not (run / ".live").exists()  # the files hold everything now
    live_rows = load(run, live=True)  # after the run: the record files themselves
    pd.testing.assert_frame_equal(live_rows, final)
    pd.testing.assert_frame_equal(partial, final[final.step < 4])  # the segments held the final rows


@pytest.mark.parametrize(("strategy", "accumulate"), [("hook", 1), ("autograd_grad", 1), ("hook", 2)])
def test_record_writes_the_runners_records(tmp_path: Path, strategy: str, accumulate: int) -> None:
    """The runner's job (same model, data, seed) and a hand loop under record(): the same rows, also under
    `train.accumulate=2` (activations per micro-batch, parameters once per step from the accumulated .grad)."""
    from conftest import compose_cfg

    from gradrunner.run.build import setup
    from gradrunner.run.loop import train

    cfg = compose_cfg("+experiment=mlp", "steps=3", f"capture.strategy={strategy}", "capture.histogram=true",
                      f"train.accumulate={accumulate}")  # fmt: skip
    train(cfg, out_dir=tmp_path / "runner")
    job = setup(cfg)  # built again from the seed: the runner's model, batches and optimiser
    with gradrunner.record(job.model, list(cfg.taps), tmp_path / "mine", strategy=strategy, every=int(cfg.capture.every),
                           seed=int(cfg.seed), histogram=True, update_norms=True) as rec:  # fmt: skip
        for _ in range(3):
            for _ in range(accumulate):
                x, y = next(job.batches)
                loss = job.loss_fn(job.model(x), y)
                rec.backward(loss / accumulate)
            job.optimizer.step()
            job.optimizer.zero_grad(set_to_none=True)
            rec.step()  # the step's loss: the backpropagated losses summed (their mean), as the runner's
    key = ["step", "tap", "call", "micro_step"]
    ours = pd.read_parquet(tmp_path / "mine" / "grads.parquet").sort_values(key).reset_index(drop=True)
    theirs = pd.read_parquet(tmp_path / "runner" / "grads.parquet").sort_values(key).reset_index(drop=True)
    assert len(ours) == len(theirs) > 0
    if accumulate > 1:
        assert theirs.micro_step.isna().any() and theirs.micro_step.notna().any()  # both kinds of row
    # one step engine: every row of a step carries the step's loss, the parameters' update norms are the runner's
    columns = [*key, "numel", "norm", "mean", "std", "min", "max", "abs_max", "zero_frac", "nan_count", "loss",
               "has_grad", "value_norm", "update_norm", "strategy", "rank"]  # fmt: skip
    pd.testing.assert_frame_equal(ours[columns], theirs[columns])
    steps = ["step", "captured", "loss"]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "mine" / "steps.parquet")[steps],
                                  pd.read_parquet(tmp_path / "runner" / "steps.parquet")[steps])  # fmt: skip
    assert ours.hist_counts.map(list).tolist() == theirs.hist_counts.map(list).tolist()


def test_live_segments_survive_a_killed_job(tmp_path: Path) -> None:
    """SIGKILL after 3 steps: no record file has a footer, the closed segments still read."""
    code = f"""
import os, signal, torch
from torch import nn
import gradrunner
torch.manual_seed(0)
model = nn.Linear(3, 1)
with gradrunner.record(model, [":output"], {str(tmp_path / "k")!r}, live_every=1) as rec:
    for _ in range(3):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        rec.backward(loss)
        rec.step(loss)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    assert not (tmp_path / "k" / "grads.parquet").exists()
    df = load(tmp_path / "k", live=True)
    assert list(df.step) == [0, 1, 2] and df.norm.notna().all()


def test_micro_steps_come_with_the_records_into_the_micro_step_column(tmp_path: Path) -> None:
    """The capture numbers each record's backward (`StepRecords.micro_step`); the writer writes what it says."""
    model, batches = _model(), _batches(2)
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "r") as rec:
        for x, y in batches:
            rec.backward(nn.functional.mse_loss(model(x), y) / 2)
        recs_written = rec.step()
    assert recs_written.records is not None and recs_written.records.micro_step == [0, 1, None]
    df = pd.read_parquet(tmp_path / "r" / "grads.parquet")
    assert [(t, None if pd.isna(m) else int(m)) for t, m in zip(df.tap, df.micro_step, strict=True)] == [
        ("0:output", 0), ("0:output", 1), ("0:weight", None)]  # fmt: skip


def test_every_captures_whole_steps(tmp_path: Path) -> None:
    """every=2: the captured steps' taps fire in their forward passes (capture is switched on before them)."""
    model, batches = _model(), _batches(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["*:output"], tmp_path / "r", every=2) as rec:
        _train(rec, model, batches, opt)
    df = load(tmp_path / "r")
    assert sorted(set(df.step)) == [0, 2, 4] and df.has_grad.all() and df.norm.gt(0).all()


def test_step_extra_lands_in_steps_parquet_and_a_misspelled_key_is_refused(tmp_path: Path) -> None:
    model, batches = _model(), _batches(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output"], tmp_path / "r") as rec:
        (x, y), (x2, y2) = batches
        loss = nn.functional.mse_loss(model(x), y)
        rec.backward(loss)
        opt.step()
        opt.zero_grad()
        with pytest.raises(GradrunnerError, match=r"'grad_nrom'.*no column of steps.parquet.*Did you mean 'grad_norm'"):
            rec.step(loss, extra={"grad_nrom": 2.5})
        rec.step(loss, extra={"grad_norm": 2.5, "lr": 0.1})  # the refused call wrote nothing: this is step 0
        rec.backward(nn.functional.mse_loss(model(x2), y2))
        rec.step()
    steps = load(tmp_path / "r", table="steps")
    assert list(steps.step) == [0, 1]
    assert steps.grad_norm.iloc[0] == 2.5 and steps.lr.iloc[0] == 0.1 and pd.isna(steps.grad_norm.iloc[1])


def test_step_extra_takes_tensors_and_a_bad_value_writes_nothing(tmp_path: Path) -> None:
    """An `eval_loss` from a no-grad forward, the tensor `lr` of `SGD(lr=torch.tensor(...))`, tensor flags: their
    values, as the plain loop has them; a value no column takes is one paragraph before the step's rows are written."""
    model, batches = _model(), _batches(2)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    with gradrunner.record(model, ["0:weight"], tmp_path / "r") as rec:
        wanted = []
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                eval_loss = nn.functional.mse_loss(model(x), y)
            wanted.append(float(eval_loss))
            with pytest.raises(GradrunnerError, match=r"extra=\{'lr': '0.1'\}.*is not allowed.*a number"):
                rec.step(loss, extra={"lr": "0.1"})
            with pytest.raises(GradrunnerError, match=r"lrs must be a list of numbers"):
                rec.step(loss, extra={"lrs": 0.1})
            lr = opt.param_groups[0]["lr"]
            rec.step(loss, extra={"eval_loss": eval_loss, "lr": lr, "lrs": [lr], "skipped": torch.tensor(False),
                                  "loss_scale": torch.tensor(1.0, dtype=torch.float64)})  # fmt: skip
    steps, grads = load(tmp_path / "r", table="steps"), load(tmp_path / "r")
    assert list(steps.step) == [0, 1] and sorted(set(grads.step)) == [0, 1]  # the refused calls wrote nothing
    assert list(steps.eval_loss) == pytest.approx(wanted, rel=1e-7)
    assert list(steps.lr) == pytest.approx([0.1, 0.1]) and [list(v) for v in steps.lrs] == [[steps.lr[0]]] * 2
    assert list(steps.skipped) == [False, False] and list(steps.loss_scale) == [1.0, 1.0]


def _gan() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"g": nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 4)), "d": nn.Linear(4, 1)})


def _gan_steps(model: nn.ModuleDict, steps: int, rec: Any = None) -> list[dict[str, float]]:
    """A GAN step (the generator steps before the discriminator's backward), plain torch; per step each weight's
    whole change over the step's two optimizer steps."""
    og, od = torch.optim.SGD(model["g"].parameters(), lr=0.1), torch.optim.SGD(model["d"].parameters(), lr=0.1)
    gen, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        z, real = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        og.zero_grad()
        g_loss = nn.functional.softplus(-model["d"](model["g"](z))).mean()
        g_loss.backward()
        og.step()
        od.zero_grad()
        fake = model["g"](z).detach()
        d_loss = nn.functional.softplus(-model["d"](real)).mean() + nn.functional.softplus(model["d"](fake)).mean()
        d_loss.backward()
        od.step()
        out.append({n.replace(".weight", ":weight"): float((p.detach() - before[n]).norm())
                    for n, p in model.named_parameters() if n.endswith("weight")})  # fmt: skip
        if rec is not None:
            rec.step(g_loss.detach() + d_loss.detach())
    return out


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_update_norms_of_a_step_with_two_optimizer_steps_are_the_whole_change(tmp_path: Path, strategy: str) -> None:
    """Before, the parameters were copied after the step's last backward (the discriminator's), when the generator
    had stepped already: its update_norm was 0.0 at every step."""
    want = _gan_steps(_gan(), 3)
    model = _gan()
    taps = ["g.0:weight", "g.2:weight", "d:weight"]
    with gradrunner.record(model, taps, tmp_path, strategy=strategy, update_norms=True) as rec:
        _gan_steps(model, 3, rec)
    rows = pd.read_parquet(tmp_path / "grads.parquet")
    for tap in taps:
        got = rows[rows["tap"] == tap].sort_values("step")["update_norm"].tolist()
        assert got == pytest.approx([w[tap] for w in want], rel=1e-5), tap
        assert min(got) > 0


@pytest.mark.parametrize(("step", "backwards"), [(-1, None), (2.5, None), (True, None), ("3", None), (2, -1), (2, 1.5)])
def test_start_at_refuses_a_step_that_is_no_whole_number_of_at_least_0(
    tmp_path: Path, step: Any, backwards: Any
) -> None:
    """Before: start_at(-1) wrote step -1 in both tables, start_at(2.5) wrote step 2, and both ended with done.json."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = "backwards" if backwards is not None else "step"
    with pytest.raises(
        GradrunnerError, match=rf"start_at\({bad}=.*\) is not allowed; {bad} must be a whole number of at least 0"
    ):
        with gradrunner.record(model, ["0:output"], tmp_path / "run") as rec:
            rec.start_at(step, backwards)
            _train(rec, model, _batches(1), opt)
    assert not (tmp_path / "run" / "done.json").exists() and not (tmp_path / "run" / "grads.parquet").exists()
    with gradrunner.record(model, ["0:output"], tmp_path / "ok") as rec:
        rec.start_at(np.int64(2))  # a numpy integer is a whole number
        _train(rec, model, _batches(1), opt)
    assert load(tmp_path / "ok", table="steps").step.tolist() == [2]
