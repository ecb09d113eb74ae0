"""Local variables of a module's `forward()`, reachable without editing the model's code.

`assigned_names(fn)` lists the locals a `forward()` assigns (for validation and error messages);
`rewrite(fn, names, tap)` returns a copy of `fn` whose every assignment of a tapped name is
followed by `name = tap(name_str, name)`. Untapped code is unchanged, line numbers still point
at the user's file, and zero-argument `super()` keeps working (the `__class__` cell is reused).

Example::

    fn = rewrite(type(model).forward, {"hidden"}, lambda name, value: value)
    model.forward = types.MethodType(fn, model)
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from collections.abc import Callable, Iterable
from functools import lru_cache

from gradrunner.errors import GradrunnerError

TAP_NAME = "__gradrunner_tap__"
_OUTER_NAME = "__gradrunner_outer__"

TapFn = Callable[[str, object], object]


class SourceUnavailable(GradrunnerError):
    """The `forward()` has no Python source to read (built-in, compiled, or defined interactively)."""


def _unwrap(fn: Callable[..., object]) -> types.FunctionType:
    fn = getattr(fn, "__func__", fn)
    if hasattr(fn, "__wrapped__"):
        raise SourceUnavailable(
            f"{getattr(fn, '__qualname__', fn)!r} is wrapped by a decorator; local-variable taps need an "
            "undecorated forward() (tap the module's output or input instead)"
        )
    if not isinstance(fn, types.FunctionType):
        raise SourceUnavailable(f"{fn!r} is not a Python function, so its local variables cannot be tapped")
    return fn


@lru_cache(maxsize=256)
def _parse(fn: types.FunctionType) -> tuple[ast.Module, ast.FunctionDef | ast.AsyncFunctionDef]:
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise SourceUnavailable(
            f"the source of {fn.__qualname__} is unavailable ({exc}); local-variable taps need a forward() "
            "defined in a .py file"
        ) from exc
    tree = ast.parse(textwrap.dedent("".join(lines)))
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SourceUnavailable(f"{fn.__qualname__} is not defined by a def statement; its locals cannot be tapped")
    ast.increment_lineno(tree, first - 1)
    return tree, func


def _targets(node: ast.AST) -> Iterable[str]:
    """Names bound by an assignment target (tuple/list unpacking and starred included)."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


class _Scope(ast.NodeVisitor):
    """Walks one function body without entering nested functions, classes or lambdas."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:  # nested scope: left as it is
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]


class _Collect(_Scope):
    def __init__(self) -> None:
        self.names: list[str] = []

    def _add(self, names: Iterable[str]) -> None:
        self.names.extend(n for n in names if n not in self.names)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._add(_targets(t))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._add(_targets(node.target))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._add(_targets(node.target))
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._add(_targets(node.target))
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._add(_targets(node.target))
        self.generic_visit(node)

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                self._add(_targets(item.optional_vars))
        self.generic_visit(node)

    visit_AsyncWith = visit_With  # type: ignore[assignment]


def assigned_names(fn: Callable[..., object]) -> list[str]:
    """The local variables `fn` assigns, in order of first assignment (arguments excluded).

    Example::

        assigned_names(CosineRegression.forward)  # ['mul_x', 'sum_x']
    """
    _, func = _parse(_unwrap(fn))
    collector = _Collect()
    for stmt in func.body:
        collector.visit(stmt)
    return collector.names


def _tap_stmt(name: str, at: ast.AST) -> ast.stmt:
    """`name = __gradrunner_tap__("name", name)`, placed at `at`'s line."""
    call = ast.Call(
        func=ast.Name(TAP_NAME, ast.Load()),
        args=[ast.Constant(name), ast.Name(name, ast.Load())],
        keywords=[],
    )
    stmt = ast.Assign(targets=[ast.Name(name, ast.Store())], value=call)
    return ast.copy_location(stmt, at)


