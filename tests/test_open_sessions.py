"""Sessions open together: `hook` and `retain_grad` ones each record the true gradients; none beside `autograd_grad`.

Before the refusal, a `record()` opened inside `capture(..., strategy="autograd_grad")` (or the reverse) recorded
'takes no part in the loss' for a parameter whose `.grad` the step had just filled: `autograd_grad` calls each
parameter's accumulator itself, which runs no other session's hooks. The reference is the parameter's `.grad` of
the same step without gradrunner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from gradrunner import capture, record
from gradrunner.errors import GradrunnerError

TAPS = ["0:output", "0:weight"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _true_weight_grad_norm() -> float:
    plain = _model()
    plain(_x()).pow(2).mean().backward()
    return plain[0].weight.grad.norm().item()  # type: ignore[union-attr]


def _weight_norm(run: Path) -> float:
    df = pd.read_parquet(run / "grads.parquet")
    row = df[df.tap == "0:weight"].iloc[0]
    assert row.has_grad, row.reason
    return float(row.norm)


@pytest.mark.parametrize("other", ["hook", "retain_grad", "autograd_grad"])
def test_record_inside_an_autograd_grad_capture_is_refused_naming_both(tmp_path: Path, other: str) -> None:
    model, run = _model(), tmp_path / "run"
    with capture(model, TAPS, strategy="autograd_grad") as cap:
        with pytest.raises(GradrunnerError) as refused, record(model, TAPS, run, strategy=other):
            pass
        loss = model(_x()).pow(2).mean()
        cap.backward(loss)  # the open session goes on as before
        recs = cap.records(loss)
    message = str(refused.value)
    assert f"record() into {str(run.resolve())!r} (strategy={other!r}) cannot be opened while " in message
    assert "capture(Sequential, strategy='autograd_grad') is open" in message and "\n" not in message
    assert not run.exists()  # refused before the run dir was looked at
    assert recs.has_grad.all() and recs.stats["norm"][1] == pytest.approx(_true_weight_grad_norm(), rel=1e-6)


@pytest.mark.parametrize("outer", ["hook", "retain_grad"])
def test_an_autograd_grad_capture_inside_record_is_refused_and_the_record_stays_true(
    tmp_path: Path, outer: str
) -> None:
    model = _model()
    with record(model, TAPS, tmp_path / "run", strategy=outer) as rec:
        with pytest.raises(GradrunnerError, match=r"capture\(Sequential, strategy='autograd_grad'\) cannot be opened"):
            with capture(model, TAPS, strategy="autograd_grad"):
                pass
        loss = model(_x()).pow(2).mean()
        loss.backward()
        rec.step(loss)
    assert _weight_norm(tmp_path / "run") == pytest.approx(_true_weight_grad_norm(), rel=1e-6)
    with capture(model, TAPS, strategy="autograd_grad"):  # alone again: opens
        pass


@pytest.mark.parametrize(("outer", "inner"), [("hook", "retain_grad"), ("retain_grad", "hook"), ("hook", "hook")])
def test_nested_hook_and_retain_grad_sessions_both_record_the_true_gradient(
    tmp_path: Path, outer: str, inner: str
) -> None:
    model = _model()
    with capture(model, TAPS, strategy=outer) as cap, record(model, TAPS, tmp_path / "run", strategy=inner) as rec:
        loss = model(_x()).pow(2).mean()
        loss.backward()
        rec.step(loss)
        recs = cap.records(loss)
    truth = _true_weight_grad_norm()
    assert recs.has_grad.all() and recs.stats["norm"][1] == pytest.approx(truth, rel=1e-6)
    assert _weight_norm(tmp_path / "run") == pytest.approx(truth, rel=1e-6)


def _plain_grads(model: nn.Sequential, loss_of: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float]:
    """0:output's and 0:weight's gradient norms with a plain tensor hook, no gradrunner: the reference."""
    seen: dict[str, torch.Tensor] = {}

    def tap(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__("g", g.clone()))

    handle = model[0].register_forward_hook(tap)
    loss_of(model(_x())).backward()
    handle.remove()
    weight = model[0].weight.grad
    assert weight is not None
    norms = (seen["g"].norm().item(), weight.norm().item())
    model.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize(("first", "second"), [("autograd_grad", "hook"), ("retain_grad", "autograd_grad"),
                                               ("autograd_grad", "autograd_grad")])  # fmt: skip
def test_sessions_on_models_that_share_nothing_open_together_and_each_records_its_own_true_gradients(
    tmp_path: Path, first: str, second: str
) -> None:
    """Two models trained side by side, each with its own session and backward: f7e3c12 refused the pair
    process-wide whenever one was autograd_grad ('cannot be opened while ... is open'), where the code before
    recorded both exactly (found 2026-11-27 by differential testing). Only sessions sharing a model are refused."""
    a, b = _model(), _model()
    with torch.no_grad():
        b[0].weight.mul_(-2.0)  # another model, other gradients
    truth = {"a": _plain_grads(a, lambda out: out.pow(2).mean()), "b": _plain_grads(b, lambda out: out.sin().sum())}
    with capture(a, TAPS, strategy=first) as cap, record(b, TAPS, tmp_path / "run", strategy=second) as rec:
        loss_a = a(_x()).pow(2).mean()
        cap.backward(loss_a)
        recs = cap.records(loss_a)
        loss_b = b(_x()).sin().sum()
        rec.backward(loss_b)
        rec.step(loss_b)
    assert recs.has_grad.all()
    assert list(recs.stats["norm"]) == pytest.approx(list(truth["a"]), rel=1e-6)
    df = pd.read_parquet(tmp_path / "run" / "grads.parquet").set_index("tap")
    assert df.has_grad.all()
    assert [df.norm["0:output"], df.norm["0:weight"]] == pytest.approx(list(truth["b"]), rel=1e-6)


def test_an_autograd_grad_backward_through_another_sessions_model_is_refused_naming_both() -> None:
    """Models that share no module may still share a graph (one model's output fed to the other): an autograd_grad
    session's backward through the other session's model fills its parameters' .grad without that session's hooks,
    so the other's parameter taps would record 'takes no part in the loss' for a .grad that changed (1:weight,
    with .grad norm 0.328694). Refused as that backward reaches the model; both sessions go on."""
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(4, 6)), nn.Sequential(nn.Tanh(), nn.Linear(6, 2))
    with capture(encoder, TAPS, strategy="autograd_grad") as cap, capture(head, ["1:weight"], strategy="hook") as other:
        with pytest.raises(GradrunnerError) as refused:
            cap.backward(head(encoder(_x())).pow(2).mean())
        message = str(refused.value)
        assert message.startswith("capture(Sequential, strategy='autograd_grad') ran its backward through the model "
                                  "of capture(Sequential, strategy='hook'), which is open beside it") and "\n" not in message  # fmt: skip
        loss = encoder(_x()).pow(2).mean()  # the encoder alone: recorded as without the head's session
        cap.backward(loss)
        recs = cap.records(loss)
        assert other.pending_backwards == 0
    encoder.zero_grad(set_to_none=True)
    assert list(recs.stats["norm"]) == pytest.approx(
        list(_plain_grads(encoder, lambda out: out.pow(2).mean())), rel=1e-6
    )
