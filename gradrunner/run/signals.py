"""The runner's signal handling, in one place: which signals end a run, how, and with what exit status.

Contents:
    ENDING_SIGNALS                  -- SIGTERM (a scheduler cancelling or preempting) and SIGHUP (a closed terminal)
    Terminated                      -- raised by those signals: a KeyboardInterrupt, so records are kept as on Ctrl-C
    ending_signals_as_interrupt()   -- while open, SIGTERM and SIGHUP raise `Terminated`
    between_runs()                  -- the CLI's process, outside any run: SIGTERM and SIGHUP raise `Terminated` too
    exit_status(interrupt)          -- 130 after Ctrl-C, 128 + N after signal N
    ignore_further_signals()        -- the run is ending: a second signal must not cut its last message
    quiet_interrupts(message)       -- Ctrl-C before the app runs or after it ended: one line, exit 130

While a run is open Ctrl-C raises KeyboardInterrupt, as Python's own handler does. While a step's rows
or a file's close are written, all three are held back (`records.critical.deferred_signals`) and act
once that ends; the handlers installed here are the only ones, for the whole run.

A signal the process was started with ignored stays ignored, as Python keeps an inherited `SIG_IGN`
for SIGINT: SIGHUP under `nohup`, SIGINT for a background job of a non-interactive shell.

Example::

    with ending_signals_as_interrupt():
        train(cfg)             # SIGHUP: Terminated, the completed steps' records kept
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from gradrunner.records.critical import DEFERRED, defers, hold

#: Signals that end a run the way Ctrl-C does (records of completed steps kept).
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: Signals gradrunner itself set to SIG_IGN (`ignore_further_signals`): those are not the process's choice.
_IGNORED_HERE: set[int] = set()


def ignored(sig: int) -> bool:
    """Whether `sig` is ignored by the process's own choice (`nohup`, a background job): gradrunner keeps it so."""
    return signal.getsignal(sig) == signal.SIG_IGN and sig not in _IGNORED_HERE


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: handled like Ctrl-C, completed steps are kept. `signum` says which."""

    def __init__(self, message: str = "", signum: int = signal.SIGTERM) -> None:
        super().__init__(message or f"terminated by signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def ending_signals_as_interrupt() -> Iterator[None]:
    """While open, SIGTERM and SIGHUP raise `Terminated` (a KeyboardInterrupt) and Ctrl-C KeyboardInterrupt,
    so records are closed, not lost; inside a critical section of the records they wait for its end.

    Installed once for the run: the records' critical sections (`records.critical.deferred_signals`,
    every step) then only count, instead of swapping handlers. Only in the main thread (the only one
    Python delivers signals to); the previous handlers come back on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    @defers
    def on_signal(signum: int, frame: FrameType | None) -> None:
        if hold(signum):
            return  # a step's rows, a row group or a close is being written: acts when it ends
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum=signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in DEFERRED if not ignored(sig)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def between_runs() -> None:
    """From now on SIGTERM and SIGHUP raise `Terminated` outside a run too (Ctrl-C raises KeyboardInterrupt already).

    Example::

        between_runs()       # the CLI, first thing: a sweep's SIGTERM between two jobs is a message and exit 143

    A run's own handlers (`ending_signals_as_interrupt`) replace these while it runs and put them
    back after; a signal the process started with ignored stays ignored. Main thread only.
    """

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum=signum)

    for sig in ENDING_SIGNALS:
        if not ignored(sig):
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                signal.signal(sig, on_signal)


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + interrupt.signum if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED


def ignore_further_signals() -> None:
    """The records are closed and the run is ending: another signal must not cut the message with a traceback."""
    for sig in (signal.SIGINT, *ENDING_SIGNALS):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            if signal.getsignal(sig) != signal.SIG_IGN:
                _IGNORED_HERE.add(sig)
            signal.signal(sig, signal.SIG_IGN)


def quiet_interrupts(message: str) -> None:
    """From now on, Ctrl-C (and SIGTERM, SIGHUP) print `message` on one line and end the process with 128 + N.

    For the moments no record is open: the run has ended (Python's exit, `atexit` callbacks such as the
    sweep manifest), where a KeyboardInterrupt would only print a traceback.
    """

    def on_signal(signum: int, frame: FrameType | None) -> None:
        os.write(2, f"gradrunner: {message}\n".encode())
        os._exit(128 + signum)

    for sig in (signal.SIGINT, *ENDING_SIGNALS):
        if not ignored(sig):
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, on_signal)


#: The name the step loop has used (`run.guards` re-exports both).
sigterm_as_interrupt = ending_signals_as_interrupt
