"""Resume: an existing run dir is refused or resumed; a killed sweep re-run completes only what was missing."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import INTERRUPT_AT_STEP_3, check_ok, cli_env, compose_cfg, gradrunner_in_process
from records_check import check_records

from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import LOCK_FILE
from gradrunner.records.rundir import DONE, FAILED, job_state
from gradrunner.run.books import LiveRun, RunLock
from gradrunner.run.job import run

RECORDS = ("grads.parquet", "steps.parquet", DONE)
STRATEGIES = "hook,retain_grad,autograd_grad"


def stamps(directory: Path, names: tuple[str, ...] = RECORDS) -> dict[str, tuple[int, int]]:
    """inode and mtime of each file: both unchanged means the file was not touched."""
    return {n: ((directory / n).stat().st_ino, (directory / n).stat().st_mtime_ns) for n in names}


# -- a single run into an existing dir ------------------------------------------------------------


def test_a_completed_run_writes_done_json_last(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path)
    done = json.loads((tmp_path / DONE).read_text())
    assert done["status"] == "completed" and done["files"] == ["grads.parquet", "steps.parquet"]
    assert done["run_id"] == pd.read_parquet(tmp_path / "grads.parquet").run_id.iloc[0]
    assert (tmp_path / DONE).stat().st_mtime_ns >= (tmp_path / "grads.parquet").stat().st_mtime_ns
    assert job_state(tmp_path).status == "completed"


def test_a_second_run_into_the_same_dir_is_refused(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    (tmp_path / LOCK_FILE).unlink()  # as a dir written before run-dir locks holds none
    before = stamps(tmp_path)
    named = rf"run dir {re.escape(str(tmp_path))} already holds records .*resume=true"
    with pytest.raises(GradrunnerError, match=named):
        run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    assert stamps(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*RECORDS, "anomalies.parquet"])  # no lock file left by the refused run


def test_resume_skips_a_completed_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    with caplog.at_level(logging.INFO, logger="gradrunner.run.books"):
        path = run(compose_cfg("+experiment=cosine", "steps=1", "resume=true"), out_dir=tmp_path)
    assert path == tmp_path / "grads.parquet"
    assert "already completed (done.json): skipped" in caplog.text
    assert stamps(tmp_path) == before


def test_resume_refuses_a_completed_run_of_another_config(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    with pytest.raises(GradrunnerError, match=r"completed run of a different config \(steps: 1 -> 2\)"):
        run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert stamps(tmp_path) == before


def test_resume_reruns_an_incomplete_run_from_step_0(tmp_path: Path) -> None:
    (tmp_path / "grads.parquet").write_bytes(b"partial")  # as a Ctrl-C'd run leaves it, minus the footer
    (tmp_path / ".steps.parquet.tmp").write_bytes(b"partial")
    (tmp_path / FAILED).write_text('{"error": "earlier"}')
    with pytest.raises(GradrunnerError, match="did not complete"):
        run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path)
    run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*RECORDS, LOCK_FILE, "anomalies.parquet"])
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1]


def test_an_interrupted_run_has_no_marker_and_resumes(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        run(compose_cfg("+experiment=cosine", "steps=5", *INTERRUPT_AT_STEP_3), out_dir=tmp_path)
    assert (tmp_path / "grads.parquet").exists() and not (tmp_path / DONE).exists()
    assert job_state(tmp_path).status == "missing"
    run(compose_cfg("+experiment=cosine", "steps=5", "resume=true"), out_dir=tmp_path)
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_cli_refuses_an_existing_run_dir_then_resumes_it(tmp_path: Path) -> None:
    args = ("+experiment=cosine", "steps=1", "hydra.run.dir=run")  # the CLI in-process (conftest.python_m)
    check_ok(gradrunner_in_process(tmp_path, *args))
    hydra_before = {f.name: f.read_bytes() for f in (tmp_path / "run" / ".hydra").iterdir()}
    refused = gradrunner_in_process(tmp_path, *args, "seed=7")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    # A refused run changes nothing there: not the records, not .hydra/, and it writes no failed.json.
    assert {f.name: f.read_bytes() for f in (tmp_path / "run" / ".hydra").iterdir()} == hydra_before
    assert not (tmp_path / "run" / FAILED).exists()
    (line,) = [s for s in refused.stderr.splitlines() if s.strip()]
    assert line.startswith(f"gradrunner: error: the run dir {tmp_path / 'run'} already holds records")
    assert "resume=true" in line
    resumed = gradrunner_in_process(tmp_path, *args, "resume=true")
    check_ok(resumed)
    assert "already completed (done.json): skipped" in resumed.stdout + resumed.stderr


# -- a sweep killed part-way ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_sweep_rerun_completes_only_what_was_missing(tmp_path: Path) -> None:
    args = ["-m", "hydra.sweep.dir=sw", "+experiment=cosine", "steps=400", f"capture.strategy={STRATEGIES}"]
    sw = tmp_path / "sw"
    proc = subprocess.Popen([sys.executable, "-m", "gradrunner", *args], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (sw / "0" / DONE).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before job 0 completed"
            time.sleep(0.01)
        proc.kill()  # SIGKILL: no handler runs, no manifest, job 1 is cut off wherever it was
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert job_state(sw / "1").status == "missing" and not (sw / "2" / DONE).exists()
    before = stamps(sw / "0")

    result = gradrunner_in_process(tmp_path, *args)  # the re-run: in-process (the killed sweep was a real process)
    check_ok(result)
    assert stamps(sw / "0") == before
    # Job 0 is skipped either way: by the catalogue when its row was written before the kill (after
    # done.json, so the kill can land between the two), else by its verified done.json.
    assert ("already completed (done.json): skipped" in result.stdout
            or "1 of 3 jobs completed before with this config (catalogue.sqlite): skipped" in result.stdout)
    assert all(job_state(sw / str(i)).status == "completed" for i in range(3))
    assert json.loads((sw / "manifest.json").read_text())["counts"] == {"completed": 3, "failed": 0, "missing": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        df = load(sw, table="steps")
    assert df.groupby("strategy").step.apply(list).map(lambda s: s == list(range(400))).all()
    assert sorted(df.strategy.unique()) == ["autograd_grad", "hook", "retain_grad"]


def test_a_sweep_killed_in_job_1_names_job_2_that_never_started_and_a_rerun_runs_only_1_and_2(tmp_path: Path) -> None:
    """seed=0,1,2 whose launcher (the basic launcher: job 1 is its process) is SIGKILLed in job 1: load() said
    "1 of 2 jobs ... did not complete: job 1" and never named job 2, as the manifest was written only at the end."""
    for seed in (0, 2):
        (tmp_path / f"killed_{seed}").touch()  # only seed 1's job is killed
    args = ["-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=3", "data._target_=killing_data.KillAt",
            "+data.at_batch=1", f"+data.marker={tmp_path}/killed_${{seed}}", "seed=0,1,2"]  # fmt: skip
    sw = tmp_path / "sw"
    killed = subprocess.run([sys.executable, "-m", "gradrunner", *args], cwd=tmp_path, env=cli_env(),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr  # SIGKILL: no handler ran, no end-of-sweep manifest
    assert [job_state(sw / n).status for n in ("0", "1")] == ["completed", "missing"] and not (sw / "2").exists()
    manifest = json.loads((sw / "manifest.json").read_text())  # the one written as the sweep started
    assert manifest["ended"] is False
    assert manifest["counts"] == {"completed": 0, "failed": 0, "missing": 0, "pending": 3}
    assert [(j["num"], j["status"], j["overrides"][-1]) for j in manifest["jobs"]] == [
        (0, "pending", "seed=0"), (1, "pending", "seed=1"), (2, "pending", "seed=2")]  # fmt: skip
    assert manifest["jobs"][2]["overrides"][:-1] == json.loads((sw / "0" / DONE).read_text())["overrides"][:-1]

    with pytest.warns(UserWarning) as caught:
        df = load(sw)
    said = " | ".join(str(w.message) for w in caught)
    assert len(caught) == 1 and said.startswith(f"2 of 3 jobs in {sw} did not complete and are left out: "), said
    assert "job 1 has no done.json" in said and re.search(r"job 2 \(\+experiment=mlp .*seed=2\) did not start", said)
    assert "The other 1 job(s) completed and are read" in said
    # job 1 has its dir, without done.json: named by its number and its own overrides (which config was cut off)
    assert re.search(r"job 1 has no done.json \(killed, or still running; its overrides: \+experiment=mlp .*seed=1\)", said)
    assert df.job.unique().tolist() == ["0"] and len(df) == len(pd.read_parquet(sw / "0" / "grads.parquet"))

    before = stamps(sw / "0")
    check_ok(gradrunner_in_process(tmp_path, *args))  # the markers are there: nothing is killed now
    assert stamps(sw / "0") == before  # job 0 was not run again
    assert all(job_state(sw / str(i)).status == "completed" for i in range(3))
    manifest = json.loads((sw / "manifest.json").read_text())
    assert manifest["ended"] is True and manifest["counts"] == {"completed": 3, "failed": 0, "missing": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps = load(sw, table="steps")
    assert steps.groupby("seed").step.apply(list).to_dict() == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


# -- resume verifies a completed job's files instead of trusting done.json --------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_page_byte(path: Path) -> None:
    """Flip one byte inside the first data page of `grads.parquet`'s `norm` column (its checksum then fails)."""
    meta = pq.read_metadata(path)
    col = next(meta.row_group(0).column(i) for i in range(meta.num_columns)
               if meta.row_group(0).column(i).path_in_schema == "norm")  # fmt: skip
    data = bytearray(path.read_bytes())
    data[col.data_page_offset + col.total_compressed_size - 3] ^= 0xFF  # inside the page body, past its header
    path.write_bytes(bytes(data))


