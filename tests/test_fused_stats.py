"""`gradrunner.capturing.fused_stats`: the one-pass kernel against numpy in float64 and the torch path."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hist_cases import edge_neighbours, float64_beyond_float32, wide_gradient

from gradrunner.capturing import fused_stats
from gradrunner.capturing.stats import DEFER_NUMEL, Collector
from gradrunner.records.columns import COUNT_COLUMNS, HIST_BINS, HIST_EDGES, STAT_COLUMNS, TapKey

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 2, 7, 4095, 4096, 4097, 2 * 4096 + 7, DEFER_NUMEL - 1, DEFER_NUMEL, DEFER_NUMEL + 1, 3 * DEFER_NUMEL + 5]



@pytest.fixture
def kernel() -> None:
    """Skips where no kernel could be built; builds it on first use (never while collecting tests)."""
    if not fused_stats.cpu_available():
        pytest.skip("no C compiler: fused kernel not built")


needs_kernel = pytest.mark.usefixtures("kernel")


def _gradient(n: int, dtype: torch.dtype, special: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 0.5).to(dtype)
    if n:
        at = torch.randint(0, n, (3,), generator=gen)
        if special == "zeros":
            g[at] = torch.tensor([0.0, -0.0, 0.0], dtype=dtype)
        elif special == "nan":
            g[at[0]] = math.nan
        elif special == "inf":
            g[at[0]], g[at[-1]] = math.inf, -math.inf
    return g


def _numpy_reductions(g: torch.Tensor) -> list[float]:
    d = g.double().numpy()
    if d.size == 0:
        return [0.0, 0.0, math.inf, -math.inf, 0, 0, 0]
    with np.errstate(invalid="ignore", over="ignore"):
        return [
            float(d.sum()), float((d * d).sum()), float(d.min()), float(d.max()),
            int(np.count_nonzero(d)), int(np.isnan(d).sum()), int(np.isinf(d).sum()),
        ]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("special", ["plain", "zeros", "nan", "inf"])
def test_kernel_matches_numpy_float64(dtype: torch.dtype, n: int, special: str) -> None:
    g = _gradient(n, dtype, special, seed=n + len(special))
    out = torch.full((7,), -1.0, dtype=torch.float64)
    assert fused_stats.reduce_into(g, out)
    got, want = out.tolist(), _numpy_reductions(g)
    scale = float(g.double().abs().nan_to_num(posinf=0.0).sum()) + 1.0
    for i in (0, 1):  # float64 rounding of a sum of n terms: relative to the sum of magnitudes
        if math.isfinite(want[i]):
            bound = scale * (scale if i == 1 else 1.0) * 1e-13
            assert abs(got[i] - want[i]) <= bound, (i, got, want)
        else:
            assert not math.isfinite(got[i])
    if special != "nan" and n:
        assert got[2:4] == want[2:4]
    assert got[4:] == want[4:]


def _records(g: torch.Tensor, fused: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    monkeypatch.setenv("GRADRUNNER_FUSED", "1" if fused else "0")
    col = Collector(values="none")
    col.add(TapKey("fc1", "output", 0), g)
    return col.finish().row(0)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("special", ["plain", "zeros", "nan", "inf"])
def test_statistics_match_the_torch_path(
    dtype: torch.dtype, n: int, special: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = _gradient(n, dtype, special, seed=7 * n + 1)
    fused, reference = _records(g, True, monkeypatch), _records(g, False, monkeypatch)
    for col in COUNT_COLUMNS:
        assert fused[col] == reference[col], col
    # Both paths sum in float64 (the torch path widens a large narrow gradient chunk by chunk).
    for col in STAT_COLUMNS:
        assert fused[col] == pytest.approx(reference[col], rel=1e-12, abs=1e-12, nan_ok=True), col


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_unfused_large_gradient_is_summed_in_float64(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRADRUNNER_FUSED=0 (or no compiler): a gradient over DEFER_NUMEL took its sums in its own dtype (norm and
    std 6e-7 off for float32, 2e-6 for bfloat16); now they are float64's, as numpy's."""
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(200_000, generator=gen) * 1e-4 + 3e-7).to(dtype)
    row = _records(g, False, monkeypatch)
    a = g.double().numpy()
    want = {"norm": np.linalg.norm(a), "mean": a.mean(), "std": a.std(ddof=1)}
    for col, value in want.items():
        assert row[col] == pytest.approx(value, rel=1e-12), col


