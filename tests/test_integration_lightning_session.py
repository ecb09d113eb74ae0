"""The Lightning callback's session (issue 36 items 11, 12, 14, 16): the last word, options checked in the
constructor, `lr`/`grad_norm`/`clipped`, `edits=`, and resume with Lightning's own `ckpt_path=`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning_reference import TAPS, dataset, tiny_net  # noqa: E402  (the same net and batches)

from gradrunner.analysis import load  # noqa: E402
from gradrunner.errors import GradrunnerError  # noqa: E402
from gradrunner.integrations.lightning import GradientCapture  # noqa: E402
from gradrunner.run.session_log import LOG_FILE  # noqa: E402

CLIP = 0.05


class Module(pl.LightningModule):
    def __init__(self, nan_at: int = -1) -> None:
        super().__init__()
        self.net, self.nan_at, self.losses = tiny_net(), nan_at, []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.nan_at:
            loss = loss * float("nan")
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> object:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                                                   "interval": "step"}}  # fmt: skip


def _fit(module: Module, callbacks: list, steps: int, batches: int = 6, ckpt_path: str | None = None,
         **kwargs: object) -> pl.Trainer:  # fmt: skip
    loader = torch.utils.data.DataLoader(dataset(batches), batch_size=5, shuffle=False)
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         **{"enable_checkpointing": False, **kwargs})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("nan_at", [-1, 2])
def test_the_last_word_ends_a_lightning_run(tmp_path: Path, nan_at: int) -> None:
    module = Module(nan_at)
    _fit(module, [GradientCapture(taps=TAPS, dir=tmp_path / "run")], steps=4)
    text = (tmp_path / "run" / LOG_FILE).read_text()
    m = re.search(r"loss: (\S+) at the first step, (\S+) at the last \((\d+) steps\)", text)
    assert m and int(m[3]) == 4 and float(m[1]) == pytest.approx(module.losses[0], rel=1e-5)
    if nan_at < 0:
        assert float(m[2]) == pytest.approx(module.losses[-1], rel=1e-5) and "healthy: no NaN/Inf" in text
    else:
        assert "NaN/Inf: the loss from step 2" in text


def test_a_non_finite_stop_names_the_callbacks_own_argument(tmp_path: Path) -> None:
    """Before, the error named the runner's config (`capture.on_nonfinite=stop`, `optimizer.lr`) and no dir."""
    module = Module(nan_at=1)
    with pytest.raises(GradrunnerError) as e:
        _fit(module, [GradientCapture(taps=TAPS, dir=tmp_path / "run", on_nonfinite="stop")], steps=4)
    message = str(e.value)
    assert message.startswith("GradientCapture(..., on_nonfinite='stop'): stopped at step 1, where the loss is nan")
    assert f"kept in {tmp_path / 'run'}." in message and "set GradientCapture(..., on_nonfinite='record')" in message
    assert "capture." not in message and "optimizer.lr" not in message, message
    assert len(module.losses) == 2 and pd.read_parquet(tmp_path / "run" / "steps.parquet")["step"].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("options", "says"),
    [({"histogramm": True}, "Did you mean 'histogram'"), ({"every": 0}, "every=0"), ({"values": "ful"}, "values='ful'"),
     ({"update_norms": "yes"}, "update_norms='yes'"), ({"edits": [{"tap": "net.0:output", "scal": 1}]}, "edits[0]"),
     ({"strategy": "autograd_grad"}, "autograd_grad"), ({"anomaly": {"z": 0}}, "anomaly.z=0"),
     ({"anomaly": {"windw": 10}}, "windw")],
)  # fmt: skip
def test_option_mistakes_fail_in_the_constructor(tmp_path: Path, options: dict, says: str) -> None:
    with pytest.raises(GradrunnerError, match=re.escape(says)) as e:
        GradientCapture(taps=TAPS, dir=tmp_path / "run", **options)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def _replay(steps: int, scale: float = 1.0) -> tuple[nn.Module, list[float], list[float]]:
    """Plain torch: each step's total norm as clip_grad_norm_ returns it, and the rate the step used (StepLR)."""
    net, data = tiny_net(), dataset(6)  # the loader of `_fit`: the same draws
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    norms, lrs = [], []
    for s in range(steps):
        x, y = data.tensors[0][s * 5 : s * 5 + 5], data.tensors[1][s * 5 : s * 5 + 5]
        h = net[0](x)
        if scale != 1.0:
            h.register_hook(lambda g: g * scale)
        nn.functional.mse_loss(net[2](net[1](h)), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return net, norms, lrs


def test_lr_grad_norm_and_clipped_equal_plain_torch(tmp_path: Path) -> None:
    module = Module()
    _fit(module, [GradientCapture(taps=TAPS, dir=tmp_path / "run")], steps=4, gradient_clip_val=CLIP)
    net, norms, lrs = _replay(4)
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.lr) == pytest.approx(lrs, rel=1e-12) and lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert list(steps.grad_norm) == pytest.approx(norms, rel=1e-5)
    assert list(steps.clipped) == [n > CLIP for n in norms] and any(steps.clipped)
    torch.testing.assert_close(module.net[0].weight, net[0].weight)


def test_edits_through_the_callback_equal_a_plain_hook(tmp_path: Path) -> None:
    module = Module()
    cb = GradientCapture(taps=TAPS, dir=tmp_path / "run", edits=[{"tap": "net.0:output", "scale": 0.5}])
    _fit(module, [cb], steps=3, gradient_clip_val=CLIP)
    net, norms, _ = _replay(3, scale=0.5)
    torch.testing.assert_close(module.net[0].weight, net[0].weight)
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.grad_norm) == pytest.approx(norms, rel=1e-5)  # the edited gradients the optimiser got
    out = load(tmp_path / "run").query("tap == 'net.0:output'")
    assert list(out.edited_norm) == pytest.approx(list(0.5 * out.norm), rel=1e-6)