class _Rewrite(_Scope, ast.NodeTransformer):
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def _after(self, node: ast.stmt, bound: Iterable[str]) -> ast.stmt | list[ast.stmt]:
        tapped = [n for n in dict.fromkeys(bound) if n in self.names]
        return [node, *(_tap_stmt(n, node) for n in tapped)] if tapped else node

    def _prepend(self, node: ast.For | ast.AsyncFor | ast.With | ast.AsyncWith, bound: Iterable[str]) -> ast.AST:
        self.generic_visit(node)
        tapped = [n for n in dict.fromkeys(bound) if n in self.names]
        node.body[:0] = [_tap_stmt(n, node) for n in tapped]
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.stmt | list[ast.stmt]:
        self.generic_visit(node)
        return self._after(node, (n for t in node.targets for n in _targets(t)))

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.stmt | list[ast.stmt]:
        self.generic_visit(node)
        return self._after(node, _targets(node.target))

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.stmt | list[ast.stmt]:
        self.generic_visit(node)
        return self._after(node, _targets(node.target) if node.value is not None else ())

    def visit_NamedExpr(self, node: ast.NamedExpr) -> ast.AST:
        self.generic_visit(node)
        if node.target.id in self.names:
            node.value = ast.copy_location(
                ast.Call(ast.Name(TAP_NAME, ast.Load()), [ast.Constant(node.target.id), node.value], []), node.value
            )
        return node

    def visit_For(self, node: ast.For) -> ast.AST:
        return self._prepend(node, _targets(node.target))

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def visit_With(self, node: ast.With) -> ast.AST:
        return self._prepend(node, (n for i in node.items if i.optional_vars for n in _targets(i.optional_vars)))

    visit_AsyncWith = visit_With  # type: ignore[assignment]


def rewrite(fn: Callable[..., object], names: Iterable[str], tap: TapFn) -> types.FunctionType:
    """A copy of `fn` that passes every assignment of each name in `names` through `tap(name, value)`.

    Example::

        seen = []
        fn = rewrite(CosineRegression.forward, {"mul_x"}, lambda n, v: seen.append(n) or v)

    `tap` must return the value to bind (the same tensor, or a stand-in for it).
    """
    original = _unwrap(fn)
    _, func = _parse(original)
    new_func = copy.deepcopy(func)
    rewriter = _Rewrite(frozenset(names))
    new_func.body = [s for stmt in new_func.body for s in _as_list(rewriter.visit(stmt))]
    # Nest the function in an outer one whose parameters are its free variables plus the tap, so
    # the compiled code reads them from closure cells: the original's (`__class__` for super())
    # and a new one holding `tap`. The module's globals stay the original's, untouched.
    freevars = list(original.__code__.co_freevars)
    tree = ast.parse(f"def {_OUTER_NAME}({', '.join([*freevars, TAP_NAME])}):\n    pass")
    outer = tree.body[0]
    assert isinstance(outer, ast.FunctionDef)
    outer.body = [new_func, ast.Return(ast.Name(new_func.name, ast.Load()))]
    ast.copy_location(outer, new_func)
    tree.body = [outer]
    ast.fix_missing_locations(tree)
    filename = original.__code__.co_filename
    module_code = compile(tree, filename, "exec")
    outer_code = next(c for c in module_code.co_consts if isinstance(c, types.CodeType))
    inner_code = next(c for c in outer_code.co_consts if isinstance(c, types.CodeType) and c.co_name == func.name)
    cells = dict(zip(original.__code__.co_freevars, original.__closure__ or (), strict=True))
    cells[TAP_NAME] = types.CellType(tap)
    closure = tuple(cells[v] for v in inner_code.co_freevars)
    new = types.FunctionType(inner_code, original.__globals__, original.__name__, original.__defaults__, closure)
    new.__kwdefaults__ = original.__kwdefaults__
    new.__qualname__ = original.__qualname__
    new.__doc__ = original.__doc__
    new.__dict__.update(original.__dict__)
    new.__wrapped__ = original  # type: ignore[attr-defined]
    return new


def _as_list(node: ast.AST | list[ast.stmt] | None) -> list[ast.stmt]:
    if node is None:
        return []
    return node if isinstance(node, list) else [node]  # type: ignore[list-item]
