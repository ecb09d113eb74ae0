"""`gradrunner.capturing.forward_locals`: every assignment of a tapped local passes through the tap, nothing else changes."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import traceback
import types
from typing import Any

import pytest
import torch
from torch import nn

from gradrunner import GradrunnerError, capture, list_taps
from gradrunner.capturing.forward_locals import SourceUnavailable, assigned_names, rewrite
from gradrunner.capturing.forward_patch import patch_forward
from gradrunner.models import CosineRegression, TinyTransformerBlock


class Recorder:
    """A tap function that records (name, value) and hands back the value (or a replacement)."""

    def __init__(self, replace: dict[str, Any] | None = None) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.replace = replace or {}

    def __call__(self, name: str, value: Any) -> Any:
        self.seen.append((name, value))
        return self.replace.get(name, value)


def run(module: nn.Module, names: set[str], *args: Any, replace: dict[str, Any] | None = None) -> tuple[Any, list]:
    tap = Recorder(replace)
    fn = rewrite(type(module).forward, names, tap)
    return fn(module, *args), tap.seen


class Forms(nn.Module):
    """One of every kind of binding."""

    def forward(self, x: int) -> Any:
        a = x + 1
        a += 10
        b: int = a * 2
        c: int  # annotation only: not an assignment
        (d, [e, *f]) = (1, [2, 3, 4])
        if (g := a + b) > 0:
            pass
        for i, (j, k) in enumerate([(5, 6), (7, 8)]):
            pass
        with contextlib.nullcontext(99) as w:
            pass
        m = n = 0
        return a, b, d, e, f, g, i, j, k, w, m, n


def test_assigned_names_in_order_of_first_binding() -> None:
    assert assigned_names(Forms.forward) == ["a", "b", "d", "e", "f", "g", "i", "j", "k", "w", "m", "n"]


def test_assigned_names_of_the_built_in_models() -> None:
    assert assigned_names(CosineRegression.forward) == ["mul_x", "sum_x"]
    assert assigned_names(TinyTransformerBlock.forward) == ["q", "attn_out", "_weights", "h", "ff"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a", [1, 11]),  # plain, then augmented
        ("b", [22]),  # annotated
        ("d", [1]),  # tuple unpacking
        ("e", [2]),  # nested list unpacking
        ("f", [[3, 4]]),  # starred
        ("g", [33]),  # walrus
        ("i", [0, 1]),  # for-loop target, one call per iteration
        ("k", [6, 8]),  # nested for-loop target
        ("w", [99]),  # with ... as
        ("m", [0]),  # chained assignment
        ("n", [0]),
    ],
)
def test_every_form_of_assignment_is_tapped(name: str, expected: list[Any]) -> None:
    out, seen = run(Forms(), {name}, 0)
    assert seen == [(name, v) for v in expected]
    assert out == Forms()(0)


def test_annotation_without_value_is_not_tapped() -> None:
    assert "c" not in assigned_names(Forms.forward)
    _, seen = run(Forms(), {"c", "a"}, 0)
    assert [n for n, _ in seen] == ["a", "a"]


def test_tapped_value_is_what_the_code_goes_on_with() -> None:
    (a, b, *_), seen = run(Forms(), {"a"}, 0, replace={"a": 100})
    # both assignments of `a` are replaced by 100: `a += 10` sees 100 and is replaced again
    assert [v for _, v in seen] == [1, 110]
    assert (a, b) == (100, 200)


def test_walrus_value_is_replaced_too() -> None:
    out, seen = run(Forms(), {"g"}, 0, replace={"g": -5})
    assert seen == [("g", 33)]
    assert out[5] == -5


def test_untapped_code_is_untouched_and_the_original_still_runs() -> None:
    original = Forms.forward
    _, seen = run(Forms(), {"b"}, 0)
    assert [n for n, _ in seen] == ["b"]
    assert Forms.forward is original
    assert Forms()(0) == Forms()(0)


class Nested(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2

        def inner(v: torch.Tensor) -> torch.Tensor:
            h = v + 100  # a different `h`: the nested function is left alone
            return h

        scale = lambda v: (h := v * 3)  # noqa: E731  (lambda: its own scope too)
        h = inner(h) + scale(h)
        return h


def test_nested_functions_and_lambdas_are_untouched() -> None:
    x = torch.tensor(1.0)
    out, seen = run(Nested(), {"h"}, x)
    assert [float(v) for _, v in seen] == [2.0, 108.0]
    assert float(out) == 108.0
    assert assigned_names(Nested.forward) == ["h", "scale"]


class Base(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Child(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = super().forward(x)
        doubled = base * 2
        return doubled


def test_zero_argument_super_keeps_working() -> None:
    out, seen = run(Child(), {"base", "doubled"}, torch.tensor(1.0))
    assert [(n, float(v)) for n, v in seen] == [("base", 2.0), ("doubled", 4.0)]
    assert float(out) == 4.0


def test_zero_argument_super_through_capture(strategy: str) -> None:
    model = Child()
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with capture(model, [":base", ":doubled"], strategy=strategy) as cap:
        cap.backward((model(x) ** 2).sum())
    assert torch.equal(cap.grads[":doubled"], 2 * (2 * (x.detach() + 1)))
    assert torch.equal(cap.grads[":base"], 4 * (2 * (x.detach() + 1)))
    assert "forward" not in model.__dict__


def _make_closure_module() -> nn.Module:
    factor = 3.0

    class WithClosure(nn.Module):
        def forward(self, x: torch.Tensor, offset: float = 1.0, *, power: int = 2) -> torch.Tensor:
            y = (x * factor + offset) ** power
            return y

    return WithClosure()


def test_closures_defaults_and_keyword_only_defaults_survive() -> None:
    module = _make_closure_module()
    out, seen = run(module, {"y"}, torch.tensor(2.0))
    assert float(out) == 49.0 and float(seen[0][1]) == 49.0
    fn = rewrite(type(module).forward, {"y"}, lambda n, v: v)
    assert float(fn(module, torch.tensor(2.0), 0.0, power=3)) == 216.0


class Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h = h + 1
        raise ValueError("raised in forward")  # the line the traceback must point at


def test_line_numbers_point_at_the_original_source() -> None:
    lines, first = inspect.getsourcelines(Raises.forward)
    raise_line = first + next(i for i, line in enumerate(lines) if "raise ValueError" in line)
    fn = rewrite(Raises.forward, {"h"}, lambda n, v: v)
    with pytest.raises(ValueError) as err:
        fn(Raises(), torch.tensor(1.0))
    frame = traceback.extract_tb(err.value.__traceback__)[-1]
    assert frame.filename == __file__
    assert frame.lineno == raise_line
    assert frame.line is not None and "raise ValueError" in frame.line
    assert fn.__code__.co_firstlineno == Raises.forward.__code__.co_firstlineno


def test_tap_calls_carry_the_assignments_line() -> None:
    lines, first = inspect.getsourcelines(CosineRegression.forward)
    sum_line = first + next(i for i, line in enumerate(lines) if "sum_x = " in line)
    where: list[int] = []

    def tap(name: str, value: Any) -> Any:
        where.append(inspect.currentframe().f_back.f_lineno)  # type: ignore[union-attr]
        return value

    fn = rewrite(CosineRegression.forward, {"sum_x"}, tap)
    fn(CosineRegression(), torch.tensor([0.5]))
    assert where == [sum_line]


def _exec_module() -> nn.Module:
    namespace: dict[str, Any] = {}
    exec(
        "import torch\n"
        "class FromExec(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        y = x * 2\n"
        "        return y\n",
        namespace,
    )
    return namespace["FromExec"]()


def test_forward_without_source_raises_a_clear_error() -> None:
    module = _exec_module()
    with pytest.raises(SourceUnavailable, match="source") as err:
        rewrite(type(module).forward, {"y"}, lambda n, v: v)
    assert isinstance(err.value, GradrunnerError)
    assert "FromExec.forward" in str(err.value)


def test_capture_on_a_forward_without_source_says_why() -> None:
    module = _exec_module()
    with pytest.raises(GradrunnerError, match="source"):
        capture(module, [":y"])


def test_output_taps_still_work_on_a_forward_without_source(strategy: str) -> None:
    module = _exec_module()
    x = torch.tensor([1.0, -2.0])
    with capture(module, [":output", ":input"], strategy=strategy) as cap:
        cap.backward((module(x) ** 2).sum())
    assert torch.equal(cap.grads[":output"], 2 * module(x))
    assert torch.equal(cap.grads[":input"], 8 * x)


def test_builtin_forward_and_a_decorator_without_closure_are_refused() -> None:
    with pytest.raises(SourceUnavailable, match="not a Python function"):
        rewrite(torch.Tensor.add, {"y"}, lambda n, v: v)

    def opaque(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            return registry[0](*args)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    registry: list[Any] = []

    class Opaque(nn.Module):
        @opaque
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            return y

    with pytest.raises(
        SourceUnavailable, match=r"does not hold the wrapped function in a closure.*tap the module's output"
    ):
        rewrite(Opaque.forward, {"y"}, lambda n, v: v)


def test_a_decorated_forward_keeps_its_decorator_and_is_tapped() -> None:
    class Decorated(nn.Module):
        @torch.no_grad()
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            return y + 1

    seen: list[object] = []
    fn = rewrite(Decorated.forward, {"y"}, lambda n, v: seen.append(v) or v)
    x = torch.ones(2, requires_grad=True)
    out = fn(Decorated(), x)
    assert torch.equal(out, torch.full((2,), 3.0)) and not out.requires_grad  # no_grad still applies
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2,), 2.0))  # type: ignore[arg-type]
    assert Decorated.forward.__wrapped__.__code__ is not fn.__wrapped__.__code__  # the class is untouched


class InPlaceLocal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h += 1
        h *= 3
        h = h**2
        return h


def test_augmented_assignment_on_a_tensor_gets_each_values_gradient(strategy: str) -> None:
    torch.manual_seed(0)
    model = InPlaceLocal().double()
    x = torch.randn(3, 2, dtype=torch.float64)
    with capture(model, [":h"], strategy=strategy) as cap:
        cap.backward(model(x).sum())
    h0 = model.lin(x).detach()
    h2 = 3 * (h0 + 1)
    expected = [6 * h2, 6 * h2, 2 * h2, torch.ones_like(h0)]  # d(sum((3 (h0 + 1))^2)) at each binding
    calls = cap.grads.calls(":h")
    assert len(calls) == 4
    for got, want in zip(calls, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rewritten_function_is_a_plain_function() -> None:
    fn = rewrite(CosineRegression.forward, {"mul_x"}, lambda n, v: v)
    assert isinstance(fn, types.FunctionType)
    assert fn.__name__ == "forward" and fn.__qualname__ == CosineRegression.forward.__qualname__
    assert fn.__code__.co_filename == CosineRegression.forward.__code__.co_filename


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.fc(x)
        h = torch.tanh(h) * scale
        return h.sum()


@pytest.mark.parametrize("how", ["partial of the class forward", "partial of the bound forward"])
def test_an_instance_forward_wrapping_the_class_forward_in_a_partial_is_tapped(strategy: str, how: str) -> None:
    """Issue 36 item 9: `module.forward = functools.partial(Class.forward, module, ...)`, a common monkeypatch."""
    import functools

    from conftest import leftover_hooks

    torch.manual_seed(0)
    net, x = _Scaled(), torch.randn(4, 3)
    target = _Scaled.forward if how.endswith("class forward") else net.forward
    patched = (
        functools.partial(target, net, scale=2.0) if target is _Scaled.forward else functools.partial(target, scale=2.0)
    )
    net.forward = patched  # type: ignore[method-assign]
    # the reference: both values of `h`, retained, in plain torch
    h0 = net.fc(x)
    h0.retain_grad()
    h1 = torch.tanh(h0) * 2.0
    h1.retain_grad()
    h1.sum().backward()
    with capture(net, [":h"], strategy=strategy) as cap:
        loss = net(x)
        cap.backward(loss)
        recs = cap.records(loss.detach())
    rows = [recs.row(i) for i in range(len(recs))]
    assert [(r["call"], r["has_grad"]) for r in rows] == [(0, True), (1, True)]
    assert rows[0]["norm"] == pytest.approx(float(h0.grad.norm()), rel=1e-6)
    assert rows[1]["norm"] == pytest.approx(float(h1.grad.norm()), rel=1e-6)
    # put back: the user's partial (its own function and arguments), the class's forward, no hooks
    assert net.__dict__["forward"] is patched and patched.func is target
    assert patched.args == ((net,) if target is _Scaled.forward else ()) and patched.keywords == {"scale": 2.0}
    assert _Scaled.__dict__["forward"] is (target if target is _Scaled.forward else target.__func__)
    assert [h for h in leftover_hooks(net) if "instance attribute forward = functools.partial" not in h] == []


class VarArgs(nn.Module):
    def forward(*args: Any) -> Any:  # the instance is args[0]
        y = args[1] * 2
        return y


BLOCK = TinyTransformerBlock(d_model=8, n_heads=2, d_ff=16, out_features=8)


@pytest.mark.parametrize("module", [BLOCK, VarArgs()], ids=["self", "*args"])
def test_a_deepcopy_of_a_patched_module_runs_its_forward_untapped(module: nn.Module) -> None:
    """`copy.deepcopy` copies the instance `forward` bound to the copy: only the patched instance is tapped."""
    name = assigned_names(type(module).forward)[0]
    tap, x = Recorder(), torch.randn(2, 3, 8)
    want = module(x)
    undo = patch_forward(module, {name}, tap)
    try:
        twin = copy.deepcopy(module)
        torch.testing.assert_close(twin(x), want, rtol=0, atol=0)
        assert tap.seen == []  # the copy's forward tapped nothing
        module(x)
        assert [n for n, _ in tap.seen] == [name]
    finally:
        undo()
    torch.testing.assert_close(twin(x), want, rtol=0, atol=0)  # and keeps working after the undo
    assert "forward" not in module.__dict__


_ANNOTATED_HELPER = """{future}
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)

        def double(t: torch.Tensor) -> torch.Tensor:
            return t * 2

        return double(h).pow(2).sum()
