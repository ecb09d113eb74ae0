"""The autopsy's inputs and re-runs (defects a hunt of the flight recorder found, 2026-11-27).

The source run: the MLP experiment on a data option of the user's own, given with `--config-dir` (a tmp conf
dir: tests/conf's spiky_batch, batch 30's inputs x 30), 34 steps, a checkpoint every 5, `anomaly.replay=3`
(keeps the checkpoint before step 25). The CLI runs inside the test's process; the autopsy's sweep is a child.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import TESTS, check_ok, gradrunner_in_process

from gradrunner.run.autopsy import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cli_children")]

STEPS = 34


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("autopsy_flight")
    (root / "conf" / "data").mkdir(parents=True)
    shutil.copy(TESTS / "conf" / "data" / "spiky_batch.yaml", root / "conf" / "data" / "my_spiky.yaml")
    check_ok(gradrunner_in_process(root, "--config-dir", str(root / "conf"), "+experiment=mlp", f"steps={STEPS}",
                                   "data=my_spiky", "train.checkpoint_every=5", "anomaly.replay=3",
                                   f"hydra.run.dir={root / 'run'}"))  # fmt: skip
    return root / "run"


def _losses(path: Path) -> pd.Series:
    return pd.read_parquet(path / "steps.parquet", columns=["step", "loss"]).set_index("step")["loss"]


def _table(source: Path, step: int = 30) -> pd.DataFrame:
    return pd.read_parquet(source / "autopsy" / f"step{step}" / "autopsy.parquet").set_index("intervention")


def test_branches_are_the_runs_stored_config_not_todays_files(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run made with --config-dir failed (only hydra.searchpath was forwarded), and an edited YAML changed the
    branches (built from today's files): the baseline said 'does NOT reproduce' a spike that is deterministic."""
    conf = source.parent / "conf" / "data" / "my_spiky.yaml"
    conf.write_text(conf.read_text().replace("scale: 30.0", "scale: 1.0"))  # the spike edited away since
    assert main([str(source), "--horizon", "2", "--interventions", "baseline"]) == 0, capsys.readouterr().err
    assert "baseline reproduces the spike" in capsys.readouterr().out
    job = source / "autopsy" / "step30" / str(_table(source).loc["baseline", "job"])
    pd.testing.assert_series_equal(_losses(job), _losses(source).loc[25:32], check_exact=True)
    assert json.loads((job / "branch.json").read_text())["changed"] == []


