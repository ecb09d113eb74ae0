"""`python -m gradrunner.autopsy`: branches from the checkpoint before a data-caused loss spike.

The source run (the CLI, run inside the test's process; its dir holds Hydra's files and `done.json` its overrides): the MLP
experiment on synthetic data with one corrupted batch at step 30 (tests/conf/data/spiky_batch), SGD at
lr 0.1, 40 steps, a checkpoint every 5 steps, `anomaly.replay=3` (keeps the checkpoint before step 25).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import SEARCHPATH, check_ok, cli_env, gradrunner_in_process

from gradrunner.analysis import load
from gradrunner.run.autopsy import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cli_children")]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("autopsy")
    check_ok(gradrunner_in_process(root, "+experiment=mlp", "steps=40", "data=spiky_batch", "train.checkpoint_every=5",
                        "anomaly.replay=3", SEARCHPATH, f"hydra.run.dir={root / 'run'}"))  # fmt: skip
    return root / "run"


def _losses(path: Path) -> pd.Series:
    return pd.read_parquet(path / "steps.parquet", columns=["step", "loss"]).set_index("step")["loss"]


def _autopsy(source: Path, capsys: pytest.CaptureFixture[str]) -> tuple[pd.DataFrame, str]:
    assert main([str(source), "--horizon", "5", "--interventions", "baseline,skip_batch,lr_half"]) == 0
    return pd.read_parquet(source / "autopsy" / "step30" / "autopsy.parquet"), capsys.readouterr().out


def test_baseline_reproduces_and_skip_batch_avoids_the_spike(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table, out = _autopsy(source, capsys)
    sweep = source / "autopsy" / "step30"
    assert list(table.columns[:4]) == ["intervention", "max_loss", "final_loss", "avoided"]
    gathered = pd.read_parquet(source / "autopsy.parquet")  # CONTRACT: autopsy.parquet in the run dir
    pd.testing.assert_frame_equal(gathered.drop(columns="step"), table)
    assert set(gathered["step"]) == {30}
    rows = table.set_index("intervention")
    original = _losses(source)
    # baseline: the source's losses from the checkpoint (step 25) to step 35, bit for bit (plain pandas)
    baseline = _losses(sweep / rows.loc["baseline", "job"])
    pd.testing.assert_series_equal(baseline, original.loc[25:35], check_exact=True)  # NaN where the run's is NaN
    assert bool(rows.loc["baseline", "reproduces"]) and not rows.loc["baseline", "avoided"]
    assert math.isinf(rows.loc["baseline", "max_loss"])  # the run diverged to NaN after the spike
    # skip_batch: the corrupted batch left out, the loss stays where it was before the spike
    skipped = _losses(sweep / rows.loc["skip_batch", "job"])
    assert skipped.loc[25:29].to_dict() == original.loc[25:29].to_dict()  # the same batches before step 30
    assert rows.loc["skip_batch", "avoided"] and rows.loc["skip_batch", "max_loss"] < 1.0 < original[30]
    assert table["intervention"].iloc[0] == "skip_batch"  # ranked first
    assert "baseline reproduces the spike" in out and "skip_batch     avoided" in out
    page = (sweep / "autopsy.html").read_text()
    assert "<svg" in page and page.count("<polyline") == 4  # the run and three branches
    # The branches are records like any other: load() reads the sweep, one column says which branch
    steps = load(sweep, table="steps")
    assert sorted(steps["autopsy"].unique()) == ["baseline", "lr_half", "skip_batch"]
    assert json.loads((sweep / "1" / "branch.json").read_text())["step"] == 25


def test_a_rerun_skips_completed_branches_and_resumes_an_interrupted_one(
    source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = source / "autopsy" / "step30"
    if not (sweep / "autopsy.parquet").is_file():
        _autopsy(source, capsys)
    before = pd.read_parquet(sweep / "autopsy.parquet")
    stamps = {j: (sweep / j / "done.json").stat().st_mtime_ns for j in ("0", "2")}
    # an interrupted branch: job 1 without its completion marker and records
    for name in ("done.json", "steps.parquet", "grads.parquet"):
        (sweep / "1" / name).unlink()
    again, _ = _autopsy(source, capsys)
    pd.testing.assert_frame_equal(again, before)
    assert {j: (sweep / j / "done.json").stat().st_mtime_ns for j in ("0", "2")} == stamps  # skipped
    assert (sweep / "1" / "done.json").is_file()


def test_bad_input_is_one_paragraph_exit_2(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        (str(tmp_path),): "is not a completed run dir",
        (str(source), "--step", "40"): "--step 40 is not a step of",
        (str(source), "--interventions", "baseline,bogus"): "unknown intervention 'bogus'; the interventions: baseline, "
        "skip_batch, lr_half, clip, zero_tap, reset_moments",
        (str(source), "--interventions", "reset_moments"): "needs an Adam-like optimizer",
    }  # fmt: skip
    for argv, says in cases.items():
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    shim = subprocess.run([sys.executable, "-m", "gradrunner.autopsy", str(tmp_path)], capture_output=True, text=True,
                          env=cli_env(), timeout=300)  # fmt: skip
    assert shim.returncode == 2 and "is not a completed run dir" in shim.stderr and "Traceback" not in shim.stderr
