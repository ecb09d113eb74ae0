"""Local variables of a module's `forward()`, reachable without editing the model's code.

`assigned_names(fn)` lists the locals a `forward()` assigns (for validation and error messages);
`rewrite(fn, names, tap)` returns a copy of `fn` whose every assignment of a tapped name is
followed by `name = tap(name_str, name)`. Untapped code is unchanged, line numbers still point
at the user's file, and zero-argument `super()` keeps working (the `__class__` cell is reused).

Putting the rewritten copy where a module's calls reach it (and taking it away) is `forward_patch`.

Example::

    fn = rewrite(type(model).forward, {"hidden"}, lambda name, value: value)
    model.forward = types.MethodType(fn, model)
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import copy
import functools
import inspect
import linecache
import operator
import types
from collections.abc import Callable, Iterable, Sequence

from gradrunner.capturing.owned import owned
from gradrunner.errors import GradrunnerError

TAP_NAME = "__gradrunner_tap__"
_OUTER_NAME = "__gradrunner_outer__"

TapFn = Callable[[str, object], object]


class SourceUnavailable(GradrunnerError):
    """The `forward()` has no Python source to read (built-in, compiled, or defined interactively)."""


def _innermost(fn: Callable[..., object]) -> tuple[types.FunctionType, list[types.FunctionType]]:
    """The function a chain of `functools.wraps`-style decorators ends in, and the wrappers, outermost first."""
    fn = getattr(fn, "__func__", fn)
    wrappers: list[types.FunctionType] = []
    while hasattr(fn, "__wrapped__"):
        if not isinstance(fn, types.FunctionType):
            raise SourceUnavailable(
                f"{getattr(fn, '__qualname__', fn)!r} is wrapped by a decorator that is not a Python function "
                f"({type(fn).__name__}), so its local variables cannot be tapped; {_INSTEAD}"
            )
        wrappers.append(fn)
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    if not isinstance(fn, types.FunctionType):
        raise SourceUnavailable(f"{fn!r} is not a Python function, so its local variables cannot be tapped; {_INSTEAD}")
    return fn, wrappers


_INSTEAD = "tap the module's output, input or parameters instead, or a submodule's"


@functools.lru_cache(maxsize=256)
def _parse(fn: types.FunctionType) -> tuple[ast.Module, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The `def` of `fn` as parsed from its file, checked against the loaded code."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise SourceUnavailable(
            f"the source of {fn.__qualname__} is unavailable ({exc}); local-variable taps need a forward() "
            f"defined in a .py file; {_INSTEAD}"
        ) from exc
    # An indented def is parsed inside `if 1:` rather than dedented: dedenting breaks on a multi-line
    # string at column 0, and keeping the columns keeps tracebacks and the freshness check exact.
    indented = lines[0][:1].isspace()
    try:
        tree = ast.parse(("if 1:\n" if indented else "") + "".join(lines))
    except SyntaxError as exc:
        raise SourceUnavailable(
            f"the source of {fn.__qualname__} ({fn.__code__.co_filename}:{first}) cannot be parsed on its own "
            f"({exc.msg}); {_INSTEAD}"
        ) from None
    body = tree.body[0].body if indented else tree.body  # type: ignore[attr-defined]
    func = body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or func.name != fn.__name__:
        raise SourceUnavailable(f"{fn.__qualname__} is not defined by a def statement; its locals cannot be tapped; "
                                f"{_INSTEAD}")  # fmt: skip
    tree.body = [func]
    ast.increment_lineno(tree, first - (2 if indented else 1))
    func.decorator_list = []  # the decorators' wrappers are kept as they are (see `rewrite`)
    if not _same_code(_compile(func, fn), fn.__code__):
        raise SourceUnavailable(
            f"the source of {fn.__qualname__} in {fn.__code__.co_filename} (line {first}) no longer matches the "
            "loaded code (the file was edited after it was imported): tapping its locals would run the edited "
            "code. Restart Python to load the file as it is now, or tap outputs, inputs or parameters."
        )
    return tree, func


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same bytecode, names and constants (nested code compared the same way); line numbers ignored."""
    if (a.co_code, a.co_names, a.co_varnames, a.co_freevars, a.co_cellvars) != (
        b.co_code, b.co_names, b.co_varnames, b.co_freevars, b.co_cellvars
    ) or len(a.co_consts) != len(b.co_consts):  # fmt: skip
        return False
    for x, y in zip(a.co_consts, b.co_consts, strict=True):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _compile(func: ast.FunctionDef | ast.AsyncFunctionDef, original: types.FunctionType,
             extra_free: Sequence[str] = ()) -> types.CodeType:  # fmt: skip
    """Compile `func` where `original` was defined: inside a function that provides its free variables
    (plus `extra_free`) as closure cells, inside `class <its class>:` so that `self.__x` is name-mangled."""
    freevars = [*original.__code__.co_freevars, *extra_free]
    outer = ast.parse(f"def {_OUTER_NAME}({', '.join(freevars)}):\n    pass").body[0]
    assert isinstance(outer, ast.FunctionDef)
    outer.body = [func, ast.Return(ast.Name(func.name, ast.Load()))]
    ast.copy_location(outer, func)
    node: ast.stmt = outer
    parts = original.__qualname__.split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>" and parts[-2].isidentifier():
        node = ast.ClassDef(name=parts[-2], bases=[], keywords=[], body=[outer], decorator_list=[])
        ast.copy_location(node, func)
    # Names the original module imports: the compiler emits different bytecode for their attributes.
    imports = [
        ast.Import(names=[ast.alias(name="_", asname=n)]) for n in _imported_names(original.__code__.co_filename)
    ]
    tree = ast.Module(body=[*imports, node], type_ignores=[])
    ast.fix_missing_locations(tree)
    # The original file's own `from __future__` imports, not this module's (`annotations`: a nested def's
    # annotations compile differently, and the freshness check would call an unedited file edited).
    flags = original.__code__.co_flags & _FUTURE_FLAGS
    code = _find_code(compile(tree, original.__code__.co_filename, "exec", flags=flags, dont_inherit=True), _OUTER_NAME)
    return _find_code(code, func.name)


