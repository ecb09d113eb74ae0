"""`cpu_accounting` (the opt-in plugin that measures where the suite's CPU goes) counts what each test spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

MEASURED = """
import subprocess, sys
from hydra import compose, initialize_config_module

def test_spins():
    sum(i * i for i in range(3_000_000))

def test_waits_for_a_child():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)

def test_composes_twice():
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        compose("config", overrides=["+experiment=mlp"])
        compose("config", overrides=["+experiment=cnn"])
"""


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_measured.py").write_text(MEASURED)
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_accounting", "-p", "no:cacheprovider",
                           "test_measured.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, **env})  # fmt: skip


@pytest.mark.slow
def test_each_test_gets_its_own_cpu_its_childrens_and_its_compositions(tmp_path: Path) -> None:
    out = tmp_path / "cpu.jsonl"
    result = _pytest(tmp_path, CPU_ACCOUNTING=str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line["id"].split("::")[1]: line for line in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"test_spins", "test_waits_for_a_child", "test_composes_twice"}
    spins, waits, composes = lines["test_spins"], lines["test_waits_for_a_child"], lines["test_composes_twice"]
    assert spins["self"] > 0.05 and spins["children"] < 0.01  # its own work, no child
    assert waits["children"] > 0.05 and waits["children"] > waits["self"]  # the child's work, not the test's
    assert (composes["compositions"], spins["compositions"], waits["compositions"]) == (2, 0, 0)
    assert 0 < composes["composition_cpu"] <= composes["self"]


def test_without_the_file_it_refuses_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CPU_ACCOUNTING"}
    (tmp_path / "test_measured.py").write_text("def test_x():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_accounting", "test_measured.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**env, "PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])})  # fmt: skip
    assert result.returncode != 0 and "CPU_ACCOUNTING" in result.stderr and "Traceback" not in result.stderr
