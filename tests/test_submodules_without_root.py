"""Submodules called without the root module (`model[:3](x)`), with the user's own backward.

The session sees a backward begin at a pre-hook on the root module's output; where the root's forward never
runs, a pre-hook on each tapped value's own gradient edge does. Before it did, `retain_grad` recorded an empty
step under the user's `torch.autograd.grad` and 'takes no part in the loss' under `loss.backward()` (the
parameter tap's pre-hook began the backward after the taps' `.grad` were filled), `autograd_grad` recorded
empty steps in place of refusing a backward it did not run, and the calls of the unseen steps were carried
over into the next backward the session saw (calls 0, 1, ... of earlier steps, 'takes no part in the loss').
Each record is checked against plain torch tensor hooks on the same modules' outputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradrunner import capture
from gradrunner.capturing import torch_compat
from gradrunner.errors import GradrunnerError

TAPS = ["0:output", "2:output", "0:weight"]
NO_FILL = "no backward of the step added to .grad"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=g) for _ in range(3)]


def _backward(model: nn.Sequential, loss: torch.Tensor, how: str) -> None:
    if how == "autograd.grad":
        torch.autograd.grad(loss, [model[0].weight])
    else:
        loss.backward()


def _reference(how: str) -> list[dict[str, float]]:
    """Each step's gradient norms by plain tensor hooks (and `.grad` after `loss.backward()`), without gradrunner."""
    model, steps = _model(), []
    for x in _batches():
        got: dict[str, float] = {}

        def tap(name: str, got: dict[str, float] = got) -> object:
            def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
                out.register_hook(lambda g: got.__setitem__(name, g.norm().item()))

            return hook

        handles = [model[i].register_forward_hook(tap(f"{i}:output")) for i in (0, 2)]  # type: ignore[arg-type]
        model.zero_grad()
        _backward(model, model[:3](x).pow(2).mean(), how)
        if how == "loss.backward":
            got["0:weight"] = model[0].weight.grad.norm().item()  # type: ignore[union-attr]
        for h in handles:
            h.remove()
        steps.append(got)
    return steps


def _rows(cap: capture, loss: torch.Tensor) -> list[tuple[str, int, bool, float, str | None]]:
    r = cap.records(loss)
    assert r.reason is not None
    return [
        (k.tap, k.call, bool(h), float(n), why)
        for k, h, n, why in zip(r.keys, r.has_grad, r.stats["norm"], r.reason, strict=True)
    ]


