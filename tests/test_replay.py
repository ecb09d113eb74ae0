"""Branching from a kept checkpoint (`train.branch_from`) and replaying loss spikes (`anomaly.replay`).

The source run: the MLP experiment on synthetic data with one corrupted batch (tests/conf/data/spiky_batch:
inputs x 30 at batch 30), SGD at lr 0.1, 40 steps, a checkpoint every 5 steps, `anomaly.replay=3`. The
loss jumps from 0.24 to 460 at step 30 and the run diverges. Every run is `run.job.run` in-process.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import compose_cfg

from gradrunner.analysis import load
from gradrunner.config.schema import validate
from gradrunner.errors import GradrunnerError
from gradrunner.run.job import run

pytestmark = pytest.mark.slow

SOURCE = ("+experiment=mlp", "steps=40", "data=spiky_batch", "train.checkpoint_every=5", "anomaly.replay=3")


def _run(out: Path, *overrides: str) -> Path:
    run(compose_cfg(*overrides), out_dir=out)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory.mktemp("replay") / "source", *SOURCE)


def _rows(path: Path, since: int) -> pd.DataFrame:
    """A records file's rows from step `since` on, without the run id and the timings (plain pandas)."""
    df = pd.read_parquet(path).drop(columns=["run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"],
                                    errors="ignore")  # fmt: skip
    df = df[df["step"] >= since]
    return df.drop(columns=[c for c in ("values",) if c in df.columns]).reset_index(drop=True)


def test_the_spike_replays_exactly_and_only_its_checkpoint_is_kept(source: Path) -> None:
    steps = pd.read_parquet(source / "steps.parquet").set_index("step")["loss"]
    assert steps[29] < 1 and steps[30] > 100  # the planted spike
    verdict = json.loads((source / "replay" / "step30" / "replay.json").read_text())
    assert verdict["exact"] is True and verdict["start"] == 25 and verdict["first_difference"] is None
    assert verdict["records"] == 6 * 11  # steps 25..30 x 11 taps, every value compared
    replayed = load(source / "replay" / "step30", values=True)
    assert sorted(replayed["step"].unique()) == list(range(25, 31))
    assert replayed["values"].map(len).eq(replayed["numel"]).all()  # capture.values=full
    # The original's losses, bit for bit, read with plain pandas.
    again = pd.read_parquet(source / "replay" / "step30" / "steps.parquet").set_index("step")["loss"]
    assert again.to_dict() == steps.loc[25:30].to_dict()
    # load(run dir) reads the run's own records only, not the replay below it.
    mine = load(source)
    assert "job" not in mine.columns and len(mine) == 40 * 11
    # Retention: the checkpoint the replay started from (and the autopsy will), no other.
    kept = json.loads((source / "checkpoints" / "kept.json").read_text())
    assert [s["step"] for s in kept["states"]] == [25]
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == ["kept.json", "state-000000025.pt"]


def test_a_branch_without_change_reproduces_the_records_from_its_step_on(source: Path, tmp_path: Path) -> None:
    out = _run(tmp_path / "branch", *SOURCE[:-1], f"train.branch_from={source}:25")
    for name in ("grads.parquet", "steps.parquet"):
        pd.testing.assert_frame_equal(_rows(out / name, 25), _rows(source / name, 25))
        assert pd.read_parquet(out / name)["step"].min() == 25  # the branch's own records start at its step
    ids = {pd.read_parquet(p / "steps.parquet")["run_id"].iloc[0] for p in (out, source)}
    assert len(ids) == 2  # a new run id
    prov = json.loads((out / "branch.json").read_text())
    source_id = json.loads((source / "checkpoints" / "kept.json").read_text())["run_id"]
    assert prov["from"] == str(source) and prov["step"] == 25 and prov["run_id"] == source_id
    assert prov["changed"] == []
    done = json.loads((out / "done.json").read_text())
    assert done["config"]["train"]["branch_from"] == f"{source}:25"


def test_a_branch_with_a_lower_rate_takes_it_from_its_step(source: Path, tmp_path: Path) -> None:
    out = _run(tmp_path / "branch", *SOURCE[:-1], f"train.branch_from={source}:25", "optimizer.lr=0.05")
    ours = pd.read_parquet(out / "steps.parquet").set_index("step")
    theirs = pd.read_parquet(source / "steps.parquet").set_index("step")
    assert ours.loc[25, "lr"] == 0.05 and theirs.loc[25, "lr"] == 0.1
    assert ours.loc[25, "loss"] == theirs.loc[25, "loss"]  # the same weights before step 25
    assert ours.loc[26, "loss"] != theirs.loc[26, "loss"]  # a smaller step at 25
    assert json.loads((out / "branch.json").read_text())["changed"] == ["optimizer.lr: 0.1 -> 0.05"]


