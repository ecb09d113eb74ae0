"""Faults met by the readers (issue 38 items 3 and 5), each at a seeded point.

- `load(sweep)` never silently drops a completed job whose record file is gone: refused by name, or
  left out with a warning under `on_damaged="skip"`.
- `load(live=True)`: a job that closes its files in the middle of a read is looked at again (never a
  raw `FileNotFoundError`); a new job started in a killed job's dir is never served the dead run's rows;
  a segment of another run is refused by name. A writer process and a reader running at once agree.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import warnings
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import child_python, cli_env
from omegaconf import OmegaConf
from torch import nn

import gradrunner
from gradrunner.analysis import load
from gradrunner.analysis.reading import DamagedRecordsWarning
from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records import segments
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, TapKey
from gradrunner.records.rundir import DONE
from gradrunner.records.writer import RecordWriter, StepsWriter
from gradrunner.run.books import mark_complete

# --- item 3: a completed job's file gone ---------------------------------------------------------


def write_completed_job(job_dir: Path, run_id: str, seed: int, steps: int = 3) -> None:
    """A job as the runner leaves it: both tables and its done.json (with its overrides)."""
    consts = {"run_id": run_id, "experiment": "mlp", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    gen = torch.Generator().manual_seed(seed)
    with RecordWriter(job_dir, constants=consts, metadata={}) as w, StepsWriter(job_dir, constants=consts, metadata={}) as s:
        for step in range(steps):
            col = Collector()
            col.add(TapKey("fc1", "output", 0), torch.randn(3, 4, generator=gen))
            w.write_step(step, col.finish(torch.tensor(0.5 + step)))
            s.write(step, True, 0.5 + step, 0.1, 0.01, None)
    mark_complete(job_dir, OmegaConf.create({"seed": seed}), files=[GRADS_FILE, STEPS_FILE], run_id=run_id,
                  world_size=1, overrides=[f"seed={seed}"])  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_a_completed_job_whose_file_is_gone_is_named_never_silently_dropped(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    jobs = rng.randint(2, 5)
    for n in range(jobs):
        write_completed_job(tmp_path / str(n), f"run-{n}", seed=n)
    gone, table = str(rng.randrange(jobs)), rng.choice(["grads", "steps"])
    (tmp_path / gone / f"{table}.parquet").unlink()
    with pytest.raises(GradrunnerError) as info:
        load(tmp_path, table=table)
    message = str(info.value)
    assert str(tmp_path / gone / f"{table}.parquet") in message and "missing" in message, message
    assert len(message.splitlines()) == 1 and "on_damaged='skip'" in message
    with pytest.warns(DamagedRecordsWarning, match="missing"):
        df = load(tmp_path, table=table, on_damaged="skip")
    assert sorted(df.job.unique()) == sorted(str(n) for n in range(jobs) if str(n) != gone)
    other = "steps" if table == "grads" else "grads"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(load(tmp_path, table=other).job.unique()) == [str(n) for n in range(jobs)]


def test_a_single_run_whose_file_is_gone_is_refused_naming_it(tmp_path: Path) -> None:
    write_completed_job(tmp_path, "run-a", seed=0)
    (tmp_path / GRADS_FILE).unlink()
    with pytest.raises(GradrunnerError, match=r"grads\.parquet is missing, though done\.json lists it"):
        load(tmp_path)


# --- item 5: live reading ------------------------------------------------------------------------


def _steps(rec: gradrunner.Recorder, model: nn.Module, n: int, gen: torch.Generator) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 3, generator=gen)).pow(2).mean()
        rec.backward(loss)
        rec.step(loss)


@pytest.mark.parametrize("seed", range(3))
def test_a_job_closing_its_files_during_a_live_read_is_read_again(tmp_path: Path, seed: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The job ends (writers closed, segments removed) after the reader opened a seeded number of segments."""
    rng = random.Random(seed)
    steps = rng.randint(2, 6)
    model, gen = nn.Linear(3, 1), torch.Generator().manual_seed(seed)
    rec = gradrunner.record(model, [":output"], tmp_path / "r", live_every=1)
    rec.__enter__()
    _steps(rec, model, steps, gen)
    at = rng.randrange(steps)  # the segment whose opening finds the job gone
    opened = segments.pq.ParquetFile
    calls: list[int] = []

    def closing_meanwhile(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == at + 1:
            rec.__exit__(None, None, None)  # the job ends here: record files closed, segments removed
        return opened(*args, **kwargs)

    class Parquet:  # pyarrow.parquet as the segment reader sees it, with its ParquetFile watched
        def __getattr__(self, name: str) -> object:
            return closing_meanwhile if name == "ParquetFile" else getattr(pq, name)

    monkeypatch.setattr(segments, "pq", Parquet())
    df = load(tmp_path / "r", live=True)  # no FileNotFoundError: read again, now from the record file
    monkeypatch.undo()
    assert (tmp_path / "r" / DONE).is_file()
    pd.testing.assert_frame_equal(df, load(tmp_path / "r"))
    assert sorted(df.step.unique()) == list(range(steps))


KILLED = """
import os, signal, sys, torch
from torch import nn
import gradrunner
torch.manual_seed(0)
model = nn.Linear(3, 1)
with gradrunner.record(model, [":output"], sys.argv[1], live_every=1) as rec:
    for _ in range(int(sys.argv[2])):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        rec.backward(loss)
        rec.step(loss)
    print(rec.run_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("seed", range(2))
def test_a_new_job_in_a_killed_jobs_dir_is_never_served_the_dead_runs_rows(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    run = tmp_path / "k"
    killed_at = rng.randint(2, 5)
    dead = subprocess.run([child_python(), "-c", KILLED, str(run), str(killed_at)], env=cli_env(), capture_output=True,
                          text=True)  # fmt: skip
    assert dead.returncode == -9, dead.stderr
    dead_id = dead.stdout.strip()
    assert sorted(load(run, live=True).step) == list(range(killed_at))  # the killed job's segments, as before
    for temp in run.glob(".*.parquet.*.tmp"):  # the user removes the partial records to run there again
        temp.unlink()

    every = rng.randint(2, 3)
    model, gen = nn.Linear(3, 1), torch.Generator().manual_seed(seed)
    with gradrunner.record(model, [":output"], run, live_every=every) as rec:
        with pytest.raises(GradrunnerError, match=f"run {rec.run_id}.* has not completed a segment yet"):
            load(run, live=True)  # the dead run's segments are still there: not served
        _steps(rec, model, every - 1, gen)
        with pytest.raises(GradrunnerError, match="has not completed a segment yet"):
            load(run, table="steps", live=True)
        _steps(rec, model, 1, gen)
        live = load(run, live=True)
        assert set(live.run_id) == {rec.run_id} != {dead_id}
        assert sorted(live.step.unique()) == list(range(every))
        assert (run / segments.LIVE_DIR / dead_id).is_dir()  # kept, never read
    final = load(run)
    pd.testing.assert_frame_equal(live, final[final.step < every].reset_index(drop=True))


def test_a_segment_of_another_run_is_refused_by_name(tmp_path: Path) -> None:
    model, gen = nn.Linear(3, 1), torch.Generator().manual_seed(0)
    with gradrunner.record(model, [":output"], tmp_path / "a", live_every=1) as a:
        _steps(a, model, 2, gen)
        other = tmp_path / "a" / segments.LIVE_DIR / a.run_id / segments.segment_name("grads", 1)
        with gradrunner.record(model, [":output"], tmp_path / "b", live_every=1) as b:
            _steps(b, model, 2, gen)
            shutil.copy(other, tmp_path / "b" / segments.LIVE_DIR / b.run_id / segments.segment_name("grads", 1))
            with pytest.raises(GradrunnerError, match=f"grads-000001.parquet.seg holds rows of run.s. {a.run_id}"):
                load(tmp_path / "b", live=True)


WRITER = """
import sys, torch
from torch import nn
import gradrunner
torch.manual_seed(int(sys.argv[3]))
model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
with gradrunner.record(model, ["*:output"], sys.argv[1], live_every=int(sys.argv[2])) as rec:
    print(rec.run_id, flush=True)  # the reader starts once the job holds its dir
    for _ in range(40):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        rec.backward(loss)
        rec.step(loss)
"""


@pytest.mark.parametrize("seed", range(2))
def test_a_reader_beside_a_running_writer_sees_whole_steps_of_its_run_only(tmp_path: Path, seed: int) -> None:
    """Two processes at once, as a user watching a job: every live read is whole steps 0..k of the live run,
    or the one "not yet" message; the job's end (segments removed mid-read) is never a traceback."""
    run = tmp_path / "w"
    every = random.Random(seed).randint(1, 3)
    writer = subprocess.Popen([child_python(), "-c", WRITER, str(run), str(every), str(seed)], env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: list[pd.DataFrame] = []
    waiting = 0
    try:
        assert writer.stdout is not None
        run_id = writer.stdout.readline().strip()
        while writer.poll() is None:
            try:
                seen.append(load(run, live=True))
            except GradrunnerError as e:
                assert "has not completed a segment yet" in str(e), str(e)
                waiting += 1
    finally:
        _, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    final = load(run)
    assert json.loads((run / DONE).read_text())["run_id"] == run_id
    for df in seen:
        steps = sorted(df.step.unique())
        assert set(df.run_id) == {run_id} and steps == list(range(len(steps)))
        pd.testing.assert_frame_equal(df.reset_index(drop=True), final[final.step < len(steps)].reset_index(drop=True))
    assert seen or waiting


# --- an interrupted job of a sweep none of whose jobs completed yet --------------------------------


def _recorded(run: Path, steps: int, interrupt_at: int | None = None) -> None:
    """`record()` of a tiny loop into `run`; Ctrl-C (KeyboardInterrupt) in step `interrupt_at`, before it is recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    with gradrunner.record(model, ["0:output"], run) as rec:
        for s in range(steps):
            loss = model(torch.ones(4, 3)).square().mean()
            loss.backward()
            if s == interrupt_at:
                raise KeyboardInterrupt
            rec.step(loss)


def test_an_interrupted_job_is_never_read_as_complete_also_before_any_job_completed(tmp_path: Path) -> None:
    """Ctrl-C in job 0 at step 4 of 8, no job of the sweep completed yet: `load(sweep)` returned job 0's partial
    rows without a word (the rule applied only once some job had `done.json`); now it is named and left out."""
    sweep = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        _recorded(sweep / "0", 8, interrupt_at=4)
    assert sorted(pd.read_parquet(sweep / "0" / STEPS_FILE).step) == [0, 1, 2, 3]  # the partial records are kept
    assert not (sweep / "0" / DONE).exists()
    with pytest.warns(UserWarning, match=r"1 of 1 jobs .* job 0 has no done.json"):
        with pytest.raises(GradrunnerError, match=r"no job in .* completed; 1 of 1 jobs .* job 0 has no done.json"):
            load(sweep)
    _recorded(sweep / "1", 2)  # once a job completed: the same rule, job 0 left out and named
    with pytest.warns(UserWarning, match=r"1 of 2 jobs .* job 0 has no done.json"):
        df = load(sweep, table="steps")
    assert df.job.unique().tolist() == ["1"] and sorted(df.step) == [0, 1]
