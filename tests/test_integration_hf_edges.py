"""The HF Trainer callback at its edges, each test against a plain-torch or a Trainer-only reference (the same run
without the callback, the Trainer's own logged values)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradrunner.analysis import load  # noqa: E402
from gradrunner.integrations.hf import GradientCaptureCallback  # noqa: E402

MLP = "transformer.h.0.mlp:output"


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _data(n: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (n, 8), generator=g)]


def _args(out: Path, **kwargs: Any) -> Any:
    base = {"per_device_train_batch_size": 2, "max_steps": 3, "learning_rate": 0.05, "optim": "sgd",
            "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True, "seed": 0,
            "disable_tqdm": True}  # fmt: skip
    return transformers.TrainingArguments(output_dir=str(out), **{**base, **kwargs})


def _train(trainer: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer.train()


class Logged(transformers.TrainerCallback):
    """The Trainer's own logged loss of each log."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs and "grad_norm" in logs:
            self.losses.append(float(logs["loss"]))


class Fail(transformers.TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            raise RuntimeError("data went bad")


def _output_grad_norms(module: nn.Module) -> list[float]:
    """Plain torch: the norm of the gradient of `module`'s output, once per training backward."""
    norms: list[float] = []

    def hook(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        if m.training and torch.is_grad_enabled():
            out.register_hook(lambda g: norms.append(float(g.double().norm())))

    module.register_forward_hook(hook)
    return norms


def test_root_local_taps_fire_under_accelerates_mixed_precision_wrapper(tmp_path: Path) -> None:
    """bf16=True: accelerate sets `model.forward` to its autocast wrapper around the class's plain `forward`; the
    root's local `hidden_states` (the final layer norm's output) is recorded as a hook on `ln_f` sees it, and the
    wrapper's closure holds the class's `forward` again afterwards."""
    model = _gpt2()
    cls_forward = type(model).__dict__["forward"]
    ref = _output_grad_norms(model.transformer.ln_f)
    cb = GradientCaptureCallback(taps=[":hidden_states"], dir=tmp_path / "run")
    _train(transformers.Trainer(model=model, args=_args(tmp_path / "hf", bf16=True), train_dataset=_data(),
                                callbacks=[cb]))  # fmt: skip
    df = load(tmp_path / "run").query("call == 0").sort_values("step")
    assert len(ref) == 3 and df.has_grad.all(), df.reason.tolist()
    assert list(df.norm) == pytest.approx(ref, rel=1e-5)
    assert type(model).__dict__["forward"] is cls_forward  # the class untouched
    wrapper = model.forward.__func__.__wrapped__.__wrapped__  # accelerate's ConvertOutputsToFp32, then autocast's
    assert cls_forward in [c.cell_contents for c in wrapper.__closure__]  # the closure as accelerate left it


@pytest.mark.parametrize("tap", [MLP, ":hidden_states"])  # a module's output; a local of the root's own forward
@pytest.mark.parametrize("order", ["capture first", "failing first"])
def test_a_training_forward_after_a_failed_train_ends_the_session(tmp_path: Path, order: str, tap: str) -> None:
    """train() raises after step 0; the user's own forward and backward then get the gradients of a model with no
    hooks (the session's scale-0 edit no longer applies) and change nothing in the records: step 0 alone, with the
    loss the Trainer logs for step 0 without gradrunner; every hook is gone as that forward begins."""
    logged = Logged()
    _train(transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "ref", max_steps=1), train_dataset=_data(),
                                callbacks=[logged]))  # fmt: skip
    model = _gpt2()
    cb = GradientCaptureCallback(taps=[tap], dir=tmp_path / "run", edits=[{"tap": tap, "scale": 0.0}])
    callbacks = [cb, Fail(1)] if order == "capture first" else [Fail(1), cb]
    with pytest.raises(RuntimeError, match="data went bad"):
        _train(transformers.Trainer(model=model, args=_args(tmp_path / "hf"), train_dataset=_data(),
                                    callbacks=callbacks))  # fmt: skip
    reference = _gpt2()
    reference.load_state_dict(model.state_dict())
    batch = torch.stack([d["input_ids"] for d in _data()[:2]])
    for m in (model, reference):
        m.train()
        m.zero_grad()
        m(input_ids=batch, labels=batch).loss.backward()
    assert not model._forward_hooks and not model._forward_pre_hooks and "forward" not in vars(model)
    assert not model.transformer.h[0].mlp._forward_hooks
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    cb.close()
    assert not (tmp_path / "run" / "done.json").exists()
    grads, steps = load(tmp_path / "run"), load(tmp_path / "run", table="steps")
    assert list(steps.step) == [0] and set(grads.step) == {0} and grads.micro_step.isna().all()  # one backward
    assert list(steps.loss) == pytest.approx(logged.losses, rel=1e-6)


