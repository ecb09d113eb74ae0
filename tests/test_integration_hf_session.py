"""The HF Trainer callback's session (issue 36 items 11, 12, 14, 16) on a tiny random-init GPT-2: the last word,
`lr`/`grad_norm`/`clipped`, options checked in the constructor, resume with `resume_from_checkpoint`."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradrunner.analysis import load  # noqa: E402
from gradrunner.errors import GradrunnerError  # noqa: E402
from gradrunner.integrations.hf import GradientCaptureCallback  # noqa: E402
from gradrunner.run.session_log import LOG_FILE  # noqa: E402

TAPS = ["transformer.h.0.mlp:output", "transformer.h.0.mlp.c_fc:weight"]
CLIP, LR = 0.05, 0.05


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 40, (16, 8), generator=g)]


class Logged(transformers.TrainerCallback):
    """The Trainer's own logged loss and grad_norm, one per step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "grad_norm" in logs:
            self.grad_norms.append(float(logs["grad_norm"]))
            self.losses.append(float(logs["loss"]))


class Crash(transformers.TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == 3:
            raise RuntimeError("crash")


def _train(out: Path, callbacks: list, resume_from: str | None = None, **kwargs: Any) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=4, optim="sgd", lr_scheduler_type="linear",
        weight_decay=0.0, logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        **{"save_strategy": "no", "max_grad_norm": CLIP, "learning_rate": LR, **kwargs},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=_data(), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume_from)


@pytest.mark.slow
def test_last_word_lr_grad_norm_and_clipped(tmp_path: Path) -> None:
    logged = Logged()
    _train(tmp_path / "hf", [logged, GradientCaptureCallback(taps=TAPS, dir=tmp_path / "run")])
    steps = load(tmp_path / "run", table="steps").sort_values("step")
    assert list(steps.lr) == pytest.approx([LR * (4 - k) / 4 for k in range(4)], rel=1e-9)  # linear, no warmup
    assert list(steps.grad_norm) == pytest.approx(logged.grad_norms, rel=1e-6)
    assert list(steps.clipped) == [n > CLIP for n in logged.grad_norms] and any(steps.clipped)
    text = (tmp_path / "run" / LOG_FILE).read_text()
    m = re.search(r"loss: (\S+) at the first step, (\S+) at the last \((\d+) steps\)", text)
    assert m and int(m[3]) == 4
    assert [float(m[1]), float(m[2])] == pytest.approx([logged.losses[0], logged.losses[-1]], rel=1e-5)


@pytest.mark.parametrize(("options", "says"), [({"histogramm": True}, "Did you mean 'histogram'"),
                                               ({"resume": "yes"}, "resume='yes'"), ({"every": 0}, "every=0"),
                                               ({"anomaly": {"window": 10}}, "anomaly.warmup=20")])  # fmt: skip
def test_option_mistakes_fail_in_the_constructor(tmp_path: Path, options: dict, says: str) -> None:
    with pytest.raises(GradrunnerError, match=re.escape(says)) as e:
        GradientCaptureCallback(taps=TAPS, dir=tmp_path / "run", **options)
    assert "\n" not in str(e.value)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    cols = [c for c in a.columns if c not in {"run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"}]
    key = [c for c in ("step", "tap", "call", "micro_step") if c in a.columns]
    pd.testing.assert_frame_equal(a[cols].sort_values(key).reset_index(drop=True),
                                  b[cols].sort_values(key).reset_index(drop=True))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("edits", [[], [{"tap": TAPS[0], "dropout": 0.5}]], ids=["plain", "dropout"])
def test_resume_from_checkpoint_gives_the_uninterrupted_records(tmp_path: Path, edits: list[Any]) -> None:
    """A crash at step 3 after the Trainer's checkpoint-2; a new callback (no close() of the old one) with
    resume=True and train(resume_from_checkpoint=...): the records equal an uninterrupted run's. With a seeded
    edit, the resumed session draws on from the uninterrupted run's backward count (before: from 0 again)."""
    _train(tmp_path / "whole-hf", [GradientCaptureCallback(taps=TAPS, dir=tmp_path / "whole", edits=edits)])
    run, out = tmp_path / "run", tmp_path / "hf"
    with pytest.raises(RuntimeError, match="crash"):
        _train(out, [GradientCaptureCallback(taps=TAPS, dir=run, edits=edits), Crash()], save_strategy="steps",
               save_steps=2)  # fmt: skip
    _train(out, [GradientCaptureCallback(taps=TAPS, dir=run, resume=True, edits=edits)],
           resume_from=str(out / "checkpoint-2"), save_strategy="steps", save_steps=2)  # fmt: skip
    assert (run / "done.json").is_file()
    _same(load(tmp_path / "whole"), load(run))
    _same(load(tmp_path / "whole", table="steps"), load(run, table="steps"))


