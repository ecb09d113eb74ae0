"""`autograd_grad` hands the gradients its own engine call returns to the collector together (issue 33 item 4).

The backward is checked once for all of them (`Backwards._deliver_all`); a plain tensor's gradient goes
straight to the collector, anything that needs turning (a complex gradient, a loss scale to take out,
gradients kept for `cap.grads`) through `_deliver` one by one. The records are those of plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradrunner import capture
from gradrunner.capturing.session import Capture


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


class _Complex(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), _Double(), nn.Linear(6, 4).double(), _Complex())


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.abs().square().sum()


def _reference(x: torch.Tensor) -> dict[str, float]:
    """Each submodule output's gradient norm by plain torch (a complex one's: of |g|, as the README says)."""
    model = _model()
    outs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda _m, _i, o, n=n: outs.__setitem__(n, o))
               for n, m in model.named_modules() if n]  # fmt: skip
    loss = _loss(model(x))
    for h in handles:
        h.remove()
    grads = torch.autograd.grad(loss, list(outs.values()))
    return {f"{n}:output": float(g.abs().double().norm()) for n, g in zip(outs, grads, strict=True)}


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    deliver = Capture._deliver

    def counted(self: Capture, slot: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        calls[0] += 1
        return deliver(self, slot, grad)

    monkeypatch.setattr(Capture, "_deliver", counted)
    return calls


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_autograd_grad_hands_plain_gradients_to_the_collector_together(monkeypatch: pytest.MonkeyPatch,
                                                                       scale: float | None) -> None:  # fmt: skip
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    want = _reference(x)
    calls = _counting(monkeypatch)
    model = _model()
    scaled = None if scale is None else lambda: scale
    with capture(model, ["*:output"], strategy="autograd_grad", keep_grads=False, loss_scale=scaled) as cap:
        loss = _loss(model(x))
        cap.backward(loss if scale is None else loss * scale)
        recs = cap.records(loss)
    got = {k.tap: float(recs.stats["norm"][i]) for i, k in enumerate(recs.keys)}
    assert got == pytest.approx(want, rel=1e-6)
    # one by one: only the complex gradient (its |g|), or every one where a loss scale is taken out
    assert calls[0] == (1 if scale is None else len(want))


def test_autograd_grad_keeps_the_gradients_it_hands_over_together(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    want = _reference(x)
    calls = _counting(monkeypatch)
    model = _model()
    with capture(model, ["*:output"], strategy="autograd_grad", keep_grads=True) as cap:
        loss = _loss(model(x))
        cap.backward(loss)
        cap.records(loss)
        kept = {tap: float(cap.grads[tap].abs().double().norm()) for tap in want}  # type: ignore[union-attr]
    assert kept == pytest.approx(want, rel=1e-12)
    assert calls[0] == len(want)
