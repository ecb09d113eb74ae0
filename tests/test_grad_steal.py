"""`autograd_grad` fills `.grad` as `loss.backward()` would, also where it keeps the gradient itself (issue 33 item 4).

After its engine call, a leaf's gradient that nothing else holds becomes its empty `.grad` itself (what torch's
`AccumulateGrad` node does: it copies only a gradient someone else holds), without calling the node. These
tests hold that shortcut to the node's rules against plain `loss.backward()`: a gradient also held elsewhere
(a tap's, one a hook of the model kept, one handed to two leaves) is copied, so changing `.grad` in place
changes nothing else, and a post-accumulate-grad hook still fires.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradrunner import capture
from gradrunner.capturing import torch_compat


class Shift(nn.Module):
    """`x + b` with `b` shaped like `x`: the addition's backward hands one gradient tensor to both."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Shift(), nn.Tanh(), nn.Linear(4, 2))


def _x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(2))


def _plain_grads() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each parameter's `.grad` and the shift's output gradient, by plain torch."""
    model = _model()
    outs: list[torch.Tensor] = []
    h = model[1].register_forward_hook(lambda _m, _i, o: outs.append(o))
    y = model(_x())
    h.remove()
    (g_shift,) = torch.autograd.grad(y.square().sum(), outs, retain_graph=True)
    y.square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, g_shift  # type: ignore[union-attr]


@pytest.mark.parametrize("steal", [True, False], ids=["steal", "node"])
def test_a_gradient_handed_to_a_tap_and_a_leaf_is_not_changed_by_an_edit_of_grad(
    steal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(torch_compat.FEATURES, "steal_grad", steal)
    want_grads, g_shift = _plain_grads()
    model = _model()
    with capture(model, ["1:output"], strategy="autograd_grad", values="full") as cap:
        loss = model(_x()).square().sum()
        cap.backward(loss)
        got_grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        model[1].b.grad.mul_(0.0)  # type: ignore[union-attr]  # clipping in place, before the step's records
        recs = cap.records(loss)
    for n, g in want_grads.items():
        assert torch.equal(got_grads[n], g), n
    values = recs.values[0]
    assert values is not None
    assert torch.equal(torch.as_tensor(values).reshape(3, 4), g_shift.float())


def test_a_leaf_gradient_a_hook_kept_stays_apart_from_grad_as_under_loss_backward() -> None:
    def run(strategy: str | None) -> tuple[bool, bool]:
        model = _model()
        kept: list[torch.Tensor] = []
        w = model[3].weight
        w.register_hook(lambda g: kept.append(g))
        loss = model(_x()).square().sum()
        if strategy is None:
            loss.backward()
        else:
            with capture(model, ["0:output"], strategy=strategy) as cap:
                cap.backward(loss)
                cap.records(loss)
        before = kept[-1].clone()
        w.grad.mul_(2.0)  # type: ignore[union-attr]
        return w.grad is kept[-1], torch.equal(kept[-1], before)

    assert run("autograd_grad") == run(None) == (False, True)


def test_untapped_parameters_get_their_gradients_and_hooks_as_under_loss_backward() -> None:
    want, _ = _plain_grads()
    model = _model()
    fired: list[tuple[str, float]] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(("0.weight", float(p.grad.sum()))))  # type: ignore[union-attr]
    with capture(model, ["2:output"], strategy="autograd_grad") as cap:
        for _ in range(2):  # two backwards into one step: the second adds to `.grad` in place
            loss = model(_x()).square().sum()
            cap.backward(loss)
            if not fired[1:]:
                first = {n: p.grad for n, p in model.named_parameters()}
        cap.records(loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, 2 * want[n]), n  # type: ignore[arg-type]
        assert p.grad is first[n], n  # the same tensor object, added to in place
    assert fired == [("0.weight", pytest.approx(float(want["0.weight"].sum()))),
                     ("0.weight", pytest.approx(float(2 * want["0.weight"].sum())))]  # fmt: skip
