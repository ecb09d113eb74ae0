"""Each torch internal's public fallback (gradrunner/capturing/torch_compat.py), forced: the same gradients."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner import capture
from gradrunner.capturing import torch_compat
from gradrunner.capturing.grad_context import MADE_UNDER_NO_GRAD, NO_PART
from gradrunner.errors import GradrunnerError


class Net(nn.Module):
    """Leaf input, in-place activation after a tapped output, a view written in place, a checkpointed block."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4).double()
        self.act = nn.ReLU(inplace=True)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
        self.head = nn.Linear(4, 1).double()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h[:, 0].mul_(2.0)
        h = self.act(h)
        b = self.block(h) if self.reentrant is None else checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(b)  # type: ignore[no-any-return]


TAPS = [":input", "fc1:output", ":h", "act:output", "block.0:output", "block.0:weight", "head:weight"]


def run(strategy: str, reentrant: bool | None = None, taps: list[str] = TAPS) -> tuple[dict[str, list], list]:
    torch.manual_seed(5)
    model = Net(reentrant)
    x = torch.randn(2, 3, dtype=torch.float64)
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))
    with capture(model, taps, strategy=strategy) as cap:
        cap.backward(model(x).pow(2).sum())
    grads = {t: cap.grads.calls(t) for t in taps}
    return grads, [p.grad for p in model.parameters()] + [sorted(fired)]


def same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("feature", ["get_gradient_edge", "call_accumulate_grad", "tensor_version"])
def test_fallback_gives_the_same_gradients(strategy: str, feature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_compat.FEATURES[feature]  # torch 2.13 has it: the default path is the detected one
    default = run(strategy)
    monkeypatch.setitem(torch_compat.FEATURES, feature, False)
    same(run(strategy), default)


@pytest.mark.parametrize("reentrant", [False, True], ids=["use_reentrant=False", "use_reentrant=True"])
def test_in_backward_fallback_gives_the_same_gradients(
    strategy: str, reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if strategy == "autograd_grad" and reentrant:
        pytest.skip("refused: autograd.grad cannot run through a reentrant checkpoint")
    default = run(strategy, reentrant)
    monkeypatch.setitem(torch_compat.FEATURES, "current_graph_task_id", False)
    same(run(strategy, reentrant), default)


def test_accumulate_fallback_fires_post_accumulate_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(torch_compat.FEATURES, "call_accumulate_grad", False)
    _, (*_, fired) = run("autograd_grad")
    assert fired == sorted(n for n, _ in Net().named_parameters())


def test_without_checkpoint_frames_a_reentrant_block_says_made_under_no_grad(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if strategy == "autograd_grad":
        pytest.skip("refused: autograd.grad cannot run through a reentrant checkpoint")
    _, params = run(strategy, True, ["head:weight"])
    monkeypatch.setitem(torch_compat.FEATURES, "checkpoint_frames", False)
    with pytest.raises(GradrunnerError, match="does not require grad"):
        run(strategy, True, ["block.0:output"])
    torch.manual_seed(5)
    model = Net(True)
    with capture(model, ["block.*:output", "head:weight"], strategy=strategy) as cap:
        cap.backward(model(torch.randn(2, 3, dtype=torch.float64)).pow(2).sum())
    assert set(cap.reasons().values()) == {MADE_UNDER_NO_GRAD}
    same([p.grad for p in model.parameters()], params[:-1])


def test_without_is_view_a_view_changed_in_place_says_no_part(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    class Diag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            K = self.fc(x)
            d = K.diagonal()
            d.add_(1.0)
            return K

    monkeypatch.setitem(torch_compat.FEATURES, "is_view", False)
    model = Diag()
    with capture(model, [":d"], strategy=strategy) as cap:
        cap.backward(model(torch.randn(3, 3)).sum())
    assert list(cap.reasons().values()) == [NO_PART]


def test_without_functorch_detection_a_vmapped_tap_is_still_refused(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(torch_compat.FEATURES, "functorch_wrapped", False)
    inner = nn.Linear(3, 2)
    model = nn.Sequential(inner)
    call: Callable[[torch.Tensor], torch.Tensor] = torch.vmap(inner)
    with capture(model, ["0:output"], strategy=strategy), pytest.raises(GradrunnerError):
        call(torch.randn(4, 3))
