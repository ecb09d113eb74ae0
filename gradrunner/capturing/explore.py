"""The taps a model offers, found by running one forward pass: `list_taps(model, *args, **kwargs)`.

Every module path (as `named_modules()` prints it) with its class, how many times it was called,
the shapes and dtypes of what it returned and was given (tuple, dict and dataclass elements spelled
as the tap names that reach them: `output.0`, `output.logits`, `input.attention_mask`), its own
parameters, and the local variables of its `forward()` when its source can be read. Modules the
forward pass did not call are listed as such (a tap on them would never fire). The forward hooks
live only inside the call (a context manager removes them, also after an exception).

Example::

    listing = list_taps(model, torch.randn(2, 8))
    print(listing)                 # one block per module, in forward order
    listing.to_dict()["modules"]   # the same, for scripts (json.dumps-able)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.forward_locals import SourceUnavailable, assigned_names
from gradrunner.capturing.taps import is_glob, local_tap_name
from gradrunner.capturing.untouched import untouched

#: How deep `output.0.logits`-style element names are followed into nested containers.
_MAX_DEPTH = 3


@dataclass
class Slot:
    """One tappable element: its tap name (`output.0`), shape and dtype, or what it is when not a tensor."""

    name: str
    shape: list[int] | None
    dtype: str | None
    kind: str = "tensor"

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
    #: The forward()'s locals as tap names: `local.output` for a local named output (`:output` is the module's).
    locals: list[str] = field(default_factory=list)
    #: Why the forward()'s locals could not be read (decorated, compiled, no source), else None.
    locals_note: str | None = None


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
        lines = [f"{self.model}: {len(self.modules)} module paths; a tap is '<path>:<name>' ('' is the root)"]
        for m in self.modules:
            called = f"called {m.calls}x" if m.calls else "NOT CALLED in this forward pass (its taps never fire)"
            lines.append(f"{m.path or repr('')} ({'root, ' if not m.path else ''}{m.cls}) {called}")
            width = max((len(s.name) for s in m.outputs + m.inputs + m.parameters), default=0)
            lines += [f"    {s.name:<{width}}  {s.text()}" for s in m.outputs + m.inputs]
            lines += [f"    {s.name:<{width}}  {s.text()} parameter" for s in m.parameters]
            if m.locals:
                lines.append(f"    forward() locals: {', '.join(m.locals)}")
            elif m.locals_note:
                lines.append(f"    forward() locals: unreadable ({m.locals_note})")
        return "\n".join(lines)


def _slots(prefix: str, value: Any, depth: int = 0) -> list[Slot]:
    """The tensors inside `value`, each named by the element path a tap would use."""
    if isinstance(value, torch.Tensor):
        return [Slot(prefix, list(value.shape), str(value.dtype).removeprefix("torch."))]
    if depth >= _MAX_DEPTH or value is None:
        return [] if value is None else [Slot(prefix, None, None, type(value).__name__)]
    items: list[tuple[str | int, Any]]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return [Slot(prefix, None, None, type(value).__name__)]
    return [s for key, v in items for s in _slots(f"{prefix}.{key}", v, depth + 1)]


def _input_slots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Slot]:
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return _slots("input", args[0])  # `input` is the first positional input
    return _slots("input", list(args)) + [s for k, v in kwargs.items() for s in _slots(f"input.{k}", v, 1)]


def _locals(module: nn.Module) -> tuple[list[str], str | None]:
    """The tap names of the forward()'s locals (`local.output` for a local named output), or why none are readable."""
    try:
        return [local_tap_name(module, n) for n in assigned_names(type(module).forward)], None
    except SourceUnavailable as e:
        return [], str(e).split(";")[0]
    except Exception as e:  # a forward() whose source does not parse: list the rest anyway
        return [], f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _recording(model: nn.Module) -> Iterator[dict[int, dict[str, Any]]]:
    """Forward hooks on every module that note calls, inputs and outputs (by module id); removed on exit."""
    seen: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        for module in {id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values():

            def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
                entry = seen.setdefault(id(mod), {"calls": 0, "order": len(seen)})
                entry["calls"] += 1
                if entry["calls"] == 1:  # shapes of the first call
                    entry["outputs"], entry["inputs"] = _slots("output", out), _input_slots(args, kwargs)

            def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                seen.setdefault(id(mod), {"calls": 0, "order": len(seen)})  # forward order = order of entry

            stack.enter_context(module.register_forward_pre_hook(pre, with_kwargs=True))
            stack.enter_context(module.register_forward_hook(hook, with_kwargs=True))
        yield seen


def list_taps(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> TapListing:
    """Run `model(*example_args, **example_kwargs)` once (under no_grad if it can) and list what each module offers.

    Example::

        print(list_taps(MLP(depth=1), torch.randn(4, 8)))
        list_taps(gpt2, **batch).to_dict()      # a HuggingFace model called with keyword arguments

    The model is left exactly as it was, and so are the random generators (`untouched`: parameters,
    buffers such as BatchNorm's running statistics, `.grad`, the CPU and CUDA generator states that
    Dropout draws from); every hook is removed on return.
    """
    with untouched(model):
        try:
            with _recording(model) as seen, torch.no_grad():
                model(*example_args, **example_kwargs)
        except RuntimeError:  # a forward that needs autograd itself (torch.autograd.grad inside): once more with it
            with _recording(model) as seen:
                model(*example_args, **example_kwargs)
    called: list[tuple[int, ModuleTaps]] = []
    not_called: list[ModuleTaps] = []
    for path, module in model.named_modules(remove_duplicate=False):
        names, note = _locals(module)
        params = [_slots(n, p)[0] for n, p in module.named_parameters(recurse=False)]
        entry = seen.get(id(module), {"calls": 0})
        info = ModuleTaps(
            path, type(module).__name__, entry["calls"], entry.get("outputs", []), entry.get("inputs", []),
            params, names, note,
        )  # fmt: skip
        if entry["calls"]:
            called.append((entry["order"], info))
        else:
            not_called.append(info)
    ordered = [m for _, m in sorted(called, key=lambda c: c[0])]
    return TapListing(type(model).__name__, ordered + not_called)
