"""The taps a model offers, found by running one forward pass: `list_taps(model, *args, **kwargs)`.

Every module path (as `named_modules()` prints it) with its class, how many times it was called,
what it returned and was given (tuple, dict and dataclass elements spelled as the tap names that
reach them: `output.0`, `output.logits`, `input.attention_mask`), its own parameters, and the local
variables of its `forward()` when its source can be read, each with the shape and dtype (or type)
it held. What cannot carry a gradient (an int, a bool, None, a module, an integer tensor, a tensor
that does not require grad) is marked with why, by the rule `capture` applies when the tap fires
(`grad_context.no_grad_reason`): `capture` refuses such a tap when named, a glob records it with
`has_grad = False`. Modules the forward pass did not call are listed as such (a tap on them would
never fire). The forward runs with gradients on, the hooks and the rewritten forward()s (which
see the locals) live only inside the call, and the model and the random generators are left as
they were (`untouched`), also after an exception.

Example::

    listing = list_taps(model, torch.randn(2, 8))
    print(listing)                 # one block per module, in forward order
    listing.to_dict()["modules"]   # the same, for scripts (json.dumps-able)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.elements import Missing, bind_input, get_element
from gradrunner.capturing.forward_locals import SourceUnavailable, assigned_names
from gradrunner.capturing.forward_patch import patch_forward, tapped_forward
from gradrunner.capturing.grad_context import FROZEN, NOT_REQUIRING_GRAD, TRANSFORMED, no_grad_reason
from gradrunner.capturing.open_sessions import refuse_open_on
from gradrunner.capturing.taps import element_path, is_glob, local_tap_name
from gradrunner.capturing.torch_compat import compiled_inner, is_functorch_wrapped
from gradrunner.capturing.untouched import untouched
from gradrunner.errors import one_paragraph

#: How deep `output.0.logits`-style element names are followed into nested containers.
_MAX_DEPTH = 3
#: The `kind` of a local its forward() did not assign in this pass (a branch not taken, a module not called).
UNASSIGNED = "not assigned in this forward pass"


@dataclass
class Slot:
    """One tap of a module: its name (`output.0`, `weight`, `local.output`), what it held, and why it gets no gradient.

    `shape` and `dtype` are those of the tensor it held (the first, over calls and assignments); `kind` is
    `"tensor"`, or what it was instead (`bool`, `DynamicCache`, `NoneType`, `not assigned in this forward pass`).
    """

    name: str
    shape: list[int] | None
    dtype: str | None
    kind: str = "tensor"
    #: Why a tap on it can get no gradient (`not a tensor (a bool)`, `not a floating-point tensor (torch.int64)`,
    #: `does not require grad ...`, `parameter does not require grad (frozen)`): `capture` refuses it when named
    #: (a frozen parameter, or a value that is so while parameters are frozen, is recorded with has_grad False),
    #: a glob records it with has_grad False. None: it can carry one.
    no_gradient: str | None = None

    def text(self) -> str:
        return f"{tuple(self.shape)} {self.dtype}" if self.shape is not None else f"({self.kind})"


@dataclass
class ModuleTaps:
    """What one module path offers; `calls` is 0 for a module the forward pass did not call."""

    path: str
    cls: str
    calls: int
    outputs: list[Slot] = field(default_factory=list)
    inputs: list[Slot] = field(default_factory=list)
    parameters: list[Slot] = field(default_factory=list)
    #: The forward()'s locals in the order of its source, named as taps: `local.output` for a local named
    #: output (`:output` is the module's), with what they held at their assignments.
    locals: list[Slot] = field(default_factory=list)
    #: Why the forward()'s locals could not be read (decorated, compiled, no source), else None.
    locals_note: str | None = None

    def taps(self, tappable: bool = True) -> list[str]:
        """`'<path>:<name>'` of every slot that can carry a gradient (`tappable=False`: of those that cannot).

        Example::

            [t for m in list_taps(model, x).modules for t in m.taps()]   # every tap worth a capture
        """
        slots = self.outputs + self.inputs + self.parameters + self.locals
        return [f"{self.path}:{s.name}" for s in slots if (s.no_gradient is None) == tappable]


@dataclass
class TapListing:
    """Every module of a model, called ones first in forward order, then those not called."""

    model: str
    modules: list[ModuleTaps]

    def matching(self, pattern: str) -> TapListing:
        """Only the module paths `pattern` matches, as a tap spec's module part does (`''` is the root).

        Example::

            print(list_taps(model, x).matching("layers.0.*"))

        A glob, unless `pattern` is itself a module path (an `nn.ModuleDict` key `'x[0]'`): that path alone.
        """
        if not is_glob(pattern, {m.path for m in self.modules}):
            return TapListing(self.model, [m for m in self.modules if m.path == pattern])
        return TapListing(self.model, [m for m in self.modules if fnmatch.fnmatchcase(m.path, pattern)])

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists (`--format json`)."""
        return {"model": self.model, "modules": [dataclasses.asdict(m) for m in self.modules]}

    def __str__(self) -> str:
        lines = [f"{self.model}: {len(self.modules)} module paths; a tap is '<path>:<name>' ('' is the root); "
                 "'-- no gradient: <why>' marks a tap that cannot carry one"]  # fmt: skip
        for m in self.modules:
            called = f"called {m.calls}x" if m.calls else "NOT CALLED in this forward pass (its taps never fire)"
            lines.append(f"{m.path or repr('')} ({'root, ' if not m.path else ''}{m.cls}) {called}")
            rows = [(s, "") for s in m.outputs + m.inputs] + [(s, " parameter") for s in m.parameters]
            rows += [(s, " local") for s in m.locals]
            width = max((len(s.name) for s, _ in rows), default=0)
            for s, role in rows:
                why = f"  -- no gradient: {s.no_gradient}" if s.no_gradient else ""
                lines.append(f"    {s.name:<{width}}  {s.text()}{role}{why}")
            if m.locals_note:
                lines.append(f"    forward() locals: unreadable ({m.locals_note})")
        return "\n".join(lines)


