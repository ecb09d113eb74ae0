"""A named tap whose value comes only from parameters frozen for now is a row without gradient, not an error.

Fine-tuning schedules freeze a backbone for the first epochs (Lightning's `BaseFinetuning`), and a GAN step
freezes the other network (Lightning's `toggle_optimizer`): a tap on the frozen part's output fires with a
value that does not require grad, in the middle of training. Before, a named tap raised there and the
training died at step 0; a value that does not require grad while every parameter is trainable (detached,
or made under `torch.no_grad()`) is still a mistake named at once (`tests/test_errors.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from gradrunner import capture
from gradrunner.errors import GradrunnerError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def _reference(frozen_steps: int, steps: int) -> list[float | None]:
    """The norm of d loss / d backbone output per step, by a plain forward hook (None while it is frozen)."""
    net, out = Net(), []
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    for step in range(steps):
        net.backbone.requires_grad_(step >= frozen_steps)
        kept: list[torch.Tensor] = []
        handle = net.backbone.register_forward_hook(lambda m, a, o, kept=kept: kept.append(o))
        loss = nn.functional.mse_loss(net(x), y)
        handle.remove()
        out.append(
            float(torch.autograd.grad(loss, kept, retain_graph=True)[0].norm()) if kept[0].requires_grad else None
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_a_tap_on_a_backbone_frozen_for_the_first_steps_records_no_gradient_then_the_gradient(strategy: str) -> None:
    want = _reference(2, 4)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    got = []
    with capture(net, ["backbone:output"], strategy=strategy) as cap:
        for step in range(4):
            net.backbone.requires_grad_(step >= 2)
            loss = nn.functional.mse_loss(net(x), y)
            cap.backward(loss)
            row = cap.records(loss).row(0)
            got.append((row["has_grad"], row["norm"], row["reason"]))
            opt.step()
            opt.zero_grad()
    assert [g[0] for g in got] == [False, False, True, True]
    assert got[0][2] == got[1][2] == "does not require grad (detached, or frozen)"
    assert [g[1] for g in got[2:]] == pytest.approx(want[2:], rel=1e-6)


def test_a_detached_value_of_a_fully_trainable_model_is_still_named_at_once() -> None:
    class Detached(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).detach()

    net = Net()
    net.backbone = Detached(4, 8)
    with pytest.raises(GradrunnerError, match="tap 'backbone:output' cannot carry a gradient"), capture(
        net, ["backbone:output"]
    ) as cap:  # fmt: skip
        cap.backward(net(torch.randn(2, 4)).sum())


def test_lightning_fine_tuning_with_a_frozen_then_unfrozen_backbone_records_its_output(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradrunner.integrations.lightning import GradientCapture

    want = _reference(1, 4)
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Unfreeze(pl.Callback):  # BaseFinetuning's pattern: frozen in epoch 0, trained from epoch 1
        def on_train_epoch_start(self, trainer: object, module: Module) -> None:
            module.net.backbone.requires_grad_(trainer.current_epoch >= 1)  # type: ignore[attr-defined]

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_epochs=4, callbacks=[Unfreeze(), GradientCapture(taps=["net.backbone:output"], dir=tmp_path)],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   accelerator="cpu").fit(Module(), data)  # fmt: skip
    rows = pd.read_parquet(tmp_path / "grads.parquet").sort_values("step")
    assert rows["has_grad"].tolist() == [False, True, True, True]
    assert rows["norm"].iloc[1:].tolist() == pytest.approx(want[1:], rel=1e-6)


def _edited_reference(frozen_steps: int, steps: int) -> tuple[list[float | None], list[torch.Tensor]]:
    """`_reference`'s training with d loss / d backbone output halved by a plain tensor hook: per step the norm
    that arrived (None while frozen), and the parameters at the end."""
    net, out = Net(), []
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    for step in range(steps):
        net.backbone.requires_grad_(step >= frozen_steps)
        arrived: list[float] = []

        def halve(m: nn.Module, a: object, o: torch.Tensor, arrived: list[float] = arrived) -> None:
            if o.requires_grad:
                o.register_hook(lambda g: (arrived.append(float(g.norm())), g * 0.5)[1])

        handle = net.backbone.register_forward_hook(halve)
        nn.functional.mse_loss(net(x), y).backward()
        handle.remove()
        out.append(arrived[0] if arrived else None)
        opt.step()
        opt.zero_grad()
    return out, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_an_edit_on_a_tap_frozen_for_now_does_nothing_there_and_edits_once_it_trains(strategy: str) -> None:
    """Before, the edit raised 'cannot carry a gradient' at the first frozen step (a GAN step under Lightning's
    toggle_optimizer died at its first discriminator step), though the same tap without the edit is a row."""
    want, params = _edited_reference(2, 4)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    got = []
    with capture(net, ["backbone:output"], strategy=strategy, edits=[{"tap": "backbone:output", "scale": 0.5}]) as cap:
        for step in range(4):
            net.backbone.requires_grad_(step >= 2)
            loss = nn.functional.mse_loss(net(x), y)
            cap.backward(loss)
            row = cap.records(loss).row(0)
            got.append((row["has_grad"], row["edited"], row["norm"], row["edited_norm"], row["reason"]))
            opt.step()
            opt.zero_grad()
    assert [g[:2] for g in got] == [(False, False), (False, False), (True, True), (True, True)]
    assert got[0][4] == "does not require grad (detached, or frozen)"
    assert [g[2] for g in got[2:]] == pytest.approx(want[2:], rel=1e-6)
    assert [g[3] for g in got[2:]] == pytest.approx([0.5 * w for w in want[2:]], rel=1e-6)  # type: ignore[operator]
    for p, q in zip(net.parameters(), params, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-7)


def _turn_on(out: torch.Tensor, hook: Callable[[torch.Tensor], None] | None = None) -> None:
    """What `enable_input_require_grads()`'s hook does to the output, and a plain tensor hook for the reference."""
    out.requires_grad_()
    if hook is not None:
        out.register_hook(hook)


