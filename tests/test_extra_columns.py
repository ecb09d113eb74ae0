"""The columns beyond the nine statistics (issue 15), each against a reference computed without gradrunner.

`per_example_norm` against a per-example loop, `hist_counts` against numpy histograms of gradients
taken with `torch.autograd.grad` on a copy of the model, `update_norm` against the parameters before
and after the optimiser step, `value_norm` against the forward tensors; the options are off by
default and leave the old columns as they were before this issue.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TESTS, check_ok, compose_cfg, gradrunner_in_process, job_dirs
from torch import nn

from gradrunner import capture
from gradrunner.records.columns import HIST_BINS, HIST_EDGES, HIST_EDGES_KEY
from gradrunner.run.loop import train

TAPS = ["0:output", "1:output", "2:output", "0:weight", "2:bias"]
BATCH = 6


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 3, generator=g)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gradients and forward values of TAPS on a copy of `model`: forward hooks and `torch.autograd.grad`."""
    twin = copy.deepcopy(model)
    outs: dict[str, torch.Tensor] = {}
    handles = [twin[i].register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(f"{i}:output", o)) for i in range(3)]
    try:
        loss = nn.functional.mse_loss(twin(x), y)
    finally:
        for h in handles:
            h.remove()
    params = {"0:weight": twin[0].weight, "2:bias": twin[2].bias}
    tensors = {**outs, **params}
    grads = torch.autograd.grad(loss, list(tensors.values()))
    return dict(zip(tensors, grads, strict=True)), {k: v.detach() for k, v in tensors.items()}


def _captured(model: nn.Module, strategy: str, **options: bool) -> dict[str, dict[str, object]]:
    x, y = _data()
    with capture(model, TAPS, strategy, keep_grads=False, **options) as cap:
        loss = nn.functional.mse_loss(model(x), y)
        cap.backward(loss)
        recs = cap.records(loss)
    return {recs.keys[i].tap: recs.row(i) for i in range(len(recs))}


def test_per_example_norm_matches_a_per_example_loop(strategy: str) -> None:
    model = _model()
    rows = _captured(model, strategy, per_example=True)
    x, y = _data()
    expected: dict[str, list[float]] = {t: [] for t in TAPS}  # parameters too: each row's share of .grad (issue 37)
    for i in range(BATCH):  # one forward and backward per example; the batch mean is 1/BATCH of each
        grads, _ = _reference(model, x[i : i + 1], y[i : i + 1])
        for t in expected:
            expected[t].append(float(grads[t].double().norm()) / BATCH)
    for t, norms in expected.items():
        got = rows[t]["per_example_norm"]
        assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (BATCH,)
        np.testing.assert_allclose(got, norms, rtol=1e-5, atol=1e-9)


def _numpy_histogram(g: np.ndarray) -> np.ndarray:
    """Counts as documented: exact zeros, (0, e0), [e_i, e_i+1), >= e_last, non-finite; |g| in float32."""
    a = np.abs(g.astype(np.float32).reshape(-1)).astype(np.float64)
    finite = a[np.isfinite(a)]
    edges = np.asarray(HIST_EDGES, dtype=np.float32).astype(np.float64)
    bins = np.concatenate([[np.nextafter(0.0, 1.0)], edges, [np.inf]])
    middle, _ = np.histogram(finite[finite > 0], bins=bins)
    return np.concatenate([[np.sum(finite == 0)], middle, [np.sum(~np.isfinite(a))]]).astype(np.int64)


def test_hist_counts_match_numpy_histograms_of_the_gradient(strategy: str) -> None:
    model = _model()
    grads, _ = _reference(model, *_data())
    rows = _captured(model, strategy, histogram=True)
    assert (grads["0:output"] == 0).any(), "the ReLU should zero some gradients of 0:output"
    for t in TAPS:
        got = rows[t]["hist_counts"]
        expected = _numpy_histogram(grads[t].numpy())
        assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (HIST_BINS,)
        np.testing.assert_array_equal(got, expected, err_msg=t)
        assert got.sum() == grads[t].numel() and np.count_nonzero(got) >= 3, t


