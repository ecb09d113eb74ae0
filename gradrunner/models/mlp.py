"""A plain multi-layer perceptron whose layers are named `fc1, relu1, fc2, relu2, ..., head`."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


class MLP(nn.Sequential):
    """`depth` blocks of Linear + ReLU, then a Linear head.

    Example::

        model = MLP(in_features=4, hidden=16, depth=2, out_features=1)
        [name for name, _ in model.named_modules()]  # ['', 'fc1', 'relu1', 'fc2', 'relu2', 'head']

    `inplace=True` makes every ReLU in-place, the case that breaks full backward hooks.
    """

    def __init__(
        self,
        in_features: int = 8,
        hidden: int = 32,
        depth: int = 2,
        out_features: int = 1,
        inplace: bool = False,
    ) -> None:
        if depth < 0:
            raise ValueError(f"MLP depth must be >= 0, got {depth}")
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        width = in_features
        for i in range(1, depth + 1):
            layers[f"fc{i}"] = nn.Linear(width, hidden)
            layers[f"relu{i}"] = nn.ReLU(inplace=inplace)
            width = hidden
        layers["head"] = nn.Linear(width, out_features)
        super().__init__(layers)