"""


@pytest.mark.parametrize("future", ["", "from __future__ import annotations"])
def test_a_forward_with_an_annotated_nested_function_is_tapped_with_or_without_the_future_import(
    tmp_path: Any, future: str
) -> None:
    path = tmp_path / f"annotated_{'future' if future else 'plain'}.py"
    path.write_text(_ANNOTATED_HELPER.format(future=future))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    block, x = module.Block(), torch.randn(2, 3)
    h = block.lin(x)
    expected = torch.autograd.grad((h * 2).pow(2).sum(), h)[0]  # d/dh sum((2h)^2) = 8h
    assert assigned_names(module.Block.forward) == ["h"]
    with capture(block, [":h"], strategy="hook") as cap:
        cap.backward(block(x))
        assert torch.allclose(cap.grads[":h"], expected)
        assert torch.allclose(cap.grads[":h"], 8 * h.detach())


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        return (h**2).sum()


def _other_forward(self: _Plain, x: torch.Tensor) -> torch.Tensor:
    q = self.l(x) * 3
    return (q**2).sum()


def _calling_forward(self: _Plain, x: torch.Tensor) -> torch.Tensor:
    w = _Plain.forward(self, x)
    return w * 2


def test_an_instance_forward_replacing_the_class_forward_is_what_gets_tapped(strategy: str) -> None:
    torch.manual_seed(0)
    m, x = _Plain(), torch.randn(2, 3)
    replacement = types.MethodType(_other_forward, m)
    m.forward = replacement  # type: ignore[method-assign]
    q = m.l(x) * 3
    expected = torch.autograd.grad((q**2).sum(), q)[0]  # 2q
    offered = [t for mod in list_taps(m, x).modules for t in mod.taps() if t.startswith(":")]
    assert ":q" in offered and ":h" not in offered
    with pytest.raises(GradrunnerError, match="has no 'h'"):
        capture(m, [":h"], strategy=strategy)
    with capture(m, [":q"], strategy=strategy) as cap:
        cap.backward(m(x))
        assert torch.allclose(cap.grads[":q"], expected)
        assert torch.allclose(cap.grads[":q"], 2 * q.detach())
    assert m.__dict__["forward"] == replacement  # put back
    # a wrapper that calls the class's forward by name is not a replacement: the class's locals are tapped
    m.forward = types.MethodType(_calling_forward, m)  # type: ignore[method-assign]
    h = m.l(x)
    with capture(m, [":h"], strategy=strategy) as cap:
        cap.backward(m(x))
        assert torch.allclose(cap.grads[":h"], 4 * h.detach())  # d/dh 2*sum(h^2)


class _Match(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = (self.l(x), x)
        match pair:
            case (p, q) if q is not None:
                r = p * 2
            case _:
                r = x
        match {"a": r, "b": p}:
            case {"a": a, **others}:
                s = a * others["b"]
        return s.sum()


def test_names_bound_by_match_patterns_are_tapped(strategy: str) -> None:
    torch.manual_seed(0)
    m, x = _Match(), torch.randn(2, 3)
    assert assigned_names(_Match.forward) == ["pair", "p", "q", "r", "a", "others", "s"]
    p = m.l(x)
    r = p * 2
    gp, gr = torch.autograd.grad((r * p).sum(), [p, r])  # p's own use and through r: 2p + 2p = 4p; r: p
    with capture(m, [":p", ":a"], strategy=strategy) as cap:
        cap.backward(m(x))
        assert torch.allclose(cap.grads[":p"], 4 * p.detach())
        assert torch.allclose(cap.grads[":p"], gp)
        assert torch.allclose(cap.grads[":a"], gr)


class _Nonlocal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)

        def step() -> None:
            nonlocal h
            h = h * 3

        def shadow() -> torch.Tensor:
            h = torch.zeros(1)  # its own local, not the forward's
            return h

        step()
        return (h * h).sum() + shadow().sum()


def test_a_nested_functions_nonlocal_assignment_is_tapped_as_the_forwards_own(strategy: str) -> None:
    torch.manual_seed(0)
    m, x = _Nonlocal(), torch.randn(2, 3)
    h0 = m.l(x)
    h1 = h0 * 3
    g0, g1 = torch.autograd.grad((h1 * h1).sum(), [h0, h1])  # 2*h1 and 3*2*h1
    with capture(m, [":h"], strategy=strategy) as cap:
        cap.backward(m(x))
        got = cap.grads.calls(":h")
    assert len(got) == 2
    assert torch.allclose(got[0], g0) and torch.allclose(got[1], g1)
    assert torch.allclose(got[0], 18 * h0.detach())