def _names(prefix: str, value: Any, depth: int = 0) -> list[str]:
    """The tap names of the elements of `value` (tensors, and other leaves; None left out), in order."""
    if isinstance(value, torch.Tensor):
        return [prefix]
    if depth >= _MAX_DEPTH or value is None:
        return [] if value is None else [prefix]
    items: list[tuple[str | int, Any]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return [prefix]
    return [n for key, v in items for n in _names(f"{prefix}.{key}", v, depth + 1)]


def _input_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return ["input"]  # `input` is the first positional input
    return _names("input", list(args)) + [n for k, v in kwargs.items() for n in _names(f"input.{k}", v, 1)]


def _why_no_gradient(value: object, is_input: bool) -> str | None:
    """What a capture's tap would say of `value` when it fires (`Firing._attach`): None when it gets a gradient."""
    if isinstance(value, torch.Tensor):
        if is_functorch_wrapped(value):
            return TRANSFORMED
        if value.requires_grad:
            return None
    why = no_grad_reason(value, is_input)
    if why is not None and why[0] == NOT_REQUIRING_GRAD:  # what it may have been computed from, as capture's error says
        return "does not require grad (computed only from inputs, constants or frozen parameters, or detached)"
    return None if why is None else why[0]


def _slot(name: str, values: list[object], is_input: bool, unit: str) -> Slot:
    """The slot `name`, from every value it had (one per call or assignment; `Missing` where a call lacked it)."""
    if not values:
        return Slot(name, None, None, UNASSIGNED)
    present = [v for v in values if not isinstance(v, Missing)] or values
    first = next((v for v in present if isinstance(v, torch.Tensor)), present[0])
    bad = [r for r in (_why_no_gradient(v, is_input) for v in values) if r is not None]
    why = None if not bad else bad[0] if len(bad) == len(values) else f"{bad[0]}, in {len(bad)} of {len(values)} {unit}"
    if isinstance(first, torch.Tensor):
        return Slot(name, list(first.shape), str(first.dtype).removeprefix("torch."), no_gradient=why)
    return Slot(name, None, None, type(first).__name__, why)


@dataclass
class _Seen:
    """One module instance in the forward pass: when it was first entered, each call, each local's values."""

    order: int
    calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = field(default_factory=list)
    values: dict[str, list[object]] = field(default_factory=dict)


def _element_values(
    module: nn.Module, name: str, calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]]
) -> list[object]:
    """The value of the tap `name` at each call, found as the capture's hooks find it (`get_element`, `bind_input`)."""
    head, _, rest = name.partition(".")
    path = element_path(rest) if rest else ()
    if head == "output":
        return [get_element(out, path, name, missing_ok=True) if path else out for _, _, out in calls]
    found: list[object] = []
    for args, kwargs, _ in calls:
        bound = bind_input(module, path or (0,), args, kwargs)
        found.append(get_element(args if isinstance(bound[0], int) else kwargs, bound, name, missing_ok=True))
    return found


