"""Random, seeded command lines: no traceback, no hang; every mistake is one paragraph with exit 2.

Most lines are checked in-process, the way `cli.app.main` handles them (the command-line checks, Hydra
composing, `validate`), since a subprocess costs seconds on a loaded machine; a handful go through the
real CLI, which must agree.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SEARCHPATH, cli_env
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from gradrunner.config.overrides import group_mistake, misspelled_key
from gradrunner.config.schema import validate
from gradrunner.errors import GradrunnerError
from gradrunner.run.hydra_adapter import _describe

KEYS = ["steps", "seed", "capture.every", "capture.sample_size", "capture.strategy", "capture.values", "dtype",
        "device", "taps", "model", "data", "loss", "optimizer", "capture", "+experiment", "stepz",
        "capture.stratgy", "model.foo", "+model.hidden", "resume", "report", "experiment", "~taps"]  # fmt: skip
VALUES = ["-5", "0", "1", "3", str(2**31), str(2**32), str(2**63 - 1), str(2**64), "1.5", "nan", "inf", "null",
          "true", "", "[1,2]", "[]", "{a:1}", "mlp", "mpl", "cnn", "adamw", "adam", "hook", "hooks", "full",
          "cpu", "cuda:x", "fc1:output", "[fc1:output]", "${seed}", "${nope}", "abc", "1,2", "[1", "'q'"]  # fmt: skip


def command_line(rng: random.Random) -> list[str]:
    line = ["+experiment=mlp"] if rng.random() < 0.7 else []
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(KEYS)
        line.append(key if key.startswith("~") else f"{key}={rng.choice(VALUES)}")
    return line


def in_process(argv: list[str]) -> str | None:
    """What `cli.app.main` reports for `argv` before a job runs: a one-paragraph message, or None (it would run).

    Call it inside `initialize_config_module(config_module="gradrunner.conf", version_base="1.3")`.
    """
    message = misspelled_key(argv) or group_mistake(argv)
    if message is not None:
        return message
    try:
        cfg = compose("config", overrides=[SEARCHPATH, *argv])
    except (HydraException, OmegaConfBaseException) as e:  # what run/hydra_adapter.py turns into one paragraph
        return _describe(e)
    try:
        validate(cfg)
    except (GradrunnerError, OmegaConfBaseException) as e:  # what the app's task function reports
        return " ".join(str(e).split())
    return None


@pytest.mark.slow  # about 0.1-0.3 s per line (Hydra composing) on the loaded 2-core machine
def test_random_command_lines_are_refused_in_one_paragraph_or_accepted() -> None:
    rng = random.Random(19)
    refused = 0
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        for _ in range(80):
            argv = command_line(rng)
            message = in_process(argv)  # anything else raised here would be a traceback on the command line
            if message is not None:
                refused += 1
                assert message and "\n" not in message and "Traceback" not in message, (argv, message)
    assert 30 < refused < 80  # mostly mistakes, some good lines


@pytest.mark.slow
def test_a_few_random_command_lines_through_the_real_cli(tmp_path: Path) -> None:
    rng = random.Random(19)
    lines = [["device=cpu", "steps=1", *command_line(rng)] for _ in range(3)]
    lines += [["device=cpu", "steps=1", "+experiment=mlp", "loss=[1,2]"], ["device=cpu", "steps=1", "+experiment=mlp"]]
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        expected = [in_process(argv) for argv in lines]
    for n, (argv, message) in enumerate(zip(lines, expected, strict=True)):
        result = subprocess.run([sys.executable, "-m", "gradrunner", SEARCHPATH, *argv, f"hydra.run.dir=r{n}"],
                                cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert "Traceback" not in result.stderr, (argv, result.stderr)
        if message is None:
            assert result.returncode == 0, (argv, result.stderr)
            continue
        errors = [x for x in result.stderr.splitlines() if x.startswith("gradrunner: error: ")]
        assert result.returncode == 2 and len(errors) == 1, (argv, result.returncode, result.stderr)
    assert expected[-2] is not None and expected[-1] is None