def test_value_norm_is_the_norm_of_the_forward_tensor_and_of_the_parameter(strategy: str) -> None:
    model = _model()
    _, values = _reference(model, *_data())
    rows = _captured(model, strategy)
    for t in TAPS:
        assert rows[t]["value_norm"] == pytest.approx(float(values[t].double().norm()), rel=1e-6), t
        assert np.isnan(rows[t]["update_norm"]) and np.isnan(rows[t]["update_ratio"]), t  # no step was taken
        assert rows[t]["per_example_norm"] is None and rows[t]["hist_counts"] is None, t  # options off


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam_weight_decay": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_update_norm_is_the_change_of_the_optimizer_step_and_records_taken_after_it_are_unchanged(
    strategy: str, opt_name: str
) -> None:
    model, plain = _model(), _model()
    opt, plain_opt = OPTIMIZERS[opt_name](list(model.parameters())), OPTIMIZERS[opt_name](list(plain.parameters()))
    x, y = _data()
    for step in range(3):
        grads, values = _reference(plain, x, y)  # the same state as `model`: the reference of this step
        before = {t: values[t].clone() for t in ("0:weight", "2:bias")}
        plain_opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
        after = {"0:weight": plain[0].weight.detach(), "2:bias": plain[2].bias.detach()}
        with capture(model, TAPS, strategy, keep_grads=False, values="full") as cap:
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            snapshot = cap.snapshot_params()
            opt.step()  # records taken after the step, as the runner does
            recs = cap.records(loss, snapshot)
        opt.zero_grad(set_to_none=True)
        rows = {recs.keys[i].tap: recs.row(i) for i in range(len(recs))}
        for t in before:
            update = float((after[t] - before[t]).double().norm())
            assert update > 0
            assert rows[t]["update_norm"] == pytest.approx(update, rel=1e-5), (step, t)
            assert rows[t]["update_ratio"] == pytest.approx(update / float(before[t].double().norm()), rel=1e-5)
        for t in TAPS:  # what the records read was not changed by the step (weight decay, momentum)
            assert rows[t]["norm"] == pytest.approx(float(grads[t].double().norm()), rel=1e-5), (step, t)
            np.testing.assert_allclose(rows[t]["values"], grads[t].numpy().reshape(-1), rtol=1e-5, atol=1e-7)
        for t in TAPS[:3]:
            assert np.isnan(rows[t]["update_norm"]), t  # not a parameter


def test_all_options_together_still_make_one_host_transfer_per_step(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    import gradrunner.capturing.stats as stats

    calls: list[int] = []
    real = stats.to_host
    monkeypatch.setattr(stats, "to_host", lambda t: calls.append(t.numel()) or real(t))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    with capture(model, TAPS, strategy, keep_grads=False, per_example=True, histogram=True) as cap:
        for _ in range(2):
            calls.clear()
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            before = cap.snapshot_params()
            opt.step()
            recs = cap.records(loss, before)
            opt.zero_grad(set_to_none=True)
            assert len(calls) == 1, calls
    # 7 reductions + value norm per record, 2 update norms, every tap x BATCH rows (parameters' too, issue 37, the
    # check's verdict riding in them), a histogram per record, the loss
    assert calls[0] == 8 * len(TAPS) + 2 + len(TAPS) * BATCH + HIST_BINS * len(TAPS) + 1
    assert np.isfinite(recs.update_norm).sum() == 2


def test_train_records_update_norms_and_value_norms_of_the_step_that_made_them(tmp_path: Path, strategy: str) -> None:
    # cosine: a and b are scalars, SGD without momentum: a_{s+1} = a_s - lr * g_s.
    train(compose_cfg("+experiment=cosine", "steps=4", f"capture.strategy={strategy}"), out_dir=tmp_path)
    df = pd.read_parquet(tmp_path / "grads.parquet")
    lr, x = 0.05, np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    a = df[df.tap == ":a"].sort_values("step")
    np.testing.assert_allclose(a.value_norm.iloc[0], 1.0)  # the initial a
    np.testing.assert_allclose(a.update_norm, lr * np.abs(a["mean"]), rtol=1e-5)
    np.testing.assert_allclose(a.value_norm.to_numpy()[1:], np.abs(a.value_norm - lr * a["mean"]).to_numpy()[:-1], rtol=1e-5)
    np.testing.assert_allclose(a.update_ratio, a.update_norm / a.value_norm, rtol=1e-12)
    mul_x = df[df.tap == ":mul_x"].sort_values("step")  # the local a * x, with a before each step
    np.testing.assert_allclose(mul_x.value_norm, a.value_norm.to_numpy() * np.linalg.norm(x), rtol=1e-5)
    assert mul_x.update_norm.isna().all() and mul_x.update_ratio.isna().all()


OLD_COLUMNS = ["step", "tap", "call", "numel", "norm", "mean", "std", "min", "max", "abs_max", "zero_frac",
               "nan_count", "inf_count", "loss", "has_grad"]  # fmt: skip


def test_options_are_off_by_default_and_the_old_columns_are_as_before_this_issue(tmp_path: Path) -> None:
    cfg = compose_cfg("+experiment=cosine", "steps=5", "seed=3")
    assert cfg.capture.per_example is False and cfg.capture.histogram is False
    train(cfg, out_dir=tmp_path)
    df = pd.read_parquet(tmp_path / "grads.parquet")
    assert "per_example_norm" not in df.columns and "hist_counts" not in df.columns
    assert df.columns[-6:].tolist() == ["value_norm", "update_norm", "update_ratio", "micro_step", "edited", "edited_norm"]
    assert HIST_EDGES_KEY.encode() not in pq.read_schema(tmp_path / "grads.parquet").metadata
    # written by the commit before this issue (682a83f) with the same config and seed
    before = pd.DataFrame(json.loads((TESTS / "data" / "cosine_before_issue15.json").read_text()))
    pd.testing.assert_frame_equal(df[OLD_COLUMNS].reset_index(drop=True), before, check_dtype=False, rtol=1e-6)


def test_turning_the_options_on_changes_no_other_column(tmp_path: Path) -> None:
    on = ("capture.per_example=true", "capture.histogram=true", "capture.values=sample")
    train(compose_cfg("+experiment=mlp", "steps=2", "capture.values=sample"), out_dir=tmp_path / "off")
    train(compose_cfg("+experiment=mlp", "steps=2", *on), out_dir=tmp_path / "on")
    off, with_options = (pd.read_parquet(tmp_path / n / "grads.parquet") for n in ("off", "on"))
    assert with_options.columns.tolist() == [*off.columns, "per_example_norm", "hist_counts"]
    keep = [c for c in off.columns if c not in ("run_id", "values", "shape")]
    pd.testing.assert_frame_equal(off[keep], with_options[keep])
    assert all(np.array_equal(a, b) for a, b in zip(off["values"], with_options["values"], strict=True))
    meta = pq.read_schema(tmp_path / "on" / "grads.parquet").metadata
    assert json.loads(meta[HIST_EDGES_KEY.encode()]) == list(HIST_EDGES)
    params = with_options.name == "weight"  # a parameter's rows: the batch's (issue 37), as its activations'
    batch = with_options.loc[~params, "shape"].str[0]
    assert with_options.loc[~params, "per_example_norm"].map(len).eq(batch).all()
    assert with_options.loc[params, "per_example_norm"].map(len).eq(batch.iloc[0]).all()
    assert (with_options.hist_counts.map(sum) == with_options.numel).all()


def test_a_bad_option_value_or_a_misspelled_option_is_refused_naming_it(tmp_path: Path) -> None:
    bad = gradrunner_in_process(tmp_path, "+experiment=cosine", "steps=1", "capture.per_example=maybe")
    # Hydra's own type check of the schema's bool (as for steps=abc): exit 1, key and value named
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "capture.per_example" in bad.stderr and "maybe" in bad.stderr
    typo = gradrunner_in_process(tmp_path, "+experiment=cosine", "steps=1", "capture.histogramm=true")
    assert typo.returncode == 2 and "capture.histogram" in typo.stderr and "Traceback" not in typo.stderr
    assert not list(tmp_path.rglob("grads.parquet"))


@pytest.mark.slow
def test_cli_run_with_both_options_and_its_report(tmp_path: Path) -> None:
    check_ok(gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=4", "capture.per_example=true",
                                   "capture.histogram=true", "report=true"))  # fmt: skip
    (job,) = job_dirs(tmp_path)
    df = pd.read_parquet(job / "grads.parquet")
    assert {"per_example_norm", "hist_counts", "value_norm", "update_norm", "update_ratio"} <= set(df.columns)
    weights = df[df.name == "weight"]
    assert (weights.update_norm > 0).all() and (weights.update_ratio > 0).all()
    page = (job / "report.html").read_text()
    for title in ("Gradient histograms over steps", "Update-to-weight ratio", "Per-example gradient norms"):
        assert title in page, title