def test_a_resume_after_an_epochs_short_last_window_draws_on_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """gradient_accumulation_steps=3 over epochs of 4 micro-batches: windows of 3 and 1, so the uninterrupted run has
    run 4 backwards before step 2, not 2 * 3. A dropout edit resumed from checkpoint-2 draws on from backward 4 (as the
    Trainer's own resume counts the epoch's batches): its masks, records and training are the uninterrupted run's."""
    edits, more = [{"tap": TAPS[0], "dropout": 0.5}], {"gradient_accumulation_steps": 3}
    _train(tmp_path / "whole-hf", [GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "whole", edits=edits)], **more)
    run, out = tmp_path / "run", tmp_path / "hf"
    with pytest.raises(RuntimeError, match="crash"):
        _train(out, [GradientCaptureCallback(taps=TAPS[:1], dir=run, edits=edits), Crash()], save_strategy="steps",
               save_steps=2, **more)  # fmt: skip
    _train(out, [GradientCaptureCallback(taps=TAPS[:1], dir=run, resume=True, edits=edits)],
           resume_from=str(out / "checkpoint-2"), save_strategy="steps", save_steps=2, **more)  # fmt: skip
    whole, resumed = load(tmp_path / "whole"), load(run)
    assert list(whole.groupby("step").size()) == [3, 1, 3, 1]  # the epochs' windows
    _same(whole, resumed)  # edited_norm included: the same masks
    _same(load(tmp_path / "whole", table="steps"), load(run, table="steps"))


class HalveMlpGradient(transformers.TrainerCallback):
    """A plain tensor hook: the first block's MLP output gradient times 0.5 (what the edit below does)."""

    def __init__(self) -> None:
        self.handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(lambda g: g * 0.5)

        self.handle = model.transformer.h[0].mlp.register_forward_hook(hook)


@pytest.mark.slow
def test_edits_through_the_callback_equal_a_plain_hook(tmp_path: Path) -> None:
    """`edits=` in the HF callback trains as a plain tensor hook does (the Trainer's logged losses and grad norms
    equal), and the records hold the gradient before the edit (`norm`) and after it (`edited_norm`)."""
    plain, edited = Logged(), Logged()
    _train(tmp_path / "a", [plain, HalveMlpGradient()])
    cb = GradientCaptureCallback(taps=TAPS, dir=tmp_path / "run", edits=[{"tap": TAPS[0], "scale": 0.5}])
    _train(tmp_path / "b", [edited, cb])
    assert edited.grad_norms == pytest.approx(plain.grad_norms, rel=1e-6)
    assert edited.losses == pytest.approx(plain.losses, rel=1e-6)
    out = load(tmp_path / "run").query(f"tap == '{TAPS[0]}'")
    assert len(out) == 4 and list(out.edited_norm) == pytest.approx(list(0.5 * out.norm), rel=1e-6)