def test_a_branch_from_a_step_without_a_kept_checkpoint_names_the_kept_ones(source: Path, tmp_path: Path) -> None:
    with pytest.raises(GradrunnerError, match=r"no kept checkpoint before step 20; it keeps the checkpoints before steps 25"):
        _run(tmp_path / "branch", *SOURCE[:-1], f"train.branch_from={source}:20")
    assert not (tmp_path / "branch" / "grads.parquet").exists()


def test_a_branch_from_a_kept_state_that_is_gone_is_one_paragraph(source: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "source"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("replay"))
    (copy / "checkpoints" / "state-000000025.pt").unlink()
    with pytest.raises(GradrunnerError, match=r"state-000000025.pt, the state kept.json lists for step 25, is missing"):
        _run(tmp_path / "branch", *SOURCE[:-1], f"train.branch_from={copy}:25")
    assert not (tmp_path / "branch" / "grads.parquet").exists()


def test_replay_without_checkpoints_is_one_paragraph() -> None:
    with pytest.raises(GradrunnerError, match=r"anomaly.replay=3 needs train.checkpoint_every") as e:
        validate(compose_cfg("+experiment=mlp", "anomaly.replay=3"))
    assert "\n" not in str(e.value)


def test_replay_with_the_detector_off_is_one_paragraph(tmp_path: Path) -> None:
    """Nothing is flagged with anomaly.enabled=false: a replay would be of a spike the run's last word never named."""
    with pytest.raises(GradrunnerError, match=r"anomaly.replay=3 needs the spike detector, and anomaly.enabled=false") as e:
        _run(tmp_path / "run", *SOURCE, "anomaly.enabled=false")
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "grads.parquet").exists()


def test_a_planted_nondeterminism_does_not_replay_exactly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    noisy = ("model._target_=noisy_model.NoisyMLP", "+model.std=0.001")
    with caplog.at_level(logging.WARNING, logger="gradrunner.run.replay"):
        out = _run(tmp_path / "noisy", *SOURCE, *noisy)
    verdict = json.loads((out / "replay" / "step30" / "replay.json").read_text())
    assert verdict["exact"] is False and verdict["start"] == 25
    assert verdict["first_difference"].startswith("step 25")  # the first replayed step already differs
    # plain numbers, every digit (it was "np.float64(0.0123...)"), the records' own values (plain pandas)
    tap, stat, a, b = re.fullmatch(r"step 25, (.+), (\w+): (\S+) vs (\S+)", verdict["first_difference"]).groups()
    if tap == "the step":
        ours, theirs = (pd.read_parquet(d / "steps.parquet").set_index("step").loc[25, stat]
                        for d in (out, out / "replay" / "step30"))  # fmt: skip
    else:
        ours, theirs = (pd.read_parquet(d / "grads.parquet").query("step == 25 and tap == @tap")[stat].iloc[0]
                        for d in (out, out / "replay" / "step30"))  # fmt: skip
    assert (float(a), float(b)) == (ours, theirs) and (a, b) == (repr(float(ours)), repr(float(theirs)))
    assert "does not replay exactly: not exact (transient" in caplog.text


def test_the_spikes_come_from_anomalies_parquet_when_the_run_wrote_one(source: Path, tmp_path: Path) -> None:
    from gradrunner.analysis.anomalies import Detector
    from gradrunner.analysis.anomaly_signals import detect_run, save_anomalies
    from gradrunner.run.replay import loss_spikes, spike_starts

    offline = loss_spikes(source)  # no anomalies.parquet: the detector over the records
    assert spike_starts(offline) == [30] and offline["step"].iloc[0] == 30 and offline.attrs["settings"]["z"] == 6.0
    copy = tmp_path / "run"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("replay", "checkpoints"))
    run_id = json.loads((copy / "done.json").read_text())["run_id"]
    save_anomalies(copy, detect_run(copy, Detector(z=5.0)), run_id)  # as the loop writes it, at z = 5
    written = loss_spikes(copy)
    assert written.attrs["settings"]["z"] == 5.0 and spike_starts(written) == [30]
    assert written["first_tap"].iloc[0] == offline["first_tap"].iloc[0]


def test_a_kept_state_whose_bytes_changed_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    copy = tmp_path / "source"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("replay"))
    state = copy / "checkpoints" / "state-000000025.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    state.write_bytes(bytes(data))
    with pytest.raises(GradrunnerError, match=r"state-000000025.pt is not the file kept.json recorded"):
        _run(tmp_path / "branch", *SOURCE[:-1], f"train.branch_from={copy}:25")
    assert not (tmp_path / "branch" / "grads.parquet").exists()


