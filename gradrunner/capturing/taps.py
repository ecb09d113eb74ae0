"""Tap specs: parse `"<module>:<name>"` strings and `{module, name}` mappings, resolve them on a model.

Resolution happens before the first forward pass: globs are expanded, every module path and name is
checked, and a mistake raises `GradrunnerError` naming the closest real paths or what the module
offers (outputs, inputs, parameters, locals of its `forward()`).

Example::

    taps = resolve_taps(model, ["fc*:output", ":mul_x", {"module": "head", "name": "weight"}])
    [t.tap for t in taps]  # ['fc1:output', 'fc2:output', ':mul_x', 'head:weight']
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.nn.utils import parametrize

from gradrunner.capturing.dtensors import is_dtensor
from gradrunner.capturing.forward_locals import SourceUnavailable, assigned_names
from gradrunner.capturing.forward_patch import tapped_forward
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import ACTIVATION_NAMES, LOCAL_PREFIX

TapSpec = str | Mapping[str, str]
Kind = Literal["output", "input", "param", "local"]
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Tap:
    """A resolved tap: one module, one name. `path` is the element path for `output.0.key`-style names."""

    module: str
    name: str
    kind: Kind
    path: tuple[str | int, ...] = ()
    #: Selected by a glob: a value that cannot carry a gradient is recorded, not an error.
    from_glob: bool = False

    @property
    def tap(self) -> str:
        return f"{self.module}:{self.name}"

    @property
    def variable(self) -> str:
        """A local tap's variable name: `name`, or what follows `local.` (`local.input` is a local named input)."""
        return self.name.removeprefix(LOCAL_PREFIX)


def parse_spec(spec: object) -> tuple[str, str]:
    """Split one spec into (module pattern, name); raises GradrunnerError on a malformed spec.

    Example::

        parse_spec("fc1:output")                         # ('fc1', 'output')
        parse_spec({"module": "", "name": "hidden"})     # ('', 'hidden')
    """
    if isinstance(spec, str):
        module, sep, name = spec.rpartition(":")
        if not sep:
            raise GradrunnerError(
                f"tap {spec!r} has no ':'; write '<module path>:<name>', e.g. '{spec}:output' for the output of "
                f"module {spec!r}, or ':{spec}' for a local variable or parameter of the root module"
            )
    elif isinstance(spec, Mapping):
        extra = sorted(set(map(str, spec)) - {"module", "name"})
        if extra or "name" not in spec:
            raise GradrunnerError(
                f"tap {dict(spec)!r} must be a mapping with keys 'module' and 'name' only "
                f"({'unexpected ' + ', '.join(extra) if extra else 'missing name'}), e.g. {{module: fc1, name: output}}"
            )
        module, name = str(spec.get("module") or ""), str(spec["name"])
    else:
        raise GradrunnerError(
            f"tap {spec!r} is a {type(spec).__name__}; a tap is a string '<module>:<name>' or a mapping "
            "{module: <path>, name: <name>}"
        )
    if not name.strip():
        raise GradrunnerError(
            f"tap {spec!r} has an empty name; allowed names: output, input, output.N, input.N, "
            "a parameter, or a local variable of the module's forward()"
        )
    return module.strip(), name.strip()


def element_path(rest: str) -> tuple[str | int, ...]:
    """The element path of what follows `output.`/`input.` in a tap name: `element_path("0.logits")` is `(0, 'logits')`."""
    return tuple(int(p) if p.lstrip("-").isdigit() else p for p in rest.split("."))


def module_offers(module: nn.Module) -> dict[str, list[str]]:
    """What can be tapped on `module`: outputs/inputs, its own parameters, locals of its forward()."""
    try:
        local_names = assigned_names(tapped_forward(module))
    except SourceUnavailable:
        local_names = []
    return {
        "outputs": ["output", "input", "output.N", "input.N", "output.KEY", "input.KEY"],
        "parameters": [n for n, _ in module.named_parameters(recurse=False)],
        "locals": local_names,
    }


