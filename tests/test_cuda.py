"""CUDA: statistics on the device against numpy float64, no host sync inside hooks, one transfer a step.

All skipped without a GPU. One command runs them: `python -m pytest -q tests/test_cuda.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hist_cases import edge_neighbours, wide_gradient
from torch import nn

import gradrunner.capturing.stats as stats
from gradrunner import capture
from gradrunner.capturing import fused_stats, fused_triton
from gradrunner.capturing.extras import histogram_counts
from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.models import MLP
from gradrunner.records.columns import COUNT_COLUMNS, STAT_COLUMNS, TapKey

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 2049, stats.DEFER_NUMEL, stats.DEFER_NUMEL + 1, 1 << 20]
TAPS = ["fc*:output", "relu*:output", "head:output", "fc1:weight"]


def _gradient(n: int, dtype: torch.dtype, special: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 0.5).to(dtype)
    if n > 3 and special == "nan_inf":
        g[1], g[2], g[3] = math.nan, math.inf, -0.0
    return g


def _numpy_stats(g: torch.Tensor) -> dict[str, float]:
    d = g.double().numpy()
    finite = d[np.isfinite(d)]
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "norm": float(np.sqrt((d * d).sum())), "mean": float(d.mean()),
            "std": float(d.std(ddof=1)) if d.size > 1 else math.nan,
            "min": float(d.min()), "max": float(d.max()), "abs_max": float(np.abs(d).max()),
            "zero_frac": float((d == 0).mean()),
            "nan_count": int(np.isnan(d).sum()), "inf_count": int(np.isinf(d).sum()), "finite": finite.size,
        }  # fmt: skip


def _check(g: torch.Tensor, rel: float) -> None:
    col = stats.Collector(values="none")
    col.add(TapKey("fc1", "output", 0), g.cuda())
    row = col.finish().row(0)
    want = _numpy_stats(g)
    for c in COUNT_COLUMNS:
        assert row[c] == want[c], c
    for c in STAT_COLUMNS:
        assert row[c] == pytest.approx(want[c], rel=rel, abs=1e-12, nan_ok=True), (c, row[c], want[c])


@pytest.mark.skipif(fused_triton.triton is None, reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("special", ["plain", "nan_inf"])
def test_triton_statistics_match_numpy_float64(dtype: torch.dtype, n: int, special: str) -> None:
    _check(_gradient(n, dtype, special), rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_torch_path_statistics_match_numpy(dtype: torch.dtype, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton: chunked float32 sums added in float64, no float64 copy of the gradient."""
    monkeypatch.setattr(fused_triton, "triton", None)
    _check(_gradient(n, dtype, "plain"), rel=1e-12 if dtype == torch.float64 else 1e-6)


