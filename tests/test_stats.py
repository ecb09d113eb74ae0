"""`gradrunner.capturing.stats`: statistics against torch's own, values, and fixed sample positions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradrunner.capturing.stats
from gradrunner import capture
from gradrunner.capturing.stats import Collector, sample_positions
from gradrunner.models import MLP
from gradrunner.records.columns import COUNT_COLUMNS, STAT_COLUMNS, TapKey

KEY = TapKey("fc1", "output", 0)
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
#: torch's own statistics, the reference, are float32 for gradients narrower than float64 (gradrunner's are summed
#: in float64): within float32 rounding of them.
RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 2e-5}


@pytest.fixture(autouse=True, params=["per_tap", "batched"])
def reduction_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every statistics test runs twice: gradients reduced one by one, and batched at finish."""
    monkeypatch.setattr(gradrunner.capturing.stats, "DEFER_NUMEL", 0 if request.param == "per_tap" else 1 << 30)
    return str(request.param)


def _grad(kind: str, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(11)
    g = torch.randn(7, 13, dtype=torch.float64)
    if kind == "zeros_and_negative_zeros":
        g[0, :5] = 0.0
        g[1, :4] = -0.0
    elif kind == "nan":
        g[2, 3] = math.nan
        g[4, 0] = math.nan
    elif kind == "inf":
        g[0, 0] = math.inf
        g[5, 1] = -math.inf
        g[3, 3] = math.inf
    elif kind == "nan_and_inf":
        g[0, 0] = math.nan
        g[1, 1] = -math.inf
    elif kind == "single":
        g = torch.tensor([[-2.5]], dtype=torch.float64)
    elif kind == "all_zero":
        g = torch.zeros(3, 2, dtype=torch.float64)
        g[0, 0] = -0.0
    return g.to(dtype)


def _expected(g: torch.Tensor) -> dict[str, float]:
    """torch's own statistics, on the gradient's exact values widened to float64."""
    d = g.double()
    return {
        "norm": float(d.norm()),
        "mean": float(d.mean()),
        "std": float(d.std()) if d.numel() > 1 else math.nan,
        "min": float(d.min()),
        "max": float(d.max()),
        "abs_max": float(d.abs().max()),
        "zero_frac": float((d == 0).double().mean()),
        "nan_count": int(d.isnan().sum()),
        "inf_count": int(d.isinf().sum()),
    }


def _one(g: torch.Tensor | None, values: str = "none") -> gradrunner.capturing.stats.StepRecords:
    col = Collector(values=values)
    col.add(KEY, g)
    return col.finish()


KINDS = ["normal", "zeros_and_negative_zeros", "nan", "inf", "nan_and_inf", "single", "all_zero"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_match_torch(kind: str, dtype: torch.dtype) -> None:
    g = _grad(kind, dtype)
    row = _one(g).row(0)
    expected = _expected(g)
    for col in STAT_COLUMNS:
        assert row[col] == pytest.approx(expected[col], rel=RTOL[dtype], abs=1e-12, nan_ok=True), col
    for col in COUNT_COLUMNS:
        assert row[col] == expected[col], col
    assert row["has_grad"] is True
    assert row["shape"] == list(g.shape) and row["numel"] == g.numel()


def test_negative_zeros_count_as_zeros() -> None:
    g = torch.tensor([0.0, -0.0, -0.0, 1.0, -2.0])
    assert _one(g).row(0)["zero_frac"] == pytest.approx(3 / 5)


def test_nan_and_inf_counts() -> None:
    g = torch.tensor([math.nan, math.inf, -math.inf, math.nan, math.nan, 1.0], dtype=torch.float16)
    row = _one(g).row(0)
    assert (row["nan_count"], row["inf_count"]) == (3, 2)
    assert math.isnan(row["norm"]) and math.isnan(row["mean"])


def test_single_element_gradient() -> None:
    row = _one(torch.tensor([-3.0], dtype=torch.float64)).row(0)
    assert (row["norm"], row["mean"], row["min"], row["max"], row["abs_max"]) == (3.0, -3.0, -3.0, -3.0, 3.0)
    assert math.isnan(row["std"])  # unbiased, as torch.std: undefined for one element
    assert row["zero_frac"] == 0.0


def test_empty_gradient_is_recorded_with_nan_statistics() -> None:
    row = _one(torch.zeros(0, 4)).row(0)
    assert row["has_grad"] is True and row["numel"] == 0 and row["shape"] == [0, 4]
    for col in ("mean", "std", "min", "max", "abs_max", "zero_frac"):
        assert math.isnan(row[col]), col  # torch: mean, std, (g == 0).mean() are nan; min/max raise
    assert (row["nan_count"], row["inf_count"]) == (0, 0)


def test_empty_gradient_norm_is_zero() -> None:
    assert _one(torch.zeros(0, 4)).row(0)["norm"] == float(torch.zeros(0, 4).norm()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=lambda o: f"offset{o}")
def test_std_of_a_gradient_with_a_small_offset(dtype: torch.dtype, offset: float) -> None:
    torch.manual_seed(5)
    g = (offset + torch.randn(1000, dtype=torch.float64)).to(dtype)
    assert _one(g).row(0)["std"] == pytest.approx(float(g.double().std()), rel=RTOL[dtype])


def test_std_of_a_float32_gradient_with_a_large_common_offset() -> None:
    torch.manual_seed(5)
    g = (10.0 + 1e-3 * torch.randn(1000, dtype=torch.float64)).float()
    assert float(g.std()) == pytest.approx(float(g.double().std()), rel=1e-3)  # torch's own float32 std
    assert _one(g).row(0)["std"] == pytest.approx(float(g.double().std()), rel=1e-3)


def test_missing_gradient_is_a_row_without_gradient() -> None:
    col = Collector(values="full")
    col.add(KEY, torch.ones(3))
    col.add(TapKey("fc2", "output", 0), None)
    recs = col.finish()
    row = recs.row(1)
    assert row["has_grad"] is False and row["numel"] == 0 and row["values"] is None
    assert all(math.isnan(row[c]) for c in STAT_COLUMNS)
    assert (row["nan_count"], row["inf_count"]) == (0, 0)
    assert recs.row(0)["norm"] == pytest.approx(math.sqrt(3))


def test_records_are_kept_in_firing_order() -> None:
    col = Collector()
    col.add(TapKey("b", "output", 0), torch.full((2,), 2.0), order=1)
    col.add(TapKey("a", "output", 0), torch.full((2,), 1.0), order=0)
    recs = col.finish()
    assert [k.module for k in recs.keys] == ["a", "b"]
    assert list(recs.stats["mean"]) == [1.0, 2.0]


def test_loss_rides_along() -> None:
    col = Collector()
    col.add(KEY, torch.ones(2))
    assert col.finish(torch.tensor(0.25, dtype=torch.float64)).loss == 0.25


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_values_are_the_flattened_gradient(dtype: torch.dtype) -> None:
    g = _grad("nan_and_inf", dtype).reshape(7, 13)
    values = _one(g, values="full").values
    assert values is not None and values[0].dtype == np.float32
    np.testing.assert_array_equal(values[0], g.flatten().float().numpy())


def test_full_values_do_not_alias_the_gradient() -> None:
    g = torch.arange(6.0)
    col = Collector(values="full")
    col.add(KEY, g)
    g.zero_()
    np.testing.assert_array_equal(col.finish().values[0], np.arange(6.0, dtype=np.float32))


@pytest.mark.parametrize("values, transfers", [("none", 1), ("full", 2), ("sample", 2)])
def test_one_transfer_per_step_however_many_gradients(
    monkeypatch: pytest.MonkeyPatch, values: str, transfers: int
) -> None:
    counts = []
    real = gradrunner.capturing.stats.to_host
    monkeypatch.setattr(gradrunner.capturing.stats, "to_host", lambda t: counts.append(1) or real(t))
    for n in (1, 40):
        counts.clear()
        col = Collector(values=values, sample_size=3)
        for i in range(n):
            col.add(TapKey(f"m{i}", "output", 0), torch.randn(5))
        col.add(TapKey("none", "output", 0), None)
        recs = col.finish(torch.tensor(1.0))
        assert len(recs) == n + 1
        assert len(counts) == transfers


# -- sampled values --------------------------------------------------------------------------------
def test_sample_positions_are_fixed_sorted_and_in_range() -> None:
    pos = sample_positions("fc1:output", 1000, 16, seed=0)
    assert len(pos) == 16 and len(set(pos.tolist())) == 16
    assert (np.diff(pos) > 0).all() and pos.min() >= 0 and pos.max() < 1000
    np.testing.assert_array_equal(pos, sample_positions("fc1:output", 1000, 16, seed=0))
    assert not np.array_equal(pos, sample_positions("fc1:output", 1000, 16, seed=1))
    assert not np.array_equal(pos, sample_positions("fc2:output", 1000, 16, seed=0))
    np.testing.assert_array_equal(sample_positions("fc1:output", 5, 16, seed=0), np.arange(5))


def test_sampled_values_are_the_gradient_at_the_positions_every_step() -> None:
    col = Collector(values="sample", sample_size=8, seed=3)
    positions = []
    for step in range(3):
        g = torch.randn(10, 10) * (step + 1)
        col.add(KEY, g)
        recs = col.finish()
        assert recs.positions is not None and recs.values is not None
        np.testing.assert_array_equal(recs.values[0], g.flatten()[torch.from_numpy(recs.positions[0])].numpy())
        positions.append(recs.positions[0])
    assert len(positions[0]) == 8
    for pos in positions[1:]:
        np.testing.assert_array_equal(pos, positions[0])
    np.testing.assert_array_equal(positions[0], sample_positions(KEY.tap, 100, 8, seed=3))


def test_sample_positions_identical_across_strategies_and_steps(strategy: str) -> None:
    """Each strategy's sampled positions equal the seeded positions; values are the grads there."""
    torch.manual_seed(0)
    model = MLP(in_features=3, hidden=16, depth=2, out_features=2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    taps = ["fc1:output", "fc2:weight", "relu2:output"]
    with capture(model, taps, strategy=strategy, values="sample", sample_size=5, seed=9, keep_grads=False) as cap:
        for _ in range(2):
            model.zero_grad()
            out = model(x)
            loss = 0.5 * ((out - y) ** 2).sum()
            cap.backward(loss)
            recs = cap.records(loss)
            assert recs.positions is not None and recs.values is not None
            for i, key in enumerate(recs.keys):
                numel = recs.row(i)["numel"]
                np.testing.assert_array_equal(recs.positions[i], sample_positions(key.tap, numel, 5, seed=9))
    # the values at those positions are the gradients of the last step
    exact = {
        "fc1:output": _output_grad(model, "fc1", x, y),
        "fc2:weight": torch.autograd.grad(0.5 * ((model(x) - y) ** 2).sum(), [model.fc2.weight])[0],
        "relu2:output": _output_grad(model, "relu2", x, y),
    }
    for i, key in enumerate(recs.keys):
        flat = exact[key.tap].flatten().float()
        np.testing.assert_allclose(recs.values[i], flat[torch.from_numpy(recs.positions[i])].numpy(), rtol=2e-7)


def _output_grad(model: torch.nn.Module, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient at a module's output, by a plain forward hook adding a zero delta."""
    module = dict(model.named_modules())[path]
    holder: list[torch.Tensor] = []

    def hook(mod: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        delta = torch.zeros_like(out, requires_grad=True)
        holder.append(delta)
        return out + delta

    handle = module.register_forward_hook(hook)
    try:
        loss = 0.5 * ((model(x) - y) ** 2).sum()
    finally:
        handle.remove()
    return torch.autograd.grad(loss, holder)[0]


@pytest.mark.parametrize("fused", ["1", "0"])
def test_the_norm_of_float32_elements_near_1e20_is_finite(fused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # their squares (1e40) are beyond float32 (3.4e38); the norm (~1e22) is not. float64 numpy is the reference.
    monkeypatch.setenv("GRADRUNNER_FUSED", fused)
    g = (torch.randn(20_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1e20).float()
    row = _one(g).row(0)
    want = float(np.sqrt(np.sum(g.double().numpy() ** 2)))
    assert (row["nan_count"], row["inf_count"]) == (0, 0)
    assert row["norm"] == pytest.approx(want, rel=1e-12)


def test_the_accelerator_sum_of_squares_is_float64_from_the_first_element() -> None:
    # `_device_sums` is the CUDA path without the fused kernel; it takes any tensor, so it runs here too
    from gradrunner.capturing.reductions import _device_sums

    g = (torch.randn(3 * 4096 + 17, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 1e20).float()
    d = g.double().numpy()
    s, ss = _device_sums(g)
    assert float(ss) == pytest.approx(float(np.sum(d * d)), rel=1e-12)
    assert float(s) == pytest.approx(float(np.sum(d)), rel=1e-5, abs=1e-6 * float(np.sum(np.abs(d))))


@pytest.mark.parametrize("fused", ["1", "0"], ids=["kernel", "GRADRUNNER_FUSED=0"])
@pytest.mark.parametrize("spread", [1e-4, 1e-6])
def test_std_next_to_a_large_mean_within_the_documented_limit(
    spread: float, fused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README (Statistics): std comes from float64 sums in one read, so where spread << |mean| its relative error is
    about 1e-15 * (mean/std)^2 (bounded here by 4e-15 * (mean/std)^2), unlike numpy's two-pass std."""
    monkeypatch.setenv("GRADRUNNER_FUSED", fused)
    gen = torch.Generator().manual_seed(0)
    g = 1.0 + spread * torch.randn(20_000, generator=gen, dtype=torch.float64)
    col = Collector(values="none")
    col.add(KEY, g)
    row = col.finish().row(0)
    want = g.numpy().std(ddof=1)
    assert abs(row["std"] - want) <= 4e-15 * (g.numpy().mean() / want) ** 2 * want
    assert row["mean"] == pytest.approx(g.numpy().mean(), rel=1e-15)
