"""The spike flight recorder's edges, in-process and fast: replay under torchrun, kept checkpoints, the detector's
feed, the autopsy's inputs (the defects a hunt of the recorder found, 2026-11-27)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_cfg

from gradrunner.config.schema import validate
from gradrunner.errors import GradrunnerError


def test_replay_under_torchrun_is_refused_before_step_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun job's checkpoints are per rank and DCP folders, which replay cannot read: it crashed at the
    run's end parsing `state-<step>.rank<r>.pt`. Refused in one paragraph now, naming the single-process way."""
    cfg = compose_cfg("+experiment=mlp", "anomaly.replay=3", "train.checkpoint_every=5")
    validate(cfg)  # one process: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GradrunnerError, match=r"anomaly.replay=3 is not allowed under torchrun \(WORLD_SIZE=2\)") as e:
        validate(cfg)
    assert "\n" not in str(e.value) and "single process" in str(e.value)
    validate(compose_cfg("+experiment=mlp", "anomaly.replay=0", "train.checkpoint_every=5"))


def test_a_branch_under_torchrun_is_refused_before_step_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner seeds a branch from its kept single-process state in one process only: under torchrun
    `train.branch_from` was ignored without a word (a 2-rank job trained from step 0, no branch.json, where the
    same command in one process starts at the kept step). Refused in one paragraph now, as replay is."""
    cfg = compose_cfg("+experiment=mlp", "train.branch_from=runs/src:4")
    validate(cfg)  # one process: fine (the source is checked when the job starts)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        GradrunnerError, match=r"train.branch_from='runs/src:4' is not allowed under torchrun \(WORLD_SIZE=2\)"
    ) as e:
        validate(cfg)
    assert "\n" not in str(e.value) and "single process" in str(e.value)
    validate(compose_cfg("+experiment=mlp"))  # no branch: torchrun runs as ever


def test_kept_states_ignore_a_torchrun_jobs_rank_files(tmp_path: Path) -> None:
    """`state-<step>.rank<r>.pt` is not a single-process state: it made `int('000000005.rank0')` raise."""
    from gradrunner.records.checkpoint_files import CHECKPOINT_DIR
    from gradrunner.run.checkpoint import KEPT_DIR, KEPT_MANIFEST, Checkpointer

    folder = tmp_path / CHECKPOINT_DIR
    folder.mkdir()
    for name in ("state-000000005.pt", "state-000000005.rank0.pt", "state-000000010.rank1.pt"):
        (folder / name).write_bytes(name.encode())
    ckpt = Checkpointer(tmp_path, 5, "anomaly: {replay: 3}\n", open_segment=None)
    ckpt.finish()
    kept = json.loads((tmp_path / KEPT_DIR / KEPT_MANIFEST).read_text())
    assert [(s["step"], s["name"]) for s in kept["states"]] == [(5, "state-000000005.pt")]


def _spike(run_dir: Path, step: int, losses: dict[int, float], **kw: object) -> object:
    import pandas as pd

    from gradrunner.run.autopsy import Spike

    fields: dict[str, object] = {"start": 0, "horizon": 2, "threshold": 1.0, "config": {}, "first_tap": None}
    fields.update(kw)
    return Spike(run_dir, step, losses=pd.Series(losses), **fields)  # type: ignore[arg-type]


def test_a_nan_spike_reproduced_as_nan_reproduces(tmp_path: Path) -> None:
    """NaN != NaN made the baseline 'NOT reproduce' a NaN spike it reproduced exactly."""
    import pandas as pd

    from gradrunner.run.autopsy import results

    nan = float("nan")
    for job, at_3 in (("0", nan), ("1", 0.5)):
        (tmp_path / job).mkdir()
        pd.DataFrame({"step": [2, 3, 4], "loss": [0.4, at_3, nan]}).to_parquet(tmp_path / job / "steps.parquet")
    table = results(_spike(tmp_path, 3, {2: 0.4, 3: nan, 4: nan}), tmp_path, ["baseline", "other"])  # type: ignore[arg-type]
    assert table.set_index("intervention")["reproduces"].to_dict() == {"baseline": True, "other": False}


def test_skip_batch_evaluates_on_the_runs_held_out_set() -> None:
    """SkipBatches hid the inner source's `held_out`: the skip_batch branch measured eval_loss on another set."""
    import torch

    from gradrunner.data import Corrupted, Synthetic
    from gradrunner.run.branch import skipping
    from gradrunner.run.evaluation import eval_source, fixed_batches, held_out_seed

    cfg = compose_cfg("+experiment=mlp", "data=corrupted", "train.eval_every=1", "train.eval_batches=2")
    inner = {k: v for k, v in cfg.data.inner.items() if k != "_target_"}
    run_data = Corrupted(Synthetic(**inner), at_batch=60, scale=1000.0)
    branch_data = skipping("gradrunner.data.Corrupted", [60], inner=Synthetic(**inner), at_batch=60, scale=1000.0)
    sets = [fixed_batches(eval_source(cfg, d).source, 2, held_out_seed(0), torch.device("cpu"), torch.float32)
            for d in (run_data, branch_data)]  # fmt: skip
    for (xa, ya), (xb, yb) in zip(*sets, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize(("bad", "named"), [
    ({"replay": 3}, "record() and the callbacks have none); allowed: enabled, z, window, warmup"),
    ({"enabled": "no"}, "anomaly enabled='no' is not allowed; it must be True or False"),
    ({"enabled": 1}, "anomaly enabled=1 is not allowed"),
])  # fmt: skip
def test_record_refuses_replay_and_a_non_bool_enabled(tmp_path: Path, bad: dict[str, object], named: str) -> None:
    """record(anomaly={'replay': 3}) was accepted (record() has no replay), and enabled='no' turned the detector on."""
    from torch import nn

    from gradrunner import record

    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(GradrunnerError) as e:
        record(model, ["0:output"], tmp_path / "rec", anomaly=bad)
    assert named in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "rec").exists()
