"""gradrunner.config.schema and gradrunner/conf: the schema, the shipped config tree, `validate`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import compose_cfg
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.config.schema import DTYPES, CaptureConfig, Config, validate
from gradrunner.errors import GradrunnerError

CONF = Path(__file__).resolve().parents[1] / "gradrunner" / "conf"
EXPERIMENTS = ["mlp", "cnn", "transformer", "cosine", "sigmoid2"]
GROUP_OPTIONS = {
    "model": {"mlp", "cnn", "transformer", "cosine", "sigmoid2", "gpt2"},
    "data": {"synthetic", "tensors", "digits", "tokens", "corrupted"},
    "loss": {"mse", "cross_entropy", "half_sse", "model_loss", "lm_cross_entropy"},
    "optimizer": {"sgd", "adam", "adamw"},
    "capture": {"default"},
    "scheduler": {"none", "cosine", "onecycle", "linear_warmup", "warmup_cosine"},
    "experiment": {*EXPERIMENTS, "gpt2", "gpt2_pretrain", "spike_data", "spike_attention"},
    "anomaly": {"default"},
}


def test_defaults_compose_with_the_contract_defaults() -> None:
    cfg = compose_cfg()
    assert cfg.device == "auto" and cfg.dtype == "float32" and cfg.experiment == "default"
    assert cfg.capture.strategy == "hook" and cfg.capture["values"] == "none"
    assert cfg.capture.every == 1 and cfg.capture.sample_size == 64
    assert cfg.optimizer._partial_ is True
    validate(cfg)


@pytest.mark.parametrize("group, options", sorted(GROUP_OPTIONS.items()))
def test_every_group_ships_its_options(group: str, options: set[str]) -> None:
    assert {p.stem for p in (CONF / group).glob("*.yaml")} == options


def test_primary_defaults_list_schema_then_self_then_groups_and_no_experiment() -> None:
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    assert list(defaults[:2]) == ["gradrunner_schema", "_self_"]
    assert [next(iter(d)) for d in defaults[2:]] == ["model", "data", "loss", "optimizer", "capture", "scheduler",
                                                     "anomaly", "override hydra/sweeper"]  # fmt: skip
    assert defaults[-1]["override hydra/sweeper"] == "gradrunner"


def test_the_sweeper_is_gradrunners_basic_sweeper_and_basic_restores_hydras() -> None:
    assert compose_cfg(hydra=True).hydra.sweeper._target_.endswith(".GradrunnerSweeper")
    basic = compose_cfg("hydra/sweeper=basic", hydra=True).hydra.sweeper._target_
    assert basic == "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def test_hydra_dirs_are_relative_to_the_cwd_with_one_dir_per_sweep_job() -> None:
    h = compose_cfg(hydra=True).hydra
    assert h.run.dir.startswith("outputs/") and h.sweep.dir.startswith("multirun/")
    assert "subdir: ${hydra.job.num}" in OmegaConf.to_yaml(h.sweep)
    assert h.job.chdir is False


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_files_are_global_packages(name: str) -> None:
    assert (CONF / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_composes_names_itself_and_validates(name: str) -> None:
    cfg = compose_cfg(f"+experiment={name}")
    assert cfg.experiment == name
    assert len(cfg.taps) > 0
    validate(cfg)


def test_experiment_values_beat_the_primary_config_and_overrides_beat_both() -> None:
    assert compose_cfg("+experiment=sigmoid2").steps == 5
    assert compose_cfg("+experiment=sigmoid2", "steps=1").steps == 1


def test_sigmoid2_experiment_is_the_issue_network() -> None:
    cfg = compose_cfg("+experiment=sigmoid2")
    assert OmegaConf.to_container(cfg.model.w1) == [[1.0], [2.0]]
    assert OmegaConf.to_container(cfg.model.w2) == [[3.0, 4.0], [5.0, 6.0]]
    assert OmegaConf.to_container(cfg.data.inputs) == [[1.0]]
    assert OmegaConf.to_container(cfg.data.targets) == [[1.0], [0.0]]
    assert cfg.loss._target_ == "gradrunner.losses.HalfSumSquaredError"
    assert cfg.optimizer._target_ == "torch.optim.SGD"
    assert list(cfg.taps) == [":z_1", ":y_1", ":z_2", ":y_2", ":w1", ":w2"]


@pytest.mark.parametrize("override", ["stepz=3", "capture.stratgy=hook", "capture.every=often"])
def test_schema_rejects_misspelled_keys_and_bad_types_at_compose(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


def test_schema_rejects_a_misspelled_key_in_a_config_file() -> None:
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(OmegaConf.structured(Config), {"capture": {"strategyy": "hook"}})
    with pytest.raises(ValidationError):
        OmegaConf.merge(OmegaConf.structured(CaptureConfig), {"every": "x"})


@pytest.mark.parametrize("override, key", [("+capture.stratgy=hook", "capture.stratgy"), ("+foo=1", "foo")])
def test_keys_forced_past_the_schema_are_refused_by_validate(override: str, key: str) -> None:
    cfg = compose_cfg(override)
    with pytest.raises(GradrunnerError, match=rf"unknown config key {key}\b.*Allowed keys"):
        validate(cfg)


@pytest.mark.parametrize(
    "override, named, allowed",
    [
        ("capture.strategy=hooks", "capture.strategy='hooks'", ", ".join(STRATEGIES)),
        ("capture.values=all", "capture.values='all'", "none, full, sample"),
        ("device=tpu", "device='tpu'", "auto, cpu, cuda, cuda:N, mps"),
        ("device=cuda:x", "device='cuda:x'", "auto, cpu, cuda, cuda:N, mps"),
        ("dtype=int8", "dtype='int8'", ", ".join(DTYPES)),
        ("steps=-1", "steps=-1", "integer >= 0"),
        ("capture.every=0", "capture.every=0", "integer >= 1"),
        ("capture.sample_size=0", "capture.sample_size=0", "integer >= 1"),
        ("seed=-3", "seed=-3", "integer >= 0"),
    ],
)
def test_validate_names_the_bad_value_and_what_is_allowed(override: str, named: str, allowed: str) -> None:
    with pytest.raises(GradrunnerError) as info:
        validate(compose_cfg(override))
    message = str(info.value)
    assert named in message and allowed in message
    assert "\n" not in message


def test_validate_suggests_the_closest_strategy() -> None:
    with pytest.raises(GradrunnerError, match="Did you mean 'hook'"):
        validate(compose_cfg("capture.strategy=hooks"))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_device_grammar_accepts_every_documented_form(device: str) -> None:
    validate(compose_cfg(f"device={device}"))  # availability is checked later, by the runner


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_validates(dtype: str) -> None:
    validate(compose_cfg(f"dtype={dtype}"))


def test_validate_needs_a_target_in_every_group() -> None:
    cfg = compose_cfg()
    cfg.model = {"hidden": 3}
    with pytest.raises(GradrunnerError, match="model has no _target_"):
        validate(cfg)


def test_validate_accepts_the_hydra_node() -> None:
    validate(compose_cfg(hydra=True))


def test_taps_accept_strings_and_mappings_from_the_command_line() -> None:
    cfg = compose_cfg("taps=[fc1:output,{module: head, name: weight}]")
    assert OmegaConf.to_container(cfg.taps) == ["fc1:output", {"module": "head", "name": "weight"}]


def test_a_misnamed_optimizer_key_names_the_accepted_ones_not_partial() -> None:
    from gradrunner.run.build import setup

    with pytest.raises(GradrunnerError) as caught:
        setup(compose_cfg("+experiment=mlp", "+optimizer.learning_rate=0.1"))
    message = str(caught.value)
    assert "torch.optim.SGD has no 'learning_rate', it accepts: lr, momentum, dampening" in message
    assert "_partial_" not in message


def test_a_tuple_output_tap_suggests_its_elements(tmp_path: Path) -> None:
    from gradrunner.run.loop import train

    with pytest.raises(GradrunnerError, match=r"tap 'attn:output' cannot carry a gradient: its value is a tuple, "
                       r"not a tensor\. Tap one of its elements instead: attn:output\.0, attn:output\.1\."):  # fmt: skip
        train(compose_cfg("+experiment=transformer", "taps=[attn:output]", "steps=1"), out_dir=tmp_path)


README = Path(__file__).resolve().parents[1] / "README.md"
#: The config groups the README's config table lists as one row each (its default is the group's option).
TABLE_GROUPS = ("model", "data", "loss", "optimizer", "scheduler")


def _config_table() -> dict[str, tuple[str, str]]:
    """README's "The config" table: each key of a row -> (its default as written, the row's meaning)."""
    lines = README.read_text().split("\n## The config\n", 1)[1].splitlines()
    start = lines.index("| key | default | meaning |") + 2
    rows = itertools.takewhile(lambda line: line.startswith("| "), lines[start:])
    table: dict[str, tuple[str, str]] = {}
    for row in rows:
        keys, defaults, meaning = (cell.strip() for cell in row.strip("|").split(" | ", 2))
        names = [k.strip().strip("`") for k in keys.split(",")]
        values = [d.strip().strip("`") for d in defaults.split(", ")] if len(names) > 1 else [defaults.strip("`")]
        assert len(values) == len(names), row
        table.update({n: (v, meaning) for n, v in zip(names, values, strict=True)})
    return table


def _leaf_keys(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, dict) or prefix.rstrip(".") in TABLE_GROUPS:
        return [prefix.rstrip(".")]
    return [k for key, value in node.items() for k in _leaf_keys(value, f"{prefix}{key}.")]


def test_the_readme_config_table_lists_every_key_with_its_default_and_every_group_option() -> None:
    """Every key of the composed default config (the schema's and config.yaml's) is a row of README's config
    table, with the default it composes to; each group row names every option the group ships."""
    cfg = compose_cfg(hydra=True)
    choices = cfg.hydra.runtime.choices
    config = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(config, dict)
    del config["hydra"]
    table = _config_table()
    keys = _leaf_keys(config)
    assert sorted(set(keys) - set(table)) == []
    for key in keys:
        written, meaning = table[key]
        if key in TABLE_GROUPS:
            assert written == choices[key], key
            for option in GROUP_OPTIONS[key]:
                assert f"`{option}`" in meaning, (key, option)
            continue
        value = _plain(OmegaConf.select(cfg, key))
        if isinstance(value, str):  # as written: YAML would read `off` as false
            assert written == value, key
        else:  # numbers, null, booleans, lists, {}: as YAML reads them
            assert _plain(OmegaConf.create(f"v: {written}").v) == value, (key, written, value)


def _plain(value: object) -> object:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_the_readme_experiments_table_names_every_experiment_the_package_ships() -> None:
    """README's experiments table ("Experiments (`+experiment=NAME`, ...)") left out spike_data and spike_attention,
    two of the nine options the experiment group ships: it now has a row for each, and no row for one it lacks."""
    text = README.read_text()
    lines = text.split("Experiments (`+experiment=NAME`", 1)[1].splitlines()
    start = lines.index("| name | model, data, loss | taps |") + 2
    rows = itertools.takewhile(lambda line: line.startswith("| "), lines[start:])
    names = {row.strip("|").split(" | ", 1)[0].strip().strip("`") for row in rows}
    assert names == GROUP_OPTIONS["experiment"]
