"""The spike detector on real training runs: quiet on smooth runs, and right about planted spikes.

Each run is `gradrunner.run.loop.train` in-process; the detector is fed offline from the records
(`detect_run`: the steps table and the grads rows, through the same `tap_signals` rule the loop's
`step_signals` uses online; test_anomalies checks the two agree) at the defaults z=6, window 128,
warm-up 20.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf, open_dict

from gradrunner.analysis import load
from gradrunner.analysis.anomalies import space_of
from gradrunner.analysis.anomaly_signals import TAP_COLUMNS, detect_run, read_anomalies, run_signals, save_anomalies
from gradrunner.analysis.anomaly_summary import summary_lines
from gradrunner.records import rundir
from gradrunner.run.loop import train

pytestmark = pytest.mark.slow

HAS_HF = importlib.util.find_spec("transformers") is not None
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None


def run(tmp_path: Path, name: str, *overrides: str, data: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """Train `+experiment=<...>` with `overrides` into `tmp_path/name`; `data`/`model`: keys replacing the option's."""
    cfg = compose_cfg(*overrides)
    with open_dict(cfg):
        if data is not None:
            cfg.data = OmegaConf.create(data | {"inner": OmegaConf.to_container(cfg.data)})
        if model is not None:
            cfg.model = OmegaConf.create(OmegaConf.to_container(cfg.model) | model)
    (tmp_path / name).mkdir()  # train.checkpoint_every (gpt2_pretrain) fails on a dir not there yet
    quiet, level = logging.getLogger("gradrunner"), logging.getLogger("gradrunner").level
    quiet.setLevel(logging.WARNING)  # long runs: no progress lines; put back so later tests' caplog sees INFO
    try:
        train(cfg, out_dir=tmp_path / name)
    finally:
        quiet.setLevel(level)
    return tmp_path / name


