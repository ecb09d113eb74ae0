"""The batched statistics of small gradients (`Collector.flush`) against the per-tap torch path and numpy.

On an accelerator every gradient of at most `DEFER_NUMEL` elements is kept when it arrives and
reduced with all the others of its dtype at the end of backward, in a fixed number of ops. On CPU
the C kernel takes every gradient, so these tests turn it off (`GRADRUNNER_FUSED=0`): the small
gradients then take the batched path, on CPU, as they do on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradrunner.capturing.stats as stats
from gradrunner import capture
from gradrunner.capturing.extras import histogram_counts, value_norm, value_norms
from gradrunner.capturing.stats import DEFER_NUMEL, Collector
from gradrunner.records.columns import COUNT_COLUMNS, STAT_COLUMNS, StepRecords, TapKey

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: across the batched path's threshold and the 4,096-element blocks of the other paths
SIZES = [1, 2, 7, 4095, 4096, 4097, DEFER_NUMEL - 1, DEFER_NUMEL, DEFER_NUMEL + 1, 2 * DEFER_NUMEL + 3]
SPECIALS = ["plain", "zeros", "nan", "inf", "all_zero"]


@pytest.fixture(autouse=True)
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C kernel: on CPU the small gradients then take the batched path (collectors made after this)."""
    monkeypatch.setenv("GRADRUNNER_FUSED", "0")


def _gradient(n: int, dtype: torch.dtype, special: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 0.5).to(dtype)
    at = torch.randint(0, n, (3,), generator=gen)
    if special == "zeros":
        g[at] = torch.tensor([0.0, -0.0, 0.0], dtype=dtype)
    elif special == "nan":
        g[at[0]] = math.nan
    elif special == "inf":
        g[at[0]], g[at[-1]] = math.inf, -math.inf
    elif special == "all_zero":
        g.zero_()
        g[at[0]] = -0.0
    return g


def _reference(g: torch.Tensor) -> dict[str, float]:
    """numpy in float64 on the gradient's exact values."""
    d = g.double().numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "norm": float(np.sqrt((d * d).sum())), "mean": float(d.mean()),
            "std": float(d.std(ddof=1)) if d.size > 1 else math.nan,
            "min": float(d.min()), "max": float(d.max()), "abs_max": float(np.abs(d).max()),
            "zero_frac": float((d == 0).mean()), "nan_count": int(np.isnan(d).sum()), "inf_count": int(np.isinf(d).sum()),
        }  # fmt: skip


def _collect(grads: list[torch.Tensor], batched: bool, monkeypatch: pytest.MonkeyPatch, **kw: bool) -> StepRecords:
    monkeypatch.setattr(stats, "DEFER_NUMEL", DEFER_NUMEL if batched else 0)
    col = Collector(values="none", **kw)
    for i, g in enumerate(grads):
        col.add(TapKey(f"t{i}", "output", 0), g.reshape(-1, 1) if i % 2 else g, mutable=False)
    if batched:
        assert any(p.deferred is not None for p in col._pending) == any(g.numel() <= DEFER_NUMEL for g in grads)
    return col.finish()


def _assert_close(got: dict[str, object], want: dict[str, object], rel: float, what: str) -> None:
    for col in COUNT_COLUMNS:
        assert got[col] == want[col], (what, col)
    for col in STAT_COLUMNS:
        assert got[col] == pytest.approx(want[col], rel=rel, abs=1e-12, nan_ok=True), (what, col, got[col], want[col])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("special", SPECIALS)
