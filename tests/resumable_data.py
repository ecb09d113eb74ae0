"""Test-only data and model for exact resume: a shuffling `torch.utils.data.DataLoader` over random samples,
interrupted once at batch N (a marker file says it was), and a stock-layer MLP with dropout.

`_target_: resumable_data.ShuffledLoader` (the tests' dir is on sys.path / PYTHONPATH). The loader has no
generator of its own: as in most user code, each epoch's order comes from torch's global generator.

Example::

    ShuffledLoader(n=20, batch_size=4, at_batch=7, marker="/tmp/cut")   # KeyboardInterrupt at batch 7, once
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradrunner.data import Batch, as_batches


class ShuffledLoader:
    """`DataLoader(TensorDataset(x, y), batch_size, shuffle=True)` cycled; KeyboardInterrupt at batch `at_batch` once."""

    def __init__(self, n: int, batch_size: int, at_batch: int = -1, marker: str = "", seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen)
        self.loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
        self.at_batch, self.marker = at_batch, Path(marker) if marker else None

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.loader, device, dtype)):
            if i == self.at_batch and self.marker is not None and not self.marker.exists():
                self.marker.touch()
                raise KeyboardInterrupt
            yield batch


def dropout_mlp(p: float = 0.3) -> nn.Module:
    """Linear, ReLU, Dropout, Linear: stock layers, dropout drawing from torch's global generator every step."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 1))
