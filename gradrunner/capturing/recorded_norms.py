"""The norm a record holds of a tapped value (`value_norm`) or of an edited gradient (`edited_norm`), sharded or not.

A plain tensor's is `extras.value_norm`. A `DTensor` value's is `sharded.piece_norm`: this rank's piece's norm,
merged over the ranks by the value's own placement with the step's rows, whether its tap gets a gradient or not;
an edited `DTensor` gradient's is `sharded.mergeable_norm`, the norm the records merge beside its statistics (a
`Partial` summed first, a sub-mesh's whole). Its own module: `sharded` reaches `extras` through the reductions,
so `extras` cannot ask `sharded` without an import cycle.

Example::

    record_value_norm(torch.tensor([3.0, 4.0]))     # tensor(5., dtype=torch.float64)
    record_value_norm(tp_activation)                # PieceNorm: this rank's piece's norm, merged with the step's rows
    record_norm(edited_tp_grad)                     # this rank's piece's norm, merged with its gradient's row
"""

from __future__ import annotations

import torch

from gradrunner.capturing.dtensors import PieceNorm, is_dtensor
from gradrunner.capturing.extras import value_norm


def record_value_norm(t: torch.Tensor) -> torch.Tensor | PieceNorm:
    """The L2 norm of a tapped value `t` as its record takes it (`value_norm`), 0-d, on its device (`extras.value_norm`;
    a DTensor's: `sharded.piece_norm`, a `PieceNorm` on a mesh spanning the world, the whole norm on a sub-mesh).

    Example::

        slot.value_norm = record_value_norm(value)
    """
    if is_dtensor(t):
        from gradrunner.capturing.sharded import piece_norm  # DTensor's machinery: only where one is

        return piece_norm(t.detach())
    return value_norm(t)


def record_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of an edited gradient `t` as its record takes it (`edited_norm`), 0-d, on its device
    (`extras.value_norm`; a DTensor's: its piece's, merged by the gradient's placement with its row, or on a sub-mesh
    the whole tensor's, one all-reduce over the sub-mesh).

    Example::

        self.norms[order] = record_norm(edited)
    """
    if is_dtensor(t):
        from gradrunner.capturing.sharded import mergeable_norm  # DTensor's machinery: only where one is

        return mergeable_norm(t.detach())
    return value_norm(t)
