"""Spike detection on by default in every step path (the step engine's one seam): anomalies.parquet online.

The runner and `record()` feed the engine's detector the step's host values; the file is written at
the close on every path (a normal end, Ctrl-C) and equals what `detect_run` rebuilds from the records.
Bad settings are one paragraph before any step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import compose_cfg, gradrunner_in_process
from omegaconf import OmegaConf, open_dict
from torch import nn

from gradrunner import record
from gradrunner.analysis.anomaly_context import z_around
from gradrunner.analysis.anomaly_signals import detect_run, read_anomalies
from gradrunner.analysis.anomaly_summary import anomaly_rows
from gradrunner.errors import GradrunnerError
from gradrunner.records.anomalies import ANOMALIES_FILE
from gradrunner.report.write import write_report
from gradrunner.run.loop import train


def test_the_runner_flags_a_planted_bad_batch_online_as_the_records_say(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_cfg("+experiment=mlp", "steps=40")
    with open_dict(cfg):  # batch 30's inputs x 1e3 (tests/planted_spikes.py)
        cfg.data = OmegaConf.create({"_target_": "planted_spikes.SpikyData", "at_batch": 30, "scale": 1e3,
                                     "inner": OmegaConf.to_container(cfg.data)})  # fmt: skip
    with caplog.at_level(logging.INFO, logger="gradrunner"):
        train(cfg, out_dir=tmp_path)
    df = read_anomalies(tmp_path)
    assert df.step.min() == 30  # flagged at its step, not before
    loss = df[(df.signal == "loss") & (df.step == 30)].iloc[0]
    assert loss.z > 1e3 and loss.space == "linear" and loss.lead == 0 and isinstance(loss.first_tap, str)
    assert set(df[df.step == 30].signal) >= {"loss", "grad_norm", "fc1:output:norm", "fc1:weight:norm"}
    # online == offline: the rows the loop wrote are the rows the same rule gives from the written records
    offline = detect_run(tmp_path)
    want = anomaly_rows(offline.anomalies, offline.window, offline.taps())
    got = df.drop(columns=["run_id"]).to_dict("records")
    assert [(r["step"], r["signal"]) for r in got] == [(r["step"], r["signal"]) for r in want]
    assert [r["z"] for r in got] == pytest.approx([r["z"] for r in want], rel=1e-9)
    # the last word (the health summary: console and the run dir's log) says it, once
    said = [r.getMessage() for r in caplog.records if "loss spike at step 30 (z = " in r.getMessage()]
    assert len(said) == 1 and f"first to move: {loss.first_tap} (lead 0 steps)" in said[0]
    # the report: the spike with every signal's z around it (the z of the flagged values as the file has them)
    [(spike, table)] = [(s, t) for s, t in z_around(tmp_path) if s.signal == "loss"]
    assert spike.step == 30 and list(table.columns) == list(range(25, 33))
    assert table.loc["loss", 30] == pytest.approx(loss.z, rel=1e-9) and (table.loc[:, 25:29].abs() < 6).all().all()
    flagged = df[df.step == 30].set_index("signal").z
    assert table.loc[flagged.index, 30].tolist() == pytest.approx(flagged.tolist(), rel=1e-9)
    page = write_report(tmp_path).read_text()
    assert '<h2 id="spikes">Spikes</h2>' in page and "loss spike at step 30 (z = " in page
    assert f"step 30: loss spike; first to move: {loss.first_tap}" in page


def _loop(rec: record, steps: int, bad: int, stop_at: int | None = None) -> None:
    torch.manual_seed(0)
    model, (x, y) = rec.model, (torch.randn(64, 8), torch.randn(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        if step == stop_at:
            raise KeyboardInterrupt
        i = torch.randint(0, 64, (16,))
        loss = nn.functional.mse_loss(model(x[i] * (1e3 if step == bad else 1.0)), y[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(loss)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def test_record_detects_by_default_and_writes_the_file_when_interrupted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gradrunner"), pytest.raises(KeyboardInterrupt):
        with record(_model(), ["*:output", "0:weight"], tmp_path / "r") as rec:
            _loop(rec, 60, bad=35, stop_at=45)
    df = read_anomalies(tmp_path / "r")  # no done.json: checked against the steps' run id
    assert df.step.min() == 35 and {"loss", "grad_norm"} & set(df[df.step == 35].signal) == {"loss"}  # no grad_norm given
    assert {"0:output:norm", "0:weight:norm"} <= set(df[df.step == 35].signal)
    said = [r.getMessage() for r in caplog.records if "loss spike at step 35 (z = " in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("run summary:"), said  # said once, in the last word (was also said
    # by a "spikes (anomalies.parquet):" warning before it, found 2026-11-27)


def test_a_nan_flagged_in_warm_up_has_z_inf_in_the_reports_spike_table(tmp_path: Path) -> None:
    """A NaN at step 5, inside the detector's 20-step warm-up: anomalies.parquet holds z = inf for it, and so must the
    report's spike table (it was empty, found 2026-11-27: the table's z said NaN, blank, for every value in warm-up)."""
    torch.manual_seed(0)
    model = _model()
    with record(model, ["0:weight", "2:weight"], tmp_path / "r") as rec:
        for step in range(8):
            x = torch.randn(16, 8)
            x[0, 0] = float("nan") if step == 5 else x[0, 0]
            loss = nn.functional.mse_loss(model(x), torch.randn(16, 1))
            loss.backward()
            model.zero_grad()
            rec.step(loss)
    flagged = read_anomalies(tmp_path / "r")
    assert set(flagged.step) == {5} and (flagged.z == float("inf")).all()
    [(spike, table)] = z_around(tmp_path / "r")
    assert spike.step == 5
    for signal in flagged.signal:  # every flagged signal's cell says what the file says, the other steps blank
        assert table.loc[signal, 5] == float("inf") and table.loc[signal].drop(5).isna().all(), signal
    page = write_report(tmp_path / "r").read_text()
    assert page.count("<td>inf</td>") == len(flagged)


def test_record_without_detection_and_bad_settings_refused_before_the_dir(tmp_path: Path) -> None:
    with record(_model(), ["*:output"], tmp_path / "off", anomaly=False) as rec:
        _loop(rec, 30, bad=25)
    assert (tmp_path / "off" / "steps.parquet").is_file() and not (tmp_path / "off" / ANOMALIES_FILE).exists()
    with record(_model(), ["*:output"], tmp_path / "z4", anomaly={"z": 4.0, "window": 16, "warmup": 8}) as rec:
        _loop(rec, 30, bad=25)
    assert read_anomalies(tmp_path / "z4").step.min() == 25
    for bad, named in (({"window": 10}, "anomaly.warmup=20 is not allowed with anomaly.window=10"),
                       ({"z": -1}, "anomaly.z=-1 is not allowed"), ({"zz": 1}, "unknown key(s) zz")):  # fmt: skip
        with pytest.raises(GradrunnerError, match=named.replace("(", r"\(").replace(")", r"\)")):
            record(_model(), ["*:output"], tmp_path / "bad", anomaly=bad)
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(("override", "named"), [("anomaly.window=10", "anomaly.warmup=20 is not allowed with anomaly.window=10"),
                                                 ("anomaly.z=0", "anomaly.z=0.0 is not allowed")])  # fmt: skip
def test_bad_settings_exit_2_with_one_paragraph_before_any_step(tmp_path: Path, override: str, named: str) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=2", override)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    (line,) = [s for s in result.stderr.splitlines() if s.strip()]
    assert line.startswith("gradrunner: error: ") and named in line
    assert list(tmp_path.rglob("*.parquet*")) == []


def test_corrupted_changes_one_batch_only_and_refuses_integer_inputs() -> None:
    from gradrunner.data import Corrupted, Synthetic, Tokens, as_batches

    cpu = torch.device("cpu")
    inner = [b for _, b in zip(range(6), as_batches(Synthetic(input_shape=[4], seed=3), cpu, torch.float32), strict=False)]
    got = [b for _, b in zip(range(6), Corrupted(Synthetic(input_shape=[4], seed=3), at_batch=4, scale=10.0).batches(cpu, torch.float32), strict=False)]  # fmt: skip
    for i, ((x0, y0), (x1, y1)) in enumerate(zip(inner, got, strict=True)):
        assert torch.equal(x1, x0 * 10.0 if i == 4 else x0) and torch.equal(y1, y0)
    nan = Corrupted(Synthetic(input_shape=[4], seed=3), at_batch=0, nan=True).batches(cpu, torch.float32)
    assert torch.isnan(next(nan)[0]).all()
    with pytest.raises(GradrunnerError, match="corrupts floating-point input tensors"):
        next(Corrupted(Tokens(), at_batch=0).batches(cpu, torch.float32))
    with pytest.raises(GradrunnerError, match="data.at_batch=-1 is not allowed"):
        Corrupted(Synthetic(), at_batch=-1)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["spike_data", "spike_attention"])
def test_the_shipped_planted_spikes_are_flagged_where_the_loss_jumps(tmp_path: Path, experiment: str) -> None:
    import pandas as pd

    train(compose_cfg(f"+experiment={experiment}"), out_dir=tmp_path)
    df, steps = read_anomalies(tmp_path), pd.read_parquet(tmp_path / "steps.parquet").set_index("step")
    first = int(df[df.signal == "loss"].step.min())
    if experiment == "spike_data":  # batch 60 of 80 corrupted: flagged there and not before
        assert first == 60 and df.step.min() == 60
    before = steps.loss.loc[first - 20 : first - 1]
    # the loss flagged is a real jump (plain pandas): beyond 6 sigma of the 20 steps before, and it did not happen before
    assert steps.loss.loc[first] > before.mean() + 6 * before.std(ddof=0) and first >= 40
    assert not df[(df.signal == "loss") & (df.step < first)].shape[0]


def test_a_resumed_run_writes_the_anomalies_of_the_uninterrupted_one(tmp_path: Path) -> None:
    from gradrunner.run.job import run

    def cfg(at: int, *extra: str) -> object:  # z = 2: the noise of a smooth run is flagged, rows to compare
        return compose_cfg("+experiment=mlp", "steps=40", "data._target_=killing_data.KillAt", f"+data.at_batch={at}",
                           f"+data.marker={tmp_path / 'marker'}", "+data.fault=keyboard_interrupt",
                           "train.checkpoint_every=10", "anomaly.z=2", "anomaly.warmup=5", "device=cpu", *extra)  # fmt: skip

    run(cfg(-1), out_dir=tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        run(cfg(27), out_dir=tmp_path / "cut")
    cut = read_anomalies(tmp_path / "cut")  # written at the interrupt: steps 0-26
    run(cfg(27, "resume=true"), out_dir=tmp_path / "cut")  # from the checkpoint at step 20
    want, got = read_anomalies(tmp_path / "ref"), read_anomalies(tmp_path / "cut")
    assert len(want) > 5 and cut.step.max() <= 26
    columns = ["step", "signal", "value", "z", "streak", "first_tap", "lead"]
    pd.testing.assert_frame_equal(got[columns], want[columns])


def test_the_lightning_callback_flags_a_planted_bad_batch(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradrunner.integrations.lightning import GradientCapture

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40 * 8, 8, generator=g), torch.randn(40 * 8, 1, generator=g)
    x[30 * 8 : 31 * 8] *= 1e3  # batch 30 (of 8 rows, not shuffled): the step-30 batch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = pl.Trainer(max_steps=40, callbacks=[GradientCapture(["net.0:output", "net.0:weight"], tmp_path / "r")],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    df = read_anomalies(tmp_path / "r")
    assert df.step.min() == 30 and {"loss", "net.0:output:norm", "net.0:weight:norm"} <= set(df[df.step == 30].signal)


def test_the_hf_callback_flags_a_planted_gradient_spike_on_one_tap(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from gradrunner.integrations.hf import GradientCaptureCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30,
                                                                 n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                 attn_pdrop=0.0))  # fmt: skip
    weight, forwards = model.transformer.h[0].mlp.c_fc.weight, [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    weight.register_hook(lambda g: g * 1e3 if forwards[0] == 31 else g)  # the backward of step 30 only
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 30, (80, 8), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, max_steps=40,
                                          learning_rate=1e-3, optim="sgd", report_to="none", save_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip
    cb = GradientCaptureCallback(taps=["transformer.h.0.mlp:output", "transformer.h.0.mlp.c_fc:weight"], dir=tmp_path / "r")
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    df = read_anomalies(tmp_path / "r")
    assert df.step.min() == 30
    assert set(df[df.step == 30].signal) == {"transformer.h.0.mlp.c_fc:weight:norm"}  # the planted tap alone