def _locals(module: nn.Module) -> tuple[list[str], str | None]:
    """The variables the forward() assigns, or why none are readable."""
    try:
        return assigned_names(tapped_forward(module)), None
    except SourceUnavailable as e:
        return [], str(e).split(";")[0]
    except Exception as e:  # a forward() whose source does not parse: list the rest anyway
        return [], f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _recording(model: nn.Module, watch_locals: bool) -> Iterator[tuple[dict[int, _Seen], dict[int, str]]]:
    """Hooks on every module that note its calls (inputs, outputs) and, with `watch_locals`, forward()s rewritten
    to note every value each local is assigned; (what was seen by module id, why a module's locals were not
    watched). Everything is removed and put back on exit."""
    seen: dict[int, _Seen] = {}
    unwatched: dict[int, str] = {}

    def entry(mod: nn.Module) -> _Seen:
        return seen.setdefault(id(mod), _Seen(len(seen)))  # forward order = order of entry

    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        entry(mod)

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        entry(mod).calls.append((args, dict(kwargs), out))

    def noting(mod: nn.Module) -> Callable[[str, object], object]:
        def note(variable: str, value: object) -> object:
            entry(mod).values.setdefault(variable, []).append(value)
            return value

        return note

    with contextlib.ExitStack() as stack:
        for module in {id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values():
            stack.enter_context(module.register_forward_pre_hook(pre, with_kwargs=True))
            stack.enter_context(module.register_forward_hook(hook, with_kwargs=True))
            variables = _locals(module)[0] if watch_locals else []
            if variables:
                try:
                    stack.callback(patch_forward(module, variables, noting(module)))
                except Exception as e:  # what a local tap would meet too: its error is the locals' reason
                    unwatched[id(module)] = f"its forward() cannot be rewritten to tap them: {one_paragraph(e)}"
        yield seen, unwatched


def _module_taps(path: str, module: nn.Module, seen: _Seen | None, unwatched: str | None) -> ModuleTaps:
    calls = seen.calls if seen is not None else []
    outputs = list(dict.fromkeys(n for _, _, out in calls for n in _names("output", out)))
    inputs = list(dict.fromkeys(n for args, kwargs, _ in calls for n in _input_names(args, kwargs)))
    params = [
        Slot(n, list(p.shape), str(p.dtype).removeprefix("torch."), no_gradient=None if p.requires_grad else FROZEN)
        for n, p in module.named_parameters(recurse=False)
    ]
    variables, note = _locals(module)
    local_slots = []
    for v in variables:
        values = seen.values.get(v, []) if seen is not None else []
        slot = _slot(local_tap_name(module, v), values, False, "assignments")
        if unwatched is not None:
            slot.kind, slot.no_gradient = "not observed", unwatched
        local_slots.append(slot)
    return ModuleTaps(
        path, type(module).__name__, len(calls),
        [_slot(n, _element_values(module, n, calls), False, "calls") for n in outputs],
        [_slot(n, _element_values(module, n, calls), True, "calls") for n in inputs],
        params, local_slots, note,
    )  # fmt: skip


def list_taps(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> TapListing:
    """Run `model(*example_args, **example_kwargs)` once, with gradients on, and list what each module offers.

    Example::

        print(list_taps(MLP(depth=1), torch.randn(4, 8)))
        list_taps(gpt2, **batch).to_dict()      # a HuggingFace model called with keyword arguments
        [t for m in list_taps(model, x).modules for t in m.taps()]   # the taps that can carry a gradient

    Refused (one paragraph) while a capture session is open on the model: its forward pass would be the session's.
    The model is left exactly as it was, and so are the random generators (`untouched`: parameters,
    buffers such as BatchNorm's running statistics, `.grad`, the CPU and CUDA generator states that
    Dropout draws from, Python's `random` and numpy's global generator); every hook and rewritten forward()
    is removed on return. A forward that raises with its locals watched is run once more without: its locals
    are then listed as not observed.
    `torch.compile(model)` is listed as `capture` taps it (`compiled_inner`): its eager model's paths, from
    a forward pass of the eager model.
    """
    model = compiled_inner(model)
    refuse_open_on(model, "list_taps(...)")
    unwatched_all: str | None = None
    with untouched(model), torch.enable_grad():
        try:
            with _recording(model, watch_locals=True) as (seen, unwatched):
                model(*example_args, **example_kwargs)
        except Exception as e:
            unwatched_all = f"the forward raised {type(e).__name__} with its locals tapped: {one_paragraph(e)}"
        if unwatched_all is not None:  # outside the `except`: the model's own error, if it is one, raised unchained
            with _recording(model, watch_locals=False) as (seen, unwatched):
                model(*example_args, **example_kwargs)
    called: list[tuple[int, ModuleTaps]] = []
    not_called: list[ModuleTaps] = []
    for path, module in model.named_modules(remove_duplicate=False):
        entry = seen.get(id(module))
        info = _module_taps(path, module, entry, unwatched.get(id(module), unwatched_all))
        if info.calls:
            assert entry is not None
            called.append((entry.order, info))
        else:
            not_called.append(info)
    ordered = [m for _, m in sorted(called, key=lambda c: c[0])]
    return TapListing(type(model).__name__, ordered + not_called)
