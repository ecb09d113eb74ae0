"""`hydra_adapter.config_composed_once`: the app's config composed once, and exactly the config Hydra composes.

Hydra's `_run_hydra` composes the config for `hydra.mode` (`get_mode`) and again to run or sweep. Each
case here composes the way `_run_hydra` and `_run_app` do (`get_mode`, then the run-mode override Hydra
appends, then `compose_config` in the mode it chose) inside `config_composed_once`, and compares the
result, with its flags, to Hydra's own composition of the same inputs; and counts the compositions.
A sweep's jobs: the config the up-front check composed (`keep_job_config`) is the one the launcher's
`load_sweep_config` gets, where Hydra would compose the same one again.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import initialize_config_dir, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradrunner.run import hydra_adapter
from gradrunner.run.hydra_adapter import config_composed_once, keep_job_config, keeps_job_configs
from tests.conftest import gradrunner_in_process


@pytest.fixture
def compositions(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """How many times Hydra composed a config (`_load_configuration_impl`), under "n"."""
    counts: collections.Counter[str] = collections.Counter()
    original = ConfigLoaderImpl._load_configuration_impl

    def counted(self: ConfigLoaderImpl, *args: Any, **kwargs: Any) -> DictConfig:
        counts["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "_load_configuration_impl", counted)
    return counts


@pytest.fixture
def hydra_app() -> Iterator[Hydra]:
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        yield GlobalHydra.instance().hydra  # type: ignore[misc]


def as_run_hydra_does(hydra: Hydra, overrides: list[str], multirun: bool) -> tuple[RunMode, list[str], DictConfig]:
    """The run mode, final overrides and config of `_run_hydra` + `_run_app` (hydra/_internal/utils.py, 1.3)."""
    overrides = list(overrides)
    mode = hydra.get_mode(config_name="config", overrides=overrides)
    if mode is None:
        mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        overrides.append(f"hydra.mode={mode.name}")
    elif multirun and mode == RunMode.RUN:
        mode = RunMode.MULTIRUN
        overrides.append("hydra.mode=MULTIRUN")
    return mode, overrides, hydra.compose_config("config", overrides, run_mode=mode)


def same(got: DictConfig, want: DictConfig) -> None:
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(want)
    assert (OmegaConf.is_struct(got), OmegaConf.is_readonly(got.hydra)) == (
        OmegaConf.is_struct(want),
        OmegaConf.is_readonly(want.hydra),
    )
    assert list(got.hydra.overrides.hydra) == list(want.hydra.overrides.hydra)


CASES = {
    "run": (["+experiment=mlp", "steps=2", "hydra.run.dir=out"], False, RunMode.RUN),
    "sweep": (["+experiment=mlp", "seed=0,1", "capture.strategy=hook,retain_grad"], True, RunMode.MULTIRUN),
    "-m without a sweep": (["+experiment=cnn"], True, RunMode.MULTIRUN),
    "mode set by an override": (["+experiment=mlp", "hydra.mode=MULTIRUN"], False, RunMode.MULTIRUN),
    "RUN set, -m given": (["+experiment=mlp", "hydra.mode=RUN", "seed=3"], True, RunMode.MULTIRUN),
    "a hydra override": (["+experiment=mlp", "hydra.job.chdir=false"], False, RunMode.RUN),
}


@pytest.mark.parametrize("case", CASES)
def test_one_composition_gives_the_config_hydra_composes(
    case: str, hydra_app: Hydra, compositions: collections.Counter[str]
) -> None:
    overrides, multirun, expected_mode = CASES[case]
    with config_composed_once():
        mode, final, got = as_run_hydra_does(hydra_app, overrides, multirun)
    assert (mode, compositions["n"]) == (expected_mode, 1)
    want = hydra_app.compose_config("config", final, run_mode=mode)  # Hydra alone, as it was
    assert compositions["n"] == 2
    same(got, want)


def test_a_sweep_without_m_is_refused_as_hydra_refuses_it(hydra_app: Hydra) -> None:
    overrides = ["+experiment=mlp", "seed=0,1"]
    with pytest.raises(Exception) as without:
        as_run_hydra_does(hydra_app, overrides, multirun=False)
    with config_composed_once(), pytest.raises(Exception) as within:
        as_run_hydra_does(hydra_app, overrides, multirun=False)
    assert (type(within.value), str(within.value)) == (type(without.value), str(without.value))
    assert "Ambiguous value for argument 'seed=0,1'" in str(within.value)


def test_a_missing_config_group_is_refused_as_hydra_refuses_it(
    tmp_path: Path, compositions: collections.Counter[str]
) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.yaml").write_text("width: 3\n")
    (tmp_path / "config.yaml").write_text("defaults:\n  - model: ???\n  - _self_\nsteps: 1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        with pytest.raises(Exception) as without:
            as_run_hydra_does(hydra, ["steps=2"], multirun=False)
        compositions.clear()
        with config_composed_once(), pytest.raises(Exception) as within:
            as_run_hydra_does(hydra, ["steps=2"], multirun=False)
        assert compositions["n"] == 3  # RUN mode refused the missing group: Hydra's get_mode, then its run
        assert (type(within.value), str(within.value)) == (type(without.value), str(without.value))
        assert "You must specify 'model'" in str(within.value)
        compositions.clear()
        with config_composed_once():  # -m: Hydra's MULTIRUN skips the missing group; so does the kept config
            mode, final, got = as_run_hydra_does(hydra, ["steps=2"], multirun=True)
        assert (mode, compositions["n"]) == (RunMode.MULTIRUN, 2)
        same(got, hydra.compose_config("config", final, run_mode=mode))


def test_the_kept_config_serves_only_the_next_composition_of_the_same_inputs(
    hydra_app: Hydra, compositions: collections.Counter[str]
) -> None:
    with config_composed_once():
        hydra_app.get_mode("config", ["+experiment=mlp"])
        other = hydra_app.compose_config("config", ["+experiment=mlp", "seed=5"], run_mode=RunMode.RUN)
        again = hydra_app.compose_config("config", ["+experiment=mlp"], run_mode=RunMode.RUN)
        assert compositions["n"] == 3
        assert other.seed == 5 != again.seed
        first = hydra_app.get_mode("config", ["+experiment=mlp"])
        a = hydra_app.compose_config("config", ["+experiment=mlp", "hydra.mode=RUN"], run_mode=RunMode.RUN)
        b = hydra_app.compose_config("config", ["+experiment=mlp", "hydra.mode=RUN"], run_mode=RunMode.RUN)
    assert first is None and a is not b and compositions["n"] == 5


def test_hydra_is_as_it_was_after_the_block_and_after_an_error() -> None:
    before = (Hydra.get_mode, ConfigLoaderImpl.load_configuration)
    with config_composed_once():
        assert (Hydra.get_mode, ConfigLoaderImpl.load_configuration) != before
    with pytest.raises(RuntimeError), config_composed_once():
        raise RuntimeError("inside")
    assert (Hydra.get_mode, ConfigLoaderImpl.load_configuration) == before


def sweep_of_two(hydra: Hydra) -> tuple[DictConfig, list[list[str]]]:
    master = hydra.compose_config("config", ["+experiment=mlp", "seed=0,1"], run_mode=RunMode.MULTIRUN)
    return master, [["seed=0"], ["seed=1"]]


def test_the_launcher_gets_the_job_config_the_check_kept_where_hydra_would_compose_it_again(
    hydra_app: Hydra, compositions: collections.Counter[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loader = hydra_app.config_loader
    master, jobs = sweep_of_two(hydra_app)
    assert not keeps_job_configs(master, 2)  # outside the block
    keep_job_config(master, jobs[0], loader.load_sweep_config(master, jobs[0]))  # kept by nothing
    compositions.clear()
    with config_composed_once():
        assert keeps_job_configs(master, 2) and keeps_job_configs(master, hydra_adapter.KEPT_JOBS_AT_MOST)
        assert not keeps_job_configs(master, hydra_adapter.KEPT_JOBS_AT_MOST + 1)
        checked = [loader.load_sweep_config(master, job) for job in jobs]  # the check, composing each job
        for job, cfg in zip(jobs, checked, strict=True):
            keep_job_config(master, job, cfg)
        launched = [loader.load_sweep_config(master, job) for job in jobs]  # the launcher
        assert compositions["n"] == 2 and all(a is b for a, b in zip(launched, checked, strict=True))
        again = loader.load_sweep_config(master, jobs[0])  # served once
        assert compositions["n"] == 3 and again is not checked[0]
        for job, cfg in zip(jobs, checked, strict=True):
            keep_job_config(master, job, cfg)
        other_master, _ = sweep_of_two(hydra_app)
        assert loader.load_sweep_config(other_master, jobs[0]) is not checked[0]  # another sweep's config
        here = Path.cwd()
        monkeypatch.chdir(tmp_path)  # Hydra records the cwd as it composes: composed anew
        moved = loader.load_sweep_config(master, jobs[1])
        assert moved is not checked[1] and moved.hydra.runtime.cwd == str(tmp_path)
        monkeypatch.chdir(here)
    for job, cfg in zip(jobs, launched, strict=True):  # Hydra alone composes what was served
        same(cfg, loader.load_sweep_config(master, job))


def test_a_job_config_is_composed_anew_when_a_copied_variable_changed(
    hydra_app: Hydra, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = hydra_app.config_loader
    monkeypatch.setenv("GRADRUNNER_TEST_COPIED", "before")
    master = hydra_app.compose_config(
        "config", ["+experiment=mlp", "seed=0,1", "hydra.job.env_copy=[GRADRUNNER_TEST_COPIED]"], RunMode.MULTIRUN
    )
    with config_composed_once():
        checked = loader.load_sweep_config(master, ["seed=0"])
        keep_job_config(master, ["seed=0"], checked)
        monkeypatch.setenv("GRADRUNNER_TEST_COPIED", "after")
        launched = loader.load_sweep_config(master, ["seed=0"])
    assert launched is not checked and launched.hydra.job.env_set.GRADRUNNER_TEST_COPIED == "after"


def test_a_joblib_sweep_keeps_no_job_config(hydra_app: Hydra) -> None:
    master = hydra_app.compose_config(
        "config", ["+experiment=mlp", "seed=0,1", "hydra/launcher=joblib"], RunMode.MULTIRUN
    )
    with config_composed_once():
        assert not keeps_job_configs(master, 2)  # its jobs compose in worker processes


@pytest.mark.parametrize(
    ("args", "before", "now"),
    [(["+experiment=mlp", "steps=1"], 2, 1), (["-m", "+experiment=mlp", "steps=1", "seed=0,1"], 6, 3)],
    ids=["run", "sweep of 2"],
)
def test_the_app_composes_fewer_times(
    tmp_path: Path, compositions: collections.Counter[str], args: list[str], before: int, now: int
) -> None:
    """`before`: Hydra's count (get_mode, run or multirun; a sweep's up-front check and its launcher, a job each)."""
    result = gradrunner_in_process(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert compositions["n"] == now < before


def test_the_docs_give_the_number_of_jobs_whose_configs_are_kept() -> None:
    text = " ".join((Path(__file__).parents[1] / "docs" / "scale-out.md").read_text().split())
    assert f"in sweeps of up to {hydra_adapter.KEPT_JOBS_AT_MOST} jobs" in text
