"""A test-only data option that SIGKILLs its own process at batch N, once (a marker file says it did).

`_target_: killing_data.KillAt` (the tests' dir is on PYTHONPATH for the CLI tests): the seeded synthetic
batches of `gradrunner.data.Synthetic`, and at batch `at_batch` (-1: never), if `marker` does not exist
yet, create it and send SIGKILL to this process: a preempted job that had no chance to clean up.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradrunner.data import Batch, Synthetic, as_batches


class KillAt:
    """Example: `KillAt(at_batch=5, marker="/tmp/killed", seed=0, batch_size=4)`."""

    def __init__(self, at_batch: int, marker: str, fault: str = "sigkill", **synthetic: Any) -> None:
        self.at_batch, self.marker, self.inner = at_batch, Path(marker), Synthetic(**synthetic)
        self.fault = fault  # sigkill, or keyboard_interrupt (for a test that runs in its own process)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.inner, device, dtype)):
            if i == self.at_batch and not self.marker.exists():
                self.marker.touch()
                if self.fault == "keyboard_interrupt":
                    raise KeyboardInterrupt
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch
