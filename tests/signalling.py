"""A test-only Hydra callback that sends a signal to its own process between a sweep's jobs.

Added on the command line: `+hydra.callbacks.signal_at._target_=signalling.SignalAt
+hydra.callbacks.signal_at.when=on_job_end +hydra.callbacks.signal_at.job=1
+hydra.callbacks.signal_at.sig=SIGTERM` (the tests' dir is on PYTHONPATH for the CLI tests). Hydra calls
`on_job_start` before a job's task runs and `on_job_end` after it returned: no record is open at either.

Example::

    SignalAt(when="on_job_end", job=0, sig="SIGINT")    # Ctrl-C right after job 0
"""

from __future__ import annotations

import os
import signal
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SignalAt(Callback):
    """At `when` (`on_job_start` or `on_job_end`) of job number `job`, send `sig` to this process."""

    def __init__(self, when: str = "on_job_end", job: int = 0, sig: str = "SIGINT") -> None:
        assert when in ("on_job_start", "on_job_end"), when
        self.when, self.job, self.sig = when, job, signal.Signals[sig]

    def _at(self, when: str, config: DictConfig) -> None:
        if when == self.when and int(config.hydra.job.num) == self.job:
            os.kill(os.getpid(), self.sig)  # acts at the next bytecode boundary: still inside this callback

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._at("on_job_start", config)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self._at("on_job_end", config)