@needs_kernel
def test_no_float64_copy_and_no_deferred_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel reads the gradient where it is: nothing kept, nothing widened."""
    monkeypatch.setenv("GRADRUNNER_FUSED", "1")
    col = Collector(values="none")
    small = torch.randn(DEFER_NUMEL // 2)
    col.add(TapKey("a", "output", 0), small)
    pending = col._pending[0]
    assert pending.deferred is None and pending.reductions == 0  # row 0 of the collector's float64 buffer
    assert col._rows.dtype == torch.float64 and col._rows.shape[1] == 7


def test_failed_build_falls_back_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fused_stats, "_cpu_tried", False)
    monkeypatch.setattr(fused_stats, "_cpu_kernels", None)
    monkeypatch.setenv("GRADRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/compiler")
    monkeypatch.setenv("GRADRUNNER_FUSED", "1")
    g = torch.tensor([3.0, -4.0, 0.0])
    with caplog.at_level(logging.INFO, logger=fused_stats.__name__):
        assert not fused_stats.reduce_into(g, torch.empty(7, dtype=torch.float64))
        row = _records(g, True, monkeypatch)
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] != []
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert row["norm"] == 5.0 and row["zero_frac"] == pytest.approx(1 / 3)


def test_turned_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADRUNNER_FUSED", "0")
    assert not fused_stats.reduce_into(torch.ones(3), torch.empty(7, dtype=torch.float64))


@needs_kernel
def test_non_contiguous_and_other_dtypes_are_declined() -> None:
    out = torch.empty(7, dtype=torch.float64)
    assert not fused_stats.reduce_into(torch.ones(4, 4).t().reshape(-1)[::2], out)
    assert not fused_stats.reduce_into(torch.ones(4, dtype=torch.int64), out)



_INTERPRETED = """
import json, sys, torch
from gradrunner.capturing import fused_triton
out = torch.empty(7, dtype=torch.float64)
results = []
for path in sys.argv[1:]:
    if path.endswith(".hist.pt"):
        results.append(fused_triton.launch_hist(torch.load(path), sms=2).tolist())
    else:
        fused_triton.launch(torch.load(path), out, sms=2)
        results.append(out.tolist())
print(json.dumps(results))
"""


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


@pytest.mark.slow
def test_triton_kernel_under_the_interpreter(tmp_path: Path) -> None:
    """The CUDA kernels' arithmetic, run on CPU by Triton's interpreter (skipped without triton): the statistics,
    and the |g| histogram against numpy's counts over the whole float range and next to every edge."""
    pytest.importorskip("triton")
    cases = [(dtype, n, special) for dtype in DTYPES for n in (1, 2049, 3 * DEFER_NUMEL + 5)
             for special in ("plain", "zeros", "nan", "inf")]  # fmt: skip
    paths = []
    for i, (dtype, n, special) in enumerate(cases):
        paths.append(str(tmp_path / f"{i}.pt"))
        torch.save(_gradient(n, dtype, special, seed=n), paths[-1])
    hists = [wide_gradient(n, dtype, seed=n) for dtype in DTYPES for n in (0, 1, 9, 3 * DEFER_NUMEL + 5)]
    for g in hists:  # the interpreter's bfloat16 -> float32 (numpy) flushes subnormals to 0; a GPU's does not
        if g.dtype == torch.bfloat16:  # (test_cuda holds the kernel to the CPU's counts there, subnormals included)
            g[(g != 0) & (g.abs() < torch.finfo(torch.bfloat16).tiny)] = 1.0
    hists.append(edge_neighbours())
    hists.append(float64_beyond_float32())
    for i, g in enumerate(hists):
        paths.append(str(tmp_path / f"{i}.hist.pt"))
        torch.save(g, paths[-1])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED, *paths], capture_output=True, text=True, env=env)
    if done.returncode and "only 0-dimensional arrays can be converted" in done.stderr:
        # Triton 3.6's interpreter holds a scalar as a 1-element array and takes int() of it for a loop's bound,
        # which numpy >= 2.4 refuses: no kernel with a loop runs interpreted there (3.8's does; GPU: test_cuda)
        pytest.skip(f"Triton {_triton_version()}'s interpreter cannot run a loop under numpy {np.__version__}")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for g, got in zip(hists, results[len(cases) :], strict=True):
        assert got == _numpy_histogram(g).tolist(), (g.dtype, g.numel())
    for (dtype, n, special), got in zip(cases, results[: len(cases)], strict=True):
        want = _numpy_reductions(_gradient(n, dtype, special, seed=n))
        for i in (0, 1):
            if math.isfinite(want[i]):
                assert got[i] == pytest.approx(want[i], rel=1e-12, abs=1e-9), (dtype, n, special, i)
            else:
                assert not math.isfinite(got[i])
        if special != "nan":
            assert got[2:4] == want[2:4], (dtype, n, special)
        assert got[4:] == want[4:], (dtype, n, special)


def _numpy_histogram(g: torch.Tensor) -> np.ndarray:
    """Counts per HIST_EDGES bin written out with numpy: |g| in float32, searched among float32 edges."""
    a64 = np.abs(g.double().numpy())
    # a float64 is clamped into float32's finite nonzero range before it is rounded (README: a finite 1e39 is
    # >= 1e10, a nonzero 1e-50 in (0, 1e-30))
    inside = (a64 != 0) & np.isfinite(a64)
    a64[inside] = np.clip(a64[inside], 2.0**-149, np.finfo(np.float32).max)
    a = a64.astype(np.float32)
    edges = np.asarray(HIST_EDGES, dtype=np.float32)
    bins = np.searchsorted(edges, a, side="right") + 1  # [e_i, e_i+1) -> i + 2; (0, e_0) -> 1
    bins[a == 0] = 0
    bins[~np.isfinite(a)] = HIST_BINS - 1
    return np.bincount(bins, minlength=HIST_BINS)


