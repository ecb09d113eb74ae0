"""gradrunner.run.loop: helpers and `train(cfg)` on composed configs, no Hydra app involved."""

from __future__ import annotations

import io
import itertools
import logging
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import INTERRUPT_AT_STEP_3, compose_cfg
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from gradrunner.errors import GradrunnerError
from gradrunner.losses import HalfSumSquaredError
from gradrunner.run.build import build, resolve_device, resolve_dtype, seed_everything
from gradrunner.run.loop import Progress, train

CONTRACT_COLUMNS = [
    "run_id", "experiment", "strategy", "device", "dtype", "step", "tap", "module", "name", "call",
    "shape", "numel", "norm", "mean", "std", "min", "max", "abs_max", "zero_frac",
    "nan_count", "inf_count", "values", "loss",
]  # fmt: skip


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# -- helpers ------------------------------------------------------------------------------------


def test_seed_everything_seeds_torch_numpy_and_random() -> None:
    seed_everything(7)
    first = (torch.rand(1).item(), np.random.rand(), random.random())
    seed_everything(7)
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == first


def test_resolve_device_auto_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:3", "mps"])
def test_an_unavailable_device_is_an_error_listing_what_is_available(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(GradrunnerError, match=rf"device='{spec}' is not available.*available: cpu"):
        resolve_device(spec)


def test_resolve_dtype() -> None:
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(GradrunnerError, match="dtype='int8'.*float32"):
        resolve_dtype("int8")


def test_build_names_group_and_target_when_instantiate_fails() -> None:
    cfg = compose_cfg("model.hidden=3")
    with open_dict(cfg):
        cfg.model.hiden = 3
    with pytest.raises(GradrunnerError, match=r"could not build model from _target_='gradrunner.models.MLP'.*hiden"):
        build(cfg, "model")


def test_build_explains_an_unimportable_target() -> None:
    cfg = compose_cfg("loss._target_=nowhere.Loss")
    with pytest.raises(GradrunnerError, match=r"could not build loss.*No module named 'nowhere'.*built-in: "):
        build(cfg, "loss")


def test_build_passes_a_gradrunner_error_of_the_target_through() -> None:
    cfg = compose_cfg("data.task=ranking")
    with pytest.raises(GradrunnerError, match=r"^data.task='ranking' is not allowed"):
        build(cfg, "data")


def test_build_gives_plain_containers_to_targets() -> None:
    model = build(compose_cfg("+experiment=sigmoid2"), "model")
    assert model.w1.tolist() == [[1.0], [2.0]]


def test_half_sum_squared_error() -> None:
    out, target = torch.tensor([[0.8], [0.3]]), torch.tensor([[1.0], [0.0]])
    assert HalfSumSquaredError()(out, target).item() == pytest.approx(0.5 * (0.04 + 0.09))


def test_progress_logs_about_every_tenth_step_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    bar = Progress(total=50, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="gradrunner.run.loop"):
        for step in range(50):
            bar.update(step, loss=1.0)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 and lines[0].startswith("step 4 (5/50, 10%)")  # steps from 0, as in the records
    assert lines[-1].startswith("step 49 (50/50, 100%)") and bar.stream.getvalue() == ""


def test_progress_draws_a_tqdm_bar_on_a_terminal_without_stale_characters_and_still_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = Progress(total=3, stream=stream, min_interval=0)  # draw on every update
    with caplog.at_level(logging.INFO, logger="gradrunner.run.loop"):
        for step, loss in enumerate([123456.789, 0.25, 1.0]):
            bar.update(step, loss=loss)
        bar.close()
    assert [r.getMessage() for r in caplog.records][-1] == "step 2 (3/3, 100%)  loss 1"  # the log file gets it
    drawn = [d for d in stream.getvalue().split("\r") if d.strip()]
    assert "3/3" in drawn[-1] and drawn[-1].rstrip().endswith("step 2  loss 1]")
    assert "step 0  loss 123457" in drawn[1] and "step 1  loss 0.25" in drawn[2]
    for before, after in itertools.pairwise(drawn):  # a shorter line is padded over the longer one before it
        assert len(after.rstrip("\n")) >= len(before.rstrip())
    assert stream.getvalue().endswith("\n")


# -- train --------------------------------------------------------------------------------------


def test_train_writes_grads_and_steps_with_the_contract_columns(tmp_path: Path) -> None:
    path = train(compose_cfg("+experiment=mlp", "steps=3"), out_dir=tmp_path)
    assert path == tmp_path / "grads.parquet"
    assert files(tmp_path) == ["anomalies.parquet", "grads.parquet", "steps.parquet"]
    df = pd.read_parquet(path)
    assert df.columns[: len(CONTRACT_COLUMNS)].tolist() == CONTRACT_COLUMNS
    assert sorted(df.step.unique()) == [0, 1, 2]
    assert set(df.experiment) == {"mlp"} and set(df.strategy) == {"hook"}
    auto = "cuda:0" if torch.cuda.is_available() else "cpu"  # device=auto: cuda first (checked on an H100)
    assert set(df.device) == {auto} and set(df.dtype) == {"float32"} and df.run_id.nunique() == 1
    assert {"fc1:output", "relu3:output", "head:output", "fc1:weight", "head:weight"} <= set(df.tap)
    assert df["values"].isna().all()
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert steps.step.tolist() == [0, 1, 2] and steps.captured.all()
    assert (steps.step_time_s > 0).all() and (steps.peak_memory_bytes > 0).all()
    assert np.allclose(steps.loss.to_numpy(), df.groupby("step").loss.first().to_numpy())


def test_train_keeps_the_resolved_config_and_seed_in_the_metadata(tmp_path: Path) -> None:
    train(compose_cfg("+experiment=cosine", "steps=1", "seed=5"), out_dir=tmp_path)
    meta = pq.read_schema(tmp_path / "grads.parquet").metadata
    config = OmegaConf.create(meta[b"gradrunner.config"].decode())
    assert config.experiment == "cosine" and config.data.inputs[1] == 0.25
    assert meta[b"gradrunner.seed"] == b"5"


def test_capture_every_captures_only_every_nth_step(tmp_path: Path) -> None:
    train(compose_cfg("+experiment=cosine", "steps=5", "capture.every=2"), out_dir=tmp_path)
    assert sorted(pd.read_parquet(tmp_path / "grads.parquet").step.unique()) == [0, 2, 4]
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert steps.captured.tolist() == [True, False, True, False, True]
    assert steps.capture_time_s.isna().tolist() == [False, True, False, True, False]
    assert steps.loss.notna().all()


def test_same_seed_same_records(tmp_path: Path) -> None:
    for name in ("a", "b"):
        train(compose_cfg("+experiment=mlp", "steps=2", "capture.values=full"), out_dir=tmp_path / name)
    a, b = (pd.read_parquet(tmp_path / n / "grads.parquet") for n in ("a", "b"))
    assert a.norm.tolist() == b.norm.tolist()
    assert all(np.array_equal(x, y) for x, y in zip(a["values"], b["values"], strict=True))


def test_dtype_float64_casts_model_and_inputs_but_not_labels(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    train(compose_cfg("+experiment=cnn", "steps=1", "dtype=float64", "data.batch_size=8"), out_dir=tmp_path)
    df = pd.read_parquet(tmp_path / "grads.parquet")
    assert set(df.dtype) == {"float64"} and df.has_grad.all()


def test_steps_zero_writes_empty_readable_files(tmp_path: Path) -> None:
    train(compose_cfg("+experiment=cosine", "steps=0"), out_dir=tmp_path)
    assert len(pd.read_parquet(tmp_path / "grads.parquet")) == 0


def test_train_uses_the_hydra_output_dir(tmp_path: Path) -> None:
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=cosine", "steps=1"], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "job")
    HydraConfig.instance().set_config(cfg)
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        assert train(cfg) == tmp_path / "job" / "grads.parquet"
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["capture.strategy=bogus"], "capture.strategy='bogus'"),
        (["taps=[fc9:output]"], "no module 'fc9'"),
        (["taps=[fc1:outptu]"], "Did you mean 'output'"),
        (["data.input_shape=[7]"], r"step 0 failed.*inputs \(32, 7\)"),
        (["loss=cross_entropy", "data.target_shape=[2]"], "step 0 failed"),
        (["loss._target_=torch.nn.MSELoss", "+loss.reduction=none"], "not a scalar tensor"),
        (["optimizer.lr=-1"], "Invalid learning rate"),
        (["model._target_=torch.nn.ReLU6.nope"], "could not build model"),
    ],
)
def test_config_mistakes_raise_before_any_record_is_written(
    tmp_path: Path, overrides: list[str], match: str
) -> None:
    with pytest.raises(GradrunnerError, match=match):
        train(compose_cfg("+experiment=mlp", "steps=2", *overrides), out_dir=tmp_path)
    assert files(tmp_path) == []


def test_an_existing_grads_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "grads.parquet").write_bytes(b"precious")
    with pytest.raises(GradrunnerError, match="already exists"):
        train(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    assert (tmp_path / "grads.parquet").read_bytes() == b"precious"


def test_interrupt_keeps_the_completed_steps_readable(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg("+experiment=cosine", "steps=100", *INTERRUPT_AT_STEP_3), out_dir=tmp_path)
    assert files(tmp_path) == ["anomalies.parquet", "grads.parquet", "steps.parquet"]
    assert pd.read_parquet(tmp_path / "steps.parquet").step.tolist() == [0, 1, 2]
    assert sorted(pd.read_parquet(tmp_path / "grads.parquet").step.unique()) == [0, 1, 2]


def test_train_logs_where_the_records_are_and_how_to_load_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        path = train(compose_cfg("+experiment=cosine", "steps=1"), out_dir=tmp_path)
    last = caplog.records[-1].getMessage().split("\n  ")[1]  # the run summary's line after its head
    assert last.startswith(f"records: {path.parent} (grads.parquet, steps.parquet; ") and "pandas.read_parquet" in last
    assert last.count(str(tmp_path)) == 1 and "gradrunner.analysis.load" in last
