"""Data sources for the runner (config group `data`); `gradrunner.data.X` stays the `_target_` of each option."""

from gradrunner.data.batches import (
    TASKS,
    Batch,
    DataSource,
    Digits,
    ForwardInputs,
    Synthetic,
    Tensors,
    Tokens,
    as_batches,
    call,
    cast,
    with_kwargs,
)

__all__ = ["TASKS", "Batch", "DataSource", "Digits", "ForwardInputs", "Synthetic", "Tensors", "Tokens", "as_batches", "call", "cast", "with_kwargs"]