def _resolve_name(module_path: str, module: nn.Module, name: str, locals_too: bool = True) -> Tap | None:
    """The tap for `name` on `module`, or None when the module offers no such name.

    The forward()'s source is read only when `name` can only be a local (and `locals_too`).
    """
    head, _, rest = name.partition(".")
    if name.startswith(LOCAL_PREFIX):
        try:
            found = name[len(LOCAL_PREFIX) :] in assigned_names(tapped_forward(module))
        except SourceUnavailable:
            return None
        return Tap(module_path, name, "local") if found else None
    if head in ACTIVATION_NAMES:
        return Tap(module_path, name, head, element_path(rest) if rest else ())  # type: ignore[arg-type]
    if name in dict(module.named_parameters(recurse=False)):
        return Tap(module_path, name, "param")
    if not locals_too:
        return None
    try:
        if name in assigned_names(tapped_forward(module)):
            return Tap(module_path, name, "local")
    except SourceUnavailable:
        return None
    return None


def local_tap_name(module: nn.Module, variable: str) -> str:
    """The tap name that reaches the local `variable` of `module`'s forward(): `variable` itself, or `local.<variable>`
    where the plain name means something else (the module's `output`/`input`, a parameter of the module).

    Example::

        local_tap_name(model, "hidden")   # 'hidden'
        local_tap_name(model, "output")   # 'local.output': ':output' is the module's output
    """
    tap = _resolve_name("", module, variable)
    return variable if tap is not None and tap.kind == "local" else LOCAL_PREFIX + variable


def _describe(module: nn.Module) -> str:
    offers = module_offers(module)
    params = ", ".join(offers["parameters"]) or "none"
    try:
        assigned_names(tapped_forward(module))
        local_names = ", ".join(offers["locals"]) or "none found"
    except SourceUnavailable as exc:
        local_names = f"none readable ({exc})"
    return f"output, input, output.N, input.N, output.KEY; parameters: {params}; locals of forward(): {local_names}"