def test_reset_moments_makes_the_branch_step_adams_first(tmp_path: Path) -> None:
    """Adam's first step (no moments): each weight moves by lr x g / (|g| + eps), from the captured gradient g."""
    adam = (*SOURCE[:-1], "anomaly.replay=3", "optimizer=adam", "optimizer.lr=0.01")
    source = _run(tmp_path / "adam", *adam)
    out = _run(tmp_path / "reset", *adam, f"train.branch_from={source}:25", "train.branch_reset_moments=true",
               "capture.values=full")  # fmt: skip
    g = pd.read_parquet(out / "grads.parquet")
    g = g[(g["step"] == 25) & g["tap"].str.endswith(":weight")].set_index("tap")
    first = g["values"].map(lambda v: 0.01 * float(np.linalg.norm(v / (np.abs(v) + 1e-8))))  # torch.optim.Adam's eps
    np.testing.assert_allclose(g["update_norm"], first, rtol=1e-4)
    theirs = pd.read_parquet(source / "grads.parquet").query("step == 25").set_index("tap")
    assert (g["norm"] == theirs.loc[g.index, "norm"]).all()  # the same gradient at step 25 ...
    assert not np.allclose(theirs.loc[g.index, "update_norm"], first, rtol=1e-2)  # ... 25 steps of moments in the run


def test_a_run_that_stops_on_the_spike_is_replayed_all_the_same(tmp_path: Path) -> None:
    """`capture.on_nonfinite=stop` ends the run at its NaN step (batch 30's inputs NaN): the states the replay
    needs are kept and the spike is replayed before the stop is told; the replay stops where the run did."""
    with pytest.raises(GradrunnerError, match="step 30"):
        _run(tmp_path / "stopped", *SOURCE, "data.scale=nan", "capture.on_nonfinite=stop")
    out = tmp_path / "stopped"
    assert not (out / "done.json").exists()
    losses = pd.read_parquet(out / "steps.parquet").set_index("step")["loss"]
    assert losses.index.max() <= 30 and np.isfinite(losses.loc[:29]).all()
    verdict = json.loads((out / "replay" / "step30" / "replay.json").read_text())
    assert verdict["exact"] is True and verdict["start"] == 25 and verdict["first_difference"] is None
    again = pd.read_parquet(out / "replay" / "step30" / "steps.parquet").set_index("step")["loss"]
    pd.testing.assert_series_equal(again, losses.loc[25:], check_exact=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["kept.json", "state-000000025.pt"]


def test_a_nan_setting_is_the_same_config_twice() -> None:
    """`data.scale=nan` compared with itself: NaN != NaN made every checkpoint of such a run 'another config'."""
    from gradrunner.run.config_compare import config_diff

    assert config_diff({"data": {"scale": float("nan")}}, {"data": {"scale": float("nan")}}) == []
    assert config_diff({"data": {"scale": float("nan")}}, {"data": {"scale": 1.0}}) == ["data.scale: nan -> 1.0"]


def test_a_run_capturing_every_few_steps_is_replayed_in_full_over_the_window(tmp_path: Path) -> None:
    """capture.every=4 left the spike's steps uncaptured in the replay too: its records were one step outside the
    window, its verdict resting on that step (found 2026-11-27). The replay captures every step of it now."""
    source = _run(tmp_path / "source", *SOURCE, "capture.every=4")
    verdict = json.loads((source / "replay" / "step30" / "replay.json").read_text())
    assert verdict["exact"] is True and verdict["start"] == 25 and verdict["first_difference"] is None
    replayed = load(source / "replay" / "step30", values=True)
    assert sorted(replayed["step"].unique()) == list(range(25, 31))
    assert replayed["values"].map(len).eq(replayed["numel"]).all()
    assert verdict["records"] == 11  # the one step of the window the run captured (28), compared value for value


def test_a_replay_the_job_did_not_finish_is_done_when_the_job_is_run_again(source: Path, tmp_path: Path) -> None:
    """Killed while it replayed its spike (the job's done.json written, the replay's verdict not): `resume=true`
    finds the job complete and replays what is missing (it said "already completed: skipped" and never did);
    a replay with its verdict is not done again."""
    import shutil

    job = tmp_path / "job"
    shutil.copytree(source, job)
    verdict = job / "replay" / "step30" / "replay.json"
    want = json.loads(verdict.read_text())
    verdict.unlink()
    (job / "replay" / "step30" / "done.json").unlink()  # the replay's own job killed before its end
    _run(job, *SOURCE, "resume=true")
    got = json.loads(verdict.read_text())
    assert got["exact"] is True and {k: v for k, v in got.items() if k != "directory"} == {
        k: v for k, v in want.items() if k != "directory"}  # fmt: skip
    before = verdict.stat().st_mtime_ns
    _run(job, *SOURCE, "resume=true")
    assert verdict.stat().st_mtime_ns == before
