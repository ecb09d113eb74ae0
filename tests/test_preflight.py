"""Bad values of the training keys (issue 38 items 13-15): refused before step 0, one paragraph, nothing written.

Each case the issue's fuzz found is run the way the app runs a job (`run.job.run`, in this process):
the refusal names the key and what is allowed, and no record file is left. The checks themselves
change nothing a good run records: its learning rates are torch's own schedule, and the check of the
eval data leaves training and evaluation as they were.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import compose_cfg

from gradrunner.errors import GradrunnerError
from gradrunner.models import MLP
from gradrunner.run import preflight
from gradrunner.run.job import run

BASE = ("+experiment=mlp", "device=cpu")


def refused(tmp_path: Path, *overrides: str) -> str:
    """The one-paragraph refusal of a run of `overrides`; asserts that no record was written."""
    out = tmp_path / "run"
    with pytest.raises(GradrunnerError) as info:
        run(compose_cfg(*BASE, *overrides), out_dir=out)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert not [p.name for p in out.glob("*") if p.suffix in (".parquet", ".json", ".tmp")], list(out.glob("*"))
    return message


@pytest.mark.parametrize(("overrides", "expected"), [
    (["scheduler=onecycle", "scheduler.total_steps=3", "steps=5"], "scheduler.total_steps=3 is less than steps=5"),
    (["scheduler=cosine", "scheduler.T_max=0", "steps=3"], "scheduler.T_max=0 is not allowed; scheduler.T_max must "
                                                          "be an integer from 1 to 2147483647"),
    (["scheduler=cosine", "scheduler.T_max=null", "steps=3"], "scheduler.T_max=null is not allowed"),
    (["scheduler=cosine", "scheduler.T_max=abc", "steps=3"], "scheduler.T_max='abc' is not allowed"),
    (["scheduler=onecycle", "scheduler.max_lr=-1", "steps=3"], "scheduler.max_lr=-1 is not allowed; scheduler.max_lr "
                                                              "must be a number > 0"),
    (["scheduler=onecycle", "scheduler.max_lr=[0.1,-0.2]", "steps=3"], "scheduler.max_lr=[0.1, -0.2] is not allowed"),
    (["scheduler=cosine", "scheduler.eta_min=-0.1", "steps=3"], "scheduler.eta_min=-0.1 is not allowed"),
    (["scheduler=warmup_cosine", "scheduler.lr_lambda.warmup_steps=-3"], "scheduler.lr_lambda.warmup_steps=-3"),
    (["scheduler=warmup_cosine", "scheduler.lr_lambda.min_ratio=2"], "must be a number from 0 to 1"),
    (["scheduler=linear_warmup", "scheduler.total_iters=0"], "scheduler.total_iters=0 is not allowed"),
    ([f"train.accumulate={2**63 - 1}", "steps=3"], "train.accumulate must be an integer from 1 to 715827882"),
    ([f"train.eval_batches={2**40}", "train.eval_every=1", "steps=3"], "train.eval_batches must be an integer from 1"),
])  # fmt: skip
def test_a_bad_value_is_refused_naming_its_range(tmp_path: Path, overrides: list[str], expected: str) -> None:
    assert expected in refused(tmp_path, *overrides)


@pytest.mark.parametrize("overrides", [
    ["scheduler=cosine", "steps=0"], ["scheduler=onecycle", "steps=0"], ["scheduler=cosine", "scheduler.T_max=0", "steps=3"],
    ["anomaly.window=10", "steps=2"], ["anomaly.window=10", "anomaly.warmup=12", "steps=2"],
])  # fmt: skip
def test_the_fix_a_refusal_suggests_is_not_refused(tmp_path: Path, overrides: list[str]) -> None:
    """Each refusal's "e.g. KEY=VALUE", added to the same command line, is accepted for that key (steps=0: the
    interpolation ${steps} would be 0 as well; a window of 10: the warm-up of 20 it offered was over it)."""
    message = refused(tmp_path / "a", *overrides)
    match = re.search(r"e\.g\. ([\w.]+)=(\S+?)[,.]?(?: |$)", message)
    assert match, message
    key, value = match[1], match[2]
    run(compose_cfg(*BASE, *overrides, f"{key}={value}"), out_dir=tmp_path / "b")
    assert (tmp_path / "b" / "steps.parquet").is_file()


def test_a_scheduler_that_needs_a_metric_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "+scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
                      "+scheduler._partial_=true", "steps=3")  # fmt: skip
    assert "ReduceLROnPlateau" in message and "needs a metric" in message


def test_a_schedule_that_turns_negative_is_refused_at_its_step(tmp_path: Path) -> None:
    """No name tells it (a lambda of a user's): the schedule stepped through the run before step 0 does."""
    message = refused(tmp_path, "+scheduler._target_=torch.optim.lr_scheduler.LambdaLR", "+scheduler._partial_=true",
                      "+scheduler.lr_lambda._target_=test_preflight.Falling", "steps=6")  # fmt: skip
    assert "learning rate -0.05 at step 3" in message  # optimizer.lr=0.1 of the mlp experiment, times 1 - 3/2


class Falling:
    """A learning-rate multiplier that turns negative at step 3 (1, 0.5, 0, -0.5, ...)."""

    def __call__(self, step: int) -> float:
        return 1.0 - step / 2


@pytest.mark.parametrize("scheduler", ["none", "linear_warmup"])
@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", "nan"), ("sgd", "inf"), ("adam", "inf")])
def test_a_learning_rate_that_is_not_finite_is_refused_with_or_without_a_scheduler(
    tmp_path: Path, optimizer: str, lr: str, scheduler: str
) -> None:
    """SGD takes NaN and inf, Adam inf, without a word: the rule is checked on the built optimizer, scheduler or not."""
    message = refused(tmp_path, f"optimizer={optimizer}", f"optimizer.lr={lr}", f"scheduler={scheduler}", "steps=3")
    assert message.startswith(f"optimizer.lr={lr} is not allowed; a learning rate must be a finite number >= 0")
    assert "nothing was run" in message and "optimizer.lr=0.001" in message and "Traceback" not in message


def test_every_param_group_s_learning_rate_is_checked() -> None:
    """A group of its own (a user's param groups) with a NaN rate is named by its index, the first one fine."""
    w, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    fine = torch.optim.SGD([{"params": [w]}, {"params": [b]}], lr=0.1)
    preflight.check_rates(fine, "torch.optim.SGD")
    bad = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": float("nan")}], lr=0.1)
    with pytest.raises(GradrunnerError, match=r"has nan in param group 1 of 2\), so nothing was run"):
        preflight.check_rates(bad, "torch.optim.SGD")


def test_eval_data_that_does_not_fit_the_model_is_refused_before_step_0(tmp_path: Path) -> None:
    message = refused(tmp_path, "train.eval_every=2", "steps=3", "+eval_data._target_=gradrunner.data.Synthetic",
                      "+eval_data.input_shape=[5]")  # fmt: skip
    assert message.startswith("eval_data does not fit the model") and "32x5 and 8x32" in message


@pytest.mark.parametrize(("content", "expected"), [
    ("ints", "holds torch.int64 tensors for floating-point weights"),
    ("numbers", "holds int values, not tensors"),
])  # fmt: skip
def test_an_init_from_file_of_integers_is_refused(tmp_path: Path, content: str, expected: str) -> None:
    state = MLP(depth=3).state_dict()
    weights = {k: v.long() for k, v in state.items()} if content == "ints" else {k: 7 for k in state}
    torch.save(weights, tmp_path / "w.pt")
    assert expected in refused(tmp_path, f"+model.init_from={tmp_path / 'w.pt'}", "steps=2")


def test_the_schedule_check_leaves_torchs_own_learning_rates(tmp_path: Path) -> None:
    """The recorded rates of a OneCycleLR run are those of torch's OneCycleLR stepped by hand (no gradrunner)."""
    run(compose_cfg(*BASE, "scheduler=onecycle", "scheduler.max_lr=0.2", "steps=7"), out_dir=tmp_path / "r")
    recorded = pd.read_parquet(tmp_path / "r" / "steps.parquet").lr.tolist()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=7, pct_start=0.3)
    expected = []
    for _ in range(7):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert recorded == pytest.approx(expected, rel=1e-12)


