"""`.ci/run` runs the README's test command: the quickstart's second line, install and pytest alike."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"^pip install (torch==\S+ -e '\.\[test\]') && (python -m pytest [^\n#]*?)\s*$", readme, re.M)
    assert line, "README's quickstart has no `pip install ... -e '.[test]' && python -m pytest ...` line"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"pip install {line.group(1)} || exit 1" in ci
    assert line.group(2) in ci
    # and the same command in "Development"
    assert readme.count(f"pip install {line.group(1)} && {line.group(2)}") == 2
