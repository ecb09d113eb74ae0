"""User mistakes: the one exception type, the exit status, and the helpers every message is built with.

Example::

    raise GradrunnerError(f"capture.strategy='hooks' is not allowed; allowed: ...{did_you_mean('hooks', names)}")
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable

#: Exit status of every command for a user mistake (a bad value, path, tap, model or data).
EXIT_USER_ERROR = 2


class GradrunnerError(Exception):
    """A mistake in what the user asked for; the message names the bad value and what is allowed.

    Example::

        raise GradrunnerError("capture.strategy='hooks' is not a strategy; allowed: retain_grad, hook, autograd_grad")

    The CLI prints the message alone (no traceback) and exits with `EXIT_USER_ERROR`.
    """


def one_paragraph(error: BaseException | str) -> str:
    """The error's message on one line (OmegaConf's and pyarrow's messages span several).

    Example::

        one_paragraph(GradrunnerError("a\\n  b"))   # 'a b'
    """
    return " ".join(str(error).split())


def closest(value: object, choices: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The `n` choices closest to `value` (difflib's ratio), best first; [] when none is close.

    Example::

        closest("hooks", ["retain_grad", "hook"])   # ['hook']
    """
    return difflib.get_close_matches(str(value), list(choices), n=n, cutoff=cutoff)


def did_you_mean(value: object, choices: Iterable[str], prefix: str = "") -> str:
    """`" Did you mean 'x'?"` for the closest choice, or "" when none is close.

    Example::

        did_you_mean("stratgy", ["strategy", "values"], prefix="capture.")   # " Did you mean 'capture.strategy'?"
    """
    close = closest(value, choices)
    return f" Did you mean {prefix + close[0]!r}?" if close else ""


def not_allowed(name: str, value: object, allowed: Iterable[str], hint: str = "") -> GradrunnerError:
    """The error for `name=value` outside `allowed`: the value, the allowed ones, the closest, the fix.

    Example::

        raise not_allowed("dtype", "float", ("float32", "float64"))
    """
    allowed = list(allowed)
    return GradrunnerError(
        f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}.{did_you_mean(value, allowed)}{hint}"
        f" Fix it on the command line, e.g. {name}={allowed[0]}, or in your config file."
    )


def as_whole(value: object) -> int | None:
    """`value` as an int where it is a whole number (an int, a numpy integer, a 0-d integer tensor), else None.

    Example::

        as_whole(np.int64(3))   # 3;  as_whole(True), as_whole(2.5), as_whole("3"): None
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # whatever says it is an integer (__index__)
    except TypeError:
        return None


def whole_number(name: str, value: object, at_least: int | None = None) -> int:
    """Refuse a Python API's `name=value` that is not a whole number (of at least `at_least`), in one paragraph;
    return it as an int (a numpy integer is a whole number: `as_whole`).

    Example::

        whole_number("sample_size", 0, 1)   # GradrunnerError: sample_size=0 is not allowed; it must be a whole number ...
    """
    number = as_whole(value)
    if number is None or (at_least is not None and number < at_least):
        low = f" of at least {at_least}" if at_least is not None else ""
        raise GradrunnerError(f"{name}={value!r} is not allowed; it must be a whole number{low} (e.g. {name}=10).")
    return number