class StopAtStep2(transformers.TrainerCallback):
    """Stops training as step 2 begins (a step budget, a preemption handler); keeps the norm of the first block's MLP
    output gradient of every training backward, as a plain hook sees it."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if module.training and output.requires_grad:
                output.register_hook(lambda g: self.norms.append(float(g.double().norm())))

        model.transformer.h[0].mlp.register_forward_hook(hook)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= 2:
            control.should_training_stop = True


def test_a_stop_inside_an_accumulation_window_is_a_normal_end(tmp_path: Path) -> None:
    """gradient_accumulation_steps=2, training stopped as step 2 begins: the Trainer runs one micro-batch of step 2,
    no optimiser step, and ends normally. done.json; steps 0 and 1 with both micro-batches (the norms a plain hook
    saw); the lone micro-batch not written, which the log says; no advice meant for record()'s users."""
    stop = StopAtStep2()
    _train(tmp_path / "hf", [stop, GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "run")],
           gradient_accumulation_steps=2)  # fmt: skip
    assert len(stop.norms) == 5 and (tmp_path / "run" / "done.json").is_file()
    grads = load(tmp_path / "run").sort_values(["step", "micro_step"])
    assert list(zip(grads.step, grads.micro_step, strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(grads.norm) == pytest.approx(stop.norms[:4], rel=1e-5)
    assert list(load(tmp_path / "run", table="steps").step) == [0, 1]
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "step 2's accumulation window" in text and "1 captured micro-batch(es) are not written" in text
    assert "rec.step()" not in text


class Raise(transformers.TrainerCallback):
    """Raises `error` as step 2 ends (after the Trainer counted steps 0 and 1)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == 2:
            raise self.error


def _last_word(run: Path) -> str:
    return next(line for line in (run / LOG_FILE).read_text().splitlines() if "completed step(s)" in line)


@pytest.mark.parametrize(("error", "said"), [(KeyboardInterrupt(), "interrupted"), (KeyError("x"), "ended by KeyError"),
                                             (FileNotFoundError(2, "No such file", "data.bin"),
                                              "ended by FileNotFoundError")])  # fmt: skip
@pytest.mark.parametrize("where", ["except", "finally"])
def test_a_failed_train_ends_by_its_own_error(tmp_path: Path, error: BaseException, said: str, where: str) -> None:
    """`callback.close()` in the `except` or the `finally` around a train() that raised: the last word names that
    error (Ctrl-C: interrupted), as record()'s does (an OSError of the user's is no error writing the records); two
    steps kept, and close() raises nothing."""
    cb = GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "run")
    with pytest.raises(type(error)):
        try:
            _train(tmp_path / "hf", [cb, Raise(error)])
        except type(error):
            if where == "except":
                cb.close()
            raise
        finally:
            cb.close()
    assert _last_word(tmp_path / "run").endswith(f"- {said}; the records of 2 completed step(s) are kept in "
                                                 f"{(tmp_path / 'run').resolve()} (not marked complete; "
                                                 "GradientCaptureCallback(...) with resume=True continues them)")  # fmt: skip


def test_a_stop_on_a_nonfinite_loss_ends_by_nonfinite(tmp_path: Path) -> None:
    """on_nonfinite="stop", a learning rate that makes step 1's loss NaN: train() raises gradrunner's NonFinite once
    step 1's rows are written, and the last word says so."""
    from gradrunner.run.guards import NonFinite

    cb = GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "run", on_nonfinite="stop")
    with pytest.raises(NonFinite) as e:
        try:
            _train(tmp_path / "hf", [cb], learning_rate=1e9, max_grad_norm=0.0)
        finally:
            cb.close()
    assert "ended by NonFinite; the records of 2 completed step(s)" in _last_word(tmp_path / "run")
    # the callback's own argument, not the runner's config (`capture.on_nonfinite`, `optimizer.lr`), and the dir
    assert str(e.value).startswith("GradientCaptureCallback(..., on_nonfinite='stop'): stopped at step 1, where ")
    assert f"kept in {tmp_path / 'run'}." in str(e.value) and "capture." not in str(e.value)


def test_a_stop_on_a_nonfinite_loss_leaves_the_records_written(tmp_path: Path) -> None:
    """The callback's own NonFinite ends its session as it leaves train(), as Lightning's does: the run dir holds the
    records through the step that stopped it, and its last word, with no close() (before: only its lock)."""
    from gradrunner.run.guards import NonFinite

    cb = GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "run", on_nonfinite="stop")
    with pytest.raises(NonFinite, match="stopped at step 1"):
        _train(tmp_path / "hf", [cb], learning_rate=1e9, max_grad_norm=0.0)
    steps = load(tmp_path / "run", table="steps")
    assert list(steps.step) == [0, 1] and math.isfinite(steps.loss[0]) and math.isnan(steps.loss[1])
    assert sorted(set(load(tmp_path / "run").step)) == [0, 1]
    assert "ended by NonFinite; the records of 2 completed step(s)" in _last_word(tmp_path / "run")
    assert cb.recorder is None and not (tmp_path / "run" / "done.json").exists()


def test_a_close_with_the_error_out_of_sight_names_no_error(tmp_path: Path) -> None:
    """close() after the `except` that handled train()'s error: the error is out of sight; the last word says the
    session ended before train() did, naming no error."""
    cb = GradientCaptureCallback(taps=TAPS[:1], dir=tmp_path / "run")
    try:
        _train(tmp_path / "hf", [cb, Raise(KeyError("x"))])
    except KeyError:
        pass
    cb.close()
    word = _last_word(tmp_path / "run")
    assert "the session ended before the Trainer's train() did (no on_train_end); the records of 2" in word
    assert "Error" not in word
