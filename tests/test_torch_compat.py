"""Each torch internal's public fallback (gradrunner/capturing/torch_compat.py), forced: the same gradients."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
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


@pytest.mark.parametrize(
    "feature",
    [
        "get_gradient_edge",
        "call_accumulate_grad",
        "storage_use_count",
        "python_node",
        "tensor_version",
        "tensor_hooks",
        "engine_run_backward",
        "direct_edge",
        "will_engine_execute_node",
    ],
)
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


def test_foreach_fallback_gives_the_same_norms_and_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradrunner.capturing.extras import value_norms

    ts = [torch.randn(7), torch.randn(3, 5), torch.randn(0)]
    want = value_norms(ts, batch=True)
    olds = [t + 1 for t in ts]
    monkeypatch.setitem(torch_compat.FEATURES, "foreach", False)
    got = value_norms(ts, batch=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double())
    for d, t in zip(torch_compat.sub_all(olds, ts), ts, strict=True):
        torch.testing.assert_close(d, torch.ones_like(t))


def test_without_the_compiled_modules_internals_a_compiled_model_is_refused_with_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    compiled = torch.compile(model)
    assert torch_compat.compiled_inner(compiled) is model
    monkeypatch.setitem(torch_compat.FEATURES, "compiled_module", False)
    with pytest.raises(GradrunnerError, match="pass the model before torch.compile"):
        capture(compiled, ["0:output"])
    assert torch_compat.compiled_inner(model) is model  # an eager model is never refused


def test_scaler_scale_fallback_gives_the_same_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists once the scaler was used
    want = torch_compat.scale_tensor(scaler, "cpu")
    monkeypatch.setitem(torch_compat.FEATURES, "scaler_scale", False)
    got = torch_compat.scale_tensor(scaler, "cpu")
    assert want is not None and got is not None and float(got) == float(want) == 512.0
    assert torch_compat.scale_tensor(torch.amp.GradScaler("cpu", enabled=False), "cpu") is None


def test_without_engine_callbacks_a_backward_the_session_did_not_run_ends_at_its_next_records(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`at_backward_end` forced off: the user's own loss.backward() is read when the session next looks (here
    records()); the records equal cap.backward's (tests/test_engine.py checks whole steps with accumulation)."""
    if strategy == "autograd_grad":
        pytest.skip("autograd_grad refuses a backward it did not run")
    torch.manual_seed(5)
    model = Net()
    x = torch.randn(2, 3, dtype=torch.float64)
    with capture(model, TAPS, strategy=strategy, keep_grads=False) as cap:
        cap.backward(model(x).pow(2).sum())
        want = cap.records()
        model.zero_grad()
        monkeypatch.setitem(torch_compat.FEATURES, "queue_callback", False)
        model(x).pow(2).sum().backward()
        assert cap.pending_backwards == 1  # seen begin, its end not known yet
        got = cap.records()
    assert got.keys == want.keys
    np.testing.assert_array_equal(got.stats["norm"], want.stats["norm"])


def test_running_ddp_is_none_outside_a_ddp_forward_and_when_its_feature_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`running_ddp` (a model given as DDP's `.module` is refused at its first forward; the 2-rank check is in
    test_sharded_edges): nothing runs here, and with the feature off nothing is ever detected."""
    import torch.nn.parallel.distributed as ddp_module

    assert torch_compat.FEATURES["active_ddp_module"]
    assert torch_compat.running_ddp() is None
    wrapper = nn.Linear(1, 1)  # what DDP's forward would have made the active module
    monkeypatch.setattr(ddp_module.DistributedDataParallel, "_active_ddp_module", wrapper)
    assert torch_compat.running_ddp() is wrapper
    monkeypatch.setitem(torch_compat.FEATURES, "active_ddp_module", False)
    assert torch_compat.running_ddp() is None


def test_compiled_module_fallback_leaves_fullgraph_undetected(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    assert torch_compat.compiled_fullgraph(torch.compile(model, fullgraph=True))
    assert not torch_compat.compiled_fullgraph(torch.compile(model))
    assert not torch_compat.compiled_fullgraph(model)
    monkeypatch.setitem(torch_compat.FEATURES, "compiled_module", False)
    assert not torch_compat.compiled_fullgraph(torch.compile(model, fullgraph=True))


class _TransposedThenFlat(nn.Module):
    """A layer on the input, one past a transpose of dims 1 and 2, one on the batch's tokens flattened."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.flat = nn.Linear(4, 4), nn.Linear(3, 3), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h = self.second(h.transpose(1, 2)).transpose(1, 2)
        return self.flat(h.reshape(-1, 4)).view(x.shape[0], -1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("hidden", [(), ("view_base",), ("saved_values",), ("saved_values", "view_base")])
def test_without_autograd_nodes_saved_values_a_walk_that_reads_one_is_null(
    hidden: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-example norms' walk reads what autograd nodes saved (`Node._saved_<name>`: a transpose's dims, a view's
    sizes) and a view's base (`Tensor._base`), through `node_compat`. Without them: the layer on the model's input
    (no walk) is exact, the calls whose verdict needs a saved value are null naming the node, never a guess; without
    the base alone, the flattened tokens are told from the view's node: exact. Reference: the per-example loop."""
    from per_example_reference import all_params, assert_matches, batched, loop, sq_loss

    model, x = _TransposedThenFlat().double(), torch.randn(2, 3, 4, dtype=torch.float64)
    params = all_params(model)
    ref = loop(model, {"x": x}, sq_loss, params)[0]
    for feature in hidden:
        monkeypatch.setitem(torch_compat.FEATURES, feature, False)
    got, reasons = batched(model, {"x": x}, sq_loss, params)
    walked = ("second:weight", "second:bias", "flat:weight", "flat:bias")
    if "saved_values" in hidden:
        for name in walked:
            assert got[name] is None and "saved values" in str(reasons[name]), (name, reasons[name])
        assert "TransposeBackward" in str(reasons["second:weight"])
        ref = {n: r for n, r in ref.items() if n not in walked}
    assert_matches(got, ref, reasons)


#: Attributes of torch objects that are torch's internals (`_saved_dim0`, `_saved_self_sym_sizes`: every `_saved_`).
_PRIVATE = ("_saved_", "_input_metadata", "_sequence_nr", "_cdata", "_version", "_backward_hooks", "_is_view", "_base",
            "_orig_mod", "_get_active_ddp_module", "_execution_engine", "_storage_Use_Count", "_foreach_")  # fmt: skip


def test_torch_internals_are_read_only_in_torch_compat_and_node_compat() -> None:
    """README ("Torch internals"): every use of a private torch API is in `capturing/torch_compat.py` (autograd nodes'
    own in `capturing/node_compat.py`), each with a fallback a test forces. Until 2026-11-28 the per-example walk read
    autograd nodes' `_saved_*` values and `Tensor._base` in three other modules, with no fallback."""
    import ast
    from pathlib import Path

    import gradrunner

    root = Path(gradrunner.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name in ("torch_compat.py", "node_compat.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
                if (
                    isinstance(node.value, ast.Name)
                    and node.value.id == "torch"
                    and name.startswith("_")
                    and name[1] != "_"
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} torch.{name}")
                    continue
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                arg = node.args[1] if len(node.args) > 1 else None
                name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
            if name is not None and any(name == p or (p.endswith("_") and name.startswith(p)) for p in _PRIVATE):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert not found, found
