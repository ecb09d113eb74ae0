"""A sweep with a failed job: the report says which job it left out and why, on the page (the answer and the
Runs section) and once on stderr as one clean line, not the raw warning twice with its source lines."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pandas as pd
import pytest
from conftest import python_m
from planted import planted_sweep_with_failures
from report_tables import tables_after

from gradrunner.analysis import IncompleteSweepWarning

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


def _answer_of(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    return html.unescape(text.split('<p class="answer">', 1)[1].split("</p>", 1)[0])


def _section(page: Path, title: str) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index(f">{title}</h2>")
    return html.unescape(re.sub(r"<[^>]+>", "", text[start : text.find("<h2", start + 1)]))


def test_a_seed_whose_other_strategy_failed_is_not_compared_and_the_rest_agree(tmp_path: Path) -> None:
    """strategy x seed, (autograd_grad, 1) failed: the page said "The 2 strategies differ: largest relative
    difference inf" though seed 0's two runs are identical (planted) and seed 1 has one strategy (found 2026-11-27)."""
    from gradrunner.report import write_report

    jobs = [("retain_grad", 0, True), ("autograd_grad", 0, True), ("retain_grad", 1, True), ("autograd_grad", 1, False)]
    with pytest.warns(IncompleteSweepWarning):
        page = write_report(planted_sweep_with_failures(tmp_path, jobs))
    said = "not compared, lacking a strategy's run: seed=1 (no autograd_grad run)"
    assert f"All 2 strategies agree where compared (largest relative difference 0); {said}." in _answer_of(page)
    assert "strategies differ" not in _answer_of(page)
    agree = _section(page, "Do the strategies agree?")
    assert "identical records" in agree and f"N{said[1:]}." in agree
    worst = tables_after(page.read_text(encoding="utf-8"), "Do the strategies agree?")
    assert (worst[["abs_diff", "rel_diff"]] == 0).all().all()
    summary = tables_after(page.read_text(encoding="utf-8"), "Per-tap summary")  # seed 0: yes; seed 1: not compared
    assert summary.groupby("seed")["agree"].unique().map(list).to_dict() == {0: ["yes"], 1: ["not compared"]}


def test_runs_of_two_seeds_are_not_compared_as_two_strategies(tmp_path: Path) -> None:
    """(hook, 1) and (autograd_grad, 0) failed: the page compared hook's seed 0 with autograd_grad's seed 1 and
    said they differ (planted: hook's fc2:output at step 1, 1e-3 off); no pair of runs differs in strategy alone."""
    from gradrunner.report import write_report

    jobs = [("hook", 0, True), ("hook", 1, False), ("autograd_grad", 0, False), ("autograd_grad", 1, True)]
    with pytest.warns(IncompleteSweepWarning):
        page = write_report(planted_sweep_with_failures(tmp_path, jobs))
    lacking = "seed=0 (no autograd_grad run); seed=1 (no hook run)"
    assert f"The 2 strategies were not compared: no group of runs has every strategy ({lacking})." in _answer_of(page)
    agree = _section(page, "Do the strategies agree?")
    assert f"Not compared: no group of runs has every strategy: {lacking}." in agree
    runs = tables_after(page.read_text(encoding="utf-8"), "Runs")
    assert runs[["strategy", "seed"]].values.tolist() == [["hook", 0], ["autograd_grad", 1]]
    summary = tables_after(page.read_text(encoding="utf-8"), "Per-tap summary")
    assert set(summary["agree"]) == {"not compared"} and "differ" not in _section(page, "Per-tap summary")
