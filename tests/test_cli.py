"""End to end: the CLI (`python -m gradrunner`) on tiny runs, from a fresh cwd.

Most commands run inside the test's process (`conftest.python_m`: the same `python -m gradrunner`,
its stdout, stderr and exit status, without 2-3 s of start-up each). A real subprocess runs where the
process is the subject: the one end-to-end run, the console script, a closed stdout pipe, signals.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, SEARCHPATH, check_ok, cli_env, gradrunner, gradrunner_in_process, job_dirs
from omegaconf import OmegaConf
from records_check import check_records
from torch import nn

from gradrunner.analysis import load
from gradrunner.capturing.strategies import STRATEGIES

CONF = ROOT / "gradrunner" / "conf"
EXPERIMENTS = ["mlp", "cnn", "transformer", "cosine", "sigmoid2"]
STATS = ["norm", "mean", "std", "min", "max", "abs_max", "zero_frac", "nan_count", "inf_count", "loss"]
CONTRACT_COLUMNS = [
    "run_id", "experiment", "strategy", "device", "dtype", "step", "tap", "module", "name", "call",
    "shape", "numel", "norm", "mean", "std", "min", "max", "abs_max", "zero_frac",
    "nan_count", "inf_count", "values", "loss",
]  # fmt: skip


class ScaledLinear(nn.Module):
    """A user's own model, picked with `model=scaled` from a `--config-dir`."""

    def __init__(self, in_features: int = 3, out_features: int = 2, scale: float = 2.0) -> None:
        super().__init__()
        self.lin = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = self.lin(x) * self.scale
        return scaled


def sweep_dir(root: Path) -> Path:
    (found,) = job_dirs(root, "multirun/*/*")
    return found


# -- the app ------------------------------------------------------------------------------------


def test_help_lists_the_config_groups(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "--help")
    check_ok(result)
    assert "experiment: cnn, cosine, gpt2, gpt2_pretrain, mlp, sigmoid2, spike_attention, spike_data, transformer" in result.stdout
    assert "data: corrupted, digits, synthetic, tensors, tokens" in result.stdout


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=sigmoid2", "--cfg", "job")
    check_ok(result)
    cfg = OmegaConf.create(result.stdout)
    assert cfg.experiment == "sigmoid2" and cfg.capture.strategy == "hook"
    assert list(tmp_path.rglob("*.parquet")) == []


@pytest.mark.slow
def test_one_run_writes_records_under_outputs_of_the_cwd(tmp_path: Path) -> None:
    result = gradrunner(tmp_path, "+experiment=mlp", "steps=2", warm=False)  # the end-to-end smoke: a fresh process
    check_ok(result)
    (job,) = job_dirs(tmp_path)
    assert {p.name for p in job.iterdir()} >= {"grads.parquet", "steps.parquet", "gradrunner.log", ".hydra"}
    df = pd.read_parquet(job / "grads.parquet")
    assert df.columns[: len(CONTRACT_COLUMNS)].tolist() == CONTRACT_COLUMNS
    assert sorted(df.step.unique()) == [0, 1] and set(df.experiment) == {"mlp"}
    last = [line for line in result.stdout.splitlines() if "records: " in line]
    assert len(last) == 1 and last[0].count(str(job)) == 1 and "gradrunner.analysis.load" in last[0]
    assert last[0].endswith(f"records: {job} (grads.parquet, steps.parquet; read the dir with gradrunner.analysis.load, a file with pandas.read_parquet)")


