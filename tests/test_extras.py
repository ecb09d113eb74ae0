"""Per-example norms, |g| histograms and value norms on the device, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradrunner.capturing.extras import histogram_counts, per_example_norms, value_norm
from gradrunner.records.columns import HIST_BINS, HIST_EDGES


def numpy_histogram(g: np.ndarray) -> np.ndarray:
    """The documented binning, written with numpy: zeros, (0, e0), [e_i, e_i+1), >= e_last, non-finite."""
    a = np.abs(g.astype(np.float64)).astype(np.float32).reshape(-1)
    edges = np.asarray(HIST_EDGES, dtype=np.float32)
    finite = np.isfinite(a)
    counts = np.zeros(HIST_BINS, dtype=np.int64)
    counts[0] = np.sum(a[finite] == 0)
    positive = a[finite & (a > 0)]
    counts[1] = np.sum(positive < edges[0])
    inner, _ = np.histogram(positive[(positive >= edges[0]) & (positive < edges[-1])], bins=edges)
    counts[2 : 2 + len(inner)] = inner
    counts[-2] = np.sum(positive >= edges[-1])
    counts[-1] = np.sum(~finite)
    return counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(4))
def test_histogram_matches_numpy_on_wide_ranging_values(dtype: torch.dtype, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(2000) * 10.0 ** rng.uniform(-12, 6, 2000)
    values[rng.choice(2000, 50, replace=False)] = 0.0
    values[:3] = [np.nan, np.inf, -np.inf]
    g = torch.from_numpy(values).to(dtype)
    got = histogram_counts(g).numpy()
    assert got.shape == (HIST_BINS,) and got.sum() == g.numel()
    np.testing.assert_array_equal(got, numpy_histogram(g.double().numpy()))


def test_histogram_of_every_edge_and_its_float32_neighbours_matches_numpy() -> None:
    # float32 log10 rounds values next to an edge either way: the bins must still follow the edges exactly.
    edges = np.asarray(HIST_EDGES, dtype=np.float32)
    near = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf)),
                           np.float32([1.4e-45, 3.4e38, 1e-38])])  # fmt: skip
    for sign in (1, -1):
        g = torch.from_numpy(sign * near)
        np.testing.assert_array_equal(histogram_counts(g).numpy(), numpy_histogram(g.numpy()))
    for e in edges:  # one at a time: each value lands in the bin its edge opens, its lower neighbour below
        counts = histogram_counts(torch.from_numpy(np.float32([e, np.nextafter(e, np.float32(0))])))
        assert counts.sum() == 2 and np.count_nonzero(counts.numpy()) == 2


def test_histogram_bins_of_edge_values() -> None:
    e = np.float32(HIST_EDGES[80])  # exactly 1e-10 in float32: falls into the bin it opens
    counts = histogram_counts(torch.tensor([0.0, -0.0, float(e), 1e-40, 1e12, float("nan")]))
    assert counts[0] == 2 and counts[1] == 1 and counts[2 + 80] == 1 and counts[-2] == 1 and counts[-1] == 1


def test_per_example_norms_match_a_loop_over_examples() -> None:
    g = torch.randn(5, 3, 4, dtype=torch.float32)
    want = np.array([np.linalg.norm(g[i].double().numpy()) for i in range(5)])
    np.testing.assert_allclose(per_example_norms(g).numpy(), want, rtol=1e-12)
    assert per_example_norms(torch.tensor(1.0)) is None
    assert per_example_norms(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]
    assert per_example_norms(torch.zeros(0, 4)).shape == (0,)  # an expert given no tokens (it raised: 2026-11-27)


def test_value_norm_of_real_integer_and_complex_tensors() -> None:
    assert value_norm(torch.tensor([3.0, 4.0], dtype=torch.bfloat16)).item() == 5.0
    assert value_norm(torch.tensor([3, 4])).item() == 5.0
    assert value_norm(torch.tensor([3 + 4j, 0j])).item() == pytest.approx(5.0)


def test_value_norm_of_a_large_float32_tensor_is_accurate_to_float64() -> None:
    rng = np.random.default_rng(0)
    for n in (4096 * 2, 4096 * 3 + 17, 10**6):  # chunked in float32: whole chunks and a tail
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
        expected = np.linalg.norm(x.astype(np.float64))
        got = value_norm(torch.from_numpy(x))
        assert got.dtype == torch.float64 and got.item() == pytest.approx(expected, rel=1e-6)
    # the worst case for float32 sums (equal values): still within 1e-5
    assert value_norm(torch.full((10**6,), 0.1)).item() == pytest.approx(1000 * np.float64(np.float32(0.1)), rel=1e-5)