def series(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    steps = rundir.read_verified(run_dir / "steps.parquet", None)
    return list(run_signals(load(run_dir, columns=TAP_COLUMNS), steps))


def reference_z(
    values: list[dict[str, float]], at: int, flagged: set[tuple[int, str]] = frozenset()
) -> dict[str, float]:  # type: ignore[assignment]
    """z of every signal at index `at`: against the plain mean/std of its last 128 values before (ln of them for a
    norm signal, 0 left out there), those `flagged` left out."""
    out = {}
    for name, x in values[at].items():
        log = space_of(name) == "log"
        scale = math.log if log else float
        last = np.array([scale(v[name]) for i, v in enumerate(values[:at])
                         if name in v and (i, name) not in flagged and not (log and v[name] <= 0)][-128:])  # fmt: skip
        out[name] = (scale(x) - last.mean()) / max(last.std(), 1e-3 * (1.0 if log else abs(last.mean())))
    return out


SMOOTH = [
    ("mlp", 300), ("cosine", 300), ("transformer", 300),
    # cnn (Adam, lr 0.01, digits) climbs out of its initial plateau between steps ~30 and ~130 in grad-norm
    # jumps of 2.5-10x in one step: tens of sigma on a linear scale, a few on the log scale norms are judged on.
    pytest.param("cnn", 300, marks=pytest.mark.skipif(not HAS_SKLEARN, reason="needs scikit-learn (digits)")),
    pytest.param("gpt2", 300, marks=pytest.mark.skipif(not HAS_HF, reason="needs transformers")),
    # warm-up then cosine decay, clipping, bf16 autocast, 2 micro-batches, taps every 5th step (default 200 steps)
    pytest.param("gpt2_pretrain", None, marks=pytest.mark.skipif(not HAS_HF, reason="needs transformers")),
]  # fmt: skip


@pytest.mark.parametrize(("experiment", "steps"), SMOOTH)
def test_no_false_alarm_over_smooth_runs_of_the_built_in_experiments(
    tmp_path: Path, experiment: str, steps: int | None
) -> None:
    for seed in (0, 1):
        length = [f"steps={steps}"] if steps else []
        run_dir = run(tmp_path, str(seed), f"+experiment={experiment}", f"seed={seed}", *length)
        det = detect_run(run_dir)
        assert len(det.signals) >= 6 and "grad_norm" in det.signals and any(":norm" in s for s in det.signals)
        assert det.anomalies == [], summary_lines(det.anomalies, det.window)


def test_a_planted_bad_batch_is_flagged_at_its_step_and_not_before(tmp_path: Path) -> None:
    # Batch 150's inputs x 1e3: the loss and every gradient blow up at step 150 (then the model is wrecked).
    bad = {"_target_": "planted_spikes.SpikyData", "at_batch": 150, "scale": 1e3}
    run_dir = run(tmp_path, "bad", "+experiment=mlp", "steps=160", data=bad)
    det = detect_run(run_dir)
    assert min(a.step for a in det.anomalies) == 150
    at = {a.signal: a for a in det.anomalies if a.step == 150}
    values = [v for _, v in series(run_dir)]
    assert set(at) == set(values[150])  # every signal: loss, grad_norm, each tap's norm and update ratio
    want = reference_z(values, 150)
    assert {s: a.z for s, a in at.items()} == pytest.approx(want, rel=1e-9)
    moved_most = max((s for s in want if ":" in s), key=lambda s: want[s])  # the first mover: the largest z of the step
    save_anomalies(run_dir, det, run_id=str(load(run_dir, table="steps").run_id[0]))
    df = read_anomalies(run_dir)
    loss = df[(df.signal == "loss") & (df.step == 150)].iloc[0]
    assert (loss.first_tap, loss.lead, loss.value) == (moved_most.rsplit(":", 1)[0], 0, values[150]["loss"])
    [line, grad_line] = summary_lines(det.anomalies, det.window, det.taps())
    assert line.startswith("loss spike at step 150 (z = ") and line.endswith(f"first to move: {loss.first_tap} (lead 0 steps)")
    assert grad_line.startswith("grad_norm spike at step 150 (z = ")


def test_the_first_mover_is_the_tap_whose_gradient_was_planted(tmp_path: Path) -> None:
    # Planted with a tensor hook on fc1.weight in the test model (tests/planted_spikes.SpikedMLP): its
    # gradient x 1e3 in the backward of step 150 only (gradient edits have no per-step selection yet).
    # Only fc1:weight moves at 150 (no activation's gradient changes; the grad norm includes it); the
    # SGD step it takes wrecks the next forward: the loss spikes at 151.
    spiked = {"_target_": "planted_spikes.SpikedMLP", "param": "fc1.weight", "at_step": 150, "scale": 1e3}
    run_dir = run(tmp_path, "spiked", "+experiment=mlp", "steps=160", model=spiked)
    det = detect_run(run_dir)
    assert min(a.step for a in det.anomalies) == 150
    assert {a.signal for a in det.anomalies if a.step == 150} == {"grad_norm", "fc1:weight:norm",
                                                                 "fc1:weight:update_ratio"}  # fmt: skip
    values = [v for _, v in series(run_dir)]
    assert values[150]["fc1:weight:norm"] == pytest.approx(1e3 * np.mean([v["fc1:weight:norm"] for v in values[140:150]]),
                                                           rel=0.5)  # fmt: skip
    save_anomalies(run_dir, det, run_id=str(load(run_dir, table="steps").run_id[0]))
    df = read_anomalies(run_dir).set_index(["signal", "step"])
    assert (df.loc[("grad_norm", 150), "first_tap"], df.loc[("grad_norm", 150), "lead"]) == ("fc1:weight", 0)
    assert (df.loc[("loss", 151), "first_tap"], df.loc[("loss", 151), "lead"]) == ("fc1:weight", 1)
    assert ("loss", 150) not in df.index and math.isfinite(df.loc[("loss", 151), "z"])
    lines = summary_lines(det.anomalies, det.window, det.taps())
    assert lines[0].startswith("grad_norm spike at step 150") and lines[0].endswith("fc1:weight (lead 0 steps)")
    assert lines[1].startswith("loss spike at step 151") and lines[1].endswith("fc1:weight (lead 1 step)")