def test_console_script_is_the_same_app(tmp_path: Path) -> None:
    script = shutil.which("gradrunner")
    if script is None:
        pytest.skip("the gradrunner console script is not installed (pip install -e .)")
    result = subprocess.run([script, "+experiment=cosine", "--cfg", "job"], cwd=tmp_path, env=cli_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    check_ok(result)
    assert OmegaConf.create(result.stdout).experiment == "cosine"


# -- every experiment x every strategy ----------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """One multirun: every built-in experiment with every strategy, 2 steps, full values."""
    cwd = tmp_path_factory.mktemp("sweep")
    result = gradrunner_in_process(
        cwd, "-m", f"+experiment={','.join(EXPERIMENTS)}", f"capture.strategy={','.join(STRATEGIES)}",
        "steps=2", "capture.values=full",
    )  # fmt: skip
    check_ok(result)
    return load(sweep_dir(cwd), values=True)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_with_every_strategy(sweep: pd.DataFrame, experiment: str) -> None:
    df = sweep[sweep.experiment == experiment]
    assert set(df.strategy) == set(STRATEGIES)
    assert df.columns[: len(CONTRACT_COLUMNS)].tolist() == CONTRACT_COLUMNS
    assert set(df.step) == {0, 1} and df.run_id.nunique() == len(STRATEGIES)
    assert df["values"].map(len).eq(df.numel).all()


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_all_strategies_give_the_same_gradients(sweep: pd.DataFrame, experiment: str) -> None:
    df = sweep[sweep.experiment == experiment]
    frames = {s: g.sort_values(["step", "tap", "call"]).reset_index(drop=True) for s, g in df.groupby("strategy")}
    ref = frames["hook"]
    for strategy, frame in frames.items():
        assert frame[["step", "tap", "call"]].equals(ref[["step", "tap", "call"]]), strategy
        np.testing.assert_allclose(frame[STATS].to_numpy(float), ref[STATS].to_numpy(float),
                                   rtol=1e-5, atol=1e-7, equal_nan=True, err_msg=strategy)  # fmt: skip
        for a, b in zip(frame["values"], ref["values"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=strategy)


# -- gradients checked against independent computations ------------------------------------------


@pytest.fixture(scope="module")
def analytic(tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """sigmoid2 and cosine in float64, every strategy, 3 SGD steps, full values."""
    cwd = tmp_path_factory.mktemp("analytic")
    result = gradrunner_in_process(
        cwd, "-m", "+experiment=sigmoid2,cosine", f"capture.strategy={','.join(STRATEGIES)}", "steps=3",
        "dtype=float64", "capture.values=full", "optimizer.lr=0.5",
    )  # fmt: skip
    check_ok(result)
    return load(sweep_dir(cwd), values=True)


def grads_of(df: pd.DataFrame, strategy: str, step: int) -> dict[str, np.ndarray]:
    rows = df[(df.strategy == strategy) & (df.step == step) & (df.call == 0)]
    return {r.tap: np.asarray(r.values, dtype=np.float64).reshape(r.shape) for r in rows.itertuples()}


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sigmoid2_reproduces_the_textbook_gradients(analytic: pd.DataFrame, strategy: str) -> None:
    df = analytic[analytic.experiment == "sigmoid2"]
    w1, w2 = np.array([[1.0], [2.0]]), np.array([[3.0, 4.0], [5.0, 6.0]])
    x, y = np.array([[1.0]]), np.array([[1.0], [0.0]])
    for step in range(3):
        z1 = w1 @ x
        y1 = sigmoid(z1)
        z2 = w2 @ y1
        y2 = sigmoid(z2)
        d_y2 = y2 - y  # d/dy2 of 0.5 * sum((y2 - y)^2)
        d_z2 = d_y2 * y2 * (1 - y2)
        d_y1 = w2.T @ d_z2
        d_z1 = d_y1 * y1 * (1 - y1)
        expected = {":y_2": d_y2, ":z_2": d_z2, ":y_1": d_y1, ":z_1": d_z1, ":w2": d_z2 @ y1.T, ":w1": d_z1 @ x.T}
        got = grads_of(df, strategy, step)
        for tap, want in expected.items():
            np.testing.assert_allclose(got[tap], want, rtol=1e-6, atol=1e-12, err_msg=f"step {step} {tap}")
        loss = df[(df.strategy == strategy) & (df.step == step)].loss.iloc[0]
        assert loss == pytest.approx(0.5 * float(np.sum((y2 - y) ** 2)), rel=1e-9)
        w1, w2 = w1 - 0.5 * expected[":w1"], w2 - 0.5 * expected[":w2"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_cosine_matches_the_analytic_gradients(analytic: pd.DataFrame, strategy: str) -> None:
    df = analytic[analytic.experiment == "cosine"]
    exp = OmegaConf.load(CONF / "experiment" / "cosine.yaml")
    x, y = np.array(exp.data.inputs, dtype=np.float64), np.array(exp.data.targets, dtype=np.float64)
    a, b = float(exp.model.a), float(exp.model.b)
    for step in range(3):
        mul_x = a * x
        sum_x = np.cos(mul_x) - b
        d_sum = 2.0 * (sum_x - y) / x.size  # MSE, mean over the elements
        d_mul = -np.sin(mul_x) * d_sum
        d_a, d_b = float(np.sum(d_mul * x)), float(-np.sum(d_sum))
        expected = {":sum_x": d_sum, ":mul_x": d_mul, ":a": np.array(d_a), ":b": np.array(d_b)}
        got = grads_of(df, strategy, step)
        for tap, want in expected.items():
            np.testing.assert_allclose(got[tap], want, rtol=1e-6, atol=1e-12, err_msg=f"step {step} {tap}")
        a, b = a - 0.5 * d_a, b - 0.5 * d_b


# -- the user's own options -----------------------------------------------------------------------


@pytest.mark.slow
def test_own_model_data_loss_and_optimizer_options_from_a_config_dir(tmp_path: Path) -> None:
    conf = tmp_path / "myconf"
    options = {
        "model/scaled.yaml": f"_target_: {__name__}.ScaledLinear\nin_features: 3\nout_features: 2\nscale: 3.0\n",
        "data/mine.yaml": "_target_: gradrunner.data.Synthetic\ninput_shape: [3]\ntarget_shape: [2]\n"
        "batch_size: 4\nnum_samples: 16\nseed: ${seed}\n",
        "loss/l1.yaml": "_target_: torch.nn.L1Loss\n",
        "optimizer/rms.yaml": "_target_: torch.optim.RMSprop\n_partial_: true\nlr: 0.01\n",
    }
    for rel, text in options.items():
        (conf / rel).parent.mkdir(parents=True, exist_ok=True)
        (conf / rel).write_text(text)
    result = gradrunner_in_process(tmp_path, "--config-dir", str(conf), "model=scaled", "data=mine", "loss=l1",
                                   "optimizer=rms", "steps=2", "taps=[lin:output,':scaled',lin:weight]")  # fmt: skip
    check_ok(result)
    (job,) = job_dirs(tmp_path)
    df = pd.read_parquet(job / "grads.parquet")
    assert set(df.tap) == {"lin:output", ":scaled", "lin:weight"} and set(df.experiment) == {"default"}
    assert list(df[df.tap == "lin:weight"]["shape"].iloc[0]) == [2, 3]


# -- mistakes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, named",
    [
        ("capture.strategy=hooks", "capture.strategy='hooks'"),
        ("device=tpu", "device='tpu'"),
        ("steps=-1", "steps=-1"),
        ("taps=[fc9:output]", "'fc9'"),
    ],
)
def test_a_bad_value_exits_2_with_one_paragraph_and_no_records(tmp_path: Path, override: str, named: str) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=2", override)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    (line,) = [s for s in result.stderr.splitlines() if s.strip()]
    assert line.startswith("gradrunner: error: ") and named in line
    assert "allowed" in line or "Closest paths" in line
    assert list(tmp_path.rglob("grads.parquet")) == [] and list(tmp_path.rglob("*.parquet*")) == []


def test_a_misspelled_key_is_refused_without_a_traceback(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "capture.stratgy=hook")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "stratgy" in result.stderr
    assert list(tmp_path.rglob("*.parquet")) == []


@pytest.mark.slow
def test_a_sweep_runs_the_other_jobs_and_fails_at_the_end(tmp_path: Path) -> None:
    # a mistake only the forward pass finds (inputs of 3 features into an 8-feature MLP): job 1 fails, 0 and 2 run
    result = gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "steps=1", "data.input_shape=[8],[3],[8]")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "failed in the model's forward()" in result.stderr
    root = sweep_dir(tmp_path)
    assert sorted(p.parent.name for p in root.glob("*/grads.parquet")) == ["0", "2"]


@pytest.mark.slow
def test_a_sweep_is_validated_before_its_first_job_and_each_mistake_is_reported_once(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "-m", "+experiment=cosine", "steps=1", "capture.strategy=hook,bogus",
                                   "seed=0,1,2")  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("gradrunner: error: jobs 3, 4, 5 of 6 (all: +experiment=cosine steps=1 "
                               "capture.strategy=bogus; job 3: seed=0; job 4: seed=1; job 5: seed=2): ")  # fmt: skip
    assert "capture.strategy='bogus' is not allowed; allowed: retain_grad, hook, autograd_grad" in lines[0]
    assert "nothing was run" in lines[1] and not list(tmp_path.rglob("*.parquet"))
    # taps are resolved against each job's model (built on the meta device) before anything runs
    taps = gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "model.depth=3,2", "taps=[fc3:output]", "steps=1")
    assert taps.returncode == 2 and "Traceback" not in taps.stderr
    lines = taps.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("gradrunner: error: job 1 of 2 (+experiment=mlp model.depth=2")
    assert "tap 'fc3:output': no module 'fc3' in MLP. Closest paths: 'fc2', 'fc1'" in lines[0]
    assert not list(tmp_path.rglob("*.parquet"))


def test_a_mistake_of_several_sweep_jobs_names_each_jobs_own_overrides(tmp_path: Path) -> None:
    """seed=0,1 capture.strategy=bogus: the up-front check said "jobs 0, 1 of 2 (... seed=0 ...)", job 0's overrides
    as if both jobs had them."""
    result = gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "steps=2", "seed=0,1", "capture.strategy=bogus")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "nothing was run" in lines[1], result.stderr
    assert lines[0].startswith("gradrunner: error: jobs 0, 1 of 2 (all: +experiment=mlp steps=2 capture.strategy=bogus; "
                               "job 0: seed=0; job 1: seed=1): capture.strategy='bogus' is not allowed"), lines[0]  # fmt: skip
    assert not tmp_path.joinpath("multirun").exists()  # nothing ran, no sweep dir


