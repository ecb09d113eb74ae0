"""`hydra_adapter.yaml_parsed_once`: each config file's text parsed once per process, the configs unchanged.

Every composition inside the block is compared, with its flags, to Hydra's own composition of the same
inputs outside it; YAML parses are counted by wrapping `yaml.load`.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from gradrunner.run import hydra_adapter
from gradrunner.run.hydra_adapter import config_composed_once, yaml_parsed_once


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How many YAML texts were parsed (`yaml.load`), under "n"; the cache starts empty and is emptied after."""
    counts: collections.Counter[str] = collections.Counter()
    original = yaml.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(yaml, "load", counted)
    monkeypatch.setattr(hydra_adapter, "_PARSED", {})
    return counts


def composed(*overrides: str, config_dir: Path | None = None) -> DictConfig:
    init = (initialize_config_dir(config_dir=str(config_dir), version_base="1.3") if config_dir is not None
            else initialize_config_module(config_module="gradrunner.conf", version_base="1.3"))  # fmt: skip
    with init:
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def same(a: DictConfig, b: DictConfig) -> None:
    assert OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b)
    assert OmegaConf.is_struct(a) == OmegaConf.is_struct(b)
    assert OmegaConf.is_readonly(a) == OmegaConf.is_readonly(b)


@pytest.mark.parametrize("overrides", [["+experiment=mlp"], ["+experiment=gpt2", "capture.strategy=hook"], []])
def test_configs_are_hydras_own_and_the_second_composition_parses_nothing(
    parses: collections.Counter[str], overrides: list[str]
) -> None:
    reference = composed(*overrides)
    parsed_without = parses["n"]
    assert parsed_without >= 10  # Hydra parses every file of the defaults list at each composition
    parses.clear()
    with yaml_parsed_once():
        first = composed(*overrides)
        parsed_first = parses["n"]
        second = composed(*overrides)
    same(first, reference)
    same(second, reference)
    assert parsed_first == parsed_without
    assert parses["n"] == parsed_first  # the second composition parsed no YAML
    # hydra.runtime / job fields are filled by Hydra at each composition, not taken from the first
    assert second.hydra.runtime.cwd == reference.hydra.runtime.cwd


def test_a_config_changed_in_the_returned_copy_does_not_reach_the_next_composition(
    parses: collections.Counter[str],
) -> None:
    with yaml_parsed_once():
        first = composed("+experiment=mlp")
        OmegaConf.set_readonly(first, False)
        OmegaConf.set_struct(first, False)
        first.model.hidden = -7
        first.new_key = 1
        second = composed("+experiment=mlp")
    assert second.model.hidden != -7
    assert "new_key" not in second
    same(second, composed("+experiment=mlp"))


def _config_dir(tmp_path: Path, body: str) -> Path:
    (tmp_path / "config.yaml").write_text(body)
    return tmp_path


def test_an_edited_file_is_parsed_anew(parses: collections.Counter[str], tmp_path: Path) -> None:
    config_dir = _config_dir(tmp_path, "lr: 0.1\nname: a\n")
    with yaml_parsed_once():
        assert composed(config_dir=config_dir).lr == 0.1
        first = parses["n"]  # this file and Hydra's own
        (tmp_path / "config.yaml").write_text("lr: 0.2\nname: a\n")  # same length, same second
        assert composed(config_dir=config_dir).lr == 0.2
        assert parses["n"] == first + 1  # only the edited file
        assert composed(config_dir=config_dir).lr == 0.2
    assert parses["n"] == first + 1


def test_a_yaml_error_names_the_file_as_without_the_block(parses: collections.Counter[str], tmp_path: Path) -> None:
    config_dir = _config_dir(tmp_path, "lr: [0.1\nname: a\n")
    with pytest.raises(Exception) as without:
        composed(config_dir=config_dir)
    with yaml_parsed_once(), pytest.raises(Exception) as within:
        composed(config_dir=config_dir)
    assert type(within.value) is type(without.value)
    assert str(within.value) == str(without.value)
    assert "config.yaml" in str(within.value.__cause__ or within.value) or "config.yaml" in str(within.value)


def test_empty_and_scalar_files_load_as_omegaconf_loads_them(parses: collections.Counter[str], tmp_path: Path) -> None:
    for body in ["", "# only a comment\n", "- 1\n- 2\n"]:
        path = tmp_path / "f.yaml"
        path.write_text(body)
        with path.open() as f:
            expected = OmegaConf.load(f)
        with yaml_parsed_once():
            for _ in range(2):
                with path.open() as f:
                    got = OmegaConf.load(f)
                assert type(got) is type(expected) and OmegaConf.to_container(got) == OmegaConf.to_container(expected)


def test_a_path_passes_through_and_is_not_kept(parses: collections.Counter[str], tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("a: 1\n")
    with yaml_parsed_once():
        assert OmegaConf.load(path).a == 1
        assert OmegaConf.load(str(path)).a == 1
    assert hydra_adapter._PARSED == {}
    assert parses["n"] == 2


def test_load_is_restored_after_the_block_nested_and_on_an_error() -> None:
    original = OmegaConf.__dict__["load"]
    with yaml_parsed_once():
        inner = OmegaConf.__dict__["load"]
        assert inner is not original
        with yaml_parsed_once():
            assert OmegaConf.__dict__["load"] is inner  # re-entrant: one patch
        assert OmegaConf.__dict__["load"] is inner
    assert OmegaConf.__dict__["load"] is original
    with pytest.raises(RuntimeError), yaml_parsed_once():
        raise RuntimeError("boom")
    assert OmegaConf.__dict__["load"] is original
    with config_composed_once():  # the app's block opens it too
        assert OmegaConf.__dict__["load"] is not original
    assert OmegaConf.__dict__["load"] is original


def test_the_kept_texts_are_bounded(
    parses: collections.Counter[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(hydra_adapter, "PARSED_AT_MOST", 2)
    monkeypatch.setattr(hydra_adapter, "PARSED_TEXT_AT_MOST", 10)
    texts = ["a: 1\n", "b: 2\n", "c: 3\n", "long: 123456789\n"]
    with yaml_parsed_once():
        for text in texts:
            path = tmp_path / "f.yaml"
            path.write_text(text)
            with path.open() as f:
                assert OmegaConf.to_container(OmegaConf.load(f)) == yaml.safe_load(text)
    assert list(hydra_adapter._PARSED) == ["b: 2\n", "c: 3\n"]  # the oldest let go; the long one not kept