class Probe(transformers.TrainerCallback):
    """A user's callback: a training-mode forward with gradients at `event` while train() runs (a saliency metric),
    its loss and d loss / d c_fc.weight kept; `plain` (a copy with no hook) checks them bitwise on the spot."""

    def __init__(self, event: str, plain: bool = False) -> None:
        self.event, self.plain = event, plain
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _probe(self, model: nn.Module) -> None:
        batch = torch.stack([d["input_ids"] for d in _data()[:2]])
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        (grad,) = torch.autograd.grad(loss, model.transformer.h[0].mlp.c_fc.weight)
        self.seen.append((loss.detach(), grad))
        if self.plain:
            copy = _gpt2()
            copy.load_state_dict(model.state_dict())
            copy.train()
            loss2 = copy(input_ids=batch, labels=batch).loss
            (grad2,) = torch.autograd.grad(loss2, copy.transformer.h[0].mlp.c_fc.weight)
            assert torch.equal(loss, loss2) and torch.equal(grad, grad2)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.event == "on_step_end":
            self._probe(model)

    def on_log(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.event == "on_log":
            self._probe(model)


@pytest.mark.parametrize("event", ["on_step_end", "on_log"])
def test_a_callbacks_training_forward_while_train_runs_is_not_captured(tmp_path: Path, event: str) -> None:
    """A user's callback runs a training forward (and autograd.grad) between the Trainer's steps: every step is
    recorded (norms as plain hooks on a run without gradrunner read them, losses as the Trainer logs them), done.json
    is written, and that forward's loss and gradient are bitwise those of the run without gradrunner."""
    model, logged, probe = _gpt2(), Logged(), Probe(event)
    norms = _output_grad_norms(model.transformer.h[0].mlp)
    ref: list[float] = []

    class Keep(transformers.TrainerCallback):  # the plain-hook norms of the Trainer's backwards, not the probe's
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            norms.clear()  # the probe's, between the steps

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ref.extend(norms)

    _train(transformers.Trainer(model=model, args=_args(tmp_path / "ref"), train_dataset=_data(),
                                callbacks=[Keep(), logged, probe]))  # fmt: skip
    cb, probe2 = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run"), Probe(event)
    _train(transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "hf"), train_dataset=_data(),
                                callbacks=[probe2, cb]))  # fmt: skip
    assert (tmp_path / "run" / "done.json").is_file()
    grads, steps = load(tmp_path / "run"), load(tmp_path / "run", table="steps")
    assert list(steps.step) == [0, 1, 2] and list(grads.sort_values("step").step) == [0, 1, 2]
    assert len(ref) == 3 and list(grads.sort_values("step").norm) == pytest.approx(ref, rel=1e-6)
    assert list(steps.loss) == pytest.approx(logged.losses, rel=1e-6)
    # on_log: train()'s summary log too
    assert len(probe2.seen) == len(probe.seen) == {"on_step_end": 3, "on_log": 4}[event]
    for (loss, grad), (loss2, grad2) in zip(probe.seen, probe2.seen, strict=True):
        assert torch.equal(loss, loss2) and torch.equal(grad, grad2)