def _other_run_rows(path: Path) -> None:
    """Replace `steps.parquet` by a readable file of another run with the same rows (a mixed-up dir)."""
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                             pa.array(["another-run"] * table.num_rows))  # fmt: skip
    pq.write_table(table, path)


DAMAGES = {
    "truncated": ("grads.parquet", _truncate, "grads.parquet cannot be read"),
    "deleted": ("steps.parquet", lambda p: p.unlink(), "steps.parquet is missing"),
    "byte-flipped": ("grads.parquet", _flip_a_page_byte, "grads.parquet cannot be read"),
    "other-run": ("steps.parquet", _other_run_rows, "steps.parquet holds rows of run(s) another-run"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_reruns_a_completed_job_whose_files_do_not_verify_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    run(compose_cfg("+experiment=cosine", "steps=3"), out_dir=tmp_path)
    first = json.loads((tmp_path / DONE).read_text())["run_id"]
    name, harm, reason = DAMAGES[damage]
    harm(tmp_path / name)
    with caplog.at_level(logging.WARNING, logger="gradrunner.run.books"):
        run(compose_cfg("+experiment=cosine", "steps=3", "resume=true"), out_dir=tmp_path)
    assert f"{tmp_path} is marked completed but {reason}" in caplog.text and "running again" in caplog.text
    done = json.loads((tmp_path / DONE).read_text())
    assert done["run_id"] != first
    assert check_records(tmp_path) == [0, 1, 2]


def test_load_names_a_damaged_file_and_its_job(tmp_path: Path) -> None:
    for job in ("0", "1"):
        run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path / job)
    _truncate(tmp_path / "1" / "grads.parquet")
    with pytest.raises(GradrunnerError, match=rf"cannot read 1 record file.*: {re.escape(str(tmp_path / '1' / 'grads.parquet'))} "
                       rf"\(job 1 of {re.escape(str(tmp_path))}\).*resume=true"):  # fmt: skip
        load(tmp_path)


# -- the run dir's lock ----------------------------------------------------------------------------


def test_a_live_run_holding_the_dir_refuses_a_second_one_naming_it(tmp_path: Path) -> None:
    run(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    before = stamps(tmp_path)
    with RunLock(tmp_path, "the-live-run"):  # another run, alive, in this very process
        with pytest.raises(LiveRun) as info:
            run(compose_cfg("+experiment=cosine", "steps=1", "resume=true"), out_dir=tmp_path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and f"the run dir {tmp_path} is in use by a live run" in message
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started 20" in message and "the-live-run" in message
    assert stamps(tmp_path) == before


def test_a_dead_owners_lock_does_not_block_resume(tmp_path: Path) -> None:
    # What a SIGKILLed run leaves: its lock file, naming it, but no process holding the flock.
    (tmp_path / LOCK_FILE).write_text('{"host": "gone", "pid": 999999, "started": "2020-01-01", "run_id": "dead"}')
    (tmp_path / ".grads.parquet.dead.tmp").write_bytes(b"cut off")
    run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert check_records(tmp_path) == [0, 1]