def test_a_rerun_with_another_horizon_or_interventions_replaces_the_sweep(
    source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another --horizon / --interventions / --override failed: the sweep's jobs held runs of another config, and
    the error named hydra.sweep.dir=..., which the command does not have."""
    for argv in (["--horizon", "2", "--interventions", "baseline"],
                 ["--horizon", "3", "--interventions", "baseline,lr_half"],
                 ["--horizon", "3", "--interventions", "baseline", "--override", "lr_tenth", "optimizer.lr=0.01"]):  # fmt: skip
        assert main([str(source), *argv]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        table = _table(source)
        assert sorted(table.index) == sorted(argv[3].split(",") + argv[5:6])
        for name, job in table["job"].items():
            losses = _losses(source / "autopsy" / "step30" / str(job))
            assert losses.index.tolist() == list(range(25, 30 + int(argv[1]) + 1)), name
    assert "was replaced by this one" in out
    lr = pd.read_parquet(source / "autopsy" / "step30" / str(table.loc["lr_tenth", "job"]) / "steps.parquet")
    assert lr["lr"].eq(0.01).all()
    # the same plan again: kept, nothing replaced
    assert main([str(source), "--horizon", "3", "--interventions", "baseline", "--override", "lr_tenth",
                 "optimizer.lr=0.01"]) == 0  # fmt: skip
    assert "replaced" not in capsys.readouterr().out


def test_a_failed_sweeps_message_is_cut_between_words(source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from gradrunner.errors import GradrunnerError
    from gradrunner.run import autopsy as autopsy_module

    words = [f"word{i:04d}" for i in range(400)] + ["Use", "a", "new", "dir."]
    failed = subprocess.CompletedProcess([], 2, "", "\n".join(words))
    monkeypatch.setattr(autopsy_module, "sweep", lambda *a: failed)
    with pytest.raises(GradrunnerError) as e:
        autopsy_module.autopsy(source, horizon=2, names=["baseline"])
    said = str(e.value).split("failed (exit 2): ", 1)[1].split()
    assert said[-4:] == ["Use", "a", "new", "dir."] and set(said[:-4]) - {"..."} <= set(words)


def test_a_step_before_the_first_kept_checkpoint_branches_from_step_0(
    source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 22 (the first kept checkpoint is 25) was refused ('no kept checkpoint'): it branches from the seed now."""
    assert main([str(source), "--step", "22", "--horizon", "1", "--interventions", "baseline"]) == 0, capsys.readouterr().err
    assert "baseline reproduces the spike" in capsys.readouterr().out
    job = source / "autopsy" / "step22" / str(_table(source, 22).loc["baseline", "job"])
    pd.testing.assert_series_equal(_losses(job), _losses(source).loc[0:23], check_exact=True)
    assert json.loads((job / "branch.json").read_text())["step"] == 0


def test_a_step_outside_the_run_is_refused_naming_its_steps(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--step 99 of a 34-step run was accepted (and its sweep made)."""
    assert main([str(source), "--step", str(STEPS), "--interventions", "baseline"]) == 2
    err = capsys.readouterr().err
    assert f"--step {STEPS} is not a step of {source}: its steps are 0 to {STEPS - 1}" in err and err.count("\n") == 1
    assert "(its flagged loss spikes: 30)" in err
    assert not (source / "autopsy" / f"step{STEPS}").exists()


def test_a_missing_kept_state_or_a_bad_override_is_refused_before_any_branch(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing state file was a flattened traceback after the sweep started; a misspelled override key ran the
    baseline first and then failed."""
    copy = tmp_path / "run"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("autopsy", "autopsy.parquet"))
    bad = {("--override", "lr_tenth", "optimizer.lrr=0.01"): "the run's config has no key 'optimizer.lrr' Did you "
           "mean 'optimizer.lr'?", ("--override", "lr_tenth", "optimizer.lr"): "each override is KEY=VALUE"}  # fmt: skip
    for argv, says in bad.items():
        assert main([str(copy), "--interventions", "baseline", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    (copy / "checkpoints" / "state-000000025.pt").unlink()
    assert main([str(copy), "--interventions", "baseline"]) == 2
    err = capsys.readouterr().err
    assert "state-000000025.pt cannot be read (FileNotFoundError" in err and err.count("\n") == 1
    assert "Traceback" not in err and not (copy / "autopsy").exists()


def test_a_run_stopped_on_its_spike_is_autopsied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """capture.on_nonfinite=stop ends the run at its NaN step (failed.json, no done.json); its kept checkpoint and
    replay are there, but the autopsy said 'not a completed run dir'. Its branches run through the spike."""
    from conftest import SEARCHPATH

    stopped = gradrunner_in_process(tmp_path, "+experiment=mlp", f"steps={STEPS}", "data=spiky_batch", SEARCHPATH,
                                    "data.scale=nan", "capture.on_nonfinite=stop", "train.checkpoint_every=5",
                                    "anomaly.replay=3", f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    run_dir = tmp_path / "run"
    assert stopped.returncode == 2 and (run_dir / "failed.json").is_file() and not (run_dir / "done.json").exists()
    argv = [str(run_dir), "--horizon", "1", "--interventions", "baseline,skip_batch"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "baseline reproduces the spike" in capsys.readouterr().out
    table = pd.read_parquet(run_dir / "autopsy" / "step30" / "autopsy.parquet").set_index("intervention")
    baseline = _losses(run_dir / "autopsy" / "step30" / str(table.loc["baseline", "job"]))
    pd.testing.assert_series_equal(baseline.loc[25:30], _losses(run_dir).loc[25:30], check_exact=True)  # NaN at 30
    assert baseline.index.max() == 31 and bool(table.loc["skip_batch", "avoided"])


def test_an_unflagged_steps_threshold_is_the_runs_own_rule(tmp_path: Path) -> None:
    """--step S on a step the detector did not flag: the threshold was taken over the last 128 losses whatever the
    run's anomaly.window, and z from the file but the floor hard-coded; it is the detector's band now, with the
    window, z and floor anomalies.parquet was written with."""
    from conftest import SEARCHPATH

    from gradrunner.run.autopsy import find_spike

    check_ok(gradrunner_in_process(tmp_path, "+experiment=mlp", f"steps={STEPS}", "data=spiky_batch", SEARCHPATH,
                                   "anomaly.window=8", "anomaly.warmup=5", "anomaly.z=5",
                                   f"hydra.run.dir={tmp_path / 'run'}"))  # fmt: skip
    run_dir = tmp_path / "run"
    flagged = pd.read_parquet(run_dir / "anomalies.parquet").query("signal == 'loss'")["step"]
    assert flagged.min() == 30  # nothing flagged before the corrupted batch: the window is the last 8 losses
    window = _losses(run_dir).loc[:27].tail(8)  # the reference: plain pandas, population std, floor 1e-3 x |mean|
    want = window.mean() + 5 * max(window.std(ddof=0), 1e-3 * abs(window.mean()))
    spike = find_spike(run_dir, 28, 1)
    assert spike.threshold == pytest.approx(want, rel=1e-9)
    assert spike.threshold != pytest.approx(_losses(run_dir).loc[:27].pipe(lambda w: w.mean() + 5 * w.std(ddof=0)))