@pytest.mark.parametrize("failing", [[n for n in range(2000) if n != 7], list(range(0, 2000, 2))])
def test_a_mistake_of_thousands_of_sweep_jobs_is_a_readable_paragraph(failing: list[int]) -> None:
    """Before, the up-front check listed every failing job's number (a 2000-job sweep: thousands of characters)."""
    from gradrunner.cli.app import _jobs_named

    jobs = [["a=1", f"seed={n}"] for n in range(2000)]
    said = _jobs_named(jobs, failing)
    assert len(said) < 300, said
    head, _, rest = said.partition(" (")
    shown, _, more = head.removeprefix("jobs ").partition(" and ")
    numbers = [n for part in shown.split(", ") for n in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    assert numbers == failing[: len(numbers)]  # the first jobs, as runs of numbers, then how many more
    assert len(numbers) + int(more.removesuffix(" more") or 0) == len(failing)
    first = "; ".join(f"job {n}: seed={n}" for n in failing[:5])
    assert rest == f"{len(failing)} of 2000; all: a=1; {first}; and {len(failing) - 5} more jobs)", said


def test_help_piped_into_head_ends_without_a_traceback(tmp_path: Path) -> None:
    """`gradrunner --help | head`: the reader is gone before the help is written (closed before the start)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "gradrunner", "--help"], cwd=tmp_path, env=cli_env(),
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 0


# -- interruptions ------------------------------------------------------------------------------


@contextlib.contextmanager
def long_run(cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """A run of many steps, yielded once 5 steps completed (it says so in a file); killed at the end.

    No fixed sleep: the test data option `data=faulty` writes `ready.<pid>` at batch 5, however
    loaded the machine is.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradrunner", SEARCHPATH, "+experiment=cosine", "steps=100000000", "data=faulty",
         "data.at_batch=5", f"data.ready_file={cwd / 'ready'}"],
        cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A shell's background job ignores SIGINT, and the child would inherit that: restore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not list(cwd.glob("ready.*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.01)  # polling a file, not waiting out a race
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "status", "said"),
    [(signal.SIGINT, 130, "gradrunner: interrupted"), (signal.SIGTERM, 143, "gradrunner: terminated (SIGTERM)"),
     (signal.SIGHUP, 129, "gradrunner: terminated (SIGHUP)")],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_ctrl_c_and_sigterm_close_cleanly_and_keep_completed_steps(
    tmp_path: Path, sig: signal.Signals, status: int, said: str
) -> None:
    with long_run(tmp_path) as proc:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, out
    assert "Traceback" not in out and said in out
    (job,) = job_dirs(tmp_path)
    kept = check_records(job)  # both tables, the same steps, each once, no temp file left
    assert len(kept) >= 5 and f"the records of {len(kept)} completed step(s) are kept in {job}" in out


@pytest.mark.slow
def test_sigkill_leaves_no_unreadable_grads_file(tmp_path: Path) -> None:
    with long_run(tmp_path) as proc:
        proc.kill()
        proc.communicate(timeout=60)
    (job,) = job_dirs(tmp_path)
    assert not (job / "grads.parquet").exists()
    for path in job.glob("*.parquet"):
        pq.read_metadata(path)  # anything with the final name is complete
