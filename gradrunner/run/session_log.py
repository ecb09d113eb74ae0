"""The log of a `record()`/callback session and of a runner job: `<run dir>/gradrunner.log`, whatever the console shows.

A runner job logs through Hydra (the console and `<run dir>/gradrunner.log`); `record()` and the
Lightning/HF callbacks run in the user's process, where logging is usually not configured and INFO
lines (the last word of a healthy run) go nowhere. `session_log(run_dir)` gives them the same two
places for the session's life: every `gradrunner.*` line goes into the run dir's `gradrunner.log`
(appended: a resumed session continues it), and to stderr when no handler of the process would show
it (a user who configured logging keeps their own console handlers). The `gradrunner` logger's level
is lowered to INFO on the console only when nobody set it.

The run dir's log file is the run's record: a level the user set on the `gradrunner` logger (or on one of
its loggers, or on the root logger under Hydra) to quiet the console quiets the console only
(`files_hear_info`, which `session_log` and the runner's `job_log` use). The file still gets every INFO line;
every other handler, the user's and Hydra's console included, gets what the user's level lets through, once.

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
from collections.abc import Iterator, Sequence
from pathlib import Path

#: The runner's log file name (Hydra names it after the job, `gradrunner`), and its line format.
LOG_FILE = "gradrunner.log"
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


#: The logger every gradrunner module logs under (`logging.getLogger(__name__)`).
ROOT = "gradrunner"


class _Relay(logging.Handler):
    """While `files_hear_info` holds the `gradrunner` logger: the handlers its records reached before (its own, then up
    its chain while it propagated), given only the records the user's levels let through, as before.

    `gate` is the level a record needs where no logger between its own and `gradrunner` set one; `levels` the
    levels the session moved, as the user set them; `skip` the files, which get every record directly.
    """

    def __init__(
        self, gate: int, own: list[logging.Handler], parent: logging.Logger | None, levels: dict[str, int],
        skip: Sequence[logging.Handler],
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate, self.own, self.parent, self.levels, self.skip = gate, own, parent, levels, skip

    def _user_level(self, name: str) -> int:
        """The level the user's settings give logger `name` (a `gradrunner.*` one): its own, else its nearest parent's."""
        while name.startswith(ROOT + "."):
            made = logging.Logger.manager.loggerDict.get(name)  # not getLogger: looking makes no logger
            level = self.levels.get(name, made.level if isinstance(made, logging.Logger) else logging.NOTSET)
            if level != logging.NOTSET:
                return level
            name = name.rpartition(".")[0]
        return self.gate

    def handlers(self) -> Iterator[logging.Handler]:
        """The handlers the records reached before (looked up now: tqdm's redirect swaps the console's while it runs)."""
        yield from self.own
        current = self.parent
        while current is not None:
            yield from current.handlers
            current = current.parent if current.propagate else None

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < self._user_level(record.name):
            return
        for handler in self.handlers():
            if handler not in self.skip and record.levelno >= handler.level:
                handler.handle(record)


def _shown_on_console(logger: logging.Logger) -> bool:
    """Whether a handler up `logger`'s chain writes to a terminal stream (the user's or a framework's)."""
    current: logging.Logger | None = logger
    while current is not None:
        for h in current.handlers:
            reached = list(h.handlers()) if isinstance(h, _Relay) else [h]
            if any(isinstance(r, logging.StreamHandler) and not isinstance(r, logging.FileHandler) for r in reached):
                return True
        current = current.parent if current.propagate else None
    return False


@contextlib.contextmanager
def files_hear_info(
    files: Sequence[logging.Handler], gate: int, console: logging.Handler | None = None
) -> Iterator[None]:
    """Every `gradrunner.*` INFO line (and above) into `files` while open, whatever level the user set on the
    `gradrunner` loggers; `console` and every handler the lines reached before see only what the user's levels
    let through (`gate` where none was set), once. Everything is put back on leaving.

    Example::

        with files_hear_info([logging.FileHandler("run/gradrunner.log")], gate=logging.CRITICAL):
            logging.getLogger("gradrunner.x").info("kept")   # in the file, not on the console

    Inside another such block (two sessions open at once) the files are added to the one already open.
    A `gradrunner.*` logger that has handlers of its own or does not propagate is left at its level.
    """
    logger = logging.getLogger(ROOT)
    if any(isinstance(h, _Relay) for h in logger.handlers):  # an outer block gates the console already
        with _added(logger, files):
            yield
        return
    lowered = {
        name: lg.level for name, lg in _descendants() if lg.level > logging.INFO and lg.propagate and not lg.handlers
    }
    own, level, propagate = list(logger.handlers), logger.level, logger.propagate
    relay = _Relay(gate, own, logger.parent if propagate else None, lowered, files)
    if console is not None:  # shown as the user's own handlers would show it
        relay.own = [*own, console]
    for h in own:
        logger.removeHandler(h)
    logger.propagate = False
    for name in lowered:
        logging.getLogger(name).setLevel(logging.INFO)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        with _added(logger, [*files, relay]):
            yield
    finally:
        later = list(logger.handlers)  # added by someone else while open: kept, after the ones from before
        for h in later:
            logger.removeHandler(h)
        for h in [*own, *later]:
            logger.addHandler(h)
        logger.propagate = propagate
        if logger.level != level:
            logger.setLevel(level)
        for name, was in lowered.items():
            logging.getLogger(name).setLevel(was)


def _descendants() -> list[tuple[str, logging.Logger]]:
    """The `gradrunner.*` loggers made so far (not `gradrunner` itself)."""
    items = list(logging.Logger.manager.loggerDict.items())
    return [(n, lg) for n, lg in items if n.startswith(ROOT + ".") and isinstance(lg, logging.Logger)]


@contextlib.contextmanager
def _added(logger: logging.Logger, handlers: Sequence[logging.Handler]) -> Iterator[None]:
    """`handlers` on `logger` while open."""
    for h in handlers:
        logger.addHandler(h)
    try:
        yield
    finally:
        for h in handlers:
            logger.removeHandler(h)


@contextlib.contextmanager
def session_log(directory: Path) -> Iterator[None]:
    """`gradrunner.*` log lines into `<directory>/gradrunner.log` (and stderr if nothing shows them) while open."""
    logger = logging.getLogger(ROOT)
    try:
        file = logging.FileHandler(directory / LOG_FILE, encoding="utf-8", delay=True)
    except OSError:  # an unwritable dir was refused before; a vanished one costs the log file only
        file = None
    if file is not None:
        file.setFormatter(logging.Formatter(FORMAT))
    console = None
    if not _shown_on_console(logger):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(FORMAT))
    unset = logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO
    gate = logging.INFO if unset else logger.getEffectiveLevel()  # INFO on the console only when nobody set a level
    try:
        with files_hear_info([file] if file is not None else [], gate, console):
            yield
    finally:
        for h in (file, console):
            if h is not None:
                with contextlib.suppress(OSError):
                    h.close()


@contextlib.contextmanager
def job_log() -> Iterator[None]:
    """A runner job's `gradrunner.log` (Hydra's file handlers on the root logger) gets every `gradrunner.*` INFO
    line while open, whatever level the user set (`hydra.job_logging`) to quiet the console.

    Example::

        with job_log():
            run(cfg)        # +hydra.job_logging.loggers.gradrunner.level=ERROR: the last word in the file still
    """
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:  # hydra/job_logging=disabled, or a run outside Hydra: no log file to keep
        yield
        return
    with files_hear_info(files, logging.getLogger(ROOT).getEffectiveLevel()):
        yield


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
