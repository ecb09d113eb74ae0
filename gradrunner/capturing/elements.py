"""Elements of a module's structured output or input: `output.0`, `output.logits`, `input.mask`.

`get_element` follows a tap's element path through tuples, lists, namedtuples, dicts, dataclasses
and attributes; `set_element` returns the value with one element replaced, for strategies that hand the model a
stand-in tensor: dicts, tuples, lists, namedtuples and dataclasses are rebuilt (never mutated); any
other object reached by attribute is changed in place (`setattr`) and returned.

`element_hint` names the element taps of a value that is no tensor (for an error or a row's reason).

`tensors_in` lists the tensors of such a value, a level or two deep (a module's outputs, a call's arguments).

Example::

    get_element({"logits": t}, ("logits",), "fc:output.logits")   # t
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gradrunner.errors import GradrunnerError

if TYPE_CHECKING:
    from gradrunner.capturing.taps import Tap


class Missing:
    """Stands for an element a glob-selected tap's module does not have (recorded as having no gradient)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def get_element(value: Any, path: tuple[str | int, ...], tap: str, missing_ok: bool = False) -> Any:
    """The element at `path`; a missing one raises GradrunnerError naming `tap`, or is `Missing` if `missing_ok`.

    Example::

        get_element((a, b), (1,), "lstm:output.1")   # b
    """
    for p in path:
        try:
            if isinstance(value, Mapping):
                value = value[p]
            elif isinstance(p, int) and isinstance(value, (tuple, list)):
                value = value[p]
            else:
                value = getattr(value, str(p))
        except (KeyError, IndexError, AttributeError, TypeError):
            what = (
                f"the value has no element {p!r} (it is a {type(value).__name__}"
                f"{' of length ' + str(len(value)) if isinstance(value, (tuple, list)) else ''})"
            )
            if missing_ok:
                return Missing(what)
            how = ("input.N for the N-th positional argument, input.NAME for a keyword argument (the module may be "
                   "called with keyword arguments only)" if tap.partition(":")[2].startswith("input") else
                   "output.N for tuple elements, output.KEY for dict keys or attributes")  # fmt: skip
            raise GradrunnerError(f"tap {tap!r}: {what}; use {how}") from None
    return value


def set_element(value: Any, path: tuple[str | int, ...], new: Any) -> Any:
    """`value` with the element at `path` replaced.

    Mappings, tuples, lists, namedtuples and dataclasses are copied (the original is never mutated); any
    other object on the path (one reached by attribute, e.g. a `ModelOutput`-like class) has the attribute
    set in place with `setattr`, and that same object is returned.
    """
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, Mapping):
        out: Any = dict(value) if type(value) is dict else value.__class__(value)  # type: ignore[call-arg]
        out[head] = set_element(value[head], rest, new)
        return out
    if isinstance(value, (tuple, list)) and isinstance(head, int):
        items = list(value)
        items[head] = set_element(items[head], rest, new)
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items)
    replaced = set_element(getattr(value, str(head)), rest, new)
    if hasattr(value, "_fields") and hasattr(value, "_replace"):  # namedtuple field by name
        return value._replace(**{str(head): replaced})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{str(head): replaced})
    setattr(value, str(head), replaced)  # mutated in place: a plain object has no general way to copy
    return value


def _positions(forward: Any) -> dict[str, int]:
    """Each argument of `forward` that can be passed positionally, by name: its position (self excluded)."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    out: dict[str, int] = {}
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out[p.name] = i
    return out


def bind_input(
    module: Any, path: tuple[str | int, ...], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[str | int, ...]:
    """An `input.NAME` path bound to this call: `(NAME, ...)` when passed by keyword, `(position, ...)` when
    passed positionally (the module's `forward()` signature says where), as written otherwise.

    Example::

        bind_input(layer, ("hidden_states",), (h,), {})   # (0,): layer(h) passed it first
    """
    head = path[0]
    if isinstance(head, int) or head in kwargs:
        return path
    at = _positions(module.forward).get(head)
    return (at, *path[1:]) if at is not None and at < len(args) else path


def tensors_in(value: Any, depth: int = 2) -> Iterator[torch.Tensor]:
    """The tensors of `value`, in order: itself, or those inside its tuples, lists and mappings (HF's ModelOutput)
    down to `depth` levels.

    Example::

        list(tensors_in((x, {"mask": m}, 3)))    # [x, m]
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0:
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
        for item in items:
            yield from tensors_in(item, depth - 1)


def element_hint(tap: Tap, value: object) -> str:
    """For a tuple or dict value: the element taps that reach its tensors (`attn:output.0`, `:output.logits`).

    For None where attention weights are tapped: HF attention returns no weights under SDPA/flash.
    """
    if value is None and "attn" in tap.tap.lower():
        return (" Attention weights are None unless the attention computes them: build the model with "
                "attn_implementation=\"eager\" (in YAML, attn_implementation: eager in the model's config node).")  # fmt: skip
    if isinstance(value, Mapping):
        names = [f"{tap.tap}.{k}" for k, v in value.items() if isinstance(v, torch.Tensor)]
    elif isinstance(value, (tuple, list)):
        names = [f"{tap.tap}.{i}" for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    else:
        return ""
    return f" Tap one of its elements instead: {', '.join(names[:4])}." if names else ""
