"""The HF callback's `steps.parquet` loss against what the Trainer backpropagated (`training_step`'s return, kept by
a Trainer subclass) and what the model's own `loss` output held, step by step."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_reference import tiny_gpt2  # noqa: E402

from gradrunner.analysis import load  # noqa: E402
from gradrunner.integrations.hf import GradientCaptureCallback  # noqa: E402

MLP = "transformer.h.0.mlp:output"


class Kept(transformers.Trainer):
    """Keeps what `training_step` returned (what the Trainer backpropagated, before accumulation's division) and the
    model's own loss of each training forward; `extra_from` adds an L2 term to the loss from that global step on."""

    extra_from: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backpropagated: list[float] = []
        self.own: list[float] = []

    def compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if self.extra_from is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        out = model(**inputs)
        self.own.append(float(out.loss))
        loss = out.loss
        if self.state.global_step >= self.extra_from:  # an auxiliary term switched on after a warm-up
            loss = loss + sum((p**2).sum() for p in model.transformer.h[0].mlp.parameters())
        return (loss, out) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.backpropagated.append(float(loss))
        return loss


def _run(
    out: Path, extra_from: int | None = None, trainer: type[Kept] = Kept, loss_func: Any = None, **kwargs: Any
) -> Kept:
    base = {"per_device_train_batch_size": 2, "max_steps": 4, "learning_rate": 0.05, "optim": "sgd",
            "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True, "seed": 0,
            "disable_tqdm": True}  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(out / "hf"), **{**base, **kwargs})
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (16, 8), generator=g)]
    run = trainer(model=tiny_gpt2(), args=args, train_dataset=data, compute_loss_func=loss_func,
                  callbacks=[GradientCaptureCallback(taps=[MLP], dir=out / "run")])  # fmt: skip
    run.extra_from = extra_from
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.train()
    return run


def test_each_log_of_two_steps_is_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """logging_steps=2 over 6 steps, an extra term backpropagated from step 2 on: steps 0 and 1 (logged together,
    agreeing) hold what was backpropagated; the log of steps 2-3 disagrees: step 2, written before it, holds the
    model's own loss (the warning names it), steps 3-5 are null (each log was checked, not only the first)."""
    with caplog.at_level(logging.WARNING, logger="gradrunner.integrations.hf"):
        trainer = _run(tmp_path, extra_from=2, max_steps=6, logging_steps=2)
    loss = load(tmp_path / "run", table="steps").loss
    assert trainer.backpropagated[2] > trainer.own[2] + 1  # the extra term is there
    assert list(loss.iloc[:2]) == pytest.approx(trainer.backpropagated[:2], rel=1e-6)
    assert loss.iloc[2] == pytest.approx(trainer.own[2], rel=1e-6)
    assert loss.iloc[3:].isna().all(), list(loss)
    assert "steps 2..2, written before this log, hold the model's own loss" in caplog.text


def test_a_diverging_run_logged_every_step_records_each_steps_loss(tmp_path: Path) -> None:
    """The stock compute_loss, logging_steps=1, a learning rate that makes the loss NaN from step 1: every row holds
    what the Trainer backpropagated, NaN included (the logs' 0.0, logging_nan_inf_filter's substitute, is none)."""
    trainer = _run(tmp_path, learning_rate=1e9, max_grad_norm=0.0)
    loss = list(load(tmp_path / "run", table="steps").loss)
    assert math.isfinite(trainer.backpropagated[0]) and math.isnan(trainer.backpropagated[1])
    assert loss == pytest.approx(trainer.backpropagated, rel=1e-6, nan_ok=True)


class InPlace(Kept):
    """compute_loss scales the model's loss in place, as Trainer.compute_loss itself does (`loss *= loss_scale`)."""

    def compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        out = model(**inputs)
        loss = out.loss
        self.own.append(float(loss))
        loss *= 2.0
        return (loss, out) if return_outputs else loss