def test_batched_statistics_equal_the_per_tap_path_and_numpy(
    dtype: torch.dtype, special: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every size in one step (one batch of all the small ones), each against numpy float64 and per-tap."""
    grads = [_gradient(n, dtype, special, seed=n) for n in SIZES]
    batched = _collect(grads, True, monkeypatch)
    per_tap = _collect(grads, False, monkeypatch)
    # The batch sums widened elements in float64: float64 rounding; the per-tap path sums float32 in float32.
    rel_per_tap = 1e-12 if dtype == torch.float64 else 2e-5
    for i, g in enumerate(grads):
        got = batched.row(i)
        _assert_close(got, _reference(g), 1e-10 if g.numel() <= DEFER_NUMEL else rel_per_tap, f"numpy {g.numel()}")
        _assert_close(got, per_tap.row(i), rel_per_tap, f"per-tap {g.numel()}")


def test_batches_of_several_dtypes_and_empty_and_missing_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = [_gradient(n, dtype, "zeros", seed=n) for dtype in DTYPES for n in (3, 700)]
    col = Collector(values="none")
    for i, g in enumerate(grads):
        col.add(TapKey(f"t{i}", "output", 0), g)
    col.add(TapKey("empty", "output", 0), torch.zeros(0, 3))
    col.add(TapKey("none", "output", 0), None)
    recs = col.finish()
    for i, g in enumerate(grads):
        _assert_close(recs.row(i), _reference(g), 1e-10, str(g.dtype))
    assert recs.row(len(grads))["numel"] == 0 and recs.row(len(grads))["norm"] == 0.0
    assert recs.row(len(grads) + 1)["has_grad"] is False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_histograms_equal_the_per_tap_counts(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    grads = []
    for n in SIZES:
        g = _gradient(n, dtype, "zeros", seed=3 * n).double()
        g *= torch.logspace(-40, 38, n, dtype=torch.float64)[torch.randperm(n, generator=torch.Generator().manual_seed(n))]
        g[0] = math.nan if n > 2 else g[0]
        grads.append(g.to(dtype))
    recs = _collect(grads, True, monkeypatch, histogram=True)
    assert recs.hist_counts is not None
    for g, counts in zip(grads, recs.hist_counts, strict=True):
        assert counts is not None
        np.testing.assert_array_equal(counts, histogram_counts(g).numpy())


def test_batched_per_example_norms_equal_the_per_tap_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = [_gradient(n, torch.float32, "zeros", seed=n).reshape(r, -1) for n, r in ((6, 3), (4096, 8), (7, 7), (DEFER_NUMEL, 2))]
    grads.append(_gradient(DEFER_NUMEL + 4, torch.float32, "plain", seed=1).reshape(4, -1))  # not batched
    monkeypatch.setattr(stats, "DEFER_NUMEL", DEFER_NUMEL)
    col = Collector(values="none", per_example=True)
    for i, g in enumerate(grads):
        col.add(TapKey(f"t{i}", "output", 0), g, mutable=False, batched=i != 2)  # t2: a parameter, no rows
    recs = col.finish()
    assert recs.per_example_norm is not None
    for i, (g, got) in enumerate(zip(grads, recs.per_example_norm, strict=True)):
        if i == 2:
            assert got is None
            continue
        assert got is not None
        np.testing.assert_allclose(got, torch.linalg.vector_norm(g.double(), dim=1).numpy(), rtol=1e-12)


#: ops that make a new view of the same memory: no kernel is launched for them
_VIEWS = {"aten.detach.default", "aten.view.default", "aten._reshape_alias.default", "aten.alias.default",
          "aten.select.int", "aten.slice.Tensor"}


class _CountOps(TorchDispatchMode):
    """The ops dispatched in its block, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func) not in _VIEWS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting() -> Iterator[_CountOps]:
    mode = _CountOps()
    with mode:
        yield mode