def _hist(g: torch.Tensor, fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, dict[str, object]]:
    monkeypatch.setenv("GRADRUNNER_FUSED", "1" if fused else "0")
    col = Collector(values="none", histogram=True)
    col.add(TapKey("fc1", "output", 0), g)
    recs = col.finish()
    assert recs.hist_counts is not None and recs.hist_counts[0] is not None
    return recs.hist_counts[0], recs.row(0)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 2 * 4096 + 7, DEFER_NUMEL + 1, 3 * DEFER_NUMEL + 5])
def test_fused_histogram_counts_equal_the_unfused_ones(dtype: torch.dtype, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = wide_gradient(n, dtype, seed=n)
    fused, fused_row = _hist(g, True, monkeypatch)
    unfused, unfused_row = _hist(g, False, monkeypatch)
    want = _numpy_histogram(g)
    assert fused.tolist() == want.tolist()
    assert unfused.tolist() == want.tolist()
    assert fused.sum() == n
    # the statistics read in the same pass are those of the kernel without histograms
    plain = _records(g, True, monkeypatch)
    for col in (*STAT_COLUMNS, *COUNT_COLUMNS):
        assert fused_row[col] == pytest.approx(plain[col], rel=0, abs=0, nan_ok=True), col
    assert fused_row["nan_count"] == unfused_row["nan_count"] and fused_row["inf_count"] == unfused_row["inf_count"]


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "GRADRUNNER_FUSED=0"])
@pytest.mark.parametrize("n", [500, DEFER_NUMEL + 1], ids=["batched", "large"])
def test_float64_histogram_beyond_float32s_range_matches_numpy(
    fused: bool, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float64 magnitudes 1e-300 to 1e300 with zeros, NaN and Inf, against numpy.histogram on the documented edges:
    a finite 1e39 is >= 1e10 (not NaN/Inf), a nonzero 1e-50 in (0, 1e-30) (not an exact zero)."""
    if fused and not fused_stats.cpu_available():
        pytest.skip("no C compiler: fused kernel not built")
    g = float64_beyond_float32()
    g = torch.cat([g[-9:], g[torch.linspace(0, g.numel() - 10, n - 9, dtype=torch.float64).long()]])  # specials last
    got, row = _hist(g, fused, monkeypatch)
    a = np.abs(g.numpy())
    finite = a[np.isfinite(a)]
    edges = np.asarray(HIST_EDGES)
    inner = np.histogram(finite[(finite >= edges[0]) & (finite < edges[-1])], bins=edges)[0]
    want = [int((finite == 0).sum()), int(((finite > 0) & (finite < edges[0])).sum()), *inner.tolist(),
            int((finite >= edges[-1]).sum()), int((~np.isfinite(a)).sum())]  # fmt: skip
    assert got.tolist() == want
    assert want[1] > 0 and want[-2] > 0 and want[0] > 0 and want[-1] > 0
    assert row["nan_count"] + row["inf_count"] == want[-1]


@needs_kernel
def test_fused_histogram_edges_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float32 edge, its neighbours one ulp away, and the float32 range's ends."""
    edges = np.asarray(HIST_EDGES, dtype=np.float32)
    values = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf)),
                             [np.float32(1.4e-45), np.finfo(np.float32).tiny, np.finfo(np.float32).max]])  # fmt: skip
    g = torch.from_numpy(np.concatenate([values, -values]).astype(np.float32))
    fused, _ = _hist(g, True, monkeypatch)
    assert fused.tolist() == _numpy_histogram(g).tolist()


@needs_kernel
@pytest.mark.parametrize("waits", [True, False], ids=["waited", "wait_collective off"])
def test_a_wrapper_without_storage_never_reaches_the_kernel(waits: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence-parallel gradient's local piece is an `AsyncCollectiveTensor` (no storage of its own: the kernel
    segfaulted on its data pointer): waited for (`torch_compat.waited`), or else left to torch's ops."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from gradrunner.capturing import torch_compat
    from gradrunner.capturing.dtensors import local_piece
    from gradrunner.capturing.sharded import local_rows

    monkeypatch.setitem(torch_compat.FEATURES, "wait_collective", waits)
    g = _gradient(5000, torch.float32, "none", 3).reshape(50, 100)
    want = np.array(_numpy_reductions(g))
    wrapped = AsyncCollectiveTensor(g)
    assert not fused_stats.readable(wrapped) and fused_stats.readable(g)
    assert not fused_stats.reduce_into(wrapped.reshape(-1), torch.empty(7, dtype=torch.float64))
    assert (type(torch_compat.waited(AsyncCollectiveTensor(g))) is torch.Tensor) == waits
    assert local_piece(g) is g
    rows, _ = local_rows([AsyncCollectiveTensor(g)])
    np.testing.assert_allclose(rows[0].numpy(), want, rtol=1e-12)
    col = Collector()
    col.add(TapKey("norm", "output", 0), AsyncCollectiveTensor(g))
    assert col.finish().stats["norm"][0] == pytest.approx(math.sqrt(want[1]), rel=2e-5)  # the torch path (float32)
