"""A small convolutional classifier for 8x8 single-channel images (scikit-learn's digits)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv1 -> relu1 -> pool1 -> conv2 -> relu2 -> global average pool -> fc.

    Example::

        model = SmallCNN(in_channels=1, num_classes=10)
        logits = model(torch.randn(4, 1, 8, 8))  # shape (4, 10)

    Locals of `forward()`: `features` (pooled conv features) and `logits`.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:  # (batch, height, width): add the channel axis
            x = x.unsqueeze(1)
        h = self.pool1(self.relu1(self.conv1(x)))
        h = self.relu2(self.conv2(h))
        features = h.mean(dim=(2, 3))
        logits = self.fc(features)
        return logits