@pytest.mark.parametrize("order", ["capture first", "probe first"])
def test_a_callbacks_forward_is_neither_hooked_nor_edited(tmp_path: Path, order: str) -> None:
    """With a scale-0 edit on the MLP's output, a callback's forward and autograd.grad between the steps get the
    gradient of a copy with no hook (checked in the probe), and the session records every step to done.json; the
    per-example hooks (a `with_kwargs` pre-hook on the model) run before the capture closes for that forward."""
    taps = [MLP, "transformer.h.0.mlp.c_fc:weight"]
    cb = GradientCaptureCallback(taps=taps, dir=tmp_path / "run", edits=[{"tap": MLP, "scale": 0.0}], per_example=True)
    probe = Probe("on_step_end", plain=True)
    _train(transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "hf"), train_dataset=_data(),
                                callbacks=[cb, probe] if order == "capture first" else [probe, cb]))  # fmt: skip
    assert len(probe.seen) == 3 and all(bool(g.abs().sum() > 0) for _, g in probe.seen)  # the edit would zero it
    assert (tmp_path / "run" / "done.json").is_file()
    assert list(load(tmp_path / "run", table="steps").step) == [0, 1, 2]
    weight = load(tmp_path / "run").query("tap == @taps[1]").sort_values("step")
    assert list(weight.step) == [0, 1, 2] and weight.per_example_norm.map(len).tolist() == [2, 2, 2]


def test_a_forward_after_train_raised_ends_a_session_a_callbacks_forward_had_suspended(tmp_path: Path) -> None:
    """A callback's forward at step 0's end, then train() raises there: the user's own forward afterwards ends the
    session (step 0's records on disk, every hook gone) as after any train() that raised."""
    model = _gpt2()
    cb = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="data went bad"):
        _train(transformers.Trainer(model=model, args=_args(tmp_path / "hf"), train_dataset=_data(),
                                    callbacks=[cb, Probe("on_step_end"), Fail(1)]))  # fmt: skip
    batch = torch.stack([d["input_ids"] for d in _data()[:2]])
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not (tmp_path / "run" / "done.json").exists()
    assert list(load(tmp_path / "run", table="steps").step) == [0] and list(load(tmp_path / "run").step) == [0]


def test_evaluation_between_steps_keeps_the_session(tmp_path: Path) -> None:
    """The Trainer's evaluation after a step (no_grad, eval mode) is no forward outside its steps: all steps kept."""
    cb = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")
    args = _args(tmp_path / "hf", eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2)
    _train(transformers.Trainer(model=_gpt2(), args=args, train_dataset=_data(), eval_dataset=_data(4),
                                callbacks=[cb]))  # fmt: skip
    assert (tmp_path / "run" / "done.json").is_file()
    assert list(load(tmp_path / "run", table="steps").step) == [0, 1, 2]


