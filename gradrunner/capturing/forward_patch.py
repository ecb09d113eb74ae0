"""A module's calls of its class's `forward()` sent to a copy rewritten by `forward_locals.rewrite`, and back.

`patch_forward(module, names, tap)` installs the copy for one module instance (as an instance
`forward`, or routed through what a wrapper already installed there) and returns the undo, which
puts every attribute, closure cell and class attribute back as it was. `tapped_forward(module)` is the
`forward()` whose locals are tapped: an instance `forward` replacing the class's, or the class's.

Example::

    undo = patch_forward(model.block, {"h"}, lambda n, v: v)
    model(x)      # model.block's local `h` passes through the tap
    undo()
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable

from gradrunner.capturing.forward_locals import TapFn, rewrite
from gradrunner.errors import GradrunnerError

_ROUTES = "__gradrunner_routes__"
_ORIGINAL = "__gradrunner_original__"
#: The locals tapped now in each module (by id) whose forward() a `patch_forward` rewrote and has not yet undone.
_PATCHED: dict[int, frozenset[str]] = {}


def class_forward(cls: type) -> Callable[..., object]:
    """`cls.forward` as the class defines it (through a dispatcher `patch_forward` may have put there)."""
    fwd: Callable[..., object] = cls.forward  # type: ignore[attr-defined]
    return getattr(fwd, _ORIGINAL, fwd)


def tapped_forward(module: object) -> Callable[..., object]:
    """The `forward()` whose locals a local tap on `module` reaches: what `module(x)` actually runs.

    Example::

        model.forward = types.MethodType(other_forward, model)
        tapped_forward(model) is other_forward    # True: it replaces the class's forward()

    An instance-level `forward` bound to `module` replaces the class's when it neither holds it (an attribute
    such as `_old_forward`, a closure cell, a `functools.partial`, `__wrapped__`) nor names a `forward`
    (`Class.forward(self, ...)`, `super().forward(...)`): its own function. Otherwise (no instance forward, or a
    wrapper that calls the class's): the class's `forward` (`class_forward`).
    """
    original = class_forward(type(module))
    current = module.__dict__.get("forward")
    if not (isinstance(current, types.MethodType) and current.__self__ is module):
        return original
    fn = current.__func__
    held = [v for k, v in module.__dict__.items() if k != "forward" and getattr(v, "__func__", None) is original]
    if not isinstance(fn, types.FunctionType) or fn is original or hasattr(fn, "__wrapped__") or held:
        return original
    if "forward" in _names(fn.__code__) or _reachable_partials(current):
        return original
    cells = _reachable_cells(current, stop=original)
    if any(_held_in(c, original) for c in cells):
        return original
    return fn


def _names(code: types.CodeType) -> set[str]:
    """The attribute and global names `code` and the code nested in it use."""
    found = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            found |= _names(c)
    return found


def _held_in(cell: types.CellType, original: object) -> bool:
    with contextlib.suppress(ValueError):  # an empty cell
        value = cell.cell_contents
        return value is original or getattr(value, "__func__", None) is original
    return False


def patch_forward(module: object, names: Iterable[str], tap: TapFn) -> Callable[[], None]:
    """Make `module`'s calls of its class's `forward()` run a copy rewritten by `rewrite`; returns the undo.

    Example::

        undo = patch_forward(model.block, {"h"}, lambda n, v: v)
        ...
        undo()     # every attribute, closure cell and class attribute as it was

    Without an instance-level `forward`, the rewritten copy becomes one. With one (monkeypatched,
    accelerate- or PEFT-style wrappers), it is kept, being what `module(x)` calls, and what it can
    reach of the class's `forward()` is routed to the copy: a bound `forward` of this module held in an
    attribute (`_old_forward`), in its closure cells (or the class's plain `forward` there, which such a
    wrapper bound to this module calls with it as `self`: accelerate's mixed-precision wrapper of
    `model.forward.__func__`), a `functools.partial` of it or of the class's
    `forward` with this module as first argument (its `func` swapped), and
    `Class.forward(self, ...)` or `super().forward(...)` through a dispatcher on the class that sends
    only this instance to the copy.

    Only `module` is tapped: a `copy.deepcopy` of it made while patched gets the rewritten copy bound to itself
    (an instance `forward` is copied with the instance), which runs as the original does, untapped (`owned`).
    One rewrite per module at a time: a second `patch_forward` of a module before the first's undo (a capture
    session opened inside another, each tapping its locals) is a GradrunnerError, since the copy installed
    first would call only its own taps and the second's would never fire.
    """
    names = frozenset(names)
    if id(module) in _PATCHED:  # its forward() is another session's rewritten copy, which calls only that one's taps
        raise GradrunnerError(
            f"the forward() of this {type(module).__name__} already has its locals {sorted(_PATCHED[id(module)])} "
            f"tapped by another open capture session, so its locals {sorted(names)} cannot be tapped by a second "
            "one at the same time: name them in the session that is open, or open this one after it closed."
        )
    cls = type(module)
    original = tapped_forward(module)
    bound = types.MethodType(rewrite(original, names, tap, owner=module), module)  # a deepcopy's taps do nothing
    state = module.__dict__
    undo: list[Callable[[], object]] = [functools.partial(_PATCHED.pop, id(module), None)]
    _PATCHED[id(module)] = names

    def is_original(value: object) -> bool:
        return isinstance(value, types.MethodType) and value.__self__ is module and value.__func__ is original

    def restore() -> None:
        while undo:
            undo.pop()()

    if original is not class_forward(cls):  # an instance forward replacing the class's: its rewritten copy instead
        undo.append(functools.partial(state.__setitem__, "forward", state["forward"]))
        state["forward"] = bound
        return restore
    if "forward" not in state:
        state["forward"] = bound
        undo.append(functools.partial(state.pop, "forward", None))
        return restore
    current = state["forward"]
    for key, value in list(state.items()):
        if is_original(value):  # the instance forward itself, or `_old_forward`
            state[key] = bound
            undo.append(functools.partial(state.__setitem__, key, value))
    if not is_original(current):
        for cell in _reachable_cells(current, stop=original):
            with contextlib.suppress(ValueError):
                old = cell.cell_contents
                # the class's plain `forward` in a wrapper's closure (accelerate's autocast wrapper of
                # `model.forward.__func__`), called with this module as `self`: its rewritten copy
                new = bound if is_original(old) else bound.__func__ if old is original else None
                if new is not None:
                    cell.cell_contents = new
                    undo.append(functools.partial(setattr, cell, "cell_contents", old))
        for p in _reachable_partials(current):
            # `partial(Class.forward, module, ...)` holds the class's function itself, so no dispatcher on the
            # class reaches it: its `func` is swapped (a partial's state can be set, its attributes not)
            if p.func is original and p.args[:1] == (module,):
                undo.append(_swap_partial(p, bound.__func__))
            elif is_original(p.func):
                undo.append(_swap_partial(p, bound))
        undo.append(_route_class(cls, module, original, bound.__func__))
    return restore


def _reachable_cells(fn: object, stop: object, depth: int = 4) -> list[types.CellType]:
    """Closure cells of `fn`, of what it wraps (`__wrapped__`, `__func__`, `functools.partial`), a few levels down.

    Not those of `stop` (the class's `forward`) nor below it: its closure is the class's, shared by every instance.
    """
    cells: list[types.CellType] = []
    todo, seen = [(fn, 0)], set()
    while todo:
        f, d = todo.pop()
        if id(f) in seen or d > depth or f is stop:
            continue
        seen.add(id(f))
        cells.extend(getattr(f, "__closure__", None) or ())
        for attr in ("__wrapped__", "__func__", "func"):
            inner = getattr(f, attr, None)
            if inner is not None:
                todo.append((inner, d + 1))
    return cells


def _reachable_partials(fn: object, depth: int = 4) -> list[functools.partial[object]]:
    """The `functools.partial`s `fn` is or reaches (through `__wrapped__`, `func`, closure cells), a few levels down."""
    found: list[functools.partial[object]] = []
    todo, seen = [(fn, 0)], set()
    while todo:
        f, d = todo.pop()
        if id(f) in seen or d > depth:
            continue
        seen.add(id(f))
        if isinstance(f, functools.partial):
            found.append(f)
        for attr in ("__wrapped__", "__func__", "func"):
            inner = getattr(f, attr, None)
            if inner is not None:
                todo.append((inner, d + 1))
        for cell in getattr(f, "__closure__", None) or ():
            with contextlib.suppress(ValueError):
                todo.append((cell.cell_contents, d + 1))
    return found


def _swap_partial(p: functools.partial[object], func: Callable[..., object]) -> Callable[[], None]:
    """Make `p` call `func` (same arguments); returns the undo."""
    reduced = p.__reduce__()
    assert isinstance(reduced, tuple)
    state: tuple[object, ...] = reduced[2]  # (func, args, keywords, dict)
    set_state: Callable[[tuple[object, ...]], None] = p.__setstate__  # type: ignore[attr-defined]
    set_state((func, *state[1:]))
    return functools.partial(set_state, state)


def _route_class(
    cls: type, module: object, original: Callable[..., object], new: Callable[..., object]
) -> Callable[[], None]:
    """Put a dispatcher on `cls.forward` sending `module` (only) to `new`; returns the undo."""
    dispatcher = cls.__dict__.get("forward")
    routes: dict[int, Callable[..., object]] | None = getattr(dispatcher, _ROUTES, None)
    if routes is None:
        previous = cls.__dict__.get("forward", _NOTHING)
        table: dict[int, Callable[..., object]] = {}
        routes = table

        def forward(self: object, *args: object, **kwargs: object) -> object:
            return table.get(id(self), original)(self, *args, **kwargs)

        setattr(forward, _ROUTES, routes)
        setattr(forward, _ORIGINAL, original)
        forward.__gradrunner_previous__ = previous  # type: ignore[attr-defined]
        cls.forward = forward  # type: ignore[attr-defined]
        dispatcher = forward
    routes[id(module)] = new

    def undo() -> None:
        routes.pop(id(module), None)
        if not routes and cls.__dict__.get("forward") is dispatcher:
            previous = dispatcher.__gradrunner_previous__  # type: ignore[union-attr]
            if previous is _NOTHING:
                delattr(cls, "forward")
            else:
                cls.forward = previous  # type: ignore[attr-defined]

    return undo


_NOTHING = object()
