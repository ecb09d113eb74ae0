"""Random, seeded command lines: no traceback, no hang; every mistake is one paragraph with exit 2.

Most lines are checked in-process, the way `cli.app.main` handles them (the command-line checks, Hydra
composing, `validate`), since a subprocess costs seconds on a loaded machine; a handful go through the
whole CLI (`python -m gradrunner`, inside the test's process: `conftest.python_m`), which must agree.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from conftest import SEARCHPATH, gradrunner_in_process
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from gradrunner.config.overrides import group_mistake, misspelled_key
from gradrunner.config.schema import validate
from gradrunner.errors import GradrunnerError
from gradrunner.run.hydra_adapter import _describe, yaml_parsed_once

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

    Call it inside `initialize_config_module(config_module="gradrunner.conf", version_base="1.3")` (and
    `yaml_parsed_once()`, as the app composes: each config file's YAML parsed once per process).
    """
    return checked(argv)[0]


def checked(argv: list[str]) -> tuple[str | None, DictConfig | None]:
    """`in_process`'s message, and the composed and validated config when there is none (what the app's job runs)."""
    message = misspelled_key(argv) or group_mistake(argv)
    if message is not None:
        return message, None
    try:
        cfg = compose("config", overrides=[SEARCHPATH, *argv])
    except (HydraException, OmegaConfBaseException) as e:  # what run/hydra_adapter.py turns into one paragraph
        return _describe(e), None
    try:
        validate(cfg)
    except (GradrunnerError, OmegaConfBaseException) as e:  # what the app's task function reports
        return " ".join(str(e).split()), None
    return None, cfg


@pytest.mark.slow  # about 0.1-0.3 s per line (Hydra composing) on the loaded 2-core machine
def test_random_command_lines_are_refused_in_one_paragraph_or_accepted() -> None:
    rng = random.Random(19)
    refused = 0
    with yaml_parsed_once(), initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
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
    with yaml_parsed_once(), initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        expected = [in_process(argv) for argv in lines]
    for n, (argv, message) in enumerate(zip(lines, expected, strict=True)):
        result = gradrunner_in_process(tmp_path, SEARCHPATH, *argv, f"hydra.run.dir=r{n}")
        assert "Traceback" not in result.stderr, (argv, result.stderr)
        if message is None:
            assert result.returncode == 0, (argv, result.stderr)
            continue
        errors = [x for x in result.stderr.splitlines() if x.startswith("gradrunner: error: ")]
        assert result.returncode == 2 and len(errors) == 1, (argv, result.returncode, result.stderr)
    assert expected[-2] is not None and expected[-1] is None


# --- the new keys (issue 38 items 13-15): every line refused before step 0, or run with sane values ----------

#: Values per key: the plausible, the bad and the absurd. Any key may also draw from `ANY`.
NEW_KEYS: dict[str, list[str]] = {
    "scheduler": ["none", "cosine", "onecycle", "linear_warmup", "warmup_cosine", "null", "bogus", "3"],
    "scheduler.max_lr": ["0.05", "1e-3", "0", "-1", "[0.1,0.2]"],
    "scheduler.total_steps": ["${steps}", "1", "2", "100", "0", "-3"],
    "scheduler.T_max": ["${steps}", "1", "0", "-1", "2.5"],
    "scheduler.eta_min": ["0.0", "1e-4", "-0.5"],
    "scheduler.pct_start": ["0.3", "0", "1", "1.5", "-0.1"],
    "scheduler.start_factor": ["0.01", "1.0", "0", "2", "-1"],
    "scheduler.total_iters": ["2", "10", "0", "-2"],
    "scheduler.lr_lambda.warmup_steps": ["0", "2", "-3"],
    "scheduler.lr_lambda.min_ratio": ["0.1", "0", "1.5", "-1"],
    "+scheduler._target_": ["torch.optim.lr_scheduler.ReduceLROnPlateau", "torch.optim.lr_scheduler.StepLR",
                            "torch.optim.lr_scheduler.CosineAnnealingLR"],
    "+scheduler._partial_": ["true"],
    "+scheduler.step_size": ["1", "0", "-1"],
    "train.clip_grad_norm": ["1.0", "0", "-1", "null"],
    "train.clip_grad_value": ["0.5", "0", "-2", "null"],
    "train.autocast": ["off", "bf16", "fp16", "fp8"],
    "train.accumulate": ["1", "2", "3", "0", "-1"],
    "train.checkpoint_every": ["0", "1", "2", "-1"],
    "train.eval_every": ["0", "1", "2", "-1"],
    "train.eval_batches": ["1", "2", "0", "-1"],
    "+eval_data._target_": ["gradrunner.data.Synthetic", "gradrunner.data.Nope"],
    "+eval_data.input_shape": ["[8]", "[5]", "[2,4]"],
    "steps": ["1", "2", "3", "0", "-1"],
    "+model.init_from": ["INIT:good", "INIT:ints", "INIT:numbers", "INIT:garbage", "INIT:missing"],
}
ANY = ["null", "abc", "nan", "inf", "-1", "0", str(2**31), str(2**63 - 1), "true", "[]", "{a:1}"]


