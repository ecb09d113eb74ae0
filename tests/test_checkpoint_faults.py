"""Faults at seeded points around a mid-run checkpoint (issue 38 items 1, 7, 12; issue 36 items 3, 16).

Every job is interrupted in this process (a data option raising KeyboardInterrupt at batch N, as Ctrl-C
does there) and resumed with `resume=true`; the reference is the same config run uninterrupted in a dir
of its own. Whatever was damaged, swapped or interrupted, the records end identical to the reference's
(`RUN_COLUMNS` aside) or the run says in one paragraph what it kept.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import check_ok, compose_cfg, gradrunner_in_process
from records_check import check_records

from gradrunner.errors import GradrunnerError
from gradrunner.records.table_writer import ParquetTableWriter
from gradrunner.run.checkpoint import CHECKPOINT_DIR
from gradrunner.run.job import run

sys.path.insert(0, str(Path(__file__).parent))  # killing_data, resumable_data: as the CLI tests have them

#: Columns that differ between any two runs: who ran, and how long things took.
RUN_COLUMNS = ["run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"]
EVERY = 2


def cfg(out: Path, at: int, *extra: str, steps: int = 12) -> Any:
    """The mlp job, checkpointed every `EVERY` steps, interrupted as it asks for batch `at` (-1: never)."""
    return compose_cfg(
        "+experiment=mlp", f"steps={steps}", "data._target_=killing_data.KillAt", f"+data.at_batch={at}",
        f"+data.marker={out.parent / (out.name + '.cut')}", "+data.fault=keyboard_interrupt", "data.batch_size=4",
        f"train.checkpoint_every={EVERY}", "capture.values=sample", "capture.sample_size=4", "device=cpu", *extra,
    )  # fmt: skip


def records(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    return tuple(pd.read_parquet(out / f"{t}.parquet").drop(columns=RUN_COLUMNS, errors="ignore") for t in ("grads", "steps"))  # type: ignore[return-value]


def assert_same_records(out: Path, ref: Path) -> None:
    check_records(out)
    for got, want in zip(records(out), records(ref), strict=True):
        pd.testing.assert_frame_equal(got, want)


def interrupted(out: Path, at: int, *extra: str, **kw: Any) -> None:
    with pytest.raises(KeyboardInterrupt):
        run(cfg(out, at, *extra, **kw), out_dir=out)
    assert (out / CHECKPOINT_DIR).is_dir()


def segments(out: Path) -> list[Path]:
    return sorted((out / CHECKPOINT_DIR).glob("*-*.parquet"))


# -- item 1: a damaged, foreign or truncated segment is refused by name, never merged -------------


def _flip(rng: random.Random) -> Callable[[Path], None]:
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))

    return flip


def _truncate(rng: random.Random) -> Callable[[Path], None]:
    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: rng.randrange(path.stat().st_size)])

    return truncate


@pytest.mark.parametrize("seed", range(8))
def test_a_damaged_or_foreign_segment_is_refused_by_name_and_the_job_reruns_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    rng = random.Random(seed)
    damage = ["flip", "truncate", "foreign", "delete"][seed % 4]
    at = rng.randint(5, 11)  # a checkpoint after step 3 at least: two pairs of segments or more
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(cfg(ref, -1), out_dir=ref)
    interrupted(out, at)
    target = rng.choice(segments(out))
    if damage == "foreign":  # the same segment of a run of another seed, copied over this one
        other = tmp_path / "other"
        interrupted(other, at, "seed=1")
        (other / CHECKPOINT_DIR / target.name).replace(target)
    elif damage == "delete":
        target.unlink()
    else:
        (_flip if damage == "flip" else _truncate)(rng)(target)
    with caplog.at_level(logging.WARNING):
        run(cfg(out, at, "resume=true"), out_dir=out)  # never "free some disk space": it completes
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(said) == 1 and len(said[0].splitlines()) == 1, caplog.text
    assert f"the checkpoint in {out / CHECKPOINT_DIR} is not used: {target.name} " in said[0], said
    assert "runs from step 0" in said[0] and "disk space" not in caplog.text
    if damage == "foreign":
        assert "holds rows of run(s)" in said[0], said
    assert_same_records(out, ref)  # nothing of the damaged checkpoint went into the records
    assert not (out / CHECKPOINT_DIR).exists()


@pytest.mark.parametrize("what", ["state", "manifest"])
def test_a_flipped_bit_in_the_state_or_the_manifest_is_refused_and_the_job_reruns_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str
) -> None:
    rng = random.Random(what)
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(cfg(ref, -1), out_dir=ref)
    interrupted(out, 9)
    folder = out / CHECKPOINT_DIR
    target = next(folder.glob("state*.pt")) if what == "state" else folder / "checkpoint.json"
    _flip(rng)(target)
    with caplog.at_level(logging.WARNING):
        run(cfg(out, 9, "resume=true"), out_dir=out)
    assert f"the checkpoint in {folder} is not used: " in caplog.text and "runs from step 0" in caplog.text
    assert target.name in caplog.text
    assert_same_records(out, ref)


# -- item 7: Ctrl-C while the checkpoint's records are replayed -----------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_ctrl_c_while_the_checkpoint_is_replayed_leaves_both_tables_with_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, seed: int
) -> None:
    rng = random.Random(seed)
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(cfg(ref, -1), out_dir=ref)
    interrupted(out, 9)  # a checkpoint after step 7: four pairs of segments to replay
    at = rng.randint(1, 8)  # the write of the at-th replayed batch (each segment is one batch or more)
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    calls = [0]
    real = ParquetTableWriter.write_batch

    def write_batch(self: ParquetTableWriter, batch: Any) -> None:
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), sig)  # pending now; the run's handler acts at the next chance it has
        real(self, batch)

    monkeypatch.setattr(ParquetTableWriter, "write_batch", write_batch)
    with caplog.at_level(logging.WARNING, logger="gradrunner.run.loop"), pytest.raises(KeyboardInterrupt):
        run(cfg(out, 9, "resume=true"), out_dir=out)
    kept = check_records(out)  # both tables, the same steps
    assert kept and len(kept) % EVERY == 0, kept  # whole segments: the two tables were cut together
    assert f"the records of {len(kept)} completed step(s) are kept in {out}" in caplog.text
    monkeypatch.setattr(ParquetTableWriter, "write_batch", real)
    run(cfg(out, 9, "resume=true"), out_dir=out)  # the checkpoint is still there: resumed again, exactly
    assert_same_records(out, ref)


# -- item 12: a checkpoint found without resume=true; resuming with checkpoint_every=0 -------------


def test_a_rerun_without_resume_that_finds_a_checkpoint_is_refused_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "cut"
    interrupted(out, 7)
    for name in ("grads.parquet", "steps.parquet"):  # as a SIGKILLed run leaves it: no record file, a checkpoint
        (out / name).unlink()
    before = sorted(p.name for p in (out / CHECKPOINT_DIR).iterdir())
    with pytest.raises(GradrunnerError) as info:
        run(cfg(out, 7), out_dir=out)
    message = str(info.value)
    assert f"the run dir {out} already holds records (a mid-run checkpoint after step 5 (.checkpoint/))" in message
    assert "resume=true" in message and len(message.splitlines()) == 1
    assert sorted(p.name for p in (out / CHECKPOINT_DIR).iterdir()) == before  # nothing changed


@pytest.mark.slow  # three CLI runs: about 15 s on the shared 2-core machine
def test_the_cli_says_the_checkpoint_is_kept_refuses_a_rerun_without_resume_and_resumes_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["+experiment=mlp", "steps=12", "data._target_=killing_data.KillAt", "+data.at_batch=7",
            f"+data.marker={tmp_path / 'cut'}", "+data.fault=keyboard_interrupt", "data.batch_size=4",
            f"train.checkpoint_every={EVERY}", "device=cpu", "hydra.run.dir=run"]  # fmt: skip
    checkpoint = "a mid-run checkpoint after step 5 (.checkpoint/)"
    first = gradrunner_in_process(tmp_path, *args)  # the whole CLI, inside this process (conftest.python_m)
    assert first.returncode == 130 and [x for x in first.stderr.splitlines() if x.strip()] == [
        f"gradrunner: interrupted; the records of completed steps are kept in {run_dir} (grads.parquet, "
        f"steps.parquet); {checkpoint} is kept too: resume=true goes on from it"
    ], first.stderr
    refused = gradrunner_in_process(tmp_path, *args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"already holds records (grads.parquet, steps.parquet, {checkpoint})" in refused.stderr
    resumed = gradrunner_in_process(tmp_path, *args, "resume=true")
    check_ok(resumed)
    assert "steps 0-5 replayed from it" in resumed.stdout and check_records(run_dir) == list(range(12))


@pytest.mark.parametrize("every", [0, 3])
def test_resuming_with_another_checkpoint_every_resumes_and_leaves_no_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, every: int
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(cfg(ref, -1), out_dir=ref)
    interrupted(out, 7)
    with caplog.at_level(logging.INFO):
        run(cfg(out, 7, "resume=true", f"train.checkpoint_every={every}"), out_dir=out)
    assert "steps 0-5 replayed from it" in caplog.text and "is not used" not in caplog.text
    assert_same_records(out, ref)
    assert not (out / CHECKPOINT_DIR).exists()


# -- issue 36 item 16: a checkpoint of another config names the changed keys ----------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [("optimizer.lr=0.05", "optimizer.lr: 0.1 -> 0.05"), ("seed=3", "data.seed: 0 -> 3; seed: 0 -> 3"),
     ("capture.sample_size=3", "capture.sample_size: 4 -> 3")],
)  # fmt: skip
def test_a_checkpoint_of_another_config_is_thrown_away_naming_the_changed_key_and_both_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str, named: str
) -> None:
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(cfg(ref, -1, change), out_dir=ref)
    interrupted(out, 7)
    with caplog.at_level(logging.WARNING):
        run(cfg(out, 7, "resume=true", change), out_dir=out)
    assert f"is not used: it was written by a run of another config ({named})" in caplog.text, caplog.text
    assert_same_records(out, ref)


# -- issue 36 item 3: a shuffling DataLoader, dropout, evaluation ----------------------------------


def loader_cfg(out: Path, at: int, *extra: str) -> Any:
    """A DataLoader(shuffle=True) of 20 samples in batches of 4 (5 batches an epoch), a dropout MLP."""
    return compose_cfg(
        "~model", "+model._target_=resumable_data.dropout_mlp", "~data", "+data._target_=resumable_data.ShuffledLoader",
        "+data.n=20", "+data.batch_size=4", f"+data.at_batch={at}", f"+data.marker={out}.cut", "steps=16",
        "optimizer.lr=0.1", "taps=['0:output','3:weight']", f"train.checkpoint_every={EVERY + 1}",
        "capture.values=sample", "capture.sample_size=4", "device=cpu", *extra,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_resume_inside_a_later_epoch_of_a_shuffling_dataloader_with_dropout_is_exact(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    at = rng.randint(7, 15)  # the checkpoint before it (after step 5 at least) is inside epoch 2 or later
    extra = ("train.eval_every=2", "train.eval_batches=2") if seed % 2 else ()
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(loader_cfg(ref, -1, *extra), out_dir=ref)
    with pytest.raises(KeyboardInterrupt):
        run(loader_cfg(out, at, *extra), out_dir=out)
    run(loader_cfg(out, at, "resume=true", *extra), out_dir=out)
    assert_same_records(out, ref)


def test_a_data_source_drawing_more_often_than_a_checkpoint_keeps_runs_from_step_0_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gradrunner.run import checkpoint, data_position

    for module in (checkpoint, data_position):  # the shuffle draws at batches 0, 5, 10: more than one
        monkeypatch.setattr(module, "MAX_DRAWS", 1)
    ref, out = tmp_path / "ref", tmp_path / "cut"
    run(loader_cfg(ref, -1), out_dir=ref)
    with pytest.raises(KeyboardInterrupt):
        run(loader_cfg(out, 12), out_dir=out)
    with caplog.at_level(logging.WARNING):
        run(loader_cfg(out, 12, "resume=true"), out_dir=out)
    assert "is not used: the train data drew from torch's random generator at more than 1 batches" in caplog.text
    assert_same_records(out, ref)


def test_a_data_source_that_replays_other_draws_is_refused_in_one_paragraph() -> None:
    import torch

    from gradrunner.run.data_position import Watched

    def stream(draw_at: int) -> Iterator[int]:
        for i in range(10):
            if i == draw_at:
                torch.rand(1)  # as a sampler drawing an epoch's order
            yield i

    first = Watched(stream(2))
    for _ in range(5):
        next(first)
    assert [i for i, _ in first.state()["draws"]] == [2]
    with pytest.raises(GradrunnerError, match=r"did not draw from torch's random generator at batch 2, where the "
                       r"first run did: it is not the same sequence"):  # fmt: skip
        Watched(stream(3)).replay(first.state())


# -- a completed job re-run with another checkpoint frequency; the disk refusing a checkpoint --------


def test_a_completed_job_rerun_with_another_checkpoint_every_is_skipped_not_refused(tmp_path: Path) -> None:
    """How often a checkpoint is written changes no record: a re-run (a sweep adding `train.checkpoint_every`, a
    resume with another one) finds the completed job as it is, as `checkpoint.json` already did mid-run."""
    out = tmp_path / "done"
    run(cfg(out, -1, "train.checkpoint_every=0", steps=4), out_dir=out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".parquet", ".json")}
    run(cfg(out, -1, "resume=true", "train.checkpoint_every=2", steps=4), out_dir=out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".parquet", ".json")} == before


def test_a_checkpoint_the_disk_refuses_is_named_and_resume_goes_on_from_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the second checkpoint is saved: the message names the checkpoint (not "the records") and the
    one `resume=true` goes on from; the resumed records equal the uninterrupted run's."""
    import errno

    from gradrunner.run.checkpoint import Checkpointer

    ref, out = tmp_path / "ref", tmp_path / "full"
    run(cfg(ref, -1), out_dir=ref)
    real, calls = Checkpointer._save, []

    def save(self: Checkpointer, state: dict[str, Any], name: str) -> str:
        calls.append(name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.folder / name))
        return real(self, state, name)

    monkeypatch.setattr(Checkpointer, "_save", save)
    with pytest.raises(GradrunnerError) as e:
        run(cfg(out, -1), out_dir=out)
    said = str(e.value)
    assert f"could not write the mid-run checkpoint after step {2 * EVERY - 1}" in said, said
    assert f"resume=true: it goes on from a mid-run checkpoint after step {EVERY - 1}" in said, said
    assert "Kept: grads.parquet, steps.parquet (complete files)" in said, said
    monkeypatch.setattr(Checkpointer, "_save", real)
    run(cfg(out, -1, "resume=true"), out_dir=out)
    assert_same_records(out, ref)


def test_the_steps_an_interrupted_torchrun_job_kept_are_counted_once_not_once_per_rank(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradrunner.run.loop import _steps_in

    pq.write_table(pa.table({"step": [0, 0, 1, 1, 2, 2], "rank": [0, 1] * 3}), tmp_path / "steps.parquet")
    assert _steps_in(tmp_path / "steps.parquet") == 3
