"""The Lightning callback: records equal to plain torch under accumulation, clipping and DDP; refusals."""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import assert_accumulation_rows
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning_reference import TAPS, dataset, tiny_net  # noqa: E402

from gradrunner.analysis import load  # noqa: E402
from gradrunner.errors import GradrunnerError  # noqa: E402
from gradrunner.integrations.lightning import GradientCapture  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(steps: int, callbacks: list[pl.Callback], **kwargs: object) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                      **kwargs)  # fmt: skip


def _reference(steps: int, accumulate: int, clip: float | None) -> tuple[list[dict[str, list[torch.Tensor]]], nn.Module]:
    net, data = tiny_net(), dataset(steps * accumulate)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = []
    losses: list[float] = []
    for s in range(steps):
        grads: dict[str, list[torch.Tensor]] = {"net.0:output": [], "net.0:weight": []}
        for m in range(accumulate):
            i = (s * accumulate + m) * 5
            x, y = data.tensors[0][i : i + 5], data.tensors[1][i : i + 5]
            h = net[0](x)
            h.retain_grad()
            loss = nn.functional.mse_loss(net[2](net[1](h)), y) / accumulate
            loss.backward()
            losses.append(float(loss.detach()) + (losses.pop() if m else 0.0))
            grads["net.0:output"].append(h.grad.clone())
        grads["net.0:weight"].append(net[0].weight.grad.clone())  # one per step: the accumulated .grad, before clipping
        if clip is not None:
            nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        out.append(grads)
        grads["loss"] = [torch.tensor(losses[-1])]
    return out, net


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])  # autograd_grad is refused (below)
def test_lightning_accumulation_and_clipping_equal_plain_torch(tmp_path: Path, strategy: str) -> None:
    module = Module()
    loader = torch.utils.data.DataLoader(dataset(6), batch_size=5, shuffle=False)
    cb = GradientCapture(taps=TAPS, dir=tmp_path / "run", strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(3, [cb], accumulate_grad_batches=2, gradient_clip_val=0.05).fit(module, loader)
    ref, net = _reference(3, 2, clip=0.05)
    df = load(tmp_path / "run")
    assert sorted(set(df.step)) == [0, 1, 2] and len(df) == 3 * (2 + 1)
    assert_accumulation_rows(df, [{t: r[t] for t in TAPS} for r in ref], TAPS, param_tap="net.0:weight", rel=1e-5)
    # the capture changed nothing: the trained weights are plain torch's (clipped) ones
    torch.testing.assert_close(module.net[0].weight, net[0].weight)
    assert (tmp_path / "run" / "done.json").is_file()
    steps = load(tmp_path / "run", table="steps")
    assert list(steps.loss) == pytest.approx([float(ref[s]["loss"][0]) for s in range(3)], rel=1e-6)


def test_lightnings_records_are_records_of_the_same_training_in_a_hand_loop(tmp_path: Path) -> None:
    """One step engine: the callback's records of a Lightning run (accumulation, clipping) and record()'s of the
    same training written by hand are the same rows, loss included."""
    import gradrunner

    module = Module()
    loader = torch.utils.data.DataLoader(dataset(6), batch_size=5, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = GradientCapture(taps=TAPS, dir=tmp_path / "lightning", update_norms=True, histogram=True)
        _trainer(3, [cb], accumulate_grad_batches=2, gradient_clip_val=0.05).fit(module, loader)
    net, data = tiny_net(), dataset(6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gradrunner.record(net, [t.removeprefix("net.") for t in TAPS], tmp_path / "mine", update_norms=True,
                           histogram=True) as rec:  # fmt: skip
        for s in range(3):
            for m in range(2):
                i = (2 * s + m) * 5
                rec.backward(nn.functional.mse_loss(net(data.tensors[0][i : i + 5]), data.tensors[1][i : i + 5]) / 2)
            nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            rec.step()
    key = ["step", "tap", "call", "micro_step"]
    theirs = load(tmp_path / "lightning").assign(tap=lambda d: d.tap.str.removeprefix("net.")).sort_values(key)
    ours = load(tmp_path / "mine").sort_values(key)
    cols = [*key, "norm", "mean", "std", "min", "max", "zero_frac", "loss", "has_grad", "value_norm", "update_norm"]
    pd.testing.assert_frame_equal(theirs[cols].reset_index(drop=True), ours[cols].reset_index(drop=True), rtol=1e-6)
    assert theirs.hist_counts.map(list).tolist() == ours.hist_counts.map(list).tolist()


class PeekGrad(pl.Callback):
    """The first layer's `.grad` as the optimiser gets it: Lightning has unscaled it by then."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: object) -> None:
        self.norms.append(float(module.net[0].weight.grad.norm()))


def test_lightning_fp16_grad_scaler_records_true_gradients(tmp_path: Path) -> None:
    """16-mixed with a GradScaler (scale 1024): the records hold the unscaled gradients the optimiser steps with."""
    module, peek = Module(), PeekGrad()
    loader = torch.utils.data.DataLoader(dataset(3), batch_size=5, shuffle=False)
    plugin = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(3, [GradientCapture(taps=["net.0:weight"], dir=tmp_path / "r"), peek], plugins=[plugin]).fit(module, loader)
    df = load(tmp_path / "r").sort_values("step")
    assert list(df.norm) == pytest.approx(peek.norms, rel=1e-6)
    assert max(peek.norms) < 10  # unscaled (a scaled gradient would be about 1024 times larger)


def test_lightning_refuses_a_strategy_with_its_own_backward(tmp_path: Path) -> None:
    cb = GradientCapture(taps=TAPS, dir=tmp_path / "r")

    class Fake:
        pass

    trainer = type("T", (), {"strategy": Fake(), "world_size": 1})()
    with pytest.raises(GradrunnerError, match="cannot run under Lightning's Fake.*Supported: a single device and DDP"):
        cb._distributed(trainer)  # type: ignore[arg-type]


def test_lightning_refuses_autograd_grad_with_the_reason(tmp_path: Path) -> None:
    """autograd_grad needs an engine call of its own, which would bypass Lightning's backward: refused when the
    callback is made (nothing of Lightning is patched to route its backward any more)."""
    with pytest.raises(GradrunnerError, match=r"autograd_grad.*bypass the framework's own loss.backward\(\).*'hook'"):
        GradientCapture(taps=TAPS, dir=tmp_path / "r", strategy="autograd_grad")
    assert not (tmp_path / "r").exists()


class _DestroyGroup(pl.Callback):
    """Each spawned rank tears its process group down as fit ends (Lightning leaves it up): gloo's threads
    can otherwise abort the rank's exit ("terminate called without an active exception", seen once in a
    full suite after the records were whole; `tests/test_integration_fsdp.py` does the same)."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_lightning_ddp_records_both_ranks(tmp_path: Path) -> None:
    module = Module()
    loader = torch.utils.data.DataLoader(dataset(4), batch_size=5, shuffle=False)
    cb = GradientCapture(taps=TAPS, dir=tmp_path / "ddp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(max_steps=2, callbacks=[cb, _DestroyGroup()], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=2,
                             strategy="ddp_spawn")  # fmt: skip
        trainer.fit(module, loader)
    df = pd.read_parquet(tmp_path / "ddp" / "grads.parquet")
    assert set(df["rank"]) == {0, 1} and sorted(set(df.step)) == [0, 1]
    w = df[df.tap == "net.0:weight"].pivot(index="step", columns="rank", values="norm")
    assert (w[0] == w[1]).all()  # parameter gradients after DDP's all-reduce: the same on both ranks
    out = df[df.tap == "net.0:output"].pivot(index="step", columns="rank", values="norm")
    assert (out[0] != out[1]).all()  # activations: each rank's own batch
    assert (tmp_path / "ddp" / "done.json").is_file()


def test_lightning_last_window_of_one_micro_batch_numbers_it(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 over an epoch of 3 batches: Lightning steps after the third batch alone; its record
    holds micro_step 0 (the accumulation is configured), and the norms are those a plain hook saw."""
    module = Module()
    norms: list[float] = []

    def keep(m: nn.Module, args: object, out: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            out.register_hook(lambda g: norms.append(float(g.double().norm())))

    module.net[0].register_forward_hook(keep)
    loader = torch.utils.data.DataLoader(dataset(3), batch_size=5, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(-1, [GradientCapture(taps=TAPS[:1], dir=tmp_path / "run")], max_epochs=1,
                 accumulate_grad_batches=2).fit(module, loader)  # fmt: skip
    df = load(tmp_path / "run").sort_values(["step", "micro_step"])
    assert list(zip(df.step, df.micro_step, strict=True)) == [(0, 0), (0, 1), (1, 0)]
    assert list(df.norm) == pytest.approx(norms, rel=1e-6)