@pytest.mark.slow
def test_a_sweep_where_only_some_jobs_have_the_options_loads_and_reports(tmp_path: Path) -> None:
    from gradrunner.analysis import load, run_columns, update_ratios

    check_ok(gradrunner_in_process(tmp_path, "-m", "+experiment=cosine", "steps=2", "capture.histogram=false,true",
                                   "capture.per_example=false,true", "report=true"))  # fmt: skip
    (sweep,) = sorted(tmp_path.glob("multirun/*/*"))
    df = load(sweep)
    assert df.run_id.nunique() == 4 and {"capture.histogram", "capture.per_example"} <= set(run_columns(df))
    with_hist = df["capture.histogram"].astype(str).str.lower() == "true"
    assert df.loc[with_hist, "hist_counts"].notna().all() and df.loc[~with_hist, "hist_counts"].isna().all()
    # runs x (a at 2 steps + b at step 1): b starts at 0, so its step-0 ratio is undefined (null)
    assert len(update_ratios(df)) == 4 * 3
    b0 = df[(df.tap == ":b") & (df.step == 0)]
    assert (b0.value_norm == 0).all() and (b0.update_norm > 0).all() and b0.update_ratio.isna().all()
    assert "Gradient histograms over steps" in (sweep / "report.html").read_text()


def test_runs_recorded_before_the_options_existed_still_resume() -> None:
    from gradrunner.run.config_compare import config_diff

    old = {"capture": {"strategy": "hook"}, "steps": 2}
    assert config_diff(old, {"capture": {"strategy": "hook", "per_example": False, "histogram": False}, "steps": 2}) == []
    assert config_diff(old, {"capture": {"strategy": "hook", "per_example": False, "histogram": True}, "steps": 2}) == [
        "capture.histogram: '<unset>' -> True"
    ]