def test_a_frozen_output_a_later_hook_makes_require_grad_records_its_gradient(strategy: str) -> None:
    """transformers' `enable_input_require_grads()` (PEFT calls it for frozen embeddings) is a forward hook that
    sets `requires_grad_()` on the frozen embedding's output in place; registered after the session opened it
    runs after the tap fired. The gradient that then arrives is recorded, not 'does not require grad'."""
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    expected: list[torch.Tensor] = []
    plain = Net()  # the reference: plain torch, no gradrunner
    plain.backbone.requires_grad_(False)
    plain.backbone.register_forward_hook(lambda _m, _a, out: _turn_on(out, expected.append))
    nn.functional.mse_loss(plain(x), y).backward()
    net = Net()
    net.backbone.requires_grad_(False)
    with capture(net, ["backbone:output"], strategy=strategy) as cap:
        turn_on = net.backbone.register_forward_hook(lambda _m, _a, out: _turn_on(out))
        loss = nn.functional.mse_loss(net(x), y)
        cap.backward(loss)
        recs = cap.records(loss)
        turn_on.remove()
    row = recs.row(0)
    assert (row["has_grad"], row["reason"]) == (True, None)
    assert row["norm"] == pytest.approx(float(expected[0].norm()), rel=1e-6)
    torch.testing.assert_close(cap.grads["backbone:output"], expected[0])
    assert all(p.grad is None for p in net.backbone.parameters())
    torch.testing.assert_close(net.head.weight.grad, plain.head.weight.grad, rtol=0, atol=0)