#: Every `from __future__` feature's compiler flag: the part of a code object's `co_flags` that `compile()` takes.
_FUTURE_FLAGS = functools.reduce(
    operator.or_, (getattr(__future__, f).compiler_flag for f in __future__.all_feature_names)
)


@functools.lru_cache(maxsize=64)
def _imported_names(filename: str) -> tuple[str, ...]:
    """Names bound by import statements at the top level of the module in `filename`."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    names: list[str] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.extend((a.asname or a.name).partition(".")[0] for a in node.names if a.name != "*")
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return tuple(dict.fromkeys(n for n in names if n.isidentifier()))


def _find_code(code: types.CodeType, name: str) -> types.CodeType:
    """The code object named `name` among `code`'s constants, searched depth first."""
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            if c.co_name == name:
                return c
            with contextlib.suppress(LookupError):
                return _find_code(c, name)
    raise LookupError(name)


def _targets(node: ast.AST) -> Iterable[str]:
    """Names bound by an assignment target (tuple/list unpacking and starred included)."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _pattern_names(pattern: ast.pattern) -> list[str]:
    """Names a `case` pattern binds (`case (p, q)`, `case [first, *rest]`, `case {"k": v, **others}`, `case X() as y`)."""
    found: list[tuple[int, int, str]] = []  # (line, column, name): in source order
    for node in ast.walk(pattern):
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name is not None:
            found.append((node.lineno, node.col_offset, node.name))
        elif isinstance(node, ast.MatchMapping) and node.rest is not None:  # `**rest` comes last in its mapping
            found.append((node.end_lineno or node.lineno, node.end_col_offset or 0, node.rest))
    return [name for *_, name in sorted(found)]


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

    def visit_match_case(self, node: ast.match_case) -> None:
        self._add(_pattern_names(node.pattern))
        self.generic_visit(node)


def assigned_names(fn: Callable[..., object]) -> list[str]:
    """The local variables `fn` assigns, in order of first assignment (arguments excluded).

    Example::

        assigned_names(CosineRegression.forward)  # ['mul_x', 'sum_x']
    """
    _, func = _parse(_innermost(fn)[0])
    collector = _Collect()
    for stmt in func.body:
        collector.visit(stmt)
    return collector.names


def _tap_call(owner: str | None, name: str, value: ast.expr) -> ast.Call:
    """`__gradrunner_tap__("name", value)`, or with an `owner` `__gradrunner_tap__(self, "name", value)`: the
    instance running the forward goes first (see `rewrite`)."""
    args: list[ast.expr] = [ast.Constant(name), value]
    if owner is not None and owner.startswith("*"):  # `def forward(*args)`: the instance is args[0]
        args.insert(0, ast.Subscript(ast.Name(owner[1:], ast.Load()), ast.Constant(0), ast.Load()))
    elif owner is not None:
        args.insert(0, ast.Name(owner, ast.Load()))
    return ast.Call(func=ast.Name(TAP_NAME, ast.Load()), args=args, keywords=[])


def _owner(func: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The name the instance has inside `func` (its first parameter), or `*args` when only a vararg takes it."""
    params = [*func.args.posonlyargs, *func.args.args]
    if params:
        return params[0].arg
    if func.args.vararg is not None:
        return "*" + func.args.vararg.arg
    raise SourceUnavailable(f"{func.name}() takes no positional parameter for the module instance; {_INSTEAD}")


