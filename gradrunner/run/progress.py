"""The run's progress on the console: a tqdm bar on a terminal, a log line every ~10% of the steps otherwise.

Example::

    bar = Progress(total=100)
    for step in range(100): bar.update(step, loss=0.5)
    bar.close()
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("gradrunner.run.loop")  # the runner's log lines, as they always were named


class Progress:
    """A tqdm bar on a terminal, a log line every ~10% of the steps otherwise (and in the log file either way).

    Example::

        bar = Progress(total=100)
        for step in range(100): bar.update(step, loss=0.5)
        bar.close()

    Steps are named as the records name them, from 0 (`step 9 (10/100)`). On a terminal the log
    lines go above the bar (tqdm's logging redirect), so `gradrunner.log` gets them too.
    """

    def __init__(self, total: int, stream: TextIO | None = None, min_interval: float = 0.1) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(1, math.ceil(total / 10))
        self._stack = contextlib.ExitStack()
        self._bar: tqdm | None = None
        if self.tty:
            self._bar = self._stack.enter_context(
                tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True, mininterval=min_interval)
            )
            self._stack.enter_context(logging_redirect_tqdm())

    def update(self, step: int, loss: float | None) -> None:
        done = step + 1
        shown = "?" if loss is None else f"{loss:.6g}"
        if self._bar is not None:
            self._bar.set_postfix_str(f"step {step}  loss {shown}", refresh=False)
            self._bar.update(done - self._bar.n)
        if done % self.every == 0 or done == self.total:
            log.info("step %d (%d/%d, %d%%)  loss %s", step, done, self.total, 100 * done // max(self.total, 1), shown)

    def close(self) -> None:
        self._stack.close()
