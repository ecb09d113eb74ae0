"""A sweep with a failed job: the report says which job it left out and why, on the page (the answer and the
Runs section) and once on stderr as one clean line, not the raw warning twice with its source lines."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import python_m
from report_tables import tables_after

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")


def test_a_failed_job_is_said_once_on_stderr_and_on_the_page(tmp_path: Path) -> None:
    python_m(tmp_path, "gradrunner", "-m", "+experiment=mlp", "steps=2", "model.depth=2,-1", "hydra.sweep.dir=sw")
    sweep = tmp_path / "sw"
    assert (sweep / "1" / "failed.json").is_file() and (sweep / "0" / "done.json").is_file()
    reason = json.loads((sweep / "1" / "failed.json").read_text())
    result = python_m(tmp_path, "gradrunner.report", "sw")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradrunner.report: warning: 1 of 2 jobs"), result.stderr
    assert "job 1 failed" in lines[0] and "IncompleteSweepWarning" not in result.stderr
    page = (sweep / "report.html").read_text(encoding="utf-8")
    answer = page.split('<p class="answer">', 1)[1].split("</p>", 1)[0]
    assert "1 of 2 jobs in sw did not complete and are left out: job 1 failed" in answer
    runs_section = page[page.index(">Runs</h2>") : page.index("<h2", page.index(">Runs</h2>"))]
    assert "job 1 failed" in runs_section and "MLP depth must be &gt;= 0" in runs_section
    assert "depth" in json.dumps(reason)
    runs = tables_after(page, "Runs")  # the completed job, as its own steps.parquet says
    steps = pd.read_parquet(sweep / "0" / "steps.parquet").sort_values("step")
    assert runs["job"].astype(str).tolist() == ["0"] and runs["steps run"].tolist() == [len(steps)]
    assert float(runs["last loss"].iloc[0]) == pytest.approx(steps["loss"].iloc[-1], rel=1e-5)