class _Nonlocals(_Scope):
    """The names one function body declares `nonlocal` (nested functions' declarations left out)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        self.names.update(node.names)


class _Rewrite(_Scope, ast.NodeTransformer):
    def __init__(self, names: frozenset[str], owner: str | None) -> None:
        self.names, self.owner = names, owner

    def _tap_stmt(self, name: str, at: ast.AST) -> ast.stmt:
        """`name = __gradrunner_tap__("name", name)` (`self` first with an owner), placed at `at`'s line."""
        call = _tap_call(self.owner, name, ast.Name(name, ast.Load()))
        stmt = ast.Assign(targets=[ast.Name(name, ast.Store())], value=call)
        return ast.copy_location(stmt, at)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        """A nested function assigning a tapped local it declares `nonlocal` (`nonlocal h; h = h * 3`): those
        assignments are the forward's, tapped too; everything else in it is left as it is."""
        declared = _Nonlocals()
        for stmt in node.body:
            declared.visit(stmt)
        if self.names & declared.names:
            inner = _Rewrite(self.names & frozenset(declared.names), self.owner)
            node.body = [s for stmt in node.body for s in _as_list(inner.visit(stmt))]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _after(self, node: ast.stmt, bound: Iterable[str]) -> ast.stmt | list[ast.stmt]:
        tapped = [n for n in dict.fromkeys(bound) if n in self.names]
        return [node, *(self._tap_stmt(n, node) for n in tapped)] if tapped else node

    def _prepend(
        self, node: ast.For | ast.AsyncFor | ast.With | ast.AsyncWith | ast.match_case, bound: Iterable[str]
    ) -> ast.AST:
        self.generic_visit(node)
        tapped = [n for n in dict.fromkeys(bound) if n in self.names]
        at = node.body[0] if isinstance(node, ast.match_case) else node  # a case has no line of its own
        node.body[:0] = [self._tap_stmt(n, at) for n in tapped]
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
            node.value = ast.copy_location(_tap_call(self.owner, node.target.id, node.value), node.value)
        return node

    def visit_For(self, node: ast.For) -> ast.AST:
        return self._prepend(node, _targets(node.target))

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def visit_With(self, node: ast.With) -> ast.AST:
        return self._prepend(node, (n for i in node.items if i.optional_vars for n in _targets(i.optional_vars)))

    visit_AsyncWith = visit_With  # type: ignore[assignment]

    def visit_match_case(self, node: ast.match_case) -> ast.AST:
        return self._prepend(node, _pattern_names(node.pattern))


