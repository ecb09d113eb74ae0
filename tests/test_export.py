"""`python -m gradrunner.export`: TensorBoard, MLflow and W&B offline hold the Parquet records' numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gradrunner
from gradrunner import export


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two jobs written by `record` (different strategies), with histograms."""
    root = tmp_path_factory.mktemp("sweep")
    for i, strategy in enumerate(["hook", "retain_grad"]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradrunner.record(model, ["0:output", "2:weight"], root / str(i), strategy=strategy, histogram=True) as rec:
            for _ in range(3):
                loss = model(torch.randn(6, 3)).pow(2).mean()
                rec.backward(loss)
                opt.step()
                opt.zero_grad()
                rec.step(loss)
    return root


def _grads(job: Path) -> pd.DataFrame:
    return pd.read_parquet(job / "grads.parquet")


def test_tensorboard_export_reads_back_equal(sweep: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = subprocess.run([sys.executable, "-m", "gradrunner.export", "tensorboard", str(sweep), "--out", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for job in ("0", "1"):
        acc = EventAccumulator(str(tmp_path / job), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        df = _grads(sweep / job)
        for tap in ("0:output", "2:weight"):
            rows = df[df.tap == tap].sort_values("step")
            for stat in ("norm", "mean", "abs_max", "zero_frac", "value_norm"):
                events = acc.Scalars(f"grads/{tap}/{stat}")
                assert [e.step for e in events] == list(rows.step)
                np.testing.assert_allclose([e.value for e in events], rows[stat], rtol=1e-6)  # float32 in the events
            hist = acc.Histograms(f"grads/{tap}/hist")
            assert [int(h.histogram_value.num) for h in hist] == list(rows.numel)
            assert [list(h.histogram_value.bucket) for h in hist] == [list(map(float, c[:-1])) for c in rows.hist_counts]  # the non-finite bin is nan_count + inf_count
        steps = pd.read_parquet(sweep / job / "steps.parquet")
        np.testing.assert_allclose([e.value for e in acc.Scalars("steps/loss")], steps.loss, rtol=1e-6)
        from tensorboard.plugins.hparams import plugin_data_pb2

        meta = acc.SummaryMetadata("_hparams_/session_start_info").plugin_data
        hparams = plugin_data_pb2.HParamsPluginData.FromString(meta.content).session_start_info.hparams
        assert meta.plugin_name == "hparams" and hparams["capture.strategy"].string_value == ["hook", "retain_grad"][int(job)]


def test_mlflow_export_holds_the_numbers(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert export.main(["mlflow", str(sweep), "--out", str(tmp_path / "mlruns")]) == 0
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gradrunner").experiment_id])}
    assert set(runs) == {"0", "1"}
    for job, run in runs.items():
        assert run.data.params["capture.strategy"] == ["hook", "retain_grad"][int(job)]
        rows = _grads(sweep / job).query("tap == '0:output'").sort_values("step")
        history = sorted(client.get_metric_history(run.info.run_id, "grads/0:output/norm"), key=lambda m: m.step)
        assert [m.step for m in history] == list(rows.step)
        np.testing.assert_allclose([m.value for m in history], rows.norm, rtol=1e-12)


@pytest.mark.slow
def test_wandb_offline_export_holds_the_numbers(sweep: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "gradrunner.export", "wandb", str(sweep / "0"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    from wandb.proto import wandb_internal_pb2

    files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    logged: dict[int, dict[str, str]] = {}
    for data in _wandb_records(files[0].read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            logged[rec.history.step.num] = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
    rows = _grads(sweep / "0").query("tap == '2:weight'").sort_values("step")
    assert sorted(logged) == list(rows.step)
    np.testing.assert_allclose([float(logged[s]["grads/2:weight/norm"]) for s in rows.step], rows.norm, rtol=1e-12)


def _wandb_records(data: bytes) -> list[bytes]:
    """The records of a `.wandb` file: W&B's log format (a 7-byte header, then LevelDB-style 32 KiB blocks of
    chunks, each a 4-byte checksum, 2-byte length and 1-byte type: full, first, middle, last)."""
    block, pos, partial, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind in (2, 3):
            partial = (b"" if kind == 2 else partial) + chunk
        elif kind == 4:
            out.append(partial + chunk)
    return out


def test_bad_input_is_one_paragraph_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["tensorbored", str(tmp_path)], "target 'tensorbored' is not an export target; allowed"),
                        (["tensorboard", str(tmp_path / "nope")], "is not a directory"),
                        (["tensorboard", str(tmp_path)], "no grads.parquet found")):  # fmt: skip
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    done = subprocess.run([sys.executable, "-m", "gradrunner.export", "mlflow", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "no grads.parquet found" in done.stderr and "Traceback" not in done.stderr


def test_export_imports_no_torch() -> None:
    code = "import sys, gradrunner.export; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_record_logs_live_to_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output", "2:weight"], tmp_path / "r", every=2, log_to="tensorboard") as rec:
        for _ in range(4):
            loss = model(torch.randn(6, 3)).pow(2).mean()
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    df = _grads(tmp_path / "r")
    for tap in ("0:output", "2:weight"):
        rows = df[df.tap == tap].sort_values("step")
        events = acc.Scalars(f"grads/{tap}/norm")
        assert [e.step for e in events] == [0, 2] == list(rows.step)
        np.testing.assert_allclose([e.value for e in events], rows.norm, rtol=1e-6)
    with pytest.raises(gradrunner.GradrunnerError, match="log_to='wandb' is not allowed; allowed: tensorboard"):
        gradrunner.record(model, ["0:output"], tmp_path / "s", log_to="wandb")
