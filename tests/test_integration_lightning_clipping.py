"""The Lightning callback's `grad_norm` and `clipped`: those of the optimizer's parameters, as Lightning clips them,
checked against plain torch (`clip_grad_norm_` over the same parameters, `.grad` compared before and after)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from gradrunner.analysis import load  # noqa: E402
from gradrunner.integrations.lightning import GradientCapture  # noqa: E402

CLIP = 5.0


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(4, 8), nn.Linear(8, 1)


def _batches() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(20, 4, generator=g), 3 * torch.randn(20, 1, generator=g))


class HeadOnly(pl.LightningModule):
    """The optimizer steps `head` only; `body` still requires grad (its `.grad` grows, nothing clips or steps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _nets()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, run: Path, **kwargs: object) -> None:
    trainer = pl.Trainer(max_epochs=1, callbacks=[GradientCapture(taps=["head:weight"], dir=run)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, **kwargs)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=5, shuffle=False))


def _head_only_reference() -> tuple[list[float], list[bool], nn.Module]:
    """Plain torch: clip_grad_norm_ over the optimizer's parameters; clipped where it changed their `.grad`."""
    body, head = _nets()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    norms, clipped = [], []
    for x, y in torch.utils.data.DataLoader(_batches(), batch_size=5, shuffle=False):
        nn.functional.mse_loss(head(torch.tanh(body(x))), y).backward()
        before = [p.grad.clone() for p in head.parameters()]  # type: ignore[union-attr]
        norms.append(float(nn.utils.clip_grad_norm_(list(head.parameters()), CLIP)))
        clipped.append(any(not torch.equal(b, p.grad) for b, p in zip(before, head.parameters(), strict=True)))
        opt.step()
        opt.zero_grad()
    return norms, clipped, head


def test_grad_norm_and_clipped_are_the_optimizers_parameters(tmp_path: Path) -> None:
    module = HeadOnly()
    _fit(module, tmp_path / "run", gradient_clip_val=CLIP)
    norms, clipped, head = _head_only_reference()
    assert True in clipped and False in clipped  # the data clip some steps and not others
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.grad_norm) == pytest.approx(norms, rel=1e-6)
    assert list(steps.clipped) == clipped
    torch.testing.assert_close(module.head.weight, head.weight)  # the same training


class WarmUpWithoutClipping(pl.LightningModule):
    """`configure_gradient_clipping` overridden: Lightning's clipping from step 2 only (a warm-up without it)."""

    def __init__(self, none_at: int = -1) -> None:
        super().__init__()
        self.body, self.head = _nets()
        self.none_at = none_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        if batch_idx == self.none_at:
            return None  # Lightning skips the backward; the optimizer steps no gradient
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:  # fmt: skip
        if self.global_step >= 2:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _warm_up_reference(clip: float, algorithm: str) -> tuple[list[float], list[bool], nn.Module]:
    """Plain torch: the norm before clipping; clipped where clipping (from step 2) changed a `.grad`."""
    body, head = _nets()
    params = [*body.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    norms, clipped = [], []
    for s, (x, y) in enumerate(torch.utils.data.DataLoader(_batches(), batch_size=5, shuffle=False)):
        nn.functional.mse_loss(head(torch.tanh(body(x))), y).backward()
        before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        norms.append(float(torch.cat([b.flatten() for b in before]).double().norm()))
        if s >= 2:
            if algorithm == "norm":
                nn.utils.clip_grad_norm_(params, clip)
            else:
                nn.utils.clip_grad_value_(params, clip)
        clipped.append(any(not torch.equal(b, p.grad) for b, p in zip(before, params, strict=True)))
        opt.step()
        opt.zero_grad()
    return norms, clipped, head


@pytest.mark.parametrize(("clip", "algorithm"), [(1.0, "norm"), (0.5, "value")])
def test_clipped_is_what_an_overridden_configure_gradient_clipping_did(tmp_path: Path, clip: float,
                                                                       algorithm: str) -> None:  # fmt: skip
    module = WarmUpWithoutClipping()
    _fit(module, tmp_path / "run", gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    norms, clipped, head = _warm_up_reference(clip, algorithm)
    assert clipped == [False, False, True, True]
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.grad_norm) == pytest.approx(norms, rel=1e-6)
    assert list(steps.clipped) == clipped  # steps 0 and 1 were above the limit, and not clipped
    torch.testing.assert_close(module.head.weight, head.weight)


def test_a_step_without_gradients_has_null_grad_norm_and_clipped(tmp_path: Path) -> None:
    """training_step returning None: no gradient exists, so neither a norm of 0 nor clipped=False is recorded."""
    _fit(WarmUpWithoutClipping(none_at=1), tmp_path / "run", gradient_clip_val=1.0)
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.step) == [0, 1, 2, 3]
    assert steps.grad_norm.isna().tolist() == [False, True, False, False]
    assert steps.clipped.isna().tolist() == [False, True, False, False]
