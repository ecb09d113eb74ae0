"""`ParamSnapshot`: the tapped parameters as they were before an optimiser step, for the records' update norms.

Example::

    before = cap.snapshot_params()          # after backward, before the step (`Capture.snapshot_params`)
    optimizer.step()
    before.update_norms()                   # {key: ||p now - p before||}, on the parameters' devices
"""

from __future__ import annotations

import torch
from torch import nn

from gradrunner.capturing.dtensors import local_piece
from gradrunner.capturing.extras import value_norms
from gradrunner.capturing.torch_compat import sub_all
from gradrunner.records.columns import TapKey

__all__ = ["ParamSnapshot"]


class ParamSnapshot:
    """Copies of the tapped parameters before an optimiser step (`Capture.snapshot_params`)."""

    def __init__(self, kept: list[tuple[TapKey, nn.Parameter, torch.Tensor]]) -> None:
        self.kept = kept

    def update_norms(self) -> dict[TapKey, torch.Tensor]:
        """||p now - p before|| per parameter tap: 0-d float64 tensors on the parameter's device."""
        first: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # a tied parameter once
        for _, param, old in self.kept:
            first.setdefault(id(param), (param, old))
        now = [local_piece(p.detach()) for p, _ in first.values()]  # a sharded one: its piece (merged in the records)
        olds = [local_piece(o) for _, o in first.values()]
        # one subtraction for all on an accelerator (multi-tensor ops), then the norms batched likewise
        done = dict(zip(first, value_norms(sub_all(now, olds)), strict=True))
        return {key: done[id(param)] for key, param, _ in self.kept}
