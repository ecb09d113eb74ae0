"""What a branch (`train.branch_from`) does with changed optimizer and scheduler keys, against plain torch.

The source runs are the MLP experiment on synthetic data, 8 steps, a checkpoint every 2 steps kept for the
replay of the spikes a low threshold flags (`anomaly.z=0.5`). Every run is `run.job.run` in-process; the
references are torch's own optimizers and schedulers over the kept state, stepped by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import compose_cfg

from gradrunner.errors import GradrunnerError
from gradrunner.run.build import setup
from gradrunner.run.job import run
from gradrunner.run.schedules import WarmupCosine

MLP = ("+experiment=mlp", "steps=8", "device=cpu", "taps=[]")
#: Adam at 0.01 over 10 steps under the warm-up + cosine schedule (3 steps of warm-up, to 0.1 x lr at the end).
WARM = ("+experiment=mlp", "steps=10", "device=cpu", "taps=[]", "optimizer=adam", "optimizer.lr=0.01",
        "scheduler=warmup_cosine", "scheduler.lr_lambda.warmup_steps=3")  # fmt: skip
KEEP = ("train.checkpoint_every=2", "anomaly.replay=1", "anomaly.warmup=2", "anomaly.z=0.5")
ADAMW = (*MLP, "optimizer=adamw", "optimizer.no_decay=[bias]", "optimizer.lr=0.05")


def _source(out: Path, *overrides: str) -> tuple[Path, int, dict[str, Any]]:
    """A run that keeps checkpoints; its first kept step and that step's state."""
    run(compose_cfg(*overrides, *KEEP), out_dir=out)
    kept = json.loads((out / "checkpoints" / "kept.json").read_text())
    step = min(s["step"] for s in kept["states"])
    assert step > 0
    state = torch.load(out / "checkpoints" / f"state-{step:09d}.pt", weights_only=True)
    return out, step, state


def _column(run_dir: Path, name: str) -> pd.Series:
    return pd.read_parquet(run_dir / "steps.parquet").set_index("step")[name]


def test_a_changed_weight_decay_leaves_the_no_decay_group_at_zero(tmp_path: Path) -> None:
    source, step, state = _source(tmp_path / "source", *ADAMW)
    out = tmp_path / "branch"
    run(compose_cfg(*ADAMW, "optimizer.weight_decay=0.5", f"train.branch_from={source}:{step}"), out_dir=out)
    got = _column(out, "loss")
    # plain torch: the kept weights and moments in an AdamW over (weights: 0.5, biases: 0.0), the same batches
    job = setup(compose_cfg(*MLP))
    model = job.model
    model.load_state_dict(state["model"])
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")]},
                             {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                            lr=0.05, weight_decay=0.5)  # fmt: skip
    saved = state["optimizer"]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": s["params"]}
              for g, s in zip(opt.state_dict()["param_groups"], saved["param_groups"], strict=True)]  # fmt: skip
    opt.load_state_dict({"state": saved["state"], "param_groups": groups})
    for _ in range(step):
        next(job.batches)  # where the checkpoint left the data
    expected = []
    for _ in range(step, 8):
        x, y = next(job.batches)
        loss = job.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    assert got.index.tolist() == list(range(step, 8))
    np.testing.assert_allclose(got.to_numpy(), expected, rtol=1e-6)
    assert "optimizer.weight_decay: 0.01 -> 0.5" in json.loads((out / "branch.json").read_text())["changed"]


