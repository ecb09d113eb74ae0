"""Test-only planted non-determinism: an MLP whose forward adds noise no seed controls.

Reachable as `_target_: noisy_model.NoisyMLP` (the tests' dir is on `sys.path` in pytest).

Example::

    cfg.model = {"_target_": "noisy_model.NoisyMLP", "std": 1e-3, "depth": 3}
"""

from __future__ import annotations

import os

import torch

from gradrunner.models.mlp import MLP


class NoisyMLP(MLP):
    """`MLP` whose output gets Gaussian noise from a generator seeded from the OS (`os.urandom`), not the run's seed."""

    def __init__(self, std: float = 1e-3, **mlp: int) -> None:
        super().__init__(**mlp)  # type: ignore[arg-type]
        self.std = std
        self.noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out: torch.Tensor = super().forward(x)
        noise = torch.randn(out.shape, generator=self.noise, dtype=out.dtype)  # a CPU generator: drawn there
        return out + self.std * noise.to(out.device)