def _edited_run(
    strategy: str, late: bool, edits: list[dict[str, object]], enabled: bool = True
) -> tuple[dict[str, object] | None, list[torch.Tensor], Net]:
    """A frozen backbone whose output a forward hook makes require grad, registered after the session opened (`late`:
    it runs after the tap fired) or before it (the output requires grad when the tap fires): the row and the leaf."""
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    net = Net()
    net.backbone.requires_grad_(False)
    leaves: list[torch.Tensor] = []

    def on(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        _turn_on(out)
        leaves.append(out)

    early = None if late else net.backbone.register_forward_hook(on)
    with capture(net, ["backbone:output"], strategy=strategy, edits=edits) as cap:
        turn_on = net.backbone.register_forward_hook(on) if late else early
        cap.enabled = enabled
        cap.backward(nn.functional.mse_loss(net(x), y))
        row = cap.records().row(0) if enabled else None
        assert turn_on is not None
        turn_on.remove()
    return row, leaves, net


def test_an_edit_on_a_frozen_output_a_later_hook_makes_require_grad_is_applied_and_recorded(strategy: str) -> None:
    """An edited tap on the frozen output `enable_input_require_grads()` turns on after the tap fired: the row has
    the gradient that arrived and the edit's norm, the leaf's `.grad` is the edited gradient, as when the output
    required grad as the tap fired and as plain hooks applying the edit by hand give; parameters' `.grad` unchanged."""
    x, y = (
        torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(8, 2, generator=torch.Generator().manual_seed(2)),
    )
    arrived: list[torch.Tensor] = []
    plain = Net()  # the reference: plain torch, the edit by hand in a tensor hook on the turned-on output
    plain.backbone.requires_grad_(False)
    kept: list[torch.Tensor] = []

    def by_hand(g: torch.Tensor) -> torch.Tensor:
        arrived.append(g)
        return g * 0.5

    plain.backbone.register_forward_hook(lambda _m, _a, out: (_turn_on(out, by_hand), kept.append(out)) and None)
    nn.functional.mse_loss(plain(x), y).backward()
    random = [{"tap": "backbone:output", "scale": 0.5}, {"tap": "backbone:output", "dropout": 0.25}]
    for edits in ([{"tap": "backbone:output", "scale": 0.5}], random):
        row, leaves, net = _edited_run(strategy, True, edits)
        ref_row, ref_leaves, _ = _edited_run(strategy, False, edits)
        assert row is not None and ref_row is not None
        assert (row["has_grad"], row["reason"], row["edited"]) == (True, None, True)
        assert row["norm"] == pytest.approx(float(arrived[0].norm()), rel=1e-6)
        assert (row["norm"], row["edited_norm"]) == (ref_row["norm"], ref_row["edited_norm"])
        assert leaves[0].grad is not None and ref_leaves[0].grad is not None
        torch.testing.assert_close(leaves[0].grad, ref_leaves[0].grad, rtol=0, atol=0)  # dropout's draw too
        if len(edits) == 1:
            assert row["edited_norm"] == pytest.approx(0.5 * float(arrived[0].norm()), rel=1e-6)
            torch.testing.assert_close(leaves[0].grad, kept[0].grad, rtol=0, atol=0)
        assert all(p.grad is None for p in net.backbone.parameters())
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(net.head, name).grad, getattr(plain.head, name).grad, rtol=0, atol=0)


def test_an_edit_on_a_frozen_output_a_later_hook_makes_require_grad_is_applied_in_an_uncaptured_step(
    strategy: str,
) -> None:
    """The same in a step the session does not capture (`cap.enabled = False`, `every=N`): edits apply on every
    step, so the leaf's `.grad` is the edited gradient, as when the output required grad as the tap fired."""
    random = [{"tap": "backbone:output", "scale": 0.5}, {"tap": "backbone:output", "dropout": 0.25}]
    for edits in ([{"tap": "backbone:output", "scale": 0.5}], random):
        _, leaves, _ = _edited_run(strategy, True, edits, enabled=False)
        _, ref_leaves, _ = _edited_run(strategy, False, edits, enabled=False)
        _, unedited, _ = _edited_run(strategy, True, [], enabled=False)
        assert leaves[0].grad is not None and ref_leaves[0].grad is not None and unedited[0].grad is not None
        torch.testing.assert_close(leaves[0].grad, ref_leaves[0].grad, rtol=0, atol=0)
        if len(edits) == 1:
            torch.testing.assert_close(leaves[0].grad, 0.5 * unedited[0].grad, rtol=0, atol=0)
