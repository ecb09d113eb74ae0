"""The `edits` config key: what an entry may say, checked without torch (the config layer uses it too).

`parse_edits(entries)` turns `[{tap: <spec>, <operation>: <value>}, ...]` (plain Python values) into
`Edit`s or raises one `GradrunnerError` paragraph; `gradrunner.capturing.edits` applies them.

Example::

    parse_edits([{"tap": "relu2:output", "scale": 0.0}])[0].op    # 'scale'
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradrunner.errors import GradrunnerError


@dataclass(frozen=True)
class Operation:
    """What one operation's value must be: a `{dim, keep}` mask, or a finite number in [low, high]."""

    #: what the value is, for messages
    takes: str
    low: float = -math.inf
    high: float = math.inf
    mask: bool = False
    #: why a number outside [low, high] is refused (default: the bound it crosses)
    range_says: str = ""


#: The operations, in the order messages list them, and what each one's value must be: the one list of
#: their names and checks (`gradrunner.capturing.edits` applies each name, and checks at import that it
#: applies exactly these).
OPERATIONS: dict[str, Operation] = {
    "scale": Operation("a number (0: stop-gradient, -1: gradient reversal)"),
    "clip_norm": Operation("a number >= 0 (the largest norm the gradient keeps, per call)", low=0.0),
    "clip_value": Operation("a number >= 0 (each element clamped to [-v, v])", low=0.0),
    "mask": Operation("{dim: <int>, keep: [<index>, ...]} (only these indices along dim keep their gradient)", mask=True),
    "dropout": Operation("a probability 0 <= p <= 1 (each element zeroed with probability p, the rest scaled by "
                         "1/(1-p))", low=0.0, high=1.0, range_says="a probability is between 0 and 1"),
    "noise_std": Operation("a number >= 0 (Gaussian noise of that standard deviation added)", low=0.0),
}
_EXAMPLE = "edits='[{tap:\"fc1:output\",scale:0.0}]'"


@dataclass(frozen=True)
class Mask:
    """`mask`'s value: keep the gradient at indices `keep` along `dim` (negative counts from the end)."""

    dim: int
    keep: tuple[int, ...]


@dataclass(frozen=True)
class Edit:
    """One entry of `edits`: a tap spec and one operation with its value (`index`: its place in the list)."""

    tap: str | Mapping[str, str]
    op: str
    value: float | Mask
    index: int = 0

    @property
    def label(self) -> str:
        """How messages name it: `edits[1] {tap: 'fc1:output', scale: 0.0}`."""
        value = {"dim": self.value.dim, "keep": list(self.value.keep)} if isinstance(self.value, Mask) else self.value
        return f"edits[{self.index}] {{tap: {self.tap!r}, {self.op}: {value!r}}}"


def parse_edits(entries: object) -> list[Edit]:
    """Check the `edits` list (plain Python values) and return one `Edit` per entry, in order.

    Example::

        parse_edits([{"tap": "relu2:output", "scale": 0.0}])[0].op    # 'scale'

    Raises `GradrunnerError` (one paragraph) for anything but a list of `{tap, <one operation>}`
    mappings with a valid value; what needs the model (tap names, mask indices) is checked when a
    capture session opens (`Edits`) and when the tap first fires.
    """
    if entries is None:
        return []
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Sequence):
        raise GradrunnerError(
            f"edits={entries!r} must be a list of {{tap: <spec>, <operation>: <value>}} entries, e.g. {_EXAMPLE}; "
            f"operations: {', '.join(OPERATIONS)}."
        )
    return [e if isinstance(e, Edit) else _parse_entry(i, e) for i, e in enumerate(entries)]


def _parse_entry(i: int, entry: object) -> Edit:
    where = f"edits[{i}]"
    if not isinstance(entry, Mapping):
        raise GradrunnerError(f"{where}={entry!r} is not a mapping; each edit is {{tap: <spec>, <operation>: <value>}}, "
                              f"e.g. {_EXAMPLE}.")  # fmt: skip
    keys = [str(k) for k in entry]
    if "tap" not in entry:
        raise GradrunnerError(f"{where}={dict(entry)!r} has no tap; each edit names the tap whose gradient it changes, "
                              f"e.g. {_EXAMPLE}.")  # fmt: skip
    tap = entry["tap"]
    if not isinstance(tap, (str, Mapping)):  # the spec itself is checked where it is resolved on the model
        raise GradrunnerError(f"{where}: tap={tap!r} is a {type(tap).__name__}; a tap is a string '<module>:<name>' or a "
                              "mapping {module: <path>, name: <name>}.")  # fmt: skip
    ops = [k for k in keys if k != "tap"]
    unknown = [k for k in ops if k not in OPERATIONS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(OPERATIONS), n=1)
        maybe = f" Did you mean {close[0]!r}?" if close else ""
        raise GradrunnerError(
            f"{where} (tap {tap!r}) has an unknown operation {unknown[0]!r}.{maybe} Allowed operations: "
            f"{', '.join(OPERATIONS)}; an entry holds tap and one of them."
        )
    if not ops:
        raise GradrunnerError(f"{where} (tap {tap!r}) names no operation; give one of {', '.join(OPERATIONS)}, "
                              f"e.g. {_EXAMPLE}.")  # fmt: skip
    if len(ops) > 1:
        raise GradrunnerError(
            f"{where} (tap {tap!r}) has {len(ops)} operations ({', '.join(ops)}); one entry takes one operation. "
            "Write one entry per operation: several edits on one tap apply in config order."
        )
    op = ops[0]
    return Edit(tap, op, _check_value(where, tap, op, entry[op]), i)


def _check_value(where: str, tap: object, op: str, value: object) -> float | Mask:
    operation = OPERATIONS[op]

    def bad(why: str) -> GradrunnerError:
        return GradrunnerError(f"{where} (tap {tap!r}): {op}={value!r} is not allowed: {why}. {op} takes "
                               f"{operation.takes}.")  # fmt: skip

    if operation.mask:
        if not isinstance(value, Mapping) or set(map(str, value)) != {"dim", "keep"}:
            raise bad("it must be a mapping with exactly the keys dim and keep")
        dim, keep = value["dim"], value["keep"]
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise bad(f"dim={dim!r} is not an integer")
        if isinstance(keep, int) and not isinstance(keep, bool):
            keep = [keep]
        if isinstance(keep, (str, bytes)) or not isinstance(keep, Sequence) or not keep:
            raise bad(f"keep={keep!r} must be a non-empty list of indices (to zero the whole gradient use scale: 0)")
        if any(isinstance(k, bool) or not isinstance(k, int) for k in keep):
            raise bad(f"keep={list(keep)!r} holds a non-integer")
        return Mask(dim, tuple(keep))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad("it must be a finite number")
    number = float(value)
    if not operation.low <= number <= operation.high:
        raise bad(operation.range_says or (f"it must be >= {operation.low:g}" if operation.high == math.inf else
                                           f"it must be between {operation.low:g} and {operation.high:g}"))  # fmt: skip
    return number