def test_the_eval_data_check_changes_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with the check and without it: identical gradients and evaluation losses."""
    line = ("steps=4", "train.eval_every=2", "+eval_data._target_=gradrunner.data.Synthetic", "+eval_data.seed=5",
            "+eval_data.noise=0.5")  # fmt: skip
    run(compose_cfg(*BASE, *line), out_dir=tmp_path / "checked")
    monkeypatch.setattr(preflight, "check_eval_data", lambda *a, **k: None)
    run(compose_cfg(*BASE, *line), out_dir=tmp_path / "unchecked")
    columns = ["step", "tap", "norm", "mean", "max"]
    for name, cols in (("grads", columns), ("steps", ["step", "loss", "eval_loss", "lr"])):
        a = pd.read_parquet(tmp_path / "checked" / f"{name}.parquet")[cols]
        b = pd.read_parquet(tmp_path / "unchecked" / f"{name}.parquet")[cols]
        pd.testing.assert_frame_equal(a, b)
    assert pd.read_parquet(tmp_path / "checked" / "steps.parquet").eval_loss.notna().sum() == 2


def test_an_optimizer_whose_step_needs_a_closure_is_refused(tmp_path: Path) -> None:
    message = refused(tmp_path, "optimizer._target_=torch.optim.LBFGS", "~optimizer.momentum", "steps=2")
    assert "optimizer 'torch.optim.LBFGS' needs step(closure)" in message and "nothing was run" in message
    assert "gradrunner.record()" in message and "optimizer=sgd, adam or adamw" in message
    with pytest.raises(TypeError, match="closure"):  # torch itself: LBFGS cannot step without one
        torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))]).step()  # type: ignore[call-arg]
    preflight.check_step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), "torch.optim.SGD")  # step(closure=None)
