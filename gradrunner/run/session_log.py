"""The log of a `record()`/callback session: `<run dir>/gradrunner.log` and the console, as a runner job has.

A runner job logs through Hydra (the console and `<run dir>/gradrunner.log`); `record()` and the
Lightning/HF callbacks run in the user's process, where logging is usually not configured and INFO
lines (the last word of a healthy run) go nowhere. `session_log(run_dir)` gives them the same two
places for the session's life: every `gradrunner.*` line goes into the run dir's `gradrunner.log`
(appended: a resumed session continues it), and to stderr when no handler of the process would show
it (a user who configured logging keeps their own console handlers). The `gradrunner` logger's level
is lowered to INFO only when nobody set it.

Example::

    with session_log(Path("runs/mine")):
        health.last_word(Path("runs/mine"))     # on the console and in runs/mine/gradrunner.log

`how_it_ended(exc_type, exc)` words how a session that did not complete ended ("interrupted", "ended by
KeyError"); `EndedOutside` tells a session of an end that did not pass through it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

#: The runner's log file name (Hydra names it after the job, `gradrunner`), and its line format.
LOG_FILE = "gradrunner.log"
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _shown_on_console(logger: logging.Logger) -> bool:
    """Whether a handler up `logger`'s chain writes to a terminal stream (the user's or a framework's)."""
    current: logging.Logger | None = logger
    while current is not None:
        for h in current.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                return True
        current = current.parent if current.propagate else None
    return False


@contextlib.contextmanager
def session_log(directory: Path) -> Iterator[None]:
    """`gradrunner.*` log lines into `<directory>/gradrunner.log` (and stderr if nothing shows them) while open."""
    logger = logging.getLogger("gradrunner")
    added: list[logging.Handler] = []
    try:
        file = logging.FileHandler(directory / LOG_FILE, encoding="utf-8", delay=True)
    except OSError:  # an unwritable dir was refused before; a vanished one costs the log file only
        file = None
    if file is not None:
        file.setFormatter(logging.Formatter(FORMAT))
        added.append(file)
    if not _shown_on_console(logger):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(FORMAT))
        added.append(console)
    level = logger.level
    if level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    for h in added:
        logger.addHandler(h)
    try:
        yield
    finally:
        for h in added:
            logger.removeHandler(h)
            with contextlib.suppress(OSError):
                h.close()
        logger.setLevel(level)


class EndedOutside(Exception):
    """A framework's run ended by an error that did not pass through the session (the HF Trainer has no event for a
    `train()` that raised): the session's files close as after any error, and the last word names `cause` where it
    was seen, else says this message, naming no error that did not happen.

    Example::

        rec.__exit__(EndedOutside, EndedOutside("the run ended", cause=error_or_none), None)
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def how_it_ended(exc_type: type[BaseException], exc: BaseException | None = None) -> str:
    """How a session ended by `exc` (of `exc_type`), in its last word: "interrupted" for Ctrl-C.

    Example::

        how_it_ended(KeyError, KeyError("x"))     # 'ended by KeyError'
    """
    if isinstance(exc, EndedOutside):
        if exc.cause is None:
            return str(exc)
        exc_type = type(exc.cause)
    return "interrupted" if issubclass(exc_type, KeyboardInterrupt) else f"ended by {exc_type.__name__}"