def _rates(make: Any, steps: int) -> list[float]:
    """torch's own scheduler `make(optimizer)` over a fresh Adam at lr 0.01, stepped by hand: each step's rate."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched, rates = make(opt), []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, Any]]:
    return _source(tmp_path_factory.mktemp("warm") / "source", *WARM)


def test_a_changed_scheduler_value_is_the_branchs_schedule_from_its_step(
    warm: tuple[Path, int, dict[str, Any]], tmp_path: Path
) -> None:
    source, step, state = warm
    out = tmp_path / "branch"
    run(compose_cfg(*WARM, "scheduler.lr_lambda.min_ratio=0.5", f"train.branch_from={source}:{step}"), out_dir=out)
    expected = _rates(lambda o: torch.optim.lr_scheduler.LambdaLR(o, WarmupCosine(3, 10, 0.5)), 10)
    np.testing.assert_allclose(_column(out, "lr").to_numpy(), expected[step:], rtol=1e-12, atol=0)
    assert "scheduler.lr_lambda.min_ratio: 0.1 -> 0.5" in json.loads((out / "branch.json").read_text())["changed"]
    # the losses: plain torch, the kept weights and moments under the new schedule, the same batches
    job = setup(compose_cfg(*WARM[:4]))
    job.model.load_state_dict(state["model"])
    opt = torch.optim.Adam(job.model.parameters(), lr=0.01)
    opt.load_state_dict({"state": state["optimizer"]["state"],
                         "param_groups": [{**opt.state_dict()["param_groups"][0], "params": state["optimizer"]["param_groups"][0]["params"]}]})  # fmt: skip
    losses = []
    for s in range(10):
        x, y = next(job.batches)
        if s < step:
            continue
        for g in opt.param_groups:
            g["lr"] = expected[s]
        loss = job.loss_fn(job.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    np.testing.assert_allclose(_column(out, "loss").to_numpy(), losses, rtol=1e-6)


def test_another_scheduler_option_is_the_branchs_schedule_from_its_step(
    warm: tuple[Path, int, dict[str, Any]], tmp_path: Path
) -> None:
    source, step, _ = warm
    out = tmp_path / "branch"
    run(compose_cfg(*WARM[:-2], "scheduler=cosine", f"train.branch_from={source}:{step}"), out_dir=out)
    expected = _rates(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10), 10)
    np.testing.assert_allclose(_column(out, "lr").to_numpy(), expected[step:], rtol=1e-12, atol=0)


def test_a_branch_that_only_runs_longer_keeps_the_sources_schedule(tmp_path: Path) -> None:
    """steps=12 over a steps=10 run: `T_max: ${steps}` resolves to 12, but the branch's horizon changes no schedule."""
    cosine = (*WARM[:-2], "scheduler=cosine")
    source, step, _ = _source(tmp_path / "source", *cosine)
    out = tmp_path / "branch"
    run(compose_cfg(*cosine[:1], "steps=12", *cosine[2:], f"train.branch_from={source}:{step}"), out_dir=out)
    expected = _rates(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10), 12)
    np.testing.assert_allclose(_column(out, "lr").to_numpy(), expected[step:], rtol=1e-12, atol=0)
    assert not [c for c in json.loads((out / "branch.json").read_text())["changed"] if c.startswith("scheduler")]


@pytest.mark.parametrize(("change", "key"), [("optimizer.no_decay=[]", "optimizer.no_decay"),
                                             ("optimizer._target_=torch.optim.NAdam", "optimizer._target_")])  # fmt: skip
def test_a_changed_param_group_structure_or_optimizer_class_is_refused_by_name(
    tmp_path: Path, change: str, key: str
) -> None:
    source, step, _ = _source(tmp_path / "source", *ADAMW)
    with pytest.raises(GradrunnerError, match=rf"{key} is changed .* nothing was run") as e:
        run(compose_cfg(*ADAMW, change, f"train.branch_from={source}:{step}"), out_dir=tmp_path / "branch")
    assert "\n" not in str(e.value) and "branch from step 0" in str(e.value)


def test_an_optimizer_lr_added_or_removed_is_refused(tmp_path: Path) -> None:
    """A source run at its optimizer's own default rate (no optimizer.lr) branched with an lr (the mlp experiment's
    0.1): KeyError: 'lr' (the
    rates are scaled by new/old, and there is no old); one paragraph now, before any step."""
    adam = (*MLP, "optimizer=adam")
    source, step, _ = _source(tmp_path / "source", *adam, "~optimizer.lr")
    with pytest.raises(GradrunnerError, match=r"optimizer.lr is added \('<unset>' -> 0.1\).* nothing was run") as e:
        run(compose_cfg(*adam, f"train.branch_from={source}:{step}"), out_dir=tmp_path / "branch")
    assert "\n" not in str(e.value) and not (tmp_path / "branch" / "steps.parquet").exists()