@pytest.mark.parametrize("rows", [1, 40], ids=["narrow", "wide"])  # 7 to 21 elements, or 280 to 294: over one chunk
@pytest.mark.parametrize("histogram", [False, True])
def test_ops_per_step_do_not_grow_with_the_number_of_small_gradients(histogram: bool, rows: int) -> None:
    """No op when a small gradient arrives; the same ops at flush for 3 gradients as for 60."""
    warm = Collector(values="none", histogram=histogram, per_example=histogram)
    warm.add(TapKey("w", "output", 0), torch.randn(rows, 7), mutable=False)
    warm.finish()  # a process's first flush builds the histogram's edge tables once: not an op of every step
    counts = []
    for k in (3, 60):
        col = Collector(values="none", histogram=histogram, per_example=histogram)
        grads = [torch.randn(rows + i % 3, 7) for i in range(k)]
        with _counting() as arriving:
            for i, g in enumerate(grads):
                col.add(TapKey(f"t{i}", "output", 0), g, mutable=False)
        assert arriving.ops == []
        with _counting() as flushing:
            col.flush()
        counts.append(len(flushing.ops))
        assert all(p.deferred is None for p in col._pending)  # let go of
        recs = col.finish()
        _assert_close(recs.row(k - 1), _reference(grads[-1]), 1e-10, "last")
    assert counts[0] == counts[1]


#: ops that add into a tensor by index: in the order their atomics land on CUDA
_ORDER_DEPENDENT = frozenset({"aten.index_add_.default", "aten.index_add.default", "aten.scatter_add_.default",
                              "aten.scatter_add.default", "aten.index_put_.default", "aten._index_put_impl_.default",
                              "aten.index_put.default", "aten.scatter_reduce_.two", "aten.scatter_reduce.two"})  # fmt: skip


class _FloatAccumulations(TorchDispatchMode):
    """Ops that add floats in the order their CUDA atomics land (the last bits then differ from run to run)."""


    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name, target = str(func), args[0]
        if "index_put" in name:
            adds = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        else:
            adds = "scatter_reduce" not in name or (args[4] if len(args) > 4 else kwargs["reduce"]) in ("sum", "mean")
        if name in _ORDER_DEPENDENT and adds and target.is_floating_point():
            self.found.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_adds_floats_in_a_fixed_order(dtype: torch.dtype) -> None:
    """Same gradients, same bits: no float is added by an atomic scatter (`index_add_` on CUDA differs in the
    last bits from run to run, so two runs of one config did not agree bit for bit on a GPU; seen on an H100)."""
    grads = [torch.randn(i + 2, 5, dtype=dtype) for i in range(6)]
    col = Collector(values="none", histogram=True, per_example=True)
    for i, g in enumerate(grads):
        col.add(TapKey(f"t{i}", "output", 0), g, mutable=False)
    assert all(p.deferred is not None for p in col._pending)  # the batch path, where the segmented sums are
    mode = _FloatAccumulations()
    with mode:
        col.flush()
    assert mode.found == []
    recs = col.finish()
    for i, g in enumerate(grads):
        _assert_close(recs.row(i), _reference(g.float()), 1e-10, f"t{i}")
        got = None if recs.per_example_norm is None else recs.per_example_norm[i]
        assert got is not None
        np.testing.assert_allclose(got, torch.linalg.vector_norm(g.double(), dim=1).numpy(), rtol=1e-12)


