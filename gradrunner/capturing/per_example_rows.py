"""Whether a layer call's dim 0 holds the batch's rows, beyond its size: `RowOrigins`, one per `PerExampleNorms`.

`per_example_layers.call_reason` compares a call's dim 0 with the batch size; a tensor whose dim 0
has the batch's size by coincidence passes it. `RowOrigins` catches an `Embedding` called on ids
made inside the forward (positions, relative-position buckets) while the batch size equals another
dim of any tensor the model was called with (`start`): the encoder's length or the decoder's.

Example::

    origins = RowOrigins()
    origins.start(args, kwargs, rows=4)               # at the model's call
    why = origins.reason("embedding", ids)            # None, or why dim 0 is not the batch's rows
"""

from __future__ import annotations

from typing import Any

import torch

from gradrunner.capturing.per_example_layers import storage, tensors_of


class RowOrigins:
    """What a step's forward knows about where tensors' rows come from: reset at each model call.

    Example::

        origins.start(args, kwargs, rows)   # the model's call: B == another dim of its inputs?
        origins.reason(kind, x)             # a layer's call: None, or why dim 0 is not the batch's rows
    """

    def __init__(self) -> None:
        #: Storages of the tensors the model was called with, where B equals another dim of one of them.
        self.given: set[int] | None = None

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int | None) -> None:
        """A forward of the model with `rows` rows (None: no tensor input) begins."""
        tensors = list(tensors_of(args, kwargs))
        clash = rows is not None and any(rows in t.shape[1:] for t in tensors)
        self.given = {storage(t) for t in tensors} if clash else None

    def clear(self) -> None:
        self.given = None

    def reason(self, kind: str, x: torch.Tensor) -> str | None:
        """Why the rows of `x` (whose dim 0 has the batch's size) are not the batch's, or None."""
        if kind == "embedding" and self.given is not None and storage(x) not in self.given:
            return (f"called on ids of shape {tuple(x.shape)} made inside the forward (positions, relative-position "
                    "buckets) while the batch size equals another dim of the model's input: dim 0 may not be the batch")  # fmt: skip
        return None
