"""A tapped parameter whose tensor is swapped under capture (`torch.utils.swap_tensors(p, new)`, `.double()` under
`set_swap_module_params_on_conversion(True)`): per-example norms against each row alone through plain autograd, the
user's own hooks as without capture."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner import GradrunnerError, capture
from gradrunner.capturing import torch_compat

TAPS = ("0:weight", "2:weight", "2:bias")


@contextmanager
def _swap_on_conversion() -> Iterator[None]:
    future: Any = torch.__future__
    was = future.get_swap_module_params_on_conversion()
    future.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        future.set_swap_module_params_on_conversion(was)


def _swap(m: nn.Sequential) -> None:
    torch.utils.swap_tensors(m[2].weight, nn.Parameter(m[2].weight.detach() * 2))


def _swap_double(m: nn.Sequential) -> None:
    with _swap_on_conversion():
        m.double()


def _double_and_back(m: nn.Sequential) -> None:
    """A cast there and back with no forward between: new accumulators, the same dtype, device and tensor."""
    m.double()
    m.float()


def _rows_alone(model: nn.Module, chunks: tuple[torch.Tensor, ...], batch: int) -> dict[str, torch.Tensor]:
    """Each row alone through a copy of the model, its loss scaled to its share: the norm of its gradient."""
    ref, params = copy.deepcopy(model), {}
    named = dict(ref.named_parameters())
    out: dict[str, list[float]] = {t: [] for t in TAPS}
    for x in chunks:
        for i in range(x.shape[0]):
            ref.zero_grad(set_to_none=True)
            (ref(x[i : i + 1]).pow(2).sum() / batch).backward()
            for t in TAPS:
                params[t] = named[t.replace(":", ".")]
                out[t].append(float(params[t].grad.double().norm()))
    return {t: torch.tensor(v, dtype=torch.float64) for t, v in out.items()}


def _rows(recs: Any) -> dict[str, dict[str, Any]]:
    return {r["tap"]: r for r in (recs.row(i) for i in range(len(recs)))}


@pytest.mark.parametrize("cdata", [True, False], ids=["cdata", "fallback"])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize(
    "change", [_swap, _swap_double, _double_and_back], ids=["swap_tensors", "double_on_conversion", "double_and_back"]
)
def test_per_example_norms_of_a_swapped_parameter_match_each_row_alone(
    strategy: str, change: Callable[[nn.Sequential], None], micro: int, cdata: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-example check hooked the Parameter's gradient once; `swap_tensors` leaves hooks on the old tensor, so
    after the swap it saw no gradient and the rows were null, "its modules' outputs got gradients but it did not",
    while `.grad` and the whole norm were right (2:weight, each row alone: 0.557, 0.471, ...). Hooked again on the new
    tensor now: the rows match each row alone through plain autograd, in every strategy, with accumulation too (and
    with `torch_compat.tensor_impl`'s fallback forced: the accumulator node looked up). `model.double(); model.float()`
    gives new accumulators with nothing else changed: the rows were null under `hook` and `retain_grad` (the whole
    record "takes no part in the loss"); they match each row alone now."""
    monkeypatch.setitem(torch_compat.FEATURES, "tensor_cdata", cdata)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    with capture(model, list(TAPS), strategy=strategy, per_example=True) as cap:
        for step in range(2):
            chunks = x.chunk(micro)
            ref = _rows_alone(model, chunks, x.shape[0])
            for c in chunks:
                cap.backward(model(c).pow(2).sum() / x.shape[0])
            got = _rows(cap.records())
            for t in TAPS:
                pe = got[t]["per_example_norm"]
                assert pe is not None, (step, t)
                torch.testing.assert_close(torch.as_tensor(pe, dtype=torch.float64), ref[t], rtol=1e-4, atol=1e-7)
            model.zero_grad(set_to_none=True)
            change(model)
            x = x.to(model[0].weight.dtype)
    assert not leftover_hooks(model)


def test_a_hook_of_yours_registered_after_a_swap_fires_as_without_capture() -> None:
    """torch ties a Parameter's hook dict to the tensor it held when the dict was made: once gradrunner had hooked the
    parameter (even after the block, its empty dict left), a hook the user registered after a swap went into that dict
    and never fired (without capture it fires: the dict is made then). The check's hook now moves to the new tensor at
    the next forward, and the dict is set back to None where it empties (the block's end)."""

    def fired_after_swap(captured: bool, swap_inside: bool) -> list[str]:
        torch.manual_seed(0)
        model, x, fired = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4), []
        with capture(model, list(TAPS), per_example=True) if captured else contextlib_null():
            model(x).sum().backward()
            if swap_inside:  # a forward after the swap, then the user's hook (before it: README, not detected)
                _swap(model)
                model(x).sum().backward()
                model[2].weight.register_hook(lambda g: fired.append("inside"))
                model(x).sum().backward()
        if not swap_inside:
            _swap(model)
        model[2].weight.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
        model[2].weight.register_hook(lambda g: fired.append("after"))
        model(x).sum().backward()
        return fired

    for swap_inside in (False, True):
        assert fired_after_swap(True, swap_inside) == fired_after_swap(False, swap_inside), swap_inside


@contextmanager
def contextlib_null() -> Iterator[None]:
    yield


