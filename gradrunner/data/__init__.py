"""Data for the runner (config group `data`): `gradrunner.data.X` is each option's `_target_`, as records store it.

| module | what it holds |
| --- | --- |
| `batches` | the `DataSource` protocol, `as_batches` (any source or iterable, cycled), `cast`, `ForwardInputs`, `call` |
| `sources` | the built-in sources: `Synthetic`, `Tensors`, `Digits`, `Tokens` |
| `corrupt` | `Corrupted`: another source with one batch corrupted (a planted loss spike) |

Example::

    from gradrunner.data import Synthetic, as_batches
    x, y = next(as_batches(Synthetic(input_shape=[8]), torch.device("cpu"), torch.float32))
"""

from gradrunner.data.batches import Batch, DataSource, ForwardInputs, as_batches, call, cast, with_kwargs
from gradrunner.data.corrupt import Corrupted
from gradrunner.data.sources import TASKS, Digits, Synthetic, Tensors, Tokens

__all__ = ["TASKS", "Batch", "Corrupted", "DataSource", "Digits", "ForwardInputs", "Synthetic", "Tensors", "Tokens", "as_batches", "call", "cast", "with_kwargs"]
