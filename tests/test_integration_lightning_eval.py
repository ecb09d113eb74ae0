"""The Lightning callback pauses capture in evaluation loops: a backward in `validation_step` (a saliency metric
under `inference_mode=False`) is neither recorded as a training micro-batch nor left pending at the end."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning_reference import TAPS, dataset, tiny_net  # noqa: E402

from gradrunner.analysis import load  # noqa: E402
from gradrunner.integrations.lightning import GradientCapture  # noqa: E402


class Saliency(pl.LightningModule):
    """Validation takes the input gradient of the net's output (`torch.autograd.grad`); a plain forward hook
    keeps the training gradients of `net.0`'s output (the reference, no gradrunner)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.out_norms, self.saliency = tiny_net(), [], []
        self.net[0].register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: object, out: torch.Tensor) -> None:
        if self.trainer.training and out.requires_grad:
            out.register_hook(lambda g: self.out_norms.append(float(g.double().norm())))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.enable_grad():
            x = x.clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(self.net(x).sum(), x)
        self.saliency.append(float(gx.norm()))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_backward_in_validation_is_not_captured(tmp_path: Path, accumulate: int) -> None:
    """Validation after every batch (mid-accumulation too, and after the last step): the records are the training
    backwards' alone, equal to a plain hook's norms, and the run is marked complete."""
    module = Saliency()
    loader = torch.utils.data.DataLoader(dataset(4), batch_size=5, shuffle=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[GradientCapture(taps=TAPS, dir=tmp_path / "run")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, inference_mode=False, val_check_interval=1,
                         limit_val_batches=1, num_sanity_val_steps=1, accumulate_grad_batches=accumulate)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, loader)
    assert len(module.saliency) == 4 + 1  # validation ran after each batch, and in the sanity check
    df = load(tmp_path / "run")
    out = df.query("tap == 'net.0:output'").sort_values(["step", "micro_step"])
    steps = 4 // accumulate
    micro = [None] * 4 if accumulate == 1 else [0, 1] * steps
    assert list(out.step) == [b // accumulate for b in range(4)]
    assert [None if m != m else int(m) for m in out.micro_step] == micro
    assert list(out.norm) == pytest.approx(module.out_norms, rel=1e-6) and len(module.out_norms) == 4
    assert sorted(set(load(tmp_path / "run", table="steps").step)) == list(range(steps))
    assert (tmp_path / "run" / "done.json").is_file()


class StopAtValidation(pl.Callback):
    """Stops training at the first validation of the fit (EarlyStopping's way: `trainer.should_stop` in
    `on_validation_end`)."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            trainer.should_stop = True


def test_a_stop_inside_an_accumulation_window_is_a_normal_end(tmp_path: Path) -> None:
    """accumulate_grad_batches=2, a validation after the third batch that stops training (EarlyStopping): Lightning
    ends normally with step 1's first micro-batch backpropagated and no optimiser step. done.json; step 0 with both
    micro-batches (the norms a plain hook saw); the lone micro-batch not written, which an INFO line says; no advice
    meant for record()'s users (before: not marked complete, and 'Call rec.step() after each optimiser step')."""
    module = Saliency()
    loader = torch.utils.data.DataLoader(dataset(4), batch_size=5, shuffle=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[GradientCapture(taps=TAPS[:1], dir=tmp_path / "run"),
                                                  StopAtValidation()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         inference_mode=False, val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0,
                         accumulate_grad_batches=2)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, loader)
    assert trainer.global_step == 1 and len(module.out_norms) == 3  # the third batch's backward, no step after it
    out = load(tmp_path / "run").sort_values("micro_step")
    assert list(zip(out.step, out.micro_step, strict=True)) == [(0, 0), (0, 1)]
    assert list(out.norm) == pytest.approx(module.out_norms[:2], rel=1e-6)
    assert list(load(tmp_path / "run", table="steps").step) == [0]
    assert (tmp_path / "run" / "done.json").is_file()
    text = (tmp_path / "run" / "gradrunner.log").read_text()
    assert "Lightning's fit ended inside step 1's accumulation window" in text
    assert "1 captured micro-batch(es) are not written" in text and "rec.step()" not in text