def init_files(where: Path) -> dict[str, str]:
    """`model.init_from` files: the mlp's own weights, integer tensors, plain numbers, garbage, none."""
    import torch

    from gradrunner.models import MLP

    state = MLP(depth=3).state_dict()
    files = {"good": state, "ints": {k: v.long() for k, v in state.items()}, "numbers": {k: 3 for k in state}}
    for name, content in files.items():
        torch.save(content, where / f"{name}.pt")
    (where / "garbage.pt").write_bytes(b"\x00not a pickle" * 10)
    return {name: str(where / f"{name}.pt") for name in [*files, "garbage", "missing"]}


#: The option a key belongs to, put before it on most lines (a key of another option is a mistake too).
OPTION_OF = {"scheduler.max_lr": ["scheduler=onecycle"], "scheduler.total_steps": ["scheduler=onecycle"],
             "scheduler.pct_start": ["scheduler=onecycle"], "scheduler.T_max": ["scheduler=cosine"],
             "scheduler.eta_min": ["scheduler=cosine"], "scheduler.start_factor": ["scheduler=linear_warmup"],
             "scheduler.total_iters": ["scheduler=linear_warmup"],
             "scheduler.lr_lambda.warmup_steps": ["scheduler=warmup_cosine"],
             "scheduler.lr_lambda.min_ratio": ["scheduler=warmup_cosine"],
             "+scheduler._target_": ["+scheduler._partial_=true"],
             "+eval_data._target_": ["train.eval_every=1"],
             "+eval_data.input_shape": ["+eval_data._target_=gradrunner.data.Synthetic", "train.eval_every=2"]}  # fmt: skip


def new_key_line(rng: random.Random, files: dict[str, str]) -> list[str]:
    line = ["+experiment=mlp", "device=cpu", "steps=3"]
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(list(NEW_KEYS))
        value = rng.choice(NEW_KEYS[key] if rng.random() < 0.8 else ANY)
        before = OPTION_OF.get(key, []) if rng.random() < 0.85 else []
        line += [b for b in before if b not in line] + [f"{key}={files[value[5:]] if value.startswith('INIT:') else value}"]
    return line


class Hang(Exception):
    pass


def run_in_process(argv: list[str], cfg: DictConfig, out: Path) -> str | None:
    """The line's job run as the app runs it (on the config the app composed and validated, `checked`), in this
    process: its one-paragraph refusal, or None when it ran."""
    import signal

    from gradrunner.run.job import run

    def hung(*_: object) -> None:
        raise Hang(f"{argv} still running after 300 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)  # a hang detector, far above the second or so a line takes
    try:
        run(cfg, out_dir=out)
    except (GradrunnerError, OmegaConfBaseException) as e:
        return " ".join(str(e).split())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return None


@pytest.mark.slow  # about 0.3-1 s per line (composing, and running the accepted ones for up to 3 steps)
@pytest.mark.parametrize("seed", [38])
def test_random_lines_over_the_new_keys_are_refused_before_step_0_or_run_sanely(tmp_path: Path, seed: int) -> None:
    """A seeded fuzz over the scheduler, train.*, eval_data and init_from keys: 0 tracebacks, 0 hangs. A refused
    line wrote no records; an accepted one ran every step with finite, non-negative learning rates."""
    import pandas as pd

    from gradrunner.records.columns import RECORD_FILES

    rng = random.Random(seed)
    files = init_files(tmp_path)
    outcomes = {"refused": 0, "ran": 0}
    with yaml_parsed_once(), initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        for n in range(120):
            argv = new_key_line(rng, files)
            out = tmp_path / f"r{n}"
            message, cfg = checked(argv)
            if cfg is not None:  # anything raised here but a refusal is a traceback on the command line
                message = run_in_process(argv, cfg, out)
            if message is not None:
                outcomes["refused"] += 1
                assert message and "Traceback" not in message, (argv, message)
                written = [p.name for p in out.glob("*")] if out.is_dir() else []
                assert not [w for w in written if w.endswith((".parquet", ".tmp", ".json"))], (argv, message, written)
                continue
            outcomes["ran"] += 1
            steps = pd.read_parquet(out / RECORD_FILES[1])
            expected = int(next(a.split("=")[1] for a in reversed(argv) if a.startswith("steps=")))
            assert list(steps.step) == list(range(expected)), argv
            assert ((steps.lr >= 0) & steps.lr.map(math.isfinite)).all(), (argv, steps.lr.tolist())
    assert outcomes["refused"] > 40 and outcomes["ran"] > 15, outcomes  # both kinds of line were drawn


@pytest.mark.slow
@pytest.mark.parametrize("line", [["scheduler=onecycle", "scheduler.max_lr=-1"],
                                  ["scheduler=onecycle", "scheduler.total_steps=2"],
                                  [f"train.accumulate={2**63 - 1}"]])  # fmt: skip
def test_new_key_refusals_through_the_real_cli(tmp_path: Path, line: list[str]) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "device=cpu", "steps=3", *line, "hydra.run.dir=r")
    errors = [x for x in result.stderr.splitlines() if x.startswith("gradrunner: error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert line[-1].split("=")[0] in errors[0]
    assert not [p.name for p in (tmp_path / "r").glob("*.parquet")]
