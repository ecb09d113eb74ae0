"""Critical sections of the records: SIGINT, SIGTERM and SIGHUP held back while a block runs, then acted on.

Contents:
    DEFERRED               -- the signals held back (Ctrl-C, a scheduler's SIGTERM, a closed terminal)
    deferred_signals()     -- the block: a step's rows into both tables, a row group written and dropped, a close
    hold(signum)           -- for a handler that defers (`run.signals`): note the signal if a block is running
    defers(handler)        -- mark a handler as one that calls `hold` first

Under the runner, `run.signals` installs handlers once for the whole run that call `hold` first, and a
block is then only a counter (no handler is swapped per step). Without such handlers (the writers used
from Python), a block installs noting handlers for its duration and gives the first noted signal to
the previous handler at its end. Python runs signal handlers in the main thread only; elsewhere a
block does nothing. A Python-level handler, not a signal mask: the kernel gives a process-directed
signal to any thread not blocking it (torch's thread pools), so masking the main thread would not hold it.

Example::

    with deferred_signals():
        writer.write_table(rows)   # a Ctrl-C here waits until both lines ran
        buffer.clear()
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

#: The signals that end a run (Ctrl-C, SIGTERM of a scheduler, a closed terminal).
DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0
_held: list[int] = []
_MARK = "_gradrunner_defers"


def defers(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """Mark `handler` as calling `hold(signum)` first: blocks then leave it installed (no swapping)."""
    setattr(handler, _MARK, True)
    return handler


def hold(signum: int) -> bool:
    """Note `signum` if a block is running (it acts when the block ends); False when none is."""
    if _depth > 0:
        _held.append(signum)
        return True
    return False


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back while the block runs; the first one acts (raises) when it ends."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if all(getattr(signal.getsignal(s), _MARK, False) or signal.getsignal(s) == signal.SIG_IGN for s in DEFERRED):
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0 and _held:
                signum = _held[0]
                _held.clear()
                handler = signal.getsignal(signum)
                assert callable(handler), handler
                handler(signum, None)  # the run's handler acts now: KeyboardInterrupt or Terminated
        return
    caught: list[int] = []

    def note(signum: int, frame: object) -> None:
        caught.append(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in DEFERRED:
            previous[sig] = signal.signal(sig, note)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            _redeliver(caught[0], previous.get(signal.Signals(caught[0])))


def _redeliver(signum: int, handler: Any) -> None:
    """Act on a signal held back by `deferred_signals` as its own handler would have."""
    if callable(handler):
        handler(signum, None)  # default_int_handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action (end the process), now that the files are whole
