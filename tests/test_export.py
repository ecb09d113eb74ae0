"""`python -m gradrunner.export`: TensorBoard, MLflow and W&B offline hold the Parquet records' numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from wandb_records import wandb_records

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
    for data in wandb_records(files[0].read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            logged[rec.history.step.num] = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
    rows = _grads(sweep / "0").query("tap == '2:weight'").sort_values("step")
    assert sorted(logged) == list(rows.step)
    np.testing.assert_allclose([float(logged[s]["grads/2:weight/norm"]) for s in rows.step], rows.norm, rtol=1e-12)


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


# --- issue 36 item 8: one value per (step, tap), NaN kept, a re-export replaces ---------------------------------


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runner job with train.accumulate=2 whose loss (and so every gradient) is NaN from step 2 on, evaluated at steps 1, 3."""
    from conftest import compose_cfg

    from gradrunner.run.job import run

    root = tmp_path_factory.mktemp("acc")
    cfg = compose_cfg("+experiment=mlp", "steps=4", "train.accumulate=2", "loss=nan_after", "loss.after=4",
                      "taps=[fc1:output,relu1:output,fc1:weight,head:output]", "model.depth=2",
                      "train.eval_every=2", "+eval_data={_target_: gradrunner.data.Synthetic, seed: 5}",
                      "device=cpu")  # fmt: skip
    run(cfg, out_dir=root / "run")
    return root / "run"


def _truth(run_dir: Path) -> dict[str, dict[int, float]]:
    """What the export must hold, from pandas alone: per tag, step -> value; micro-batches side by side."""
    df = pd.read_parquet(run_dir / "grads.parquet")
    out: dict[str, dict[int, float]] = {}
    for (tap, step), rows in df.groupby(["tap", "step"]):
        with_grad = rows[rows.has_grad]
        out.setdefault(f"grads/{tap}/norm", {})[int(step)] = float(np.sqrt((with_grad.norm**2).sum(skipna=False)))
        out.setdefault(f"grads/{tap}/abs_max", {})[int(step)] = float(with_grad.abs_max.max(skipna=False))
        out.setdefault(f"grads/{tap}/nan_count", {})[int(step)] = float(rows.nan_count.sum())
    steps = pd.read_parquet(run_dir / "steps.parquet")
    out["steps/loss"] = dict(zip(steps.step.astype(int), steps.loss, strict=True))
    out["steps/eval_loss"] = {int(s): v for s, v in zip(steps.step, steps.eval_loss, strict=True) if s in (1, 3)}
    return out


def _same(got: dict[int, float], want: dict[int, float], tag: str) -> None:
    assert sorted(got) == sorted(want), tag  # every step once, none twice
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6, err_msg=tag)


