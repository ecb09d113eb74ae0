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
