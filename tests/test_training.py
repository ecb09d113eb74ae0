"""The training step's options (issue 20), each against a plain-torch loop written here.

Every run starts from weights the test saves itself (`model.init_from`) on one literal batch
(`data=tensors`), so the reference loop needs nothing of gradrunner but the model class.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import compose_cfg
from torch import nn

from gradrunner.errors import GradrunnerError
from gradrunner.models import MLP
from gradrunner.run.loop import train

X = [[0.5, -1.0, 2.0, 0.25], [1.5, 0.5, -0.5, 1.0], [-2.0, 1.0, 0.0, 0.5]]
Y = [[1.0], [-1.0], [0.5]]
SHAPE = {"in_features": 4, "hidden": 8, "depth": 2, "out_features": 1}


def _weights(tmp_path: Path) -> Path:
    torch.manual_seed(123)
    path = tmp_path / "init.pt"
    torch.save(MLP(**SHAPE).state_dict(), path)
    return path


def _reference(weights: Path) -> nn.Module:
    model = MLP(**SHAPE)
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model


def _run(tmp_path: Path, *overrides: str, steps: int = 4) -> tuple[pd.DataFrame, pd.DataFrame]:
    weights = _weights(tmp_path)
    cfg = compose_cfg(
        "+experiment=mlp", f"steps={steps}", f"+model.init_from={weights}", "model.in_features=4", "model.hidden=8",
        "model.depth=2", "data=tensors", f"data.inputs={X}", f"data.targets={Y}", "optimizer.lr=0.1",
        "taps=[fc1:output,fc1:weight]", "capture.values=full", "device=cpu", *overrides,
    )  # fmt: skip
    out = tmp_path / "run"
    train(cfg, out_dir=out)
    return pd.read_parquet(out / "grads.parquet"), pd.read_parquet(out / "steps.parquet")


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(X), torch.tensor(Y)


@pytest.mark.parametrize("scheduler", ["cosine", "warmup_cosine", "onecycle", "linear_warmup"])
def test_lr_is_the_schedulers_own_get_last_lr(tmp_path: Path, scheduler: str) -> None:
    grads, steps = _run(tmp_path, f"scheduler={scheduler}", steps=6)
    from hydra.utils import instantiate

    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = instantiate(compose_cfg("steps=6", f"scheduler={scheduler}").scheduler)(opt)
    x, y = _xy()
    lrs, losses = [], []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert len(set(lrs)) > 1  # the schedule does change the rate
    np.testing.assert_allclose(steps["lr"], lrs, rtol=1e-12)
    assert [list(v) for v in steps["lrs"]] == [[v] for v in steps["lr"]]
    np.testing.assert_allclose(steps["loss"], losses, rtol=1e-5)


def test_clipped_update_equals_clip_grad_norm(tmp_path: Path) -> None:
    grads, steps = _run(tmp_path, "train.clip_grad_norm=0.5")
    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _xy()
    norms, losses, w_grads = [], [], []
    for _ in range(4):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        w_grads.append(model.fc1.weight.grad.detach().clone())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    np.testing.assert_allclose(steps["grad_norm"], norms, rtol=1e-5)
    assert steps["clipped"].tolist() == [n > 0.5 for n in norms] and any(n > 0.5 for n in norms)
    np.testing.assert_allclose(steps["loss"], losses, rtol=1e-5)  # same updates, so the same losses
    # Parameter-tap records are the gradients before clipping, as grad_norm is.
    w = grads[grads.tap == "fc1:weight"].sort_values("step")
    np.testing.assert_allclose(w["norm"], [float(g.norm()) for g in w_grads], rtol=1e-5)


def test_clip_grad_value_as_clip_grad_value_(tmp_path: Path) -> None:
    _, steps = _run(tmp_path, "train.clip_grad_value=0.05")
    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _xy()
    losses, clipped = [], []
    for _ in range(4):
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        clipped.append(max(float(p.grad.abs().max()) for p in model.parameters()) > 0.05)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        opt.step()
    np.testing.assert_allclose(steps["loss"], losses, rtol=1e-5)
    assert steps["clipped"].tolist() == clipped


def test_fp16_records_are_true_gradients_and_an_overflow_is_a_skipped_step(tmp_path: Path) -> None:
    grads, steps = _run(tmp_path, "train.autocast=fp16", steps=12)
    assert steps["loss_scale"].iloc[0] == 65536.0
    skipped = steps["skipped"].tolist()
    assert steps["skipped"].notna().all()
    # Each skipped step halves the scale; a step that did not skip leaves it (growth only after 2000 steps).
    for i in range(1, 12):
        assert steps["loss_scale"].iloc[i] == steps["loss_scale"].iloc[i - 1] * (0.5 if skipped[i - 1] else 1.0)
    # The fp32 reference: the same steps (a skipped step changes nothing), without autocast or scaling.
    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _xy()
    for step in range(12):
        out = model.fc1(x)
        out.retain_grad()
        loss = nn.functional.mse_loss(model.head(model.relu2(model.fc2(model.relu1(out)))), y)
        opt.zero_grad()
        loss.backward()
        rows = grads[grads.step == step].set_index("tap")
        if not skipped[step]:
            for tap, ref in (("fc1:output", out.grad), ("fc1:weight", model.fc1.weight.grad)):
                got = np.asarray(rows.loc[tap, "values"], dtype=np.float64)
                np.testing.assert_allclose(got, ref.flatten().numpy(), rtol=2e-2, atol=2e-3 * float(ref.abs().max()))
            opt.step()
    assert not any(skipped)  # every step compared (the forced overflow is the next test)


def test_fp16_forced_overflow_is_recorded_as_skipped(tmp_path: Path) -> None:
    big = [[3.0e3, -3.0e3, 3.0e3, 3.0e3]]  # fp16 activations fit; the loss times 65536 does not
    _, steps = _run(tmp_path, "train.autocast=fp16", f"data.inputs={big}", "data.targets=[[0.0]]", steps=2)
    assert steps["skipped"].iloc[0] and steps["loss_scale"].iloc[1] == steps["loss_scale"].iloc[0] / 2
    assert steps["loss"].iloc[1] == steps["loss"].iloc[0]  # the optimiser step was skipped


def test_bf16_autocast_runs_and_records_finite_gradients(tmp_path: Path) -> None:
    grads, steps = _run(tmp_path, "train.autocast=bf16")
    assert steps["loss_scale"].isna().all() and steps["skipped"].isna().all()
    assert np.isfinite(grads["norm"]).all() and (grads["norm"] > 0).all()


def test_accumulation_records_activations_per_micro_batch_and_parameters_once_from_grad(tmp_path: Path) -> None:
    grads, steps = _run(tmp_path, "train.accumulate=3", "train.clip_grad_norm=0.01", steps=2)
    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _xy()
    ref_losses = []
    for step in range(2):
        opt.zero_grad()
        outs = []
        ref_losses.append(nn.functional.mse_loss(model(x), y).item())  # each micro-batch is this batch
        for _ in range(3):
            out = model.fc1(x)
            out.retain_grad()
            loss = nn.functional.mse_loss(model.head(model.relu2(model.fc2(model.relu1(out)))), y) / 3
            loss.backward()
            outs.append(out.grad.clone())
        rows = grads[grads.step == step]
        act = rows[rows.tap == "fc1:output"].sort_values("micro_step")
        assert act["micro_step"].tolist() == [0, 1, 2]
        for got, ref in zip(act["values"], outs, strict=True):
            np.testing.assert_allclose(got, ref.flatten().numpy(), rtol=1e-5, atol=1e-8)
        w = rows[rows.tap == "fc1:weight"]
        assert len(w) == 1 and w["micro_step"].isna().all()  # one record per optimisation step
        # the summed .grad, before clipping (the clip at 0.01 fires)
        np.testing.assert_allclose(w["values"].iloc[0], model.fc1.weight.grad.flatten().numpy(), rtol=1e-5, atol=1e-8)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        np.testing.assert_allclose(steps["grad_norm"].iloc[step], float(total), rtol=1e-5)
        assert steps["clipped"].iloc[step]
        opt.step()
    np.testing.assert_allclose(steps["loss"], ref_losses, rtol=1e-5)  # the same clipped updates


def test_eval_loss_every_k_steps_on_the_model_after_the_step(tmp_path: Path) -> None:
    _, steps = _run(tmp_path, "train.eval_every=2")
    model = _reference(tmp_path / "init.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _xy()
    expected: list[float] = []
    for step in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            expected.append(nn.functional.mse_loss(model(x), y).item() if step % 2 == 1 else math.nan)
    np.testing.assert_allclose(steps["eval_loss"], expected, rtol=1e-5)


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.autocast=fp8", "train.autocast='fp8' is not allowed; allowed: off, bf16, fp16"),
        ("train.clip_grad_norm=-1", "train.clip_grad_norm=-1"),
        ("train.accumulate=0", "train.accumulate=0"),
        ("train.checkpoint_every=-2", "train.checkpoint_every=-2"),
        ("~scheduler._partial_", "needs `_partial_: true`"),
    ],
)
def test_bad_train_options_are_one_paragraph(override: str, words: str) -> None:
    from gradrunner.config.schema import validate

    extra = ["scheduler=cosine"] if "scheduler" in override else []
    with pytest.raises(GradrunnerError) as e:
        validate(compose_cfg("+experiment=mlp", *extra, override))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_init_from_refuses_a_mismatch_naming_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"fc1.weight": torch.zeros(8, 4), "extra.bias": torch.zeros(3)}, path)
    cfg = compose_cfg("+experiment=mlp", "steps=1", f"+model.init_from={path}", "model.in_features=4",
                      "model.hidden=8", "model.depth=2")  # fmt: skip
    with pytest.raises(GradrunnerError) as e:
        train(cfg, out_dir=tmp_path / "run")
    msg = str(e.value)
    assert "missing keys: fc1.bias" in msg and "unexpected keys: extra.bias" in msg
    assert not (tmp_path / "run" / "grads.parquet").exists()


def test_gpt2_pretrain_composes_with_the_recipes_options() -> None:
    from gradrunner.config.schema import validate

    cfg = compose_cfg("+experiment=gpt2_pretrain")
    validate(cfg)
    t = cfg.train
    assert (t.clip_grad_norm, t.autocast, t.accumulate, t.checkpoint_every) == (1.0, "bf16", 2, 50)
    assert cfg.scheduler.lr_lambda._target_ == "gradrunner.run.schedules.WarmupCosine" and cfg.steps == 200


def test_init_from_loads_a_safetensors_file(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(7)
    state = MLP(**SHAPE).state_dict()
    path = tmp_path / "w.safetensors"
    safetensors.save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    from gradrunner.run.build import setup

    cfg = compose_cfg("+experiment=mlp", f"+model.init_from={path}", "model.in_features=4", "model.hidden=8",
                      "model.depth=2", "device=cpu")  # fmt: skip
    job = setup(cfg)
    for k, v in job.model.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.slow
def test_gpt2_pretrain_runs_on_cpu_with_its_checkpoint_and_records(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from conftest import check_ok, gradrunner_in_process

    out = tmp_path / "pre"
    check_ok(gradrunner_in_process(tmp_path, "+experiment=gpt2_pretrain", "steps=60", f"hydra.run.dir={out}"))
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 60 and steps["grad_norm"].notna().all() and steps["lr"].iloc[29] > steps["lr"].iloc[0]
    grads = pd.read_parquet(out / "grads.parquet")
    assert set(grads["micro_step"].dropna()) == {0, 1}  # activations per micro-batch
    assert grads.loc[grads.name == "weight", "micro_step"].isna().all()  # parameters once per step
    assert not (out / ".checkpoint").exists()  # the step-50 checkpoint, removed once the records closed


def _params(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return params


def _reference_norm(*grads: torch.Tensor) -> float:
    """The total 2-norm of `grads` in float64 numpy (the elements widened first)."""
    return float(np.sqrt(sum(np.sum(g.double().numpy() ** 2) for g in grads)))


@pytest.mark.parametrize("foreach", [True, False])
def test_grad_norm_of_finite_gradients_near_1e20_is_finite(foreach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradrunner.capturing import torch_compat
    from gradrunner.run.numerics import total_norm

    monkeypatch.setitem(torch_compat.FEATURES, "foreach", foreach)
    gen = torch.Generator().manual_seed(7)
    grads = (
        (torch.randn(64, 32, generator=gen, dtype=torch.float64) * 1e20).float(),  # its own squares overflow float32
        torch.full((8,), 3e19),  # a finite norm per tensor whose square overflows float32 in the total
        torch.randn(16, generator=gen).half(),
        torch.randn(5, generator=gen, dtype=torch.float64),
    )
    assert math.isinf(float(torch.nn.utils.get_total_norm(list(grads[:2]))))  # the dtype's norm: inf
    got = total_norm(_params(*grads))
    assert got.dtype == torch.float64 and float(got) == pytest.approx(_reference_norm(*grads), rel=1e-6)
    # NaN or inf only where a gradient holds one
    assert math.isinf(float(total_norm(_params(grads[0], torch.tensor([1.0, math.inf])))))
    assert math.isnan(float(total_norm(_params(grads[0], torch.tensor([1.0, math.nan])))))
    assert float(total_norm(_params(torch.ones(3)))) == pytest.approx(math.sqrt(3), rel=1e-6)
    assert float(total_norm([])) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grad_norm_of_16_bit_gradients_on_the_cpu_is_accumulated_in_float64(dtype: torch.dtype) -> None:
    """`precision="bf16-true"` on the CPU: each 16-bit gradient's norm was taken in its own dtype (2.317797 for a
    float64 2.319633); now in float64, equal to a numpy float64 norm of the same 16-bit elements."""
    from gradrunner.run.numerics import total_norm

    gen = torch.Generator().manual_seed(11)
    grads = [(torch.randn(shape, generator=gen) * 0.1).to(dtype) for shape in ((64, 32), (32,), (300, 7))]
    got = total_norm(_params(*grads))
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(_reference_norm(*grads), rel=1e-12)
    beside = torch.randn(50, generator=gen)  # a float32 gradient beside them: its norm is float32's (torch's)
    assert float(total_norm(_params(*grads, beside))) == pytest.approx(_reference_norm(*grads, beside), rel=1e-7)


def test_the_accelerator_norm_path_accumulates_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    # off the CPU every group takes `norms_all(..., dtype=float64)` (no host read); forced here on CPU tensors
    from gradrunner.capturing import torch_compat

    g = (torch.randn(300, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 1e20).float()
    for foreach in (True, False):
        monkeypatch.setitem(torch_compat.FEATURES, "foreach", foreach)
        (norm,) = torch_compat.norms_all([g], dtype=torch.float64)
        assert norm.dtype == torch.float64 and float(norm) == pytest.approx(_reference_norm(g), rel=1e-12)


def test_clipping_an_overflowing_norm_is_clip_grad_norm_to_the_bit() -> None:
    from gradrunner.run.numerics import clip, total_norm

    grads = ((torch.randn(64, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 1e20).float(),
             torch.ones(4))  # fmt: skip
    ours, plain = _params(*grads), _params(*grads)
    norm = total_norm(ours)
    assert bool(clip(ours, 1.0, None)) and math.isfinite(float(norm))
    torch.nn.utils.clip_grad_norm_(plain, 1.0)  # its norm is float32's inf: the gradients are scaled by 0
    for a, b in zip(ours, plain, strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    calm = _params(torch.full((4,), 0.1))
    assert not bool(clip(calm, 1.0, None))
    assert calm[0].grad is not None and torch.equal(calm[0].grad, torch.full((4,), 0.1))


def test_a_float32_run_whose_gradients_pass_1e19_records_a_finite_grad_norm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # spike_data: batch 60's inputs x 1000; at step 61 the gradients' elements pass 1e19 (none is inf)
    cfg = compose_cfg("+experiment=spike_data", "steps=62", "taps=[*:weight,*:bias]", "device=cpu")
    with caplog.at_level("WARNING"):
        train(cfg, out_dir=tmp_path / "run")
    grads, steps = (pd.read_parquet(tmp_path / "run" / name) for name in ("grads.parquet", "steps.parquet"))
    last = grads[grads.step == 61]
    assert last.nan_count.sum() == last.inf_count.sum() == 0 and last.abs_max.max() > 1e19
    # every parameter is tapped: the records' float64 norms give the total
    want = float(np.sqrt(np.sum(last.norm.to_numpy(dtype=np.float64) ** 2)))
    assert steps.set_index("step").loc[61, "grad_norm"] == pytest.approx(want, rel=1e-6)
    assert np.isfinite(steps.grad_norm).all()
    assert "NaN/Inf" not in caplog.text and "grad_norm spike at step 60" in caplog.text
