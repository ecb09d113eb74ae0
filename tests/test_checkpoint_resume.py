"""`train.checkpoint_every` and `resume=true`: a job SIGKILLed at seeded random steps and resumed ends
with records identical to an uninterrupted run's (the reference is that run, in its own dir).

The killed run is a real process (it SIGKILLs itself); the reference run and the resumed one run the same
`python -m gradrunner` inside the test's process (`conftest.python_m`)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from conftest import check_ok, gradrunner, gradrunner_in_process

from gradrunner.records.checkpoint_files import CHECKPOINT_DIR, read_manifest

#: Columns that differ between any two runs: who ran, and how long things took.
RUN_COLUMNS = ["run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"]
STEPS = 12


def _args(out: Path, at_batch: int, marker: Path, *extra: str) -> list[str]:
    return [
        "+experiment=mlp", f"steps={STEPS}", "data._target_=killing_data.KillAt", f"+data.at_batch={at_batch}",
        f"+data.marker={marker}", "data.batch_size=4", "train.checkpoint_every=3", "capture.values=sample",
        "capture.sample_size=4", f"hydra.run.dir={out}", *extra,
    ]  # fmt: skip


def saved_step(out: Path) -> int:
    """The step count of the checkpoint in `out`, from its verified manifest; its state file holds only tensors
    and plain values (it loads with `weights_only=True`) and says the same."""
    manifest, problem = read_manifest(out)
    assert manifest is not None, problem
    state = torch.load(out / CHECKPOINT_DIR / manifest["state"]["name"], weights_only=True)
    assert state["step"] == manifest["step"]
    return int(manifest["step"])


def _records(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    grads = pd.read_parquet(out / "grads.parquet").drop(columns=RUN_COLUMNS, errors="ignore")
    steps = pd.read_parquet(out / "steps.parquet").drop(columns=RUN_COLUMNS, errors="ignore")
    return grads, steps


def _kill_and_resume(tmp_path: Path, extra: tuple[str, ...], kills: list[int]) -> None:
    ref = tmp_path / "ref"
    check_ok(gradrunner_in_process(tmp_path, *_args(ref, -1, tmp_path / "never", *extra)))
    want_grads, want_steps = _records(ref)
    for at in kills:
        out, marker = tmp_path / f"killed-{at}", tmp_path / f"marker-{at}"
        first = gradrunner(tmp_path, *_args(out, at, marker, *extra))
        assert first.returncode == -9 and marker.exists(), first.stderr[-2000:]
        per_step = int(dict(a.split("=", 1) for a in extra).get("train.accumulate", "1"))
        saved = (at // per_step) // 3 * 3  # steps done at the last checkpoint before the kill
        if saved:
            assert saved_step(out) == saved
        second = gradrunner_in_process(tmp_path, *_args(out, at, marker, *extra), "resume=true")
        check_ok(second)
        if saved:  # it went on from the checkpoint rather than from step 0
            assert f"steps 0-{saved - 1} replayed from it" in second.stdout + second.stderr
        got_grads, got_steps = _records(out)
        pd.testing.assert_frame_equal(got_steps, want_steps)
        pd.testing.assert_frame_equal(got_grads, want_grads)
        assert not (out / CHECKPOINT_DIR).exists()  # removed once the records were closed


@pytest.mark.slow  # three CLI runs: about 35 s on the shared 2-core machine
def test_killed_and_resumed_with_scheduler_and_scaler_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    kills = random.Random(20).sample(range(1, 2 * STEPS), 1)
    _kill_and_resume(tmp_path, ("scheduler=warmup_cosine", "train.autocast=fp16", "train.accumulate=2"), kills)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("scheduler=onecycle", "train.autocast=fp16", "train.clip_grad_norm=0.5")])
def test_killed_at_several_random_steps_and_resumed_equals_an_uninterrupted_run(
    tmp_path: Path, extra: tuple[str, ...]
) -> None:
    kills = random.Random(len(extra)).sample(range(1, STEPS), 2)
    assert any(k >= 3 for k in kills)
    _kill_and_resume(tmp_path, extra, kills)


_SEEDED_EDITS = "edits=[{tap:'fc1:output',dropout:0.5},{tap:'head:weight',noise_std:0.01}]"


@pytest.mark.parametrize(
    ("edits", "resumed_at"),
    # Interrupted at batch 7: step 7 (a checkpoint after step 5), or with accumulate=2 step 3 (one after step 2).
    [((), 6), ((_SEEDED_EDITS,), 6), ((_SEEDED_EDITS, "capture.every=2", "train.accumulate=2"), 3)],
    ids=["plain", "seeded-edits", "seeded-edits-every-2-accumulate-2"],
)
def test_interrupted_in_process_and_resumed_continues_from_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edits: tuple[str, ...], resumed_at: int
) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # killing_data, as the CLI tests have it on PYTHONPATH
    from conftest import compose_cfg

    from gradrunner.run.job import run

    def cfg(out: Path, at: int, *extra: str) -> Any:
        args = [a for a in _args(out, at, tmp_path / "marker") if not a.startswith("hydra.")]
        return compose_cfg(*args, "+data.fault=keyboard_interrupt", "scheduler=cosine", "steps=8", "device=cpu", *edits, *extra)

    run(cfg(tmp_path / "ref", -1), out_dir=tmp_path / "ref")
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run(cfg(out, 7), out_dir=out)
    assert saved_step(out) == resumed_at
    with caplog.at_level("INFO", logger="gradrunner.run.checkpoint"):
        run(cfg(out, 7, "resume=true"), out_dir=out)
    assert f"steps 0-{resumed_at - 1} replayed from it" in caplog.text  # it went on from there, not from step 0
    for got, want in zip(_records(out), _records(tmp_path / "ref"), strict=True):
        pd.testing.assert_frame_equal(got, want)
    assert not (out / CHECKPOINT_DIR).exists()
