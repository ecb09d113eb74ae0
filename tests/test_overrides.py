"""A misspelled key on the command line is refused in one paragraph before Hydra composes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import gradrunner_in_process

from gradrunner.config.overrides import misspelled_key


@pytest.mark.parametrize(
    ("argv", "starts", "meant"),
    [
        (["capture.stratgy=hook"], "capture.stratgy is not a config key; capture.* keys: strategy, values", "capture.strategy"),
        (["stepz=3"], "stepz is not a config key; top-level keys: model, data", "'steps'"),
        (["+experiment=mlp", "dtyp=float64"], "dtyp is not a config key", "'dtype'"),
        (["steps.max=3"], "steps.max is not a config key: steps is a single value", "steps=..."),
    ],
)
def test_misspelled_keys_are_named_with_what_exists(argv: list[str], starts: str, meant: str) -> None:
    message = misspelled_key(argv)
    assert message is not None and message.startswith(starts) and meant in message, message


@pytest.mark.parametrize(
    "argv",
    [
        ["+experiment=mlp", "steps=3", "capture.strategy=hook", "model.depth=4", "data.batch_size=8"],
        ["-m", "capture.strategy=hook,retain_grad", "hydra/launcher=joblib", "hydra.run.dir=x", "+foo=1"],
        ["--config-dir", "my_conf", "model=tiny", "capture=default", "taps=[fc1:output]", "~taps"],
    ],
)
def test_valid_overrides_pass(argv: list[str]) -> None:
    assert misspelled_key(argv) is None


def test_the_cli_exits_2_with_one_paragraph_and_no_records(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "capture.stratgy=hook")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradrunner: error: capture.stratgy is not a config key")
    assert "Traceback" not in result.stderr and not list(tmp_path.rglob("*.parquet*"))