def _unknown_name(module_path: str, module: nn.Module, name: str) -> GradrunnerError:
    if parametrize.is_parametrized(module, name):
        where = f"{module_path}.parametrizations.{name}" if module_path else f"parametrizations.{name}"
        how = ", ".join(type(p).__name__ for p in module.parametrizations[name])  # type: ignore[index]
        return GradrunnerError(
            f"tap '{module_path}:{name}': {name!r} of module {module_path or '<root>'!r} is parametrized "
            f"(torch.nn.utils.parametrize: {how}): it is computed from '{where}.original' each time it is read, "
            f"so it is not a parameter of the module. Tap '{where}:original' for the gradient of the parameter the "
            f"optimiser steps, or '{where}:output' for the gradient of the computed {name!r}."
        )
    offers = module_offers(module)
    candidates = offers["parameters"] + offers["locals"] + ["output", "input"]
    close = difflib.get_close_matches(name, candidates, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return GradrunnerError(
        f"tap '{module_path}:{name}': module {module_path or '<root>'!r} ({type(module).__name__}) has no "
        f"{name!r}.{hint} It offers: {_describe(module)}; a local named input or output is 'local.input', "
        "'local.output'."
    )


def is_glob(pattern: str, paths: Collection[str]) -> bool:
    """Whether `pattern` is read as a glob on a model whose module paths are `paths`.

    Example::

        is_glob("blocks.*", {"", "blocks", "blocks.a"})        # True
        is_glob("blocks.q?", {"", "blocks", "blocks.q?"})      # False: an exact path wins

    A pattern with `*`, `?` or `[` is a glob unless it is itself a module path (an `nn.ModuleDict` key may
    hold those characters): an exact path wins. The glob reading of such a spec is written with one
    character in brackets (`blocks.[q]?`); `[*]`, `[?]` and `[[]` match the character itself inside a glob.
    """
    return pattern not in paths and any(c in pattern for c in _GLOB_CHARS)


def _match_modules(model: nn.Module, pattern: str, spec: object) -> tuple[list[tuple[str, nn.Module]], bool]:
    """The modules `pattern` selects, and whether it was read as a glob."""
    modules = dict(model.named_modules(remove_duplicate=False))
    if not is_glob(pattern, modules):
        if pattern in modules:
            return [(pattern, modules[pattern])], False
        close = difflib.get_close_matches(pattern, [p for p in modules if p], n=5, cutoff=0.4)
        listing = ", ".join(repr(p) for p in (close or [p for p in modules if p][:8]))
        raise GradrunnerError(
            f"tap {spec!r}: no module {pattern!r} in {type(model).__name__}. "
            f"{'Closest paths' if close else 'Some paths'}: {listing}. Paths are as model.named_modules() "
            "prints them; '' is the root; globs (*, ?, [...]) select several."
        )
    matched = [(p, m) for p, m in modules.items() if p and fnmatch.fnmatchcase(p, pattern)]
    if not matched:
        close = difflib.get_close_matches(pattern, [p for p in modules if p and p != pattern], n=5, cutoff=0.4)
        some = ", ".join(repr(p) for p in (close or list(modules)[1:9]))
        paths = (f"{'Closest paths' if close else 'Some paths'}: {some}." if some else
                 f"{type(model).__name__} has no submodule: tap the root itself (':output', ':input', its parameters).")  # fmt: skip
        raise GradrunnerError(
            f"tap {spec!r}: the glob {pattern!r} matches no module of {type(model).__name__} "
            f"(the root '' is never matched by a glob). {paths} "
            "Inside a glob, [*], [?] and [[] match those characters themselves; a path that contains them is "
            "also tapped as written."
        )
    return matched, True


def resolve_taps(model: nn.Module, specs: Sequence[TapSpec] | TapSpec) -> list[Tap]:
    """Resolve specs against `model`: expand globs, check names, drop duplicates (first wins).

    Example::

        resolve_taps(MLP(depth=1), ["*:output"])  # fc1, relu1, head outputs
    """
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    if not isinstance(specs, Iterable):
        raise GradrunnerError(f"taps must be a list of tap specs, got {specs!r}")
    resolved: dict[str, Tap] = {}
    for spec in specs:
        pattern, name = parse_spec(spec)
        matched, glob = _match_modules(model, pattern, spec)
        # A glob over a parameter name never reads source: modules without that parameter are skipped.
        is_param = len(matched) > 1 and any(name in dict(m.named_parameters(recurse=False)) for _, m in matched)
        taps = [(p, m, _resolve_name(p, m, name, locals_too=not is_param)) for p, m in matched]
        found = [t for _, _, t in taps if t is not None]
        if not found:
            if len(matched) == 1:
                raise _unknown_name(matched[0][0], matched[0][1], name)
            paths = ", ".join(repr(p) for p, _, _ in taps[:8])
            raise GradrunnerError(
                f"tap {spec!r}: the glob {pattern!r} matches {len(matched)} modules ({paths}) but none of them "
                f"has {name!r}. Every module offers output and input; parameters and forward() locals are per module."
            )
        for t in found:
            resolved.setdefault(t.tap, dataclasses.replace(t, from_glob=glob))
    return list(resolved.values())


def check_still_resolved(
    model: nn.Module,
    taps: Sequence[Tap],
    params: Mapping[str, object],
    who: str,
    placed: Placed | None = None,
    forward: bool = False,
) -> Placed:
    """Refuse a model changed since its taps were resolved: a tapped module gone, or a tapped parameter replaced.

    Example::

        placed = check_still_resolved(model, cap.taps, {"fc1:weight": fc1.weight}, "capture(MLP, strategy='hook')")

    Activation, input and local taps find their module by path as a session opens (a local tap only where that
    module's forward() assigns the variable); a parameter tap holds the parameter it resolved to, which a replaced
    module (or `.to()` making new parameters) no longer uses.
    Refused is opening the session, or with `placed` (where the tapped modules sat as the block opened, where its
    hooks are) the step about to run in the open block; a module replaced at its path since is refused then too,
    and a tapped parameter whose slot holds another object (as a root `forward` begins, only an assigned slot:
    `Placed.note`; `functional_call` lends another model's Parameters for the call without an assignment). A
    stand-in its owner puts back (`_stands_in`: `functional_call`'s tensor, FSDP2's unsharded copy) is no
    replacement. Returns where the tapped modules sit now.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    for tap in taps:
        module = modules.get(tap.module)
        if module is None:
            what = f"module {tap.module!r}, which the model no longer has"
        elif placed is not None and module is not placed.modules.get(tap.tap, module):
            what = f"module {tap.module!r}, which is another module now (replaced, or renumbered by a deletion)"
        elif tap.tap in params and module._parameters.get(tap.name) is None:  # `del lin.bias`, or `lin.bias = None`
            what = f"parameter {tap.name!r} of module {tap.module!r}, which the module no longer holds (deleted)"
        elif (
            tap.tap in params
            and (placed is None or not forward or (id(module), tap.name) in placed.reassigned)
            and getattr(module, tap.name, None) is not params[tap.tap]
            and not _stands_in(module, tap.name, params[tap.tap])
        ):
            what = f"parameter {tap.name!r} of module {tap.module!r}, which is another object now (replaced)"
        elif placed is None and tap.kind == "local" and not _assigns(module, tap.variable):  # another module's forward
            what = f"local {tap.variable!r} of module {tap.module!r}, whose forward() ({type(module).__name__}) assigns none"
        else:
            continue
        refused = "cannot open" if placed is None else "cannot run this step"
        raise GradrunnerError(
            f"{who} {refused}: its tap {tap.tap} names {what} since the session was made (taps are resolved when "
            "it is made, and its records would not be the model's); make the session again for the model as it is now"
        )
    return Placed(model, taps, params)


class Placed:
    """Where each tap's module sat as a session opened: checked at each step of its block (`intact`), as torch runs
    no registration hook when a module or parameter is deleted (`del model[2]`, `delattr`).

    Example::

        placed = Placed(model, cap.taps, {"2:weight": model[2].weight})
        del model[2]
        placed.intact()   # False: check_still_resolved(..., placed=placed) says which tap and why

    One dictionary look-up per link of the tapped modules' paths and per parameter tap, whatever the model's size.
    """

    def __init__(self, model: nn.Module, taps: Iterable[Tap], params: Mapping[str, object]) -> None:
        links: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
        self.modules: dict[str, nn.Module] = {}  # each tap's module, by tap name
        held: list[tuple[nn.Module, str, object]] = []
        for tap in taps:
            module = model
            for name in tap.module.split(".") if tap.module else ():
                child = module._modules[name]
                assert child is not None, tap.tap  # resolved, and checked as the session opened
                links.setdefault((id(module), name), (module, name, child))
                module = child
            self.modules[tap.tap] = module
            if tap.kind == "param":
                held.append((module, tap.name, params[tap.tap]))
        self._links = tuple(links.values())
        self._params = tuple(held)
        #: The parameter slots (module id, name) assigned since (`note`): a tapped one holding another object: refused
        self.reassigned: set[tuple[int, str]] = set()

    def note(self, module: nn.Module, name: str) -> None:
        """A parameter was assigned to `module.name` (torch's parameter registration hook): checked at the next step."""
        self.reassigned.add((id(module), name))

    def intact(self) -> bool:
        """Whether every tapped module is where it sat and every tapped parameter's slot holds it (no registration hook
        runs for `= None`, `_parameters[name] = ...`, `.to()` making new parameters; `swap_tensors` keeps it)."""
        return all(parent._modules.get(name) is child for parent, name, child in self._links) and all(
            module._parameters.get(name) is param for module, name, param in self._params
        )


def _assigns(module: nn.Module, variable: str) -> bool:
    """Whether the forward() `module` runs assigns `variable` (unreadable source: left to the rewrite to refuse)."""
    try:
        return variable in assigned_names(tapped_forward(module))
    except SourceUnavailable:
        return True


def _stands_in(module: nn.Module, name: str, param: object) -> bool:
    """Whether the parameter's slot holds a stand-in for `param` that its owner puts back without a registration:
    a plain tensor `torch.func.functional_call` lends for one call, or FSDP2's copy of a sharded (DTensor) `param`
    of its whole shape, which FSDP2 computes with from a forward until it reshards: unsharded (a plain tensor), or
    after the forward sharded on a smaller mesh (`reshard_after_forward=<int>`: a DTensor on another mesh); left
    there after a forward under no_grad where the group does not reshard fully (the root group by default)."""
    held = module._parameters.get(name)
    if held is None:
        return False
    if not isinstance(held, nn.Parameter):
        return True
    if not is_dtensor(param) or held.shape != getattr(param, "shape", None):
        return False
    return not is_dtensor(held) or getattr(held, "device_mesh", None) != getattr(param, "device_mesh", None)


@dataclass(frozen=True)
class GlobReach:
    """What one glob spec resolved to: its taps, counted by module depth (path components), a path at each depth."""

    spec: str
    #: depth -> (taps at that depth, the first such module path)
    by_depth: dict[int, tuple[int, str]]
    #: Why it resolves to no tap (the error a run with it gives), or None.
    refused: str | None = None

    @property
    def taps(self) -> int:
        return sum(n for n, _ in self.by_depth.values())

    def __str__(self) -> str:
        if self.refused is not None:
            return f"{self.spec} resolves to no tap, so a run with it is refused: {self.refused}"
        depths = ", ".join(
            f"{n} at depth {d} ({path}{', ...' if n > 1 else ''})" for d, (n, path) in sorted(self.by_depth.items())
        )
        deeper = (" (a glob's * and ? also match dots: it reaches the submodules below too; spell each level, "
                  "e.g. 'h.?:output' for the blocks only)") if len(self.by_depth) > 1 else ""  # fmt: skip
        return f"{self.spec} resolves to {self.taps} tap(s): {depths}{deeper}"


def glob_reach(model: nn.Module, specs: Sequence[TapSpec] | TapSpec) -> list[GlobReach]:
    """For each glob spec of `specs`, how many taps it resolved to at each module depth.

    Example::

        [str(r) for r in glob_reach(gpt2, ["transformer.h.*:output"])]
        # ['transformer.h.*:output resolves to 26 tap(s): 2 at depth 3 (transformer.h.0, ...), 12 at depth 4 (...), ...']

    Depth counts a path's components (`transformer.h.0` is 3): `*` and `?` match dots too, so
    `transformer.h.*` reaches every submodule of every block, not only the blocks.
    """
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    out = []
    paths = {p for p, _ in model.named_modules(remove_duplicate=False)}
    for spec in specs:
        pattern, _ = parse_spec(spec)
        if not is_glob(pattern, paths):
            continue
        by_depth: dict[int, tuple[int, str]] = {}
        name = spec if isinstance(spec, str) else f"{pattern}:{spec['name']}"
        try:
            resolved = resolve_taps(model, [spec])
        except GradrunnerError as e:  # the explorer lists the model's taps whatever the config's globs reach
            out.append(GlobReach(name, {}, str(e)))
            continue
        for t in resolved:
            depth = t.module.count(".") + 1
            n, first = by_depth.get(depth, (0, t.module))
            by_depth[depth] = (n + 1, first)
        out.append(GlobReach(name, by_depth))
    return out


def tap_shapes(model: nn.Module, taps: Iterable[Tap], shapes: bool = True) -> dict[str, tuple[int, ...] | None]:
    """Each resolved tap's name and, for a parameter (when `shapes`), its shape: what a resume compares.

    Example::

        tap_shapes(model, resolve_taps(model, ["0:weight", "*:output"]))   # {'0:weight': (16, 8), '0:output': None, ...}

    An activation's shape is known only once the forward runs: None. `shapes=False` (sharded parameters,
    whose records hold another shape than the local tensor): None for every tap.
    """
    out: dict[str, tuple[int, ...] | None] = {}
    for t in taps:
        param = dict(model.get_submodule(t.module).named_parameters(recurse=False)).get(t.name) if shapes else None
        out[t.tap] = tuple(param.shape) if t.kind == "param" and param is not None else None
    return out
