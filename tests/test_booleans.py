"""Booleans of the built nodes: anything but true or false is refused before the node is built.

The constructors take what they are given and a string is true whatever it says (`data.shuffle=flase`
shuffled, `data.nan=no` planted NaN), so `run.build.check_booleans`, called by `build` for every group,
checks each parameter a `_target_` annotates `bool`, at any depth. These tests find every such parameter
of every built-in option (models, data, losses, optimizers, schedulers) and give it a typo; the runner's
cases (exit status, records left) are rows of `tests/test_errors.py`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

import gradrunner
from gradrunner.errors import GradrunnerError
from gradrunner.run.build import build

CONF = Path(gradrunner.__file__).parent / "conf"
GROUPS = ("model", "data", "loss", "optimizer", "scheduler")


def booleans(node: Any, path: str) -> list[tuple[str, dict[str, Any], str]]:
    """(path of the node, the node, parameter) for every parameter a `_target_` in `node` annotates `bool`."""
    if isinstance(node, list):
        return [b for i, item in enumerate(node) for b in booleans(item, f"{path}[{i}]")]
    if not isinstance(node, dict):
        return []
    found = [b for k, v in node.items() for b in booleans(v, f"{path}.{k}")]
    target = node.get("_target_")
    if isinstance(target, str):
        params = inspect.signature(get_object(target)).parameters.items()
        found += [(path, node, name) for name, p in params if p.annotation in (bool, "bool")]
    return found


def options() -> list[tuple[str, str]]:
    found = []
    for group in GROUPS:
        for option in sorted((CONF / group).glob("*.yaml")):
            if group == "model" and option.stem.startswith("gpt2"):
                pytest.importorskip("transformers")
            found.append((group, option.stem))
    return found


def composed(group: str, option: str) -> dict[str, Any]:
    root = OmegaConf.create({"seed": 0, "steps": 10, group: OmegaConf.load(CONF / group / f"{option}.yaml")})
    node = OmegaConf.to_container(root[group], resolve=True)
    assert isinstance(node, dict)
    return node


ALL = [(g, o, path, name) for g, o in options() for path, _, name in booleans(composed(g, o), g)]


def test_the_built_in_options_booleans_are_all_found() -> None:
    """The ones the issue named and the models', so that the list below is not empty by mistake."""
    found = {(o, f"{path}.{name}") for _, o, path, name in ALL}
    assert {("digits", "data.shuffle"), ("synthetic", "data.shuffle"), ("tokens", "data.labels_in_inputs"),
            ("corrupted", "data.nan"), ("corrupted", "data.inner.shuffle"), ("lm_cross_entropy", "loss.shift"),
            ("mlp", "model.inplace"), ("transformer", "model.reuse_act"), ("sgd", "optimizer.nesterov")} <= found  # fmt: skip


@pytest.mark.parametrize(("group", "option", "path", "name"), ALL, ids=[f"{o}:{p}.{n}" for _, o, p, n in ALL])
@pytest.mark.parametrize("value", ["flase", "no", 1])
def test_a_value_that_is_not_true_or_false_is_refused_naming_it(
    group: str, option: str, path: str, name: str, value: object
) -> None:
    node = composed(group, option)
    [(_, where, _)] = [b for b in booleans(node, group) if b[0] == path and b[2] == name]
    where[name] = value
    with pytest.raises(GradrunnerError) as info:
        build(OmegaConf.create({group: node}), group)
    message = str(info.value)
    assert message.startswith(f"{path}.{name}={value!r} is not allowed; allowed: false, true.")
    assert f"e.g. {path}.{name}=false" in message and "\n" not in message


@pytest.mark.parametrize("value", [True, False])
def test_true_and_false_are_taken(value: bool) -> None:
    node = {"_target_": "gradrunner.data.Synthetic", "shuffle": value, "num_samples": 8, "batch_size": 4}
    assert build(OmegaConf.create({"data": node}), "data").shuffle is value


def test_a_data_source_given_shuffle_false_serves_its_examples_in_order() -> None:
    source = build(OmegaConf.create({"data": {"_target_": "gradrunner.data.Digits", "shuffle": False}}), "data")
    x, _ = next(source.batches(torch.device("cpu"), torch.float64))
    assert torch.equal(x, source.inputs[: source.batch_size])
