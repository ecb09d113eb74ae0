"""The package's layers: what each import costs, and the one source of each allowed value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.config.choices import STRATEGY_NAMES


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "statement",
    ["import gradrunner.analysis", "import gradrunner.report", "import gradrunner.records.writer", "import gradrunner"],
)
def test_reading_side_imports_no_torch(statement: str) -> None:
    loaded = _modules_after(statement)
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith(("gradrunner.capturing", "gradrunner.run"))}


def test_the_documented_capture_import_gives_the_function() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import gradrunner.run.loop\nfrom gradrunner import capture, Capture\n"
         "print(callable(capture), capture.__module__, Capture.__name__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "gradrunner.capturing.session", "Capture"]


def test_strategy_names_are_the_registry_keys_in_order() -> None:
    assert tuple(STRATEGIES) == STRATEGY_NAMES