def _tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_holds_one_value_per_step_nan_kept_and_a_reexport_replaces(accumulated: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    df = pd.read_parquet(accumulated / "grads.parquet")
    assert df.micro_step.notna().any() and df.norm.isna().any() and df.has_grad.all()  # the plant holds
    truth = _truth(accumulated)
    for _ in range(2):  # the second export replaces the first
        assert export.main(["tensorboard", str(accumulated), "--out", str(tmp_path)]) == 0
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1
    scalars = _tensorboard_scalars(tmp_path / "run")
    for tag, want in truth.items():
        points = scalars[tag]
        assert len(points) == len({s for s, _ in points}), tag  # one value per step
        _same(dict(points), want, tag)
    assert any(np.isnan(v) for _, v in scalars["grads/fc1:output/norm"])  # NaN kept as NaN
    assert not any(t.endswith("/lr") and t.startswith("grads") for t in scalars)


def test_mlflow_holds_one_value_per_step_nan_kept_and_a_reexport_replaces(accumulated: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for _ in range(2):
        assert export.main(["mlflow", str(accumulated), "--out", str(tmp_path / "mlruns")]) == 0
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gradrunner").experiment_id])  # active runs: one
    for tag, want in _truth(accumulated).items():
        history = client.get_metric_history(run.info.run_id, tag)
        _same({m.step: m.value for m in history}, want, tag)
        assert len(history) == len(want), tag


@pytest.mark.slow
def test_wandb_holds_one_value_per_step_nan_kept_and_a_reexport_replaces(accumulated: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "gradrunner.export", "wandb", str(accumulated), "--out", str(tmp_path)],
                              capture_output=True, text=True, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
    (file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # one run, the re-export replaced the first
    from wandb.proto import wandb_internal_pb2

    logged: dict[str, dict[int, float]] = {}
    for data in wandb_records(file.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                assert rec.history.step.num not in logged.get(key, {}), key  # one log per step
                logged.setdefault(key, {})[rec.history.step.num] = float(json.loads(item.value_json.replace("NaN", '"nan"')))
    for tag, want in _truth(accumulated).items():
        _same(logged[tag], want, tag)  # micro-batch 0 is not dropped: the value is both micro-batches'


# --- issue 33 item 6: the constant columns, one home -----------------------------------------------------------


def test_steps_scalars_are_the_schemas_numbers_less_the_constant_columns(tmp_path: Path) -> None:
    import pyarrow as pa

    from gradrunner.export.jobs import STEPS_SCALARS
    from gradrunner.records.columns import CONSTANT_COLUMNS
    from gradrunner.records.schema import STEPS_SCHEMA
    from gradrunner.records.writer import StepsWriter

    numbers = [f.name for f in STEPS_SCHEMA if pa.types.is_integer(f.type) or pa.types.is_floating(f.type)]
    assert list(STEPS_SCALARS) == [n for n in numbers if n not in {*CONSTANT_COLUMNS, "step", "rank"}]
    # every one of them reaches the export, and nothing else of steps.parquet does
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    with gradrunner.record(model, [":output"], tmp_path) as rec:
        loss = model(torch.randn(3, 2)).sum()
        rec.backward(loss)
        rec.step(loss)
    run_id = str(pd.read_parquet(tmp_path / "grads.parquet").run_id.iloc[0])
    consts = dict(zip(CONSTANT_COLUMNS, [run_id, "e", "hook", "cpu", "float32"], strict=True))
    (tmp_path / "done.json").unlink()  # the steps table is rewritten below: nothing pins it
    (tmp_path / "steps.parquet").unlink()
    with StepsWriter(tmp_path / "steps.parquet", constants=consts, metadata={}) as steps:  # every column filled
        steps.write(0, True, 1.5, 0.1, 0.01, 1000, lr=0.1, lrs=[0.1], grad_norm=2.0, clipped=True, loss_scale=8.0,
                    skipped=False, eval_loss=1.25)  # fmt: skip
    (found,) = export.jobs(tmp_path)
    tags = {t.split("/", 1)[1] for t, _, _ in found.scalars if t.startswith("steps/")}
    assert tags == set(STEPS_SCALARS)


def test_the_constant_columns_are_spelled_once() -> None:
    """No module but `records/columns.py` lists the constant columns itself: a second copy would drift."""
    import ast

    from gradrunner.records.columns import CONSTANT_COLUMNS

    package = Path(gradrunner.__file__).parent
    copies = []
    for file in package.rglob("*.py"):
        if file.relative_to(package).as_posix() == "records/columns.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(names & set(CONSTANT_COLUMNS)) >= 3:
                    copies.append(f"{file.relative_to(package)}:{node.lineno}")
    assert copies == []


# --- issue 36 item 15: the MLflow export says how to look at it -------------------------------------------------


def test_mlflow_export_prints_what_to_install_and_the_command(sweep: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    import importlib.metadata

    assert export.main(["mlflow", str(sweep), "--out", str(tmp_path / "mlruns")]) == 0
    line = capsys.readouterr().out.strip()
    uri = (tmp_path / "mlruns").resolve().as_uri()
    command = f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}"
    try:
        importlib.metadata.distribution("mlflow")  # the full package: its UI is there
        assert line.endswith(f"view with: {command}"), line
    except importlib.metadata.PackageNotFoundError:  # mlflow-skinny only: no UI, say what to install
        assert line.endswith(f"view with: pip install mlflow (mlflow-skinny, installed here, has no UI), then: {command}"), line


def _ui_bin() -> str | None:
    """A directory whose `mlflow` has the UI: the full package here, or $GRADRUNNER_MLFLOW_UI_BIN (a venv's bin)."""
    import importlib.metadata
    import shutil

    given = os.environ.get("GRADRUNNER_MLFLOW_UI_BIN")
    if given:
        return given
    try:
        importlib.metadata.distribution("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = shutil.which("mlflow")
    return str(Path(found).parent) if found else None


@pytest.mark.slow
def test_the_printed_mlflow_command_shows_the_runs(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket
    import time
    import urllib.request

    bin_dir = _ui_bin()
    if bin_dir is None:
        pytest.skip("needs the full mlflow package (or GRADRUNNER_MLFLOW_UI_BIN): mlflow-skinny has no UI")
    assert export.main(["mlflow", str(sweep), "--out", str(tmp_path / "mlruns")]) == 0
    command = capsys.readouterr().out.strip().split("view with: ", 1)[1].split("then: ")[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    ui = subprocess.Popen(f"{command} --port {port}", shell=True, env=env, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        body = json.dumps({"max_results": 10}).encode()
        deadline, found = time.monotonic() + 120, None
        while found is None and ui.poll() is None and time.monotonic() < deadline:  # polled until it answers
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search", body,
                                             {"Content-Type": "application/json"})  # fmt: skip
                found = json.load(urllib.request.urlopen(req, timeout=5))
            except OSError:
                time.sleep(0.5)
        assert found is not None, ui.stderr.read().decode()[-2000:] if ui.poll() is not None else "no answer"
        (exp,) = [e for e in found["experiments"] if e["name"] == "gradrunner"]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                                     json.dumps({"experiment_ids": [exp["experiment_id"]]}).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        runs = {r["info"]["run_name"]: r for r in json.load(urllib.request.urlopen(req, timeout=30))["runs"]}
        assert sorted(runs) == ["0", "1"]
        for job, r in runs.items():
            rows = _grads(sweep / job).query("tap == '0:output'").sort_values("step")
            (norm,) = [m for m in r["data"]["metrics"] if m["key"] == "grads/0:output/norm"]  # the latest step's
            assert norm["step"] == rows.step.iloc[-1] and norm["value"] == pytest.approx(rows.norm.iloc[-1], rel=1e-12)
    finally:
        os.killpg(ui.pid, 15)
        ui.wait(timeout=60)


def test_live_tensorboard_writes_one_value_per_step_for_micro_batches(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from gradrunner.export.tensorboard import LiveTensorBoard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(8, 3)
    micro = []
    with gradrunner.capture(model, ["0:output"], strategy="hook", keep_grads=False) as cap:
        for part in (x[:4], x[4:]):
            loss = model(part).pow(2).mean() / 2
            cap.backward(loss)
            micro.append(cap.records(loss.detach()))
    h = model[0](x)
    h.retain_grad()
    (model[2](model[1](h[:4])).pow(2).mean() / 2 + model[2](model[1](h[4:])).pow(2).mean() / 2).backward()
    live = LiveTensorBoard(tmp_path)
    live.write_step(3, micro, float("nan"))
    live.close()
    scalars = _tensorboard_scalars(tmp_path)
    (point,) = scalars["grads/0:output/norm"]
    assert point[0] == 3 and point[1] == pytest.approx(float(h.grad.norm()), rel=1e-6)  # the whole batch's gradient
    (loss_point,) = scalars["steps/loss"]
    assert np.isnan(loss_point[1])  # NaN kept


def test_record_live_tensorboard_under_accumulation_writes_one_value_per_step(tmp_path: Path) -> None:
    """`record(..., log_to="tensorboard")` with two backwards per step: one point per step and tap, the value the
    export writes for that step (the micro-batches combined into the whole batch's gradient)."""
    pytest.importorskip("tensorboard")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output", "2:weight"], tmp_path / "r", log_to="tensorboard") as rec:
        for _ in range(3):
            for part in torch.randn(2, 4, 3):
                rec.backward(model(part).pow(2).mean() / 2)
            opt.step()
            opt.zero_grad()
            rec.step()
    live = _tensorboard_scalars(tmp_path / "r" / "tensorboard")
    exported = _tensorboard_scalars(export_main_to(tmp_path / "r", tmp_path / "tb") / "run")  # a run dir: one run, "run"
    for tag in ("grads/0:output/norm", "grads/2:weight/norm"):
        assert [s for s, _ in live[tag]] == [0, 1, 2]
        assert [v for _, v in live[tag]] == pytest.approx([v for _, v in exported[tag]], rel=1e-6)


def export_main_to(run_dir: Path, out: Path) -> Path:
    from gradrunner.export.command import main

    assert main(["tensorboard", str(run_dir), "--out", str(out)]) == 0
    return out
