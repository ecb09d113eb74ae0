"""Run dirs the autopsy refuses before any branch runs (one paragraph, exit 2, nothing written): defects a hunt
of the spike flight recorder found, 2026-11-27.

The source run: the MLP experiment on synthetic data with one corrupted batch at step 30 (tests/conf/data/spiky_batch),
34 steps, a checkpoint every 5, `anomaly.replay=3`; the CLI runs inside the test's process. Each test refuses a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import SEARCHPATH, check_ok, gradrunner_in_process

from gradrunner.run.autopsy import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cli_children")]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("autopsy_refusals")
    check_ok(gradrunner_in_process(root, "+experiment=mlp", "steps=34", "data=spiky_batch", "train.checkpoint_every=5",
                                   "anomaly.replay=3", SEARCHPATH, f"hydra.run.dir={root / 'run'}"))  # fmt: skip
    return root / "run"


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to, ignore=shutil.ignore_patterns("autopsy", "autopsy.parquet"))
    return to


def _refused(run_dir: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The autopsy's exit 2 and its one paragraph; nothing written into the run dir."""
    before = sorted(p.name for p in run_dir.iterdir())
    assert main([str(run_dir), "--horizon", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == before and not (run_dir / "autopsy").exists()
    return err


def test_a_torchrun_run_is_refused(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DDP run's branches ran in one process (other batches: the unchanged baseline 'avoided' the spike), then the
    last word crashed on steps.parquet's one loss per rank (TypeError)."""
    run_dir = _copy(source, tmp_path / "run")
    done = json.loads((run_dir / "done.json").read_text())
    (run_dir / "done.json").write_text(json.dumps({**done, "world_size": 2}))  # what a torchrun job's rank 0 writes
    err = _refused(run_dir, capsys, "--interventions", "baseline,skip_batch")
    assert f"{run_dir} is a torchrun run (world_size 2 in done.json)" in err and "nothing was run or written" in err


def test_another_runs_kept_checkpoints_are_refused(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run B's dir holding run A's kept checkpoints (kept.json names A): the autopsy of B branched from A's state and
    reported it as B's; train.branch_from=B:25 took A's state too. Both refuse it now, naming both run ids."""
    run_dir = _copy(source, tmp_path / "b")
    kept = run_dir / "checkpoints" / "kept.json"
    other = "a" * 32  # the kept checkpoints of run A, copied into run B's dir
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "run_id": other}))
    own = json.loads((run_dir / "done.json").read_text())["run_id"]
    says = f"{kept} was written for run {other}, not for run {own} (done.json of {run_dir}): the kept checkpoints of another run"
    err = _refused(run_dir, capsys, "--interventions", "baseline")
    assert says in err
    branched = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=34", "data=spiky_batch", SEARCHPATH,
                                     f"train.branch_from={run_dir}:25", f"hydra.run.dir={tmp_path / 'branch'}")  # fmt: skip
    assert branched.returncode == 2 and says in branched.stderr and "Traceback" not in branched.stderr
    assert not (tmp_path / "branch" / "branch.json").exists() and not (tmp_path / "branch" / "steps.parquet").exists()


def test_a_record_session_run_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gradrunner.record() (as the Lightning and HF callbacks) flags spikes too, but its dir holds no runner config:
    the autopsy crashed with KeyError: 'train' (a traceback, exit 1)."""
    import torch

    import gradrunner
    from gradrunner.run.replay import loss_spikes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    run_dir = tmp_path / "rec"
    with gradrunner.record(model, ["0:output"], run_dir) as rec:
        for step in range(45):
            x = torch.randn(16, 8, generator=g) * (50 if step == 40 else 1)  # a planted loss spike at step 40
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    assert 40 in set(loss_spikes(run_dir)["step"])  # the spike is flagged: the autopsy would take it
    err = _refused(run_dir, capsys)
    assert f"{run_dir} was written by gradrunner.record() or a Lightning/HF callback: its done.json config has no " \
           "model, data, loss, optimizer, train" in err  # fmt: skip


def test_lr_half_is_left_out_of_a_run_without_optimizer_lr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """optimizer=adam '~optimizer.lr' (Adam's own default rate): the autopsy crashed with KeyError: 'lr'."""
    from gradrunner.run.autopsy import find_spike, plan

    check_ok(gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=34", "data=spiky_batch", SEARCHPATH,
                                   "optimizer=adam", "~optimizer.lr", "train.checkpoint_every=5", "anomaly.replay=3",
                                   f"hydra.run.dir={tmp_path / 'run'}"))  # fmt: skip
    run_dir = tmp_path / "run"
    spike = find_spike(run_dir, 30, 1)  # the corrupted batch's step
    chosen, notes = plan(spike, None, {})
    assert list(chosen) == ["baseline", "skip_batch", "clip", "reset_moments"]  # zero_tap: step 30 was not flagged
    assert notes[0] == ("lr_half left out: lr_half needs optimizer.lr in the run's config (the rate to halve); the "
                        "run's torch.optim.Adam ran at its own default rate, which the config does not hold (a branch "
                        "cannot add optimizer.lr: it scales the run's rates by new/old); make the run with "
                        "optimizer.lr set to try a lower rate")  # fmt: skip
    err = _refused(run_dir, capsys, "--step", "30", "--interventions", "lr_half")  # by name: one paragraph, exit 2
    assert "lr_half needs optimizer.lr in the run's config" in err
