"""A test-only data option that injects a fault at batch N: how the tests interrupt a run.

Reachable as `data=faulty` (tests/conf/data/faulty.yaml, on the tests' search path) or as the
`_target_` `faulty_data.Faulty` (the tests' dir is on PYTHONPATH for the CLI tests). The batch of
step N is asked for at the start of step N, so a fault at batch N leaves steps 0..N-1 complete.

Example::

    python -m gradrunner +experiment=cosine data=faulty data.at_batch=3 data.fault=sigint
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gradrunner.data import Batch, Tensors, as_batches

#: What `fault` may be: a signal sent to this process, or an exception raised in the loop.
FAULTS = ("none", "sigint", "sigterm", "sighup", "keyboard_interrupt")


class Faulty:
    """Batches of `inner` (default: the literal `inputs`, `targets`, as `data=tensors`); at batch
    `at_batch`: write `<ready_file>.<pid>` (JSON: pid, ppid), wait for `wait_for` to exist, then `fault`.

    Example::

        Faulty(inputs=[1.0], targets=[0.0], at_batch=3, fault="sigterm")
    """

    def __init__(
        self,
        inputs: object = 0.0,
        targets: object = 0.0,
        inner: object = None,
        at_batch: int = 0,
        fault: str = "none",
        ready_file: str | None = None,
        wait_for: str | None = None,
        wait_timeout_s: float = 120.0,
    ) -> None:
        assert fault in FAULTS, fault
        self.inner = inner if inner is not None else Tensors(inputs=inputs, targets=targets)
        self.at_batch, self.fault = at_batch, fault
        self.ready_file, self.wait_for, self.wait_timeout_s = ready_file, wait_for, wait_timeout_s

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.inner, device, dtype)):
            if i == self.at_batch:
                self._at_the_batch()
            yield batch

    def _at_the_batch(self) -> None:
        if self.ready_file:  # one file per process, so that concurrent runs' signals do not mix
            ready, temp = Path(f"{self.ready_file}.{os.getpid()}"), Path(f"{self.ready_file}-{os.getpid()}.tmp")
            temp.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
            temp.replace(ready)  # whole, or not there
        if self.wait_for:  # a gate the test opens: no fixed sleep decides the order
            deadline = time.monotonic() + self.wait_timeout_s
            while not Path(self.wait_for).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"faulty data: {self.wait_for} did not appear in {self.wait_timeout_s} s")
                time.sleep(0.01)
        if self.fault == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        elif self.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "sighup":
            os.kill(os.getpid(), signal.SIGHUP)
        elif self.fault == "keyboard_interrupt":
            raise KeyboardInterrupt
