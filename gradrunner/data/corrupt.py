"""`Corrupted`: another source's batches with one batch corrupted, a planted data-caused loss spike (README "Spike detection").

Example::

    source = Corrupted(Synthetic(input_shape=[8]), at_batch=60, scale=1e3)
    # in a config: data={_target_: gradrunner.data.Corrupted, inner: {...}, at_batch: 60}; or +experiment=spike_data
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gradrunner.data.batches import Batch, as_batches
from gradrunner.errors import GradrunnerError


class Corrupted:
    """The batches of `inner`, except batch `at_batch` (from 0: the step's batch when there is one per step),
    whose floating-point inputs are multiplied by `scale` (`nan=True`: replaced by NaN).

    Example::

        Corrupted(Synthetic(input_shape=[8]), at_batch=60).batches(torch.device("cpu"), torch.float32)

    Evaluation data (`held_out`) is the inner source's, uncorrupted.
    """

    def __init__(self, inner: Any, at_batch: int, scale: float = 1e3, nan: bool = False) -> None:
        if isinstance(at_batch, bool) or not isinstance(at_batch, int) or at_batch < 0:
            raise GradrunnerError(f"data.at_batch={at_batch!r} is not allowed; it must be an integer >= 0 (the batch "
                                  "to corrupt, from 0), e.g. data.at_batch=60")  # fmt: skip
        self.inner, self.at_batch, self.scale, self.nan = inner, at_batch, float(scale), bool(nan)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, (x, y) in enumerate(as_batches(self.inner, device, dtype)):
            yield (self._corrupt(x), y) if i == self.at_batch else (x, y)

    def _corrupt(self, x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            raise GradrunnerError(
                f"gradrunner.data.Corrupted corrupts floating-point input tensors; batch {self.at_batch} of "
                f"{type(self.inner).__name__} has inputs of type {type(x).__name__}"
                f"{f' ({x.dtype})' if isinstance(x, torch.Tensor) else ''}. Wrap a source of float inputs (e.g. "
                "gradrunner.data.Synthetic)."
            )
        return torch.full_like(x, float("nan")) if self.nan else x * self.scale

    @property
    def held_out(self) -> Any:
        """The inner source's `held_out(seed)` (uncorrupted evaluation data), or None: what `run.evaluation` looks for."""
        return getattr(self.inner, "held_out", None)
