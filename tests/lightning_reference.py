"""The Lightning tests' net, batches and taps (test_integration_lightning, test_integration_lightning_session): the same
draws in both, so their records compare with plain torch.

Example::

    module.net, loader = tiny_net(), DataLoader(dataset(6), batch_size=5)
"""

from __future__ import annotations

import torch
from torch import nn

TAPS = ["net.0:output", "net.0:weight"]


def tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def dataset(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n * 5, 4, generator=g), torch.randn(n * 5, 2, generator=g))
