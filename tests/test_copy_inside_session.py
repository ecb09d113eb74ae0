"""A copy of the model made inside a session (`copy.deepcopy`: a reference, EMA or lookahead copy) carries the
session's module hooks and its rewritten `forward()`s; it is not captured: its forward and backward leave no rows.

Found 2026-11-27: the copy's gradient of `0:output` was recorded as the original's (an extra micro_step row, 2.96
next to the real 0.987) and `0:weight`'s per_example_norm turned null ("also used outside them").
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from gradrunner import capture

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
TAPS = ["0:output", "0:h", "0.lin:weight", "1:input", ":output"]


class Local(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # a local tap: `0:h`
        return torch.tanh(h)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(2)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Local(), nn.Linear(6, 2))


def _copy_grads(c: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    ((c(x) - y) ** 2).sum().backward()
    return {n: p.grad.clone() for n, p in c.named_parameters() if p.grad is not None}


Rows = list[dict[str, dict[str, object]]]


def _run(strategy: str, with_copy: bool) -> tuple[Rows, list[dict[str, torch.Tensor]], list[nn.Module]]:
    m, rows, grads, copies = _model(), [], [], []  # type: ignore[var-annotated]
    with capture(m, TAPS, strategy=strategy, per_example=True) as cap:
        for x, y in _data():
            if with_copy:
                copies.append(copy.deepcopy(m))
                grads.append(_copy_grads(copies[-1], x, y))
            loss = ((m(x) - y) ** 2).sum(1).mean()
            cap.backward(loss)
            recs = cap.records(loss)
            assert len(recs) == len(TAPS)  # one call of each tap: none of the copy's
            rows.append({recs.row(i)["tap"]: recs.row(i) for i in range(len(recs))})
            m.zero_grad(set_to_none=True)
    return rows, grads, copies


def _same(a: object, b: object) -> bool:
    if isinstance(a, (float, np.floating)) or isinstance(a, np.ndarray):
        return np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True)
    return bool(a == b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_copy_made_inside_the_session_leaves_the_records_as_without_it(strategy: str) -> None:
    want, _, _ = _run(strategy, with_copy=False)
    got, copy_grads, copies = _run(strategy, with_copy=True)
    for g, w in zip(got, want, strict=True):
        for tap in TAPS:
            diff = {k: (g[tap][k], v) for k, v in w[tap].items() if not _same(g[tap][k], v)}
            assert not diff, f"{tap}: {diff}"
    assert want[0]["0.lin:weight"]["per_example_norm"] is not None  # the original's per-example norms intact
    # the copy's own gradients are those of the same copy made outside any session
    for (x, y), grads in zip(_data(), copy_grads, strict=True):
        ref = _copy_grads(copy.deepcopy(_model()), x, y)
        assert grads.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=0)
    # after the block the copy keeps inert hooks: its forward and backward are as a copy's made outside
    x, y = _data()[0]
    c = copies[0]
    c.zero_grad(set_to_none=True)
    ref_model = _model()
    torch.testing.assert_close(c(x), ref_model(x), rtol=0, atol=0)
    got_after, ref_after = _copy_grads(c, x, y), _copy_grads(ref_model, x, y)
    for n in ref_after:
        torch.testing.assert_close(got_after[n], ref_after[n], rtol=0, atol=0)
