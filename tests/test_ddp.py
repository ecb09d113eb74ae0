"""Distributed data parallel inside a job: two processes on CPU (gloo) under torchrun, tiny MLP, 2 steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import check_ok, cli_env, torchrun_command

from gradrunner.analysis import load

pytestmark = pytest.mark.slow

STRATEGIES = ["hook", "retain_grad", "autograd_grad"]
TAPS = "taps=[fc1:output,fc1:bias,head:weight]"


def torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """torchrun in a session of its own: on a time-out the whole group goes, workers included."""
    cmd = torchrun_command(2, "-m", "gradrunner", *args)
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in 180 s; its process group was killed\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """One torchrun, a sweep of the three strategies into a shared sweep dir."""
    cwd = tmp_path_factory.mktemp("ddp")
    result = torchrun(cwd, "-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=2", "capture.values=full", TAPS,
                      f"capture.strategy={','.join(STRATEGIES)}")  # fmt: skip
    check_ok(result)
    return load(cwd / "sw", values=True)


def grad(df: pd.DataFrame, strategy: str, step: int, tap: str, rank: int) -> np.ndarray:
    row = df[(df.strategy == strategy) & (df.step == step) & (df.tap == tap) & (df["rank"] == rank)]
    assert len(row) == 1, row
    return np.asarray(row["values"].iloc[0], dtype=np.float64).reshape(row["shape"].iloc[0])


def test_each_rank_has_its_rows_in_the_jobs_one_file(records: pd.DataFrame) -> None:
    assert sorted(records["rank"].unique()) == [0, 1]
    assert records.groupby("strategy").run_id.nunique().eq(1).all()  # one job, one run id, both ranks
    counts = records.groupby(["strategy", "step", "tap", "rank"]).size()
    assert counts.eq(1).all() and len(counts) == 3 * 2 * 3 * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_grads_are_per_rank_and_param_grads_are_averaged(records: pd.DataFrame, strategy: str) -> None:
    for step in (0, 1):
        out = [grad(records, strategy, step, "fc1:output", r) for r in (0, 1)]
        assert not np.allclose(out[0], out[1])  # each rank its own batch
        for tap in ("fc1:bias", "head:weight"):
            np.testing.assert_array_equal(grad(records, strategy, step, tap, 0), grad(records, strategy, step, tap, 1))
        # d loss / d bias is the batch sum of d loss / d fc1 output: DDP's gradient is the mean over ranks
        mean_of_ranks = (out[0].sum(axis=0) + out[1].sum(axis=0)) / 2
        np.testing.assert_allclose(grad(records, strategy, step, "fc1:bias", 0), mean_of_ranks, rtol=1e-5, atol=1e-8)


def test_every_strategy_takes_the_same_optimiser_step(records: pd.DataFrame) -> None:
    key = ["step", "tap", "rank"]
    frames = {s: g.sort_values(key).reset_index(drop=True) for s, g in records.groupby("strategy")}
    for strategy in ("retain_grad", "autograd_grad"):
        assert frames[strategy][key].equals(frames["hook"][key])
        # step 1's gradients come from step 0's optimiser step: equal steps, equal gradients
        for a, b in zip(frames[strategy]["values"], frames["hook"]["values"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9, err_msg=strategy)


def test_a_single_run_keeps_one_run_dir_for_both_ranks(tmp_path: Path) -> None:
    result = torchrun(tmp_path, "+experiment=cosine", "steps=2")
    check_ok(result)
    logged = [line for line in (result.stdout + result.stderr).splitlines() if "][gradrunner." in line]
    assert logged and all("] - [rank 0] " in line or "] - [rank 1] " in line for line in logged), logged[:5]
    assert {"[rank 0] rank 0 of 2", "[rank 1] rank 1 of 2"} <= {line.split("] - ")[-1][:20] for line in logged}
    (job,) = sorted(tmp_path.glob("outputs/*/*"))
    names = {p.name for p in job.iterdir()}
    assert names >= {"grads.parquet", "steps.parquet", "done.json", "gradrunner.log", "gradrunner.rank1.log"}
    steps = pd.read_parquet(job / "steps.parquet")
    assert sorted(steps["rank"]) == [0, 0, 1, 1]


def test_update_norms_are_the_averaged_step_and_the_same_on_every_rank(records: pd.DataFrame) -> None:
    params = records[records.tap.isin(["fc1:bias", "head:weight"])]
    lr = 0.1  # +experiment=mlp: plain SGD, so the step's change is lr times the averaged gradient
    np.testing.assert_allclose(params.update_norm, lr * params.norm, rtol=1e-5)
    per_rank = params.pivot_table(index=["strategy", "step", "tap"], columns="rank", values=["update_norm", "value_norm"])
    np.testing.assert_array_equal(per_rank["update_norm"][0], per_rank["update_norm"][1])
    np.testing.assert_array_equal(per_rank["value_norm"][0], per_rank["value_norm"][1])
    assert records.loc[records.tap == "fc1:output", "update_norm"].isna().all()


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun (2 gloo ranks) running `ddp_sync_count.py`'s job once per strategy in its one process group;
    each strategy's counts and records under `<dir>/<strategy>/` (one spawn where there were three)."""
    out = tmp_path_factory.mktemp("accumulated")
    script = Path(__file__).parent / "ddp_sync_count.py"
    cmd = torchrun_command(2, str(script), str(out), ",".join(STRATEGIES))
    proc = subprocess.run(cmd, cwd=out, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_under_ddp_syncs_once_per_step_and_records_the_averaged_step_gradient(
    accumulated: Path, strategy: str
) -> None:
    """train.accumulate=2 on 2 ranks: DDP all-reduces on each step's last micro-batch only (3 steps, one bucket:
    3 all-reduces, not 6); a parameter's one row per step is the step's gradient averaged over the ranks (the
    bias gradient is the sum of fc1's output gradient over both micro-batches and both ranks, halved)."""
    counts = [json.loads((accumulated / strategy / f"sync.rank{r}.json").read_text())["all_reduces"] for r in (0, 1)]
    assert counts == [3, 3]
    df = load(accumulated / strategy / "run", values=True)
    for step in range(3):
        rows = df[df.step == step]
        out = rows[rows.tap == "head:output"]
        assert sorted(zip(out["rank"], out.micro_step, strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        head = rows[rows.tap == "head:bias"]
        assert len(head) == 2 and head.micro_step.isna().all()
        np.testing.assert_array_equal(head["values"].iloc[0], head["values"].iloc[1])  # the same on both ranks
        summed = sum(np.asarray(v, dtype=np.float64).reshape(s).sum(axis=0) for v, s in zip(out["values"], out["shape"],
                                                                                             strict=True))  # fmt: skip
        np.testing.assert_allclose(head["values"].iloc[0], summed / 2, rtol=1e-5, atol=1e-8)
        w = rows[rows.tap == "fc1:weight"]
        np.testing.assert_array_equal(w["values"].iloc[0], w["values"].iloc[1])