@contextmanager
def _syncs_raise(on: bool) -> Iterator[None]:
    """Inside: any host sync raises (when `on`; the first step compiles kernels and fills caches)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if on else "default")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def model_and_batch() -> Iterator[tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    yield MLP(32, 64, 4, 8).cuda(), torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_no_host_sync_inside_forward_and_backward(
    strategy: str, model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor]
) -> None:
    model, x, y = model_and_batch
    with capture(model, TAPS, strategy=strategy, keep_grads=False) as cap:
        for step in range(2):  # the first step compiles kernels and fills caches, the second is checked
            model.zero_grad(set_to_none=True)
            with _syncs_raise(step > 0):
                loss = nn.functional.mse_loss(model(x), y)
                cap.backward(loss)
            recs = cap.records(loss)
    assert len(recs) >= 10 and bool(np.all(recs.has_grad))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_one_transfer_per_captured_step(
    strategy: str, model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x, y = model_and_batch
    calls: list[str] = []
    real = stats.to_host
    monkeypatch.setattr(stats, "to_host", lambda t: calls.append(str(t.device)) or real(t))
    with capture(model, TAPS, strategy=strategy, keep_grads=False) as cap:
        loss = nn.functional.mse_loss(model(x), y)
        cap.backward(loss)
        cap.records(loss)
    assert calls == ["cuda:0"]


def test_cuda_records_match_cpu_records(model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = model_and_batch
    model, x, y = model.double(), x.double(), y.double()
    out = {}
    for device in ("cpu", "cuda"):
        model.to(device).zero_grad(set_to_none=True)
        with capture(model, TAPS, strategy="hook", keep_grads=False) as cap:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            cap.backward(loss)
            out[device] = cap.records(loss)
    for c in STAT_COLUMNS:
        np.testing.assert_allclose(out["cuda"].stats[c], out["cpu"].stats[c], rtol=1e-9, atol=1e-15)
    for c in COUNT_COLUMNS:
        np.testing.assert_array_equal(out["cuda"].counts[c], out["cpu"].counts[c])


def test_small_gradients_give_the_same_bits_on_every_run() -> None:
    """The batch of small gradients sums in a fixed order: `index_add_`'s atomics made the last bits of a
    float64 sum differ between two runs of one config on an H100 (`test_runner`'s same-seed test failed)."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, stats.DEFER_NUMEL // 8, (120,), generator=gen).tolist()
    grads = [torch.randn(8, n, generator=gen).cuda() for n in sizes]
    runs = []
    for _ in range(4):
        col = stats.Collector(values="none", per_example=True)
        for i, g in enumerate(grads):
            col.add(TapKey(f"t{i}", "output", 0), g, mutable=False)
        recs = col.finish()
        assert recs.per_example_norm is not None
        runs.append((np.stack([recs.stats[c] for c in STAT_COLUMNS]), np.concatenate(recs.per_example_norm)))  # type: ignore[arg-type]
    for stat_block, rows in runs[1:]:
        np.testing.assert_array_equal(stat_block, runs[0][0])
        np.testing.assert_array_equal(rows, runs[0][1])


def test_no_host_sync_with_every_extra_statistic(model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = model_and_batch
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture(model, TAPS, strategy="hook", keep_grads=False, per_example=True, histogram=True) as cap:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            with _syncs_raise(step > 0):
                loss = nn.functional.mse_loss(model(x), y)
                cap.backward(loss)
                before = cap.snapshot_params()
                opt.step()
            recs = cap.records(loss, before)
    assert recs.hist_counts is not None and recs.per_example_norm is not None
    assert np.isfinite(recs.update_norm[[k.tap == "fc1:weight" for k in recs.keys]]).all()


def test_cuda_extra_columns_match_cpu(model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = model_and_batch
    model, x, y = model.double(), x.double(), y.double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for device in ("cpu", "cuda"):
        model.load_state_dict(state)
        model.to(device).zero_grad(set_to_none=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
        with capture(model, TAPS, strategy="hook", keep_grads=False, per_example=True, histogram=True) as cap:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            cap.backward(loss)
            before = cap.snapshot_params()
            opt.step()
            out[device] = cap.records(loss, before)
    cpu, cuda = out["cpu"], out["cuda"]
    for c in ("value_norm", "update_norm", "update_ratio"):
        np.testing.assert_allclose(getattr(cuda, c), getattr(cpu, c), rtol=1e-9, equal_nan=True)
    for a, b in zip(cuda.per_example_norm, cpu.per_example_norm, strict=True):  # type: ignore[arg-type]
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-9)
    for a, b in zip(cuda.hist_counts, cpu.hist_counts, strict=True):  # type: ignore[arg-type]
        np.testing.assert_array_equal(a, b)


def test_float32_value_norms_on_cuda_match_float64(model_and_batch: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = model_and_batch
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda _m, _a, out, n=n: outputs.__setitem__(n, out.detach()))
               for n, m in model.named_modules() if n.startswith(("fc", "relu"))]  # fmt: skip
    try:
        with capture(model, ["fc*:output", "relu*:output", "fc1:weight"], strategy="hook", keep_grads=False) as cap:
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            recs = cap.records(loss)
    finally:
        for h in handles:
            h.remove()
    got = dict(zip([k.tap for k in recs.keys], recs.value_norm, strict=True))
    want = {f"{n}:output": float(torch.linalg.vector_norm(o.double().cpu())) for n, o in outputs.items()}
    want["fc1:weight"] = float(torch.linalg.vector_norm(model.fc1.weight.detach().double().cpu()))
    for tap, norm in want.items():
        assert got[tap] == pytest.approx(norm, rel=1e-5), tap


def _wide(n: int, dtype: torch.dtype) -> torch.Tensor:
    """`hist_cases.wide_gradient` and `edge_neighbours` in `dtype`, with zeros, -0, NaN, ±Inf and subnormals of
    `dtype` whatever n (the wide gradient has its own from 8 elements)."""
    tiny = torch.finfo(dtype).tiny
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, tiny / 4, -tiny / 2, tiny], dtype=torch.float64)
    return torch.cat([wide_gradient(n, dtype, seed=n), edge_neighbours().to(dtype), special.to(dtype)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 7, stats.DEFER_NUMEL + 1, 1 << 20])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_cuda_histogram_counts_equal_the_cpus(dtype: torch.dtype, n: int, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The Triton histogram (one launch) and the torch ops' give the CPU's counts, bit for bit, and neither syncs."""
    if path == "triton" and fused_triton.triton is None:
        pytest.skip("triton is not installed")
    if path == "torch":
        monkeypatch.setenv("GRADRUNNER_FUSED", "0")
    g = _wide(n, dtype)
    want = histogram_counts(g)
    on_gpu = g.cuda()
    fused_stats.histogram_counts(on_gpu)  # the first call compiles the kernel
    with _syncs_raise(True):
        got = fused_stats.histogram_counts(on_gpu)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want), (got.cpu() - want).nonzero()


@pytest.mark.parametrize("seed", [0, 49, 180])
def test_per_example_parameter_norms_under_cuda_bf16_autocast_match_a_row_loop(seed: int) -> None:
    """Parameter taps' per-example norms on the GPU under bf16 autocast (cuBLAS's GEMMs, which may split K): every
    layer type of a small sequence model keeps its rows (the per-step check's bf16 tolerance holds there too) and
    they agree with each row backwarded alone under the same autocast."""
    from per_example_reference import all_params, assert_matches, batched, loop

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 64), nn.RMSNorm(64),
                          nn.Linear(64, 8)).cuda()  # fmt: skip
    x, y = torch.randn(4, 96, 64, device="cuda"), torch.randn(4, 96, 8, device="cuda")

    def rows_loss(out: torch.Tensor, i: int) -> torch.Tensor:
        return ((out.float() - y[i : i + 1]) ** 2).sum()

    params = all_params(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = loop(model, {"input": x}, rows_loss, params)[0]
        got, reasons = batched(model, {"input": x}, rows_loss, params)
    on_cpu = {name: None if norms is None else norms.cpu() for name, norms in got.items()}  # the loop's are on the CPU
    assert_matches(on_cpu, ref, reasons, rtol=1e-2)


def test_a_weight_penalty_under_cuda_bf16_autocast_nulls_the_rows() -> None:
    """The same check's other side on the GPU: a penalty worth a fifth of a Linear weight's gradient is caught."""
    from gradrunner.capturing.per_example import OUTSIDE, PerExampleNorms

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    x, y = torch.randn(8, 96, 64, device="cuda"), torch.randn(8, 96, 8, device="cuda")
    weight = model[0].weight

    def data() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return ((model(x).float() - y) ** 2).sum() / 8

    def penalty() -> torch.Tensor:
        return 30.0 * (weight**2).sum()

    with PerExampleNorms(model, [("0:weight", model[0], weight)]) as pex:
        (data() + penalty()).backward()
        norms, reasons = pex.norms(), pex.reasons()
    model.zero_grad()
    data().backward()
    of_data = weight.grad.norm()
    model.zero_grad()
    penalty().backward()
    assert weight.grad.norm() > 0.15 * of_data  # rows without the penalty would be far from .grad
    assert norms["0:weight"] is None and reasons["0:weight"] == OUTSIDE