@pytest.mark.parametrize("why", ["hook_of_yours", "no_hook_dict"])
def test_a_swap_whose_hooks_cannot_move_is_null_with_its_reason(why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the swapped Parameter holds a hook of the user's (or torch's hook dict cannot be read: the fallback), the
    check cannot hook the new tensor without changing which of the user's hooks fire: its rows are null with the reason
    that says so, never rows unchecked; the other parameters' rows still match each row alone."""
    if why == "no_hook_dict":
        monkeypatch.setitem(torch_compat.FEATURES, "tensor_hooks", False)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    if why == "hook_of_yours":
        model[2].weight.register_hook(lambda g: None)
    with pytest.warns(UserWarning, match=r"2:weight is null: its tensor was swapped \(torch.utils.swap_tensors\)"), capture(model, list(TAPS), per_example=True) as cap:
        _swap(model)
        ref = _rows_alone(model, (x,), x.shape[0])
        cap.backward(model(x).pow(2).sum() / x.shape[0])
        got = _rows(cap.records())
    assert got["2:weight"]["per_example_norm"] is None
    assert bool(got["2:weight"]["has_grad"])
    for t in ("0:weight", "2:bias"):
        torch.testing.assert_close(torch.as_tensor(got[t]["per_example_norm"], dtype=torch.float64), ref[t], rtol=1e-4, atol=1e-7)


def test_an_edited_parameter_swapped_is_refused_not_left_unedited(strategy: str) -> None:
    """A parameter edit is a hook on the Parameter, which torch leaves with the old tensor: after `swap_tensors` the
    step ran unedited (`.grad` norm 7.66 where the edit asked for 3.83, the record `edited` False) and nothing said
    so. The next root forward is refused now, in one paragraph naming the edit; the step before keeps its edited
    `.grad`; a session made after the swap edits again (against the edit done by hand on the unedited gradient)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    plain = copy.deepcopy(model)

    def unedited() -> torch.Tensor:
        plain.zero_grad(set_to_none=True)
        plain(x).pow(2).sum().backward()
        return plain[2].weight.grad.clone()

    edits = [{"tap": "2:weight", "scale": 0.5}]
    with capture(model, ["2:weight"], strategy=strategy, edits=edits) as cap:
        cap.backward(model(x).pow(2).sum())
        cap.records()
        torch.testing.assert_close(model[2].weight.grad, 0.5 * unedited())
        model.zero_grad(set_to_none=True)
        for m in (model, plain):
            _swap(m)
        with pytest.raises(GradrunnerError, match=r"edits\[0\].*2:weight was swapped since the session was made"):
            model(x)
    assert model[2].weight.grad is None
    with capture(model, ["2:weight"], strategy=strategy, edits=edits) as cap:
        cap.backward(model(x).pow(2).sum())
        assert _rows(cap.records())["2:weight"]["edited"]
    torch.testing.assert_close(model[2].weight.grad, 0.5 * unedited())
    assert not leftover_hooks(model)


def test_a_tensor_made_of_a_tapped_parameter_left_in_its_slot_runs_as_without_capture(strategy: str) -> None:
    """A plain tensor made of the tapped parameter written into its slot as the layer is called and left there
    (`lin._parameters["weight"] = w * 1.0`, accelerate-style lending): `autograd_grad` took that non-leaf for a
    parameter and called its node as an accumulator, so the first backward crashed ("Trying to backward through the
    graph a second time"), where `loss.backward()` works. Now every strategy runs the steps as without capture:
    `.grad` bitwise the uncaptured run's, the record the parameter's `.grad`, the per-example norms each row's alone."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    plain = copy.deepcopy(model)
    ref = _rows_alone(model, (x,), 1)["2:weight"]

    def lend(m: nn.Sequential) -> None:
        w = m[2].weight
        m[2].register_forward_pre_hook(lambda mod, args: mod._parameters.__setitem__("weight", w * 1.0))

    orig, want = model[2].weight, plain[2].weight  # the Parameters: their slots hold the lent tensors after a forward
    lend(model)
    lend(plain)
    with capture(model, ["2:weight"], strategy=strategy, per_example=True) as cap:
        for _ in range(3):
            plain(x).pow(2).sum().backward()
            cap.backward(model(x).pow(2).sum())
            row = _rows(cap.records())["2:weight"]
            assert torch.equal(orig.grad, want.grad)
            assert bool(row["has_grad"]) and row["norm"] == pytest.approx(float(want.grad.norm()), rel=1e-6)
            torch.testing.assert_close(torch.as_tensor(row["per_example_norm"], dtype=torch.float64), ref, rtol=1e-4, atol=1e-7)
            want.grad = orig.grad = None


def test_a_swap_between_two_backwards_of_a_step_is_null_for_the_swap_not_zero_grad(strategy: str) -> None:
    """`swap_tensors` of a tapped parameter between two micro-batches swaps `.grad` too (the new tensor's: None), so
    the first micro-batch's rows are in no `.grad`: null per-example rows, as after a reset. The reason said "its
    .grad was reset (zero_grad)", which did not happen; it names the swap now. The record is the `.grad` the step
    leaves (the second micro-batch's), and the untouched parameter's rows are each row's alone."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(6, 4)
    a, b = x.chunk(2)
    ref = _rows_alone(model, (a,), 1)["0:weight"]
    with capture(model, ["2:weight", "0:weight"], strategy=strategy, per_example=True) as cap:
        cap.backward(model(a).pow(2).sum())
        _swap(model)
        ref = torch.cat([ref, _rows_alone(model, (b,), 1)["0:weight"]])
        cap.backward(model(b).pow(2).sum())
        swapped = r"2:weight is null: its tensor was swapped \(torch.utils.swap_tensors\) between the step's backwards"
        with pytest.warns(UserWarning, match=swapped) as seen:
            got = _rows(cap.records())
    assert not any("zero_grad" in str(w.message) for w in seen)
    assert got["2:weight"]["per_example_norm"] is None
    assert got["2:weight"]["norm"] == pytest.approx(float(model[2].weight.grad.norm()), rel=1e-6)
    torch.testing.assert_close(torch.as_tensor(got["0:weight"]["per_example_norm"], dtype=torch.float64), ref, rtol=1e-4, atol=1e-7)
