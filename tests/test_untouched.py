"""`gradrunner.capturing.untouched`: parameters, buffers, `.grad` and the generators back bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from gradrunner import list_taps
from gradrunner.capturing.untouched import evaluating, untouched


def _bn_dropout() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Conv1d(1, 2, 3), nn.BatchNorm1d(2))
    model.forward = lambda x: model[4](model[3](model[2](model[1](model[0](x))).unsqueeze(1)))  # type: ignore[method-assign]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _state(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    out = [(n, p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]
    return out + [(n, b.clone(), None) for n, b in model.named_buffers()]


def _same(
    a: list[tuple[str, torch.Tensor, torch.Tensor | None]], b: list[tuple[str, torch.Tensor, torch.Tensor | None]]
) -> bool:
    return [n for n, _, _ in a] == [n for n, _, _ in b] and all(
        torch.equal(x, y)
        and x.dtype == y.dtype
        and ((g is None and h is None) or (g is not None and h is not None and torch.equal(g, h)))
        for (_, x, g), (_, y, h) in zip(a, b, strict=True)
    )


def test_list_taps_leaves_batchnorm_statistics_grads_and_the_generator_as_they_were() -> None:
    model = _bn_dropout()
    x = torch.randn(8, 4) * 5 + 3
    before, grads = _state(model), [p.grad for p in model.parameters()]
    generator = torch.get_rng_state()
    listed = list_taps(model, x)
    assert [m.path for m in listed.modules][:3] == ["", "0", "1"]
    after = _state(model)
    assert _same(before, after)
    assert int(dict(model.named_buffers())["1.num_batches_tracked"]) == 0
    assert [p.grad for p in model.parameters()] == grads  # the same objects
    assert torch.equal(torch.get_rng_state(), generator)
    # the next draw is the one it would have been without the listing
    ahead = torch.rand(3)
    torch.set_rng_state(generator)
    assert torch.equal(torch.rand(3), ahead)


def test_the_same_forward_without_untouched_moves_them() -> None:
    model = _bn_dropout()
    before, generator = _state(model), torch.get_rng_state()
    model(torch.randn(8, 4) * 5 + 3)
    assert not _same(before, _state(model)) and not torch.equal(torch.get_rng_state(), generator)


class _Reassigning(nn.Module):
    """A forward that replaces a buffer, adds one, writes a parameter in place and sets `.grad`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale * 2
        self.register_buffer("seen", x.detach().clone())
        with torch.no_grad():
            self.lin.weight.add_(1.0)
        self.lin.bias.grad = torch.full((2,), 7.0)
        if x.sum() > 1e9:
            raise ValueError("too big")
        return self.lin(x) * self.scale


@pytest.mark.parametrize("big", [False, True])
def test_reassigned_and_added_buffers_written_parameters_and_grads_are_put_back_also_after_an_exception(
    big: bool,
) -> None:
    model = _Reassigning()
    scale, weight, before = model.scale, model.lin.weight, _state(model)
    x = torch.full((1, 2), 1e10 if big else 1.0)
    with pytest.raises(ValueError, match="too big") if big else torch.no_grad(), untouched(model):
        model(x)
    assert model.scale is scale and model.lin.weight is weight
    assert "seen" not in dict(model.named_buffers()) and not hasattr(model, "seen")
    assert model.lin.bias.grad is None
    assert _same(before, _state(model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_generator_and_buffers_are_put_back() -> None:
    model = _bn_dropout().cuda()
    x = torch.randn(8, 4, device="cuda") * 5 + 3
    before, generators = _state(model), torch.cuda.get_rng_state_all()
    list_taps(model, x)
    assert _same(before, _state(model))
    assert all(torch.equal(a, b) for a, b in zip(generators, torch.cuda.get_rng_state_all(), strict=True))


def test_each_modules_own_train_eval_mode_is_put_back() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.Linear(2, 1))
    model[0].eval()  # a block kept in eval mode while the rest trains
    modes = [m.training for m in model.modules()]
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == modes == [True, False, False, False, True]
    with pytest.raises(ValueError), untouched(model):
        model.train()
        raise ValueError
    assert [m.training for m in model.modules()] == modes


def test_a_graph_built_before_list_taps_still_backpropagates_to_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.BatchNorm1d(1))
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
    loss = model(x).pow(2).sum()
    stats = model[3].running_mean.clone()  # batch_norm moves it without bumping its version: compared by value
    versions = [p._version for p in model.parameters()]
    list_taps(model, x)
    assert [p._version for p in model.parameters()] == versions  # nothing written in place
    assert torch.equal(model[3].running_mean, stats)
    loss.backward()  # 'modified by an inplace operation' before the fix
    for p, g in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, g)


class _LayerDrop(nn.Module):
    """Stochastic depth written with Python's `random` and numpy's global generator, as research code does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and random.random() < 0.1:
                continue
            x = layer(x) + float(np.random.rand()) * 0.0
        return x


def test_list_taps_leaves_pythons_and_numpys_global_generators_as_they_were() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model, x = _LayerDrop(), torch.randn(2, 4)
    expected = (random.random(), float(np.random.rand()))  # what the next draws are without list_taps
    random.seed(0)
    np.random.seed(0)
    list_taps(model, x)
    assert (random.random(), float(np.random.rand())) == expected
