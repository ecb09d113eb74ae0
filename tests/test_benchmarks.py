"""Every benchmark runs at tiny sizes, so the scripts keep working (nothing is asserted about time).

Each script runs as `python benchmarks/<script> --tiny` would, inside the test's process
(`conftest.python_script`: argv, its dir on `sys.path`, `__main__`, exit status); the extras run of
`capture_overhead.py` is the one real subprocess, the scripts' end-to-end smoke. The scripts whose
children are CLI runs or torchrun ranks (`WARM_CHILDREN`) start them through the test worker's warm
Python (`conftest.child_python`, as the suite's torchrun ranks are): each child is still a process of its
own running `python -m gradrunner ...` or the script, forked from a server that imported torch already
instead of paying 2 to 3 s of CPU for it. The scripts that measure their children's memory start fresh
interpreters as ever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_python, python_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
#: Scripts whose children (`[sys.executable, ...]`: CLI runs, torchrun and its ranks) they do not measure the memory
#: of: started warm here (module doc).
WARM_CHILDREN = frozenset({"sweep_scale.py", "load_verification.py", "sharded_capture.py"})


def test_every_benchmark_is_listed_in_benchmarks_md() -> None:
    text = (BENCHMARKS.parent / "BENCHMARKS.md").read_text()
    missing = [s for s in SCRIPTS if f"benchmarks/{s}" not in text]
    assert not missing, f"BENCHMARKS.md does not give the command for {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_tiny_size(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if script in WARM_CHILDREN:  # the script's `sys.executable` children start warm (module doc)
        monkeypatch.setattr(sys, "executable", child_python())
    out = tmp_path / "result.json"
    result = python_script(tmp_path, BENCHMARKS / script, "--tiny", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["rows"], data
    assert data["machine"]["torch"]


@pytest.mark.slow
def test_capture_overhead_extras_run_at_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(BENCHMARKS.parent)}  # this checkout's gradrunner
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "capture_overhead.py"), "--tiny", "--extras", "--values", "none",
         "--only", "transformer", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    variants = {r["variant"] for r in json.loads(out.read_text())["rows"]}
    assert {"hook+per_example", "hook+histogram", "hook+updates", "hook-value_norm"} <= variants
