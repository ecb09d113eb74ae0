"""The per-step check of per-example norms under bfloat16: a Linear used only by its calls keeps its rows, a weight
penalty in the loss nulls them (the tolerance scales with the gradient's rounding, not with the terms' magnitudes).

References: `per_example_reference.loop` (each row alone, plain autograd, the same precision) and plain autograd's
`.grad` with and without the penalty."""

from __future__ import annotations

import pytest
import torch
from per_example_reference import all_params, assert_matches, batched, loop
from torch import nn

from gradrunner.capturing.per_example import OUTSIDE, PerExampleNorms


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).sum()


@pytest.mark.parametrize("seed", [49, 180])
def test_a_linear_used_only_by_its_calls_under_autocast_keeps_its_rows(seed: int) -> None:
    """Under CPU bf16 autocast these seeds' first Linear was null ("used outside them"): autograd's one rounding of
    its bf16 weight gradient was 4% to 7% of the projected terms' magnitude (found 2026-11-27)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    x, y = torch.randn(3, 6), torch.randn(3, 2)
    params = [p for p in all_params(model) if p[0].endswith("weight")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loop(model, {"input": x}, lambda out, i: _mse(out, y[i : i + 1]), params)[0]
        got, reasons = batched(model, {"input": x}, lambda out, i: _mse(out, y[i : i + 1]), params)
    assert_matches(got, ref, reasons, rtol=2e-2)


def test_a_weight_penalty_on_bf16_linear_and_layer_norm_weights_is_caught() -> None:
    """A bf16 model with a penalty worth a fifth (Linear) and a third (LayerNorm) of each weight's gradient: their
    rows (the data's shares only) passed a tolerance of 3e-2 of the terms' magnitudes (found 2026-11-27); now None
    with the reason (the LayerNorm's weight compared element by element: its projection happened to miss it)."""
    B = 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)).bfloat16()
    x, y = torch.randn(B, 32, 16).bfloat16(), torch.randn(B, 32, 4)
    weights = {"1:weight": model[1].weight, "0:weight": model[0].weight}

    def data() -> torch.Tensor:
        return _mse(model(x), y) / B

    def penalty() -> torch.Tensor:
        return (weights["1:weight"].float() ** 2).sum() + 3.0 * (weights["0:weight"].float() ** 2).sum()

    with PerExampleNorms(model, [(n, model[int(n[0])], p) for n, p in weights.items()]) as pex:
        (data() + penalty()).backward()
        norms, reasons = pex.norms(), pex.reasons()
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in weights}
    for part in (data, penalty):
        model.zero_grad()
        part().backward()
        for n, p in weights.items():
            grads[n].append(p.grad.float().norm())
    for name, (of_data, of_penalty) in grads.items():
        assert of_penalty > 0.15 * of_data  # the penalty is a large part of .grad: rows without it would be wrong
        assert norms[name] is None and reasons[name] == OUTSIDE, name


def test_a_weight_penalty_on_a_large_float32_weight_under_bf16_autocast_is_caught() -> None:
    """A 256x64 float32 weight under CPU bf16 autocast with a penalty worth 0.88 of the data's gradient: the worst-case
    rounding bound |u|^T |g| |v| (2 unit roundoffs) is about sqrt(numel) times the projection's real rounding noise,
    so the rows (the data's shares only) passed (found 2026-11-27); the spread of independent roundings catches it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    x, y = torch.randn(8, 96, 64), torch.randn(8, 96, 8)
    weight = model[0].weight

    def data() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _mse(model(x), y) / 8

    def penalty() -> torch.Tensor:
        return 3.0 * (weight**2).sum()

    with PerExampleNorms(model, [("0:weight", model[0], weight)]) as pex:
        (data() + penalty()).backward()
        norms, reasons = pex.norms(), pex.reasons()
    of = []
    for part in (data, penalty):
        model.zero_grad()
        part().backward()
        of.append(weight.grad.norm())
    assert of[1] > 0.8 * of[0]
    assert norms["0:weight"] is None and reasons["0:weight"] == OUTSIDE


def test_rows_that_overflow_float32_are_null_with_the_reason_where_the_gradient_is_finite() -> None:
    """A diverging run's parameter gradients of norm 1e25: each row's squared norm (1e50) passes float32's range, so
    every per-example norm read inf (found 2026-11-27 in a report of the spike_data run: g2 -inf, trace_sigma inf),
    where `.grad`'s norm is finite. Now None with the reason; at 1e15 the rows equal each row backwarded alone."""
    import warnings

    import numpy as np

    from gradrunner import capture
    from gradrunner.capturing.per_example_check import OVERFLOW, PerExampleWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    for scale in (1e15, 1e25):
        with (
            warnings.catch_warnings(record=True) as caught,
            capture(model, ["0:weight", "1:bias"], per_example=True) as cap,
        ):
            warnings.simplefilter("always")
            loss = model(x).sum() * scale
            cap.backward(loss)
            recs = cap.records(loss)
        model.zero_grad()
        rows = dict(zip([k.tap for k in recs.keys], recs.per_example_norm or [], strict=True))
        assert np.isfinite(recs.stats["norm"]).all()
        if scale == 1e25:
            assert rows == {"0:weight": None, "1:bias": None}
            said = [str(w.message) for w in caught if issubclass(w.category, PerExampleWarning)]
            assert sorted(said) == [
                f"per_example_norm of parameter tap {t} is null: {OVERFLOW}" for t in ("0:weight", "1:bias")
            ]
            continue
        for name, param in (("0:weight", model[0].weight), ("1:bias", model[1].bias)):
            ref = []
            for i in range(3):
                model.zero_grad()
                (model(x[i : i + 1]).sum() * scale).backward()
                ref.append(param.grad.double().norm().item())
            np.testing.assert_allclose(rows[name], ref, rtol=1e-5)
        model.zero_grad()
