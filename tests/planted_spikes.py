"""Test-only planted spikes: one corrupted batch, and one parameter's gradient scaled at one step.

Reachable as `_target_: planted_spikes.SpikyData` / `planted_spikes.SpikedMLP` (the tests' dir is on
`sys.path` in pytest, and on PYTHONPATH for the CLI tests, as for `faulty_data`).

Example::

    cfg.data = {"_target_": "planted_spikes.SpikyData", "inner": <a data option>, "at_batch": 150, "scale": 1e3}
    cfg.model = {"_target_": "planted_spikes.SpikedMLP", "param": "fc1.weight", "at_step": 150, "scale": 1e3, ...}
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gradrunner.data import Batch, as_batches
from gradrunner.models.mlp import MLP


class SpikyData:
    """The batches of `inner`, except batch `at_batch`, whose inputs are multiplied by `scale`.

    Example::

        SpikyData(inner=Synthetic(), at_batch=150, scale=1e3)
    """

    def __init__(self, inner: object, at_batch: int, scale: float = 1e3) -> None:
        self.inner, self.at_batch, self.scale = inner, at_batch, scale

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, (x, y) in enumerate(as_batches(self.inner, device, dtype)):
            yield (x * self.scale, y) if i == self.at_batch else (x, y)


class SpikedMLP(MLP):
    """`MLP` whose parameter `param` gets its gradient multiplied by `scale` in the backward of forward `at_step`.

    Example::

        SpikedMLP(param="fc1.weight", at_step=150, scale=1e3, depth=3)   # one forward per training step

    A tensor hook on the parameter (it runs before `.grad` is accumulated): only that parameter's
    gradient changes at that step, no activation's, so the tap `fc1:weight` moves first and alone.
    """

    def __init__(self, param: str, at_step: int, scale: float = 1e3, **mlp: int) -> None:
        super().__init__(**mlp)  # type: ignore[arg-type]
        self.at_step, self.scale, self.forwards = at_step, scale, 0
        self.get_parameter(param).register_hook(self._scale)

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scale if self.forwards - 1 == self.at_step else grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.forwards += 1
        out: torch.Tensor = super().forward(x)
        return out
