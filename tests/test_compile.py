"""Capture through `torch.compile(model)` and `model.compile()`: the same gradients as eager, every strategy.

The fast tests compile with the `aot_eager` backend (dynamo and AOTAutograd, where hooks and graph
breaks are decided, without inductor's C++ build); one slow test uses the default backend.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner import GradrunnerError, capture
from gradrunner.models import MLP, TinyTransformerBlock

SPELLINGS: dict[str, Callable[[nn.Module, str], nn.Module]] = {
    "torch.compile(model)": lambda m, backend: torch.compile(m, backend=backend),  # type: ignore[dict-item]
    "model.compile()": lambda m, backend: (m.compile(backend=backend), m)[1],
}

MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], list[str]]] = {
    "mlp": (lambda: MLP(in_features=3, hidden=4, depth=2, out_features=2, inplace=True), (5, 3),
            ["fc1:output", "relu1:input", "fc2:output", ":input", ":output", "fc1:weight", "head:bias"]),
    "transformer": (lambda: TinyTransformerBlock(d_model=4, n_heads=2, d_ff=8, out_features=2), (2, 3, 4),
                    [":h", ":attn_out", "attn:output.0", "ff1:output", "ln1:weight", ":input"]),
}  # fmt: skip


def _grads(model: nn.Module, call: nn.Module, x: torch.Tensor, taps: list[str], strategy: str,
           steps: int = 2) -> dict[tuple[str, int], torch.Tensor | None]:  # fmt: skip
    with capture(call, taps, strategy=strategy) as cap:
        for _ in range(steps):  # the second step runs the compiled code, guards already checked
            model.zero_grad()
            cap.backward(call(x.clone()).square().sum())
    return {(t, n): g for t in cap.grads for n, g in enumerate(cap.grads.calls(t))}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_model_gives_the_eager_gradients(strategy: str, spelling: str, name: str) -> None:
    build, shape, taps = MODELS[name]
    torch.manual_seed(0)
    eager = build().double()
    x = torch.randn(*shape, dtype=torch.float64)
    expected = _grads(eager, eager, x, taps, strategy)
    torch._dynamo.reset()
    model = copy.deepcopy(eager)
    compiled = SPELLINGS[spelling](model, "aot_eager")
    got = _grads(model, compiled, x, taps, strategy)
    assert got.keys() == expected.keys()
    for key, g in expected.items():
        assert g is not None and got[key] is not None, key
        torch.testing.assert_close(got[key], g, rtol=1e-10, atol=1e-12)
    assert leftover_hooks(model) == []


@pytest.mark.slow
def test_compiled_with_the_default_backend_gives_the_eager_gradients() -> None:
    build, shape, taps = MODELS["mlp"]
    torch.manual_seed(0)
    eager = build()
    x = torch.randn(*shape)
    expected = _grads(eager, eager, x, taps, "hook")
    for spelling in SPELLINGS:
        torch._dynamo.reset()
        model = copy.deepcopy(eager)
        got = _grads(model, SPELLINGS[spelling](model, "inductor"), x, taps, "hook")
        for key, g in expected.items():
            torch.testing.assert_close(got[key], g, rtol=1e-5, atol=1e-6)
        assert leftover_hooks(model) == []


def test_taps_split_the_compiled_graph(capsys: pytest.CaptureFixture[str]) -> None:
    from torch._dynamo.utils import counters

    def graphs(taps: list[str]) -> int:
        torch.manual_seed(0)
        model = MLP(in_features=3, hidden=4, depth=2, out_features=2)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager")
        with capture(compiled, taps, strategy="hook") as cap:
            cap.backward(compiled(torch.randn(5, 3)).sum())
        return int(counters["stats"]["unique_graphs"])

    root_only, every_module = graphs([":output"]), graphs(["*:output"])
    with capsys.disabled():
        print(f"\ncompiled MLP graphs: {root_only} with the root's output tapped, {every_module} with all 5 module "
              "outputs (1 without capture)")  # fmt: skip
    # The session's hooks on the root break the graph before any op: the root's own code runs eagerly;
    # what dynamo still compiles are the submodules between taps.
    # torch 2.13 (CI): 0 and 4. torch 2.11 (seen on a GPU machine) compiled no graph with either set of taps.
    assert root_only <= every_module <= 5


@pytest.mark.parametrize(
    "spelling", ["torch.compile(model, fullgraph=True)", "model.compile(fullgraph=True)", "submodule"]
)
def test_a_model_compiled_with_fullgraph_is_refused_up_front_and_without_it_captured(
    strategy: str, spelling: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    out = model[0](x)
    expected = torch.autograd.grad(model[2](torch.tanh(out)).pow(2).sum(), out)[0]
    torch._dynamo.reset()
    call: nn.Module = model
    if spelling == "torch.compile(model, fullgraph=True)":
        call = torch.compile(model, backend="eager", fullgraph=True)  # type: ignore[assignment]
    elif spelling == "model.compile(fullgraph=True)":
        model.compile(backend="eager", fullgraph=True)
    else:
        model[2].compile(backend="eager", fullgraph=True)
    where = "module '2'" if spelling == "submodule" else "the model"
    with pytest.raises(GradrunnerError, match=f"{where} is compiled with fullgraph=True.*compile it without fullgraph"):
        capture(call, ["0:output"], strategy=strategy)
    assert leftover_hooks(model) == []
    compiled = torch.compile(copy.deepcopy(model), backend="eager")  # the way out the message names
    with capture(compiled, ["0:output"], strategy=strategy) as cap:
        cap.backward(compiled(x).pow(2).sum())
        torch.testing.assert_close(cap.grads["0:output"], expected)