class PenaltyTrainer(transformers.Trainer):
    """compute_loss backpropagates more than the model's own loss: plus an L2 term, or its square."""

    squared = False

    def compute_loss(
        self, model: nn.Module, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        out = model(**inputs)
        loss = out.loss**2 if self.squared else out.loss + 0.01 * sum(p.pow(2).sum() for p in model.parameters())
        return (loss, out) if return_outputs else loss


@pytest.mark.parametrize("squared", [False, True], ids=["plus-penalty", "squared"])
def test_a_custom_compute_loss_records_what_the_trainer_backpropagated(tmp_path: Path, squared: bool) -> None:
    logged = Logged()
    trainer = PenaltyTrainer(model=_gpt2(), args=_args(tmp_path / "hf"), train_dataset=_data(),
                             callbacks=[logged, GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")])  # fmt: skip
    trainer.squared = squared
    _train(trainer)
    assert len(logged.losses) == 3
    assert list(load(tmp_path / "run", table="steps").loss) == pytest.approx(logged.losses, rel=1e-6)
    assert list(load(tmp_path / "run").loss) == pytest.approx(logged.losses, rel=1e-6)


def test_a_loss_the_trainer_computes_from_the_logits_is_its_logged_loss(tmp_path: Path) -> None:
    """label_smoothing_factor: the model gets no labels (its output has no loss); logged every step, the Trainer's."""
    logged = Logged()
    cb = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")
    args = _args(tmp_path / "hf", label_smoothing_factor=0.1)
    _train(transformers.Trainer(model=_gpt2(), args=args, train_dataset=_data(), callbacks=[logged, cb]))
    assert len(logged.losses) == 3
    assert list(load(tmp_path / "run", table="steps").loss) == pytest.approx(logged.losses, rel=1e-6)


def test_a_custom_compute_loss_logged_every_other_step_gives_null_not_the_models_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    """logging_steps=2: the Trainer's first log (step 1) disagrees with the model's loss; from then on null."""
    cb = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")
    trainer = PenaltyTrainer(model=_gpt2(), args=_args(tmp_path / "hf", max_steps=4, logging_steps=2),
                             train_dataset=_data(), callbacks=[cb])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="gradrunner.integrations.hf"):
        _train(trainer)
    assert load(tmp_path / "run", table="steps").loss.iloc[1:].isna().all()
    assert "steps 0..0, written before this log, hold the model's own loss" in caplog.text


def test_the_models_loss_logged_every_other_step_is_kept(tmp_path: Path) -> None:
    """The stock compute_loss, logging_steps=2: every step's loss is recorded, and each log is the mean of its two."""
    logged = Logged()
    _train(transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "hf", max_steps=4, logging_steps=2),
                                train_dataset=_data(), callbacks=[logged, GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")]))  # fmt: skip
    loss = list(load(tmp_path / "run", table="steps").loss)
    assert [(loss[0] + loss[1]) / 2, (loss[2] + loss[3]) / 2] == pytest.approx(logged.losses, rel=1e-5)


def test_the_completed_steps_are_kept_whatever_the_callbacks_order(tmp_path: Path) -> None:
    """A callback listed before the capture raises in on_step_end of step 1: the Trainer completed steps 0 and 1
    (global_step 2) and both are recorded, with the losses it logged."""
    logged = Logged()
    cb = GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")
    trainer = transformers.Trainer(model=_gpt2(), args=_args(tmp_path / "hf", max_steps=4), train_dataset=_data(),
                                   callbacks=[logged, Fail(2), cb])  # fmt: skip
    with pytest.raises(RuntimeError, match="data went bad"):
        _train(trainer)
    cb.close()
    assert trainer.state.global_step == 2
    steps = load(tmp_path / "run", table="steps")
    assert list(steps.step) == [0, 1] and sorted(set(load(tmp_path / "run").step)) == [0, 1]
    assert list(steps.loss.iloc[:1]) == pytest.approx(logged.losses[:1], rel=1e-6)  # step 1's log never came


def test_a_last_window_of_one_micro_batch_numbers_it(tmp_path: Path) -> None:
    """gradient_accumulation_steps=2 over 5 micro-batches: steps 0 and 1 hold micro_step 0, 1; step 2 (one
    micro-batch) holds micro_step 0; the norms are those a plain hook saw, in order."""
    model = _gpt2()
    ref = _output_grad_norms(model.transformer.h[0].mlp)
    args = _args(tmp_path / "hf", max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=2)
    _train(transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                callbacks=[GradientCaptureCallback(taps=[MLP], dir=tmp_path / "run")]))  # fmt: skip
    df = load(tmp_path / "run").sort_values(["step", "micro_step"])
    assert list(zip(df.step, df.micro_step, strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert list(df.norm) == pytest.approx(ref, rel=1e-5)