def rewrite(fn: Callable[..., object], names: Iterable[str], tap: TapFn, owner: object = None) -> types.FunctionType:
    """A copy of `fn` that passes every assignment of each name in `names` through `tap(name, value)`.

    Example::

        seen = []
        fn = rewrite(CosineRegression.forward, {"mul_x"}, lambda n, v: seen.append(n) or v)

    `tap` must return the value to bind (the same tensor, or a stand-in for it). Given an `owner`, `tap` is
    called only when `fn` runs with that instance as `self` (`owned`): a `copy.deepcopy` of the module, which
    gets the rewritten copy bound to itself, runs it untapped. A `forward` wrapped by
    `functools.wraps`-style decorators (transformers' blocks) keeps its wrappers: the innermost function
    is rewritten and each wrapper is rebuilt around the rewritten one (the class is left untouched,
    so only the instances the returned function is bound to are affected).
    """
    original, wrappers = _innermost(fn)
    _, func = _parse(original)
    new_func = copy.deepcopy(func)
    rewriter = _Rewrite(frozenset(names), None if owner is None else _owner(func))
    new_func.body = [s for stmt in new_func.body for s in _as_list(rewriter.visit(stmt))]
    # The compiled code reads free variables from closure cells: the original's (`__class__` for
    # super()) and a new one holding `tap`. The module's globals stay the original's, untouched.
    inner_code = _compile(new_func, original, [TAP_NAME])
    cells = dict(zip(original.__code__.co_freevars, original.__closure__ or (), strict=True))
    cells[TAP_NAME] = types.CellType(tap if owner is None else owned(owner, _dropping_owner(tap), _value))
    new = _function(original, inner_code, tuple(cells[v] for v in inner_code.co_freevars))
    new.__wrapped__ = original  # type: ignore[attr-defined]
    for wrapper in reversed(wrappers):
        new = _rewrap(wrapper, new)
    return new


def _dropping_owner(tap: TapFn) -> Callable[[object, str, object], object]:
    def call(owner: object, name: str, value: object) -> object:
        return tap(name, value)

    return call


def _value(name: str, value: object) -> object:
    return value  # a tapped name of another instance than the owner: bound as it is


def _function(like: types.FunctionType, code: types.CodeType, closure: tuple[types.CellType, ...]) -> types.FunctionType:
    new = types.FunctionType(code, like.__globals__, like.__name__, like.__defaults__, closure)
    new.__kwdefaults__ = like.__kwdefaults__
    new.__qualname__ = like.__qualname__
    new.__doc__ = like.__doc__
    new.__dict__.update(like.__dict__)
    return new


def _rewrap(wrapper: types.FunctionType, inner: types.FunctionType) -> types.FunctionType:
    """`wrapper` rebuilt to call `inner` where it called the function it wraps (held in a closure cell)."""
    wrapped = wrapper.__wrapped__  # type: ignore[attr-defined]
    cells = list(wrapper.__closure__ or ())
    at = [i for i, c in enumerate(cells) if _cell_is(c, wrapped)]
    if not at:
        raise SourceUnavailable(
            f"{wrapper.__qualname__} is wrapped by a decorator ({wrapper.__code__.co_filename}:"
            f"{wrapper.__code__.co_firstlineno}) that does not hold the wrapped function in a closure, so the "
            f"tapped forward() cannot be put in its place; {_INSTEAD}"
        )
    for i in at:
        cells[i] = types.CellType(inner)
    new = _function(wrapper, wrapper.__code__, tuple(cells))
    new.__wrapped__ = inner  # type: ignore[attr-defined]
    return new


def _cell_is(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _as_list(node: ast.AST | list[ast.stmt] | None) -> list[ast.stmt]:
    if node is None:
        return []
    return node if isinstance(node, list) else [node]  # type: ignore[list-item]
