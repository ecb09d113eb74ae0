"""A run with taps=[]: its steps ran, no gradient row was written. The report and compare say so (not 'no step
was captured', not 'no tap in common (t0: ; t0: )'), as its steps.parquet shows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from conftest import check_ok, python_m


def test_report_and_compare_of_a_run_without_taps_say_what_happened(tmp_path: Path) -> None:
    check_ok(python_m(tmp_path, "gradrunner", "+experiment=mlp", "steps=2", "taps=[]", "hydra.run.dir=t0"))
    steps, grads = pd.read_parquet(tmp_path / "t0" / "steps.parquet"), pd.read_parquet(tmp_path / "t0" / "grads.parquet")
    assert len(grads) == 0 and steps["captured"].sum() == len(steps) == 2
    report = python_m(tmp_path, "gradrunner.report", "t0")
    assert report.returncode == 2 and report.stderr.count("\n") == 1
    assert "no step was captured" not in report.stderr
    assert f"{len(steps)} steps ran, {int(steps['captured'].sum())} captured, but no tap was recorded (taps=[])" in report.stderr
    compare = python_m(tmp_path, "gradrunner.compare", "t0", "t0")
    assert compare.returncode == 2 and "t0: ;" not in compare.stderr
    assert "neither run recorded a gradient" in compare.stderr, compare.stderr
