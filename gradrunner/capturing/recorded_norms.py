"""The norm a record holds of a tapped value (`value_norm`) or of an edited gradient (`edited_norm`), sharded or not.

A plain tensor's is `extras.value_norm`; a `DTensor`'s is `sharded.mergeable_norm`, the norm the records merge
beside its gradient's statistics (a `Partial` summed first, a sub-mesh's whole). Its own module: `sharded` reaches
`extras` through the reductions, so `extras` cannot ask `sharded` without an import cycle.

Example::

    record_norm(torch.tensor([3.0, 4.0]))     # tensor(5., dtype=torch.float64)
    record_norm(tp_activation)                # this rank's piece's norm, merged with the step's rows
"""

from __future__ import annotations

import torch

from gradrunner.capturing.dtensors import is_dtensor
from gradrunner.capturing.extras import value_norm


def record_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of `t` as its record takes it, 0-d, on its device (`extras.value_norm`; a DTensor's: its piece's,
    merged by the gradient's placement, or on a sub-mesh the whole tensor's, one all-reduce over the sub-mesh).

    Example::

        slot.value_norm = record_norm(value)
    """
    if is_dtensor(t):
        from gradrunner.capturing.sharded import mergeable_norm  # DTensor's machinery: only where one is

        return mergeable_norm(t.detach())
    return value_norm(t)