def test_a_gradient_that_may_change_is_copied_unless_settled() -> None:
    g = torch.randn(10)
    col = Collector(values="none")
    col.add(TapKey("a", "output", 0), g, mutable=True)
    col.add(TapKey("b", "output", 0), g, mutable=True, settled=True)
    assert col._pending[0].deferred is not None and col._pending[0].deferred.data_ptr() != g.data_ptr()
    assert col._pending[1].deferred is not None and col._pending[1].deferred.data_ptr() == g.data_ptr()
    want = _reference(g.clone())
    col.flush()
    g.zero_()  # after the flush: changes nothing
    recs = col.finish()
    _assert_close(recs.row(0), want, 1e-10, "copied")
    _assert_close(recs.row(1), want, 1e-10, "settled")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_capture_with_every_option_equals_the_per_tap_path(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the session: records of the batched path equal the per-tap path's, for activations and
    parameters, extras on; nothing small is held after backward; parameter gradients as without capture."""
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    plain = _mlp()
    nn.functional.mse_loss(plain(x), y).backward()
    out = {}
    for batched in (True, False):
        monkeypatch.setattr(stats, "DEFER_NUMEL", DEFER_NUMEL if batched else 0)
        model = _mlp()
        with capture(model, ["*:output", "0:weight", "2:bias", "4:weight"], strategy=strategy, keep_grads=False,
                     per_example=True, histogram=True) as cap:  # fmt: skip
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            assert cap._collector is not None
            assert all(p.deferred is None for p in cap._collector._pending)
            out[batched] = cap.records(loss)
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    got, want = out[True], out[False]
    assert got.keys == want.keys
    for i in range(len(got.keys)):
        _assert_close(got.row(i), want.row(i), 2e-6, str(got.keys[i]))
    assert got.hist_counts is not None and want.hist_counts is not None
    for a, b in zip(got.hist_counts, want.hist_counts, strict=True):
        np.testing.assert_array_equal(a, b)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_gradients_zeroed_in_place_by_post_accumulate_hooks_do_not_reach_the_batch(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optimizer-in-backward style hooks that zero `.grad` in place as soon as it is accumulated: the
    parameters' small gradients kept uncopied for the batch must still be what was delivered."""
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    out = {}
    for batched in (True, False):
        monkeypatch.setattr(stats, "DEFER_NUMEL", DEFER_NUMEL if batched else 0)
        model = _mlp()
        def zero(p: torch.Tensor) -> None:
            p.grad.zero_()  # type: ignore[union-attr]

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(zero)
        with capture(model, ["*:weight", "*:bias"], strategy=strategy, keep_grads=False) as cap:
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            out[batched] = cap.records(loss)
    for i in range(len(out[True].keys)):
        _assert_close(out[True].row(i), out[False].row(i), 2e-6, str(out[True].keys[i]))


def test_batched_value_norms_equal_one_by_one() -> None:
    torch.manual_seed(1)
    ts = [torch.randn(n) for n in (1, 7, 5000, 70000)] + [torch.randn(3, dtype=torch.float64), torch.zeros(0)]
    for got, t in zip(value_norms(ts, batch=True), ts, strict=True):
        assert float(got) == pytest.approx(float(value_norm(t)), rel=1e-5)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_batched_statistics_equal_numpy(dtype: torch.dtype) -> None:
    grads = [_gradient(n, dtype, special, seed=n) for n in SIZES for special in ("plain", "nan", "inf")]
    col = Collector(values="none", histogram=True)
    for i, g in enumerate(grads):
        col.add(TapKey(f"t{i}", "output", 0), g.cuda())
    recs = col.finish()
    assert recs.hist_counts is not None
    for i, g in enumerate(grads):
        _assert_close(recs.row(i), _reference(g), 1e-10 if g.numel() <= DEFER_NUMEL else 2e-5, str(g.numel()))
        np.testing.assert_array_equal(recs.hist_counts[i], histogram_counts(g).numpy())  # type: ignore[arg-type]


@needs_cuda
@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_cuda_no_host_sync_inside_backward_with_every_option(strategy: str) -> None:
    model = _mlp().cuda()
    x, y = torch.randn(8, 6, device="cuda"), torch.randn(8, 3, device="cuda")
    with capture(model, ["*:output", "*:weight", "*:bias"], strategy=strategy, keep_grads=False, per_example=True,
                 histogram=True, values="sample", sample_size=4) as cap:  # fmt: skip
        cap.grad_scale = torch.tensor(0.5, device="cuda")
        for step in range(2):  # the first step builds what is kept (segment numbers, tables)
            loss = nn.functional.mse_loss(model(x), y)
            torch.cuda.synchronize()
            if step:
                torch.cuda.set_sync_debug_mode("error")
            try:
                cap.backward(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            recs = cap.records(loss)
            assert recs.has_grad.all()