@pytest.mark.parametrize("how", ["loss.backward", "autograd.grad"])
@pytest.mark.parametrize("strategy", ["retain_grad", "hook"])
@pytest.mark.parametrize("callbacks", [True, False], ids=["engine-callbacks", "no-engine-callbacks"])
def test_each_step_records_its_own_gradients_once(
    strategy: str, how: str, callbacks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not callbacks:  # the backward's end is then seen at the next forward's first tap, or at records()
        monkeypatch.setitem(torch_compat.FEATURES, "queue_callback", False)
    model, ref = _model(), _reference(how)
    with capture(model, TAPS, strategy=strategy) as cap:
        for step, x in enumerate(_batches()):
            model.zero_grad()
            loss = model[:3](x).pow(2).mean()
            _backward(model, loss, how)
            rows = _rows(cap, loss)
            assert sorted(t for t, *_ in rows) == sorted(TAPS), rows  # each tap once: nothing carried over
            for tap, call, has_grad, norm, reason in rows:
                assert call == 0
                if tap in ref[step]:
                    assert has_grad and reason is None, (step, tap, reason)
                    assert norm == pytest.approx(ref[step][tap], rel=1e-6), (step, tap)
                else:  # the documented reason: torch.autograd.grad adds nothing to .grad
                    assert not has_grad and reason is not None and reason.startswith(NO_FILL), (step, tap, reason)


@pytest.mark.parametrize("how", ["loss.backward", "autograd.grad"])
def test_autograd_grad_refuses_a_backward_it_did_not_run_as_with_the_root(how: str) -> None:
    model = _model()
    with capture(model, TAPS[:2], strategy="autograd_grad") as cap:
        for x in _batches()[:2]:
            with pytest.raises(GradrunnerError, match="cannot read a loss.backward"):
                _backward(model, model[:3](x).pow(2).mean(), how)
        loss = model[:3](_batches()[2]).pow(2).mean()
        cap.backward(loss)
        rows = _rows(cap, loss)
    ref = _reference("loss.backward")[2]
    assert [(t, c, h) for t, c, h, *_ in rows] == [("0:output", 0, True), ("2:output", 0, True)]
    assert [n for *_, n, _ in rows] == pytest.approx([ref["0:output"], ref["2:output"]], rel=1e-6)


def test_steps_the_session_did_not_run_are_not_carried_into_its_backward() -> None:
    model, ref = _model(), _reference("loss.backward")
    with capture(model, TAPS[:2], strategy="retain_grad") as cap:
        for step, x in enumerate(_batches()):
            loss = model[:3](x).pow(2).mean()
            loss.backward() if step < 2 else cap.backward(loss)
            rows = _rows(cap, loss)
            assert [(t, c, h) for t, c, h, *_ in rows] == [("0:output", 0, True), ("2:output", 0, True)], (step, rows)
            assert [n for *_, n, _ in rows] == pytest.approx([ref[step]["0:output"], ref[step]["2:output"]], rel=1e-6)


@pytest.mark.parametrize("strategy", ["retain_grad", "hook"])
@pytest.mark.parametrize("callbacks", [True, False], ids=["engine-callbacks", "no-engine-callbacks"])
def test_accumulated_backwards_are_one_micro_step_each(
    strategy: str, callbacks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two micro-batches, one `records()`: without engine callbacks the first backward ends at the second's first tap."""
    if not callbacks:
        monkeypatch.setitem(torch_compat.FEATURES, "queue_callback", False)
    ref, xs = _reference("loss.backward"), _batches()[:2]
    model = _model()
    with capture(model, TAPS, strategy=strategy) as cap:
        for x in xs:
            model[:3](x).pow(2).mean().backward()
        r = cap.records()
    acts = [
        (k.tap, m, n)
        for k, m, n in zip(r.keys, r.micro_step or [], r.stats["norm"], strict=True)
        if k.tap != "0:weight"
    ]
    assert [(t, m) for t, m, _ in acts] == [("0:output", 0), ("2:output", 0), ("0:output", 1), ("2:output", 1)]
    assert [n for *_, n in acts] == pytest.approx(
        [ref[i][t] for i in (0, 1) for t in ("0:output", "2:output")], rel=1e-6
    )
    plain = _model()  # the parameter's row: the .grad the two backwards left
    for x in xs:
        plain[:3](x).pow(2).mean().backward()
    assert r.stats["norm"][r.keys.index(next(k for k in r.keys if k.tap == "0:weight"))] == pytest.approx(
        plain[0].weight.grad.norm().item(),
        rel=1e-6,  # type: ignore[union-attr]
    )


@pytest.mark.parametrize("strategy", ["retain_grad", "hook"])
def test_an_edited_tap_outside_the_root_records_what_arrived_as_under_the_root(strategy: str) -> None:
    """The edit's node runs the session's hook too: the backward must be seen before the tapped `.grad` is filled.
    Reference: the same slice captured as a root of its own (`capture(model[:3], ...)`: the same module paths)."""
    edits = [{"tap": "2:input", "scale": 0.5}]
    got = {}
    for name in ("slice as root", "slice of the root"):
        model = _model()
        tapped = model[:3] if name == "slice as root" else model
        with capture(tapped, TAPS, strategy=strategy, edits=edits) as cap:
            loss = model[:3](_batches()[0]).pow(2).mean()
            loss.backward()
            got[name] = _rows(cap, loss)
    assert all(has for _, _, has, _, _ in got["slice of the root"]), got["slice of the root"]
    assert got["slice of the root"] == got["slice as root"]
