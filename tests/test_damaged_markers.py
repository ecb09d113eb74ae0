"""A `done.json` gradrunner did not write (`{}`, garbage, deep nesting, a directory) is damage: the job
is not taken as completed, `resume=true` says so and runs it again, and nothing raises a traceback."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from conftest import compose_cfg
from records_check import check_records

from gradrunner.records.rundir import DONE, job_state
from gradrunner.run.job import run

DAMAGED = {
    "empty-object": "{}",
    "garbage": "\x00\x01 not json",
    "deep-nesting": "[" * 100_000,
    "a-list": "[1, 2]",
    "no-files": '{"status": "completed", "run_id": "x"}',
}


def damage(job: Path, how: str) -> None:
    (job / DONE).unlink()
    if how == "a-directory":
        (job / DONE).mkdir()
        (job / DONE / "x").write_text("x")
    else:
        (job / DONE).write_text(DAMAGED[how])


@pytest.mark.parametrize("how", [*DAMAGED, "a-directory"])
def test_a_done_json_gradrunner_did_not_write_is_damage_and_resume_reruns_the_job(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=tmp_path)
    run_id = json.loads((tmp_path / DONE).read_text())["run_id"]
    damage(tmp_path, how)
    assert job_state(tmp_path).status == "missing"
    with caplog.at_level(logging.WARNING):
        run(compose_cfg("+experiment=cosine", "steps=2", "resume=true"), out_dir=tmp_path)
    assert f"{DONE} is not a completion marker gradrunner wrote" in caplog.text
    marker = json.loads((tmp_path / DONE).read_text())
    assert marker["run_id"] != run_id and check_records(tmp_path) == [0, 1]
    shutil.rmtree(tmp_path)
