"""The report of a dir holding runs with different overrides (one sets `optimizer.lr`, one does not): each run's
sentence from its own steps, checked against the jobs' steps.parquet; a run that did not set the override is
matched as such (its label NaN), not dropped."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from conftest import check_ok, python_m
from report_tables import tables_after

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")


def test_runs_with_different_overrides_each_get_their_sentence(tmp_path: Path) -> None:
    from gradrunner.report import write_report

    check_ok(python_m(tmp_path, "gradrunner", "+experiment=mlp", "steps=2", "hydra.run.dir=mixed/a"))
    check_ok(python_m(tmp_path, "gradrunner", "+experiment=mlp", "steps=3", "optimizer.lr=0.5", "hydra.run.dir=mixed/b"))
    page = write_report(tmp_path / "mixed").read_text(encoding="utf-8")
    answer = page.split('<p class="answer">', 1)[1].split("</p>", 1)[0].split("<br>")
    expected = {}
    # each run named by every override that tells them apart (steps too: a column confounded with another is kept)
    for job, label in (("a", "optimizer.lr not set, override.steps=2"), ("b", "optimizer.lr=0.5, override.steps=3")):
        steps = pd.read_parquet(tmp_path / "mixed" / job / "steps.parquet").sort_values("step")
        expected[job] = steps
        loss = steps["loss"]
        said = f"{label}: Loss {loss.iloc[0]:.4g} → {loss.iloc[-1]:.4g} over {len(steps)} steps;"
        assert any(line.startswith(said) for line in answer), answer
    runs = tables_after(page, "Runs")
    for job, steps in expected.items():
        row = runs[runs["job"] == job]
        assert row["steps run"].tolist() == [len(steps)]
        assert float(row["last loss"].iloc[0]) == pytest.approx(steps["loss"].iloc[-1], rel=1e-5)
