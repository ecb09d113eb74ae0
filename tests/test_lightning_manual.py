"""Lightning manual optimisation with two optimisers (a GAN step): record steps are Lightning's logging steps;
with one optimiser stepped every N-th batch (accumulation by hand), a step is the window, numbered `global_step`.

`trainer.global_step` counts each optimiser's step (two per batch here) while Lightning's loggers count
the batch; the records count the batch too, so a resume from `fit(ckpt_path=...)` (whose global step is
twice the batches) continues them. Before, the records were numbered by batch but the resume started
at `global_step` and refused: "the records of steps 2..3 would be missing". Records are checked against
a plain torch loop with forward hooks (no gradrunner), and the resumed run against the uninterrupted one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from gradrunner.integrations.lightning import GradientCapture  # noqa: E402

TAPS = ["g.0:output", "g.0:weight", "d:weight"]


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Linear(2, 1)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 4, generator=g),
                                                                      torch.randn(10, 2, generator=g)), batch_size=5)  # fmt: skip


def _step(g: nn.Module, d: nn.Module, og: Any, od: Any, x: torch.Tensor, y: torch.Tensor, backward: Any) -> None:
    og.zero_grad()
    backward(nn.functional.mse_loss(g(x), y))
    og.step()
    od.zero_grad()
    backward(d(g(x).detach()).pow(2).mean())
    od.step()


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = _nets()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        og, od = self.optimizers()
        _step(self.g, self.d, og, od, *batch, self.manual_backward)

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)


def _reference(batches: int) -> list[dict[str, float]]:
    """Per batch: the generator's first layer output gradient (its loss), and the two weights' `.grad` at their step."""
    g, d = _nets()
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    out = []
    data = [b for _ in range(2) for b in _data()][:batches]
    for x, y in data:
        row: dict[str, float] = {}
        kept: list[torch.Tensor] = []
        handle = g[0].register_forward_hook(lambda m, a, o, kept=kept: kept.append(o))

        def backward(loss: torch.Tensor, row: dict[str, float] = row, kept: list[torch.Tensor] = kept) -> None:
            if "g.0:output" not in row:
                row["g.0:output"] = float(torch.autograd.grad(loss, kept[0], retain_graph=True)[0].norm())
            loss.backward()
            if "g.0:weight" not in row:
                row["g.0:weight"] = float(g[0].weight.grad.norm())
            else:
                row["d:weight"] = float(d.weight.grad.norm())

        _step(g, d, og, od, x, y, backward)
        handle.remove()
        out.append(row)
    return out


def _fit(out: Path, max_steps: int, ckpt: Path | None = None, save: Path | None = None, **options: Any) -> None:
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[GradientCapture(taps=TAPS, dir=out, **options)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(GAN(), _data(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)


def _norms(out: Path) -> pd.DataFrame:
    rows = pd.read_parquet(out / "grads.parquet")
    return rows[rows["has_grad"] & (rows["call"] == 0)].pivot(index="step", columns="tap", values="norm")


def test_a_two_optimiser_step_is_one_record_step_equal_to_plain_hooks(tmp_path: Path) -> None:
    _fit(tmp_path / "run", max_steps=8)  # global_step 8: four batches, two epochs
    got, want = _norms(tmp_path / "run"), pd.DataFrame(_reference(4))
    assert got.index.tolist() == [0, 1, 2, 3]
    for tap in TAPS:
        assert got[tap].tolist() == pytest.approx(want[tap].tolist(), rel=1e-6), tap
    assert pd.read_parquet(tmp_path / "run" / "steps.parquet")["step"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("edits", [[], [{"tap": "g.0:output", "dropout": 0.5}]], ids=["plain", "dropout"])
def test_a_resume_from_a_lightning_checkpoint_continues_the_records(tmp_path: Path, edits: list[Any]) -> None:
    """With a seeded edit (two backwards a step here): before, the resumed session drew from backward 0 again."""
    _fit(tmp_path / "full", max_steps=8, edits=edits)
    with pytest.raises((KeyboardInterrupt, SystemExit)):  # an interrupted fit (Lightning exits): its steps kept

        class Stop(pl.Callback):  # a checkpoint where ModelCheckpoint(every_n_train_steps=...) saves it, then Ctrl-C
            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
                if trainer.global_step == 4:  # after epoch 0's two batches
                    trainer.save_checkpoint(tmp_path / "c.ckpt")

            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
                if trainer.global_step == 4:
                    raise KeyboardInterrupt

        trainer = pl.Trainer(max_steps=8, callbacks=[Stop(), GradientCapture(taps=TAPS, dir=tmp_path / "cut", edits=edits)],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", devices=1)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(GAN(), _data())
    assert not (tmp_path / "cut" / "done.json").exists()
    assert _norms(tmp_path / "cut").index.tolist() == [0, 1]
    _fit(tmp_path / "cut", max_steps=8, ckpt=tmp_path / "c.ckpt", resume=True, edits=edits)
    pd.testing.assert_frame_equal(_norms(tmp_path / "cut"), _norms(tmp_path / "full"))


# -- one optimiser, a window of batches accumulated by hand: one step, numbered by global_step ---------------
class HandAccumulated(pl.LightningModule):
    """`manual_backward(loss / n)` every batch, `opt.step()` every `n`-th: a step of `n` micro-batches."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.n = n
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]) / self.n)
        if (i + 1) % self.n == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(60, 4, generator=g),
                                                                      torch.randn(60, 2, generator=g)), batch_size=5)  # fmt: skip


def _hand_reference(n: int, steps: int) -> list[tuple[list[float], float]]:
    """Per optimizer step, plain torch: each micro-batch's `net.0` output gradient norm, and the `.grad` it stepped."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out: list[tuple[list[float], float]] = []
    micro: list[float] = []
    for i, (x, y) in enumerate(list(_batches())[: n * steps]):
        h = net[0](x)
        loss = nn.functional.mse_loss(net[2](net[1](h)), y) / n
        micro.append(float(torch.autograd.grad(loss, h, retain_graph=True)[0].norm()))
        loss.backward()
        if (i + 1) % n == 0:
            out.append((micro, float(net[0].weight.grad.norm())))
            micro = []
            opt.step()
            opt.zero_grad()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_a_window_accumulated_by_hand_is_one_step_with_its_whole_gradient(tmp_path: Path, n: int) -> None:
    """Before, the record step was renumbered from Lightning's count of batches mid-window: with every=2, steps
    labelled 0 and 4 (n=3), the second holding 2 of 3 micro-batches and part of the `.grad` the optimizer used;
    with n=2 every step captured (0, 2, 4, 6)."""
    trainer = pl.Trainer(max_steps=4, callbacks=[GradientCapture(taps=["net.0:output", "net.0:weight"], dir=tmp_path, every=2)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(HandAccumulated(n), _batches())
    want = _hand_reference(n, 4)
    assert pd.read_parquet(tmp_path / "steps.parquet")["step"].tolist() == [0, 1, 2, 3]
    rows = pd.read_parquet(tmp_path / "grads.parquet")
    weight = rows[rows["tap"] == "net.0:weight"].set_index("step")["norm"]
    assert weight.index.tolist() == [0, 2]
    for step in (0, 2):
        assert weight[step] == pytest.approx(want[step][1], rel=1e-6)
        acts = rows[(rows["tap"] == "net.0:output") & (rows["step"] == step)].sort_values("micro_step")
        assert acts["micro_step"].tolist() == list(range(n))
        assert acts["norm"].tolist() == pytest.approx(want[step][0], rel=1e-6)