@pytest.mark.parametrize("logging_steps", [1, 500])
def test_a_loss_scaled_in_place_records_what_was_backpropagated(tmp_path: Path, logging_steps: int) -> None:
    """`loss *= 2` after the model's forward: each row holds twice the model's loss, what the Trainer backpropagated
    (logged every step or never)."""
    trainer = _run(tmp_path, trainer=InPlace, max_steps=3, logging_steps=logging_steps)
    assert trainer.backpropagated == pytest.approx([2 * own for own in trainer.own], rel=1e-6)
    assert list(load(tmp_path / "run", table="steps").loss) == pytest.approx(trainer.backpropagated, rel=1e-6)


def _losses(run_dir: Path) -> list[float | None]:
    """steps.parquet's loss as written: None for null, NaN for NaN (pandas reads both as NaN)."""
    import pyarrow.parquet as pq

    return pq.read_table(run_dir / "steps.parquet", columns=["loss"]).column("loss").to_pylist()


def test_a_nan_loss_the_trainer_computes_is_nan_not_the_filters_zero(tmp_path: Path) -> None:
    """label_smoothing_factor (the Trainer computes the loss from the logits), a run whose loss is NaN from step 1:
    the Trainer logs 0.0 for those steps (logging_nan_inf_filter), the rows hold NaN and the last word says so."""
    trainer = _run(tmp_path, learning_rate=1e9, max_grad_norm=0.0, label_smoothing_factor=0.1)
    assert math.isfinite(trainer.backpropagated[0]) and all(math.isnan(b) for b in trainer.backpropagated[1:])
    loss = _losses(tmp_path / "run")
    assert loss[0] == pytest.approx(trainer.backpropagated[0], rel=1e-6)
    assert all(v is not None and math.isnan(v) for v in loss[1:]), loss
    assert "NaN/Inf: the loss from step 1" in (tmp_path / "run" / "gradrunner.log").read_text()


def test_a_step_part_nan_is_null_not_the_filters_mix(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """compute_loss_func gives NaN for the second micro-batch of step 0 (gradient_accumulation_steps=2): the Trainer
    logs a mix of the first micro-batch's loss and the filter's stand-in; step 0 is null, said; step 1 (NaN weights,
    every micro-batch NaN, logged 0.0) is NaN."""
    calls: list[int] = []

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        calls.append(1)
        logits = outputs.logits[:, :-1].flatten(0, 1)
        loss = nn.functional.cross_entropy(logits, labels[:, 1:].flatten())
        return loss * math.nan if len(calls) == 2 else loss

    args = {"max_steps": 2, "gradient_accumulation_steps": 2, "max_grad_norm": 0.0}
    with caplog.at_level(logging.WARNING, logger="gradrunner.integrations.hf"):
        trainer = _run(tmp_path, loss_func=loss_func, **args)
    assert [math.isnan(b) for b in trainer.backpropagated] == [False, True, True, True]
    assert _losses(tmp_path / "run")[0] is None and math.isnan(_losses(tmp_path / "run")[1])
    assert "may be logging_nan_inf_filter's stand-in" in caplog.text


@pytest.mark.parametrize("extra_from", [0, None], ids=["custom-compute_loss", "stock"])
@pytest.mark.parametrize("no_log", [{"logging_steps": 500}, {"logging_strategy": "no"}], ids=["steps", "no"])
def test_a_run_with_no_loss_log_is_checked_by_train_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, extra_from: int | None, no_log: dict[str, Any]
) -> None:  # fmt: skip
    """No loss log in 3 steps: the last log's train_loss (the run's mean) checks the readings. A compute_loss adding a
    term disagrees: steps 0 and 1, written before it, hold the model's own loss (the warning names them), step 2 is
    null; the stock compute_loss agrees: every step holds what was backpropagated, no warning."""
    with caplog.at_level(logging.WARNING, logger="gradrunner.integrations.hf"):
        trainer = _run(tmp_path, extra_from=extra_from, max_steps=3, **no_log)
    loss = load(tmp_path / "run", table="steps").loss
    if extra_from is None:
        assert list(loss) == pytest.approx(trainer.backpropagated, rel=1e-6)
        assert "compute_loss" not in caplog.text
    else:
        assert list(loss.iloc[:2]) == pytest.approx(trainer.own[:2], rel=1e-6) and math.isnan(loss.iloc[2])
        assert "steps 0..1, written before this log, hold the model's own loss" in caplog.text