class Crash(pl.Callback):
    """Raises once the optimiser has made `at` steps (after Lightning's checkpoint of an earlier epoch end)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("crash")


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    cols = [c for c in a.columns if c not in {"run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"}]
    key = [c for c in ("step", "tap", "call", "micro_step") if c in a.columns]
    pd.testing.assert_frame_equal(a[cols].sort_values(key).reset_index(drop=True),
                                  b[cols].sort_values(key).reset_index(drop=True))  # fmt: skip


def test_resume_with_ckpt_path_gives_the_uninterrupted_records(tmp_path: Path) -> None:
    """Two steps an epoch, a Lightning checkpoint every 2 steps; a crash at step 5 (steps 0..4 recorded), then
    `fit(ckpt_path=<the step-4 checkpoint>)` with resume=True: the records equal an uninterrupted run's."""
    whole = tmp_path / "whole"
    _fit(Module(), [GradientCapture(taps=TAPS, dir=whole)], steps=6, batches=2, gradient_clip_val=CLIP)
    run, ckpts = tmp_path / "run", tmp_path / "ckpt"
    # every_n_train_steps: Lightning's own resume is exact from these (from an epoch-end checkpoint,
    # save_on_train_epoch_end=True, Lightning 2.6 trains the next epoch's first batch twice: not ours to fix)
    saver = pl.callbacks.ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_train_steps=2)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(Module(), [GradientCapture(taps=TAPS, dir=run), Crash(5), saver], steps=6, batches=2,
             gradient_clip_val=CLIP, enable_checkpointing=True)  # fmt: skip
    assert sorted(set(load(run, table="steps").step)) == [0, 1, 2, 3, 4] and not (run / "done.json").exists()
    with pytest.raises(GradrunnerError, match=r"GradientCapture\(\.\.\.\) with resume=True"):
        _fit(Module(), [GradientCapture(taps=TAPS, dir=run)], steps=6, batches=2, ckpt_path=str(ckpts / "epoch=1-step=4.ckpt"))
    _fit(Module(), [GradientCapture(taps=TAPS, dir=run, resume=True)], steps=6, batches=2, gradient_clip_val=CLIP,
         ckpt_path=str(ckpts / "epoch=1-step=4.ckpt"))  # fmt: skip
    assert (run / "done.json").is_file()
    _same(load(whole), load(run))
    _same(load(whole, table="steps"), load(run, table="steps"))


class Penalised(pl.LightningModule):
    """An input-gradient penalty in `training_step` (double backprop): a `torch.autograd.grad` through the net."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return _penalised(self.net, *batch)

    def configure_optimizers(self) -> object:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _penalised(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = net(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return nn.functional.mse_loss(out, y) + 0.1 * gx.pow(2).sum()


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_a_gradient_penalty_in_training_step_records_the_losss_gradients(tmp_path: Path, strategy: str) -> None:
    """One row per tap and step, each the gradient of the step's loss (not of the penalty's inner autograd.grad)."""
    module = Penalised()
    _fit(module, [GradientCapture(taps=TAPS, dir=tmp_path / "run", strategy=strategy)], steps=3)
    net, data = tiny_net(), dataset(6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want: list[tuple[float, float]] = []
    for s in range(3):
        kept: list[torch.Tensor] = []
        handle = net[0].register_forward_hook(lambda m, a, out, kept=kept: kept.append(out))
        loss = _penalised(net, data.tensors[0][s * 5 : s * 5 + 5], data.tensors[1][s * 5 : s * 5 + 5])
        handle.remove()
        (gh,) = torch.autograd.grad(loss, kept, retain_graph=True)
        loss.backward()
        want.append((float(gh.norm()), float(net[0].weight.grad.norm())))  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    df = load(tmp_path / "run").sort_values(["step", "tap"])
    assert list(zip(df.step, df.tap, df.call, strict=True)) == [(s, t, 0) for s in range(3) for t in TAPS]
    assert df.micro_step.isna().all()
    got = list(zip(df.query("tap == 'net.0:output'").norm, df.query("tap == 'net.0:weight'").norm, strict=True))
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5)
    torch.testing.assert_close(module.net[0].weight, net[0].weight)


class Validated(Module):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_a_checkpoint_validated_before_a_fit_does_not_number_that_fits_edits(tmp_path: Path) -> None:
    """`trainer.validate(ckpt_path=...)`, then `fit` with the same callback: the checkpoint's count of backwards (3),
    restored for the validation, outlived it and numbered the fit's seeded edits from backward 3 (its dropout drew
    other numbers: edited_norm 0.4986 against 0.4942 at step 0). The fit's records are a fresh callback's now."""
    ckpt = tmp_path / "three.ckpt"
    _fit(Validated(), [GradientCapture(taps=TAPS, dir=tmp_path / "first")], steps=3).save_checkpoint(ckpt)
    edits = [{"tap": "net.0:output", "dropout": 0.5}]
    for name in ("same", "fresh"):
        module = Validated()
        cb = GradientCapture(taps=TAPS, dir=tmp_path / name, edits=edits, values="full")
        validator = pl.Trainer(callbacks=[cb] if name == "same" else [], logger=False, enable_progress_bar=False,
                               enable_model_summary=False, accelerator="cpu", devices=1, enable_checkpointing=False)  # fmt: skip
        loader = torch.utils.data.DataLoader(dataset(2), batch_size=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            validator.validate(module, loader, ckpt_path=str(ckpt), verbose=False)
        _fit(module, [cb], steps=2, num_sanity_val_steps=0)
    _same(load(tmp_path / "fresh"), load(tmp_path / "same"))
