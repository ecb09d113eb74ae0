"""What a batch is and how it reaches the model: the `DataSource` protocol, casting, forward inputs.

A source is anything with `batches(device, dtype) -> Iterator[(inputs, targets)]`; `as_batches`
also accepts any iterable (a list, a `torch.utils.data.DataLoader`, ...) and cycles it, of

- `(inputs, targets)` pairs: `inputs` a tensor (the model is called `model(inputs)`) or a dict of
  keyword arguments (`model(**inputs)`);
- dicts of keyword arguments (HF style): `model(**batch)`, the targets being `batch["labels"]`
  (None without it; `loss=model_loss` takes the output's own `.loss`).

Floating-point tensors (also inside dicts, lists and tuples) are cast to the run's dtype; integer
tensors (class labels, token ids) stay integer. `forward_kwargs` (config key of the same name) are
extra keyword arguments of every forward call (`{output_attentions: true}`).

Example::

    source = Synthetic(input_shape=[8], target_shape=[1], batch_size=4, seed=0)
    x, y = next(as_batches(source, torch.device("cpu"), torch.float64))  # (4, 8), (4, 1) float64
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn, Protocol, runtime_checkable

import torch
from omegaconf import OmegaConf

from gradrunner.errors import GradrunnerError

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class DataSource(Protocol):
    """What the runner asks of a data option: an endless iterator of batches on a device.

    Example::

        class MyData:
            def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
                while True:
                    yield torch.randn(4, 8, device=device, dtype=dtype), torch.zeros(4, 1, device=device, dtype=dtype)
    """

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]: ...


def cast(value: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`value` as a tensor on `device`: floating point in `dtype`, integers (labels) unchanged.

    Example::

        cast([1, 2], torch.device("cpu"), torch.float64).dtype      # torch.int64
        cast([1.0, 2.0], torch.device("cpu"), torch.float64).dtype  # torch.float64
    """
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


class ForwardInputs(NamedTuple):
    """Inputs of a forward call with extra keyword arguments: `model(*args, **kwargs)` (see `call`).

    Example::

        call(model, ForwardInputs((x,), {"output_attentions": True}))   # model(x, output_attentions=True)
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def call(model: Callable[..., Any], inputs: Any) -> Any:
    """The forward call for a batch's inputs: `model(**inputs)` for a dict, `model(*a, **kw)` for ForwardInputs.

    Example::

        call(model, {"input_ids": ids})   # model(input_ids=ids)
        call(model, x)                    # model(x)
    """
    if isinstance(inputs, ForwardInputs):
        return model(*inputs.args, **inputs.kwargs)
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def with_kwargs(inputs: Any, forward_kwargs: Mapping[str, Any] | None) -> Any:
    """`inputs` with `forward_kwargs` added: merged into a dict, else as `ForwardInputs`."""
    if not forward_kwargs:
        return inputs
    if isinstance(inputs, Mapping):
        return {**inputs, **forward_kwargs}
    return ForwardInputs((inputs,), dict(forward_kwargs))


def as_batches(
    source: object, device: torch.device, dtype: torch.dtype, forward_kwargs: Mapping[str, Any] | None = None,
    *, once: bool = False,
) -> Iterator[Batch]:  # fmt: skip
    """An endless iterator of `(inputs, targets)` on `device`, from a `DataSource` or any iterable of batches.

    Example::

        batches = as_batches([(torch.randn(2, 8), torch.randn(2, 1))], torch.device("cpu"), torch.float32)
        x, y = next(batches); x, y = next(batches)   # a finite iterable is cycled
        as_batches(DataLoader(dataset_of_dicts, batch_size=4), cpu, torch.float32)   # ({...}, labels) pairs

    `forward_kwargs` are added to every batch's inputs (see `with_kwargs`). `once=True`: one pass over an
    iterable, not cycled (a `DataSource`'s `batches()` is its own: endless).
    """
    kwargs = dict(to_plain(forward_kwargs) or {})
    if isinstance(source, DataSource):
        it: Iterator[Any] = source.batches(device, dtype)
    elif isinstance(source, Iterable):
        it = _one_pass(source, device, dtype) if once else _cycle(source, device, dtype)
    else:
        _not_a_source(source)
    return ((with_kwargs(x, kwargs), y) for x, y in it) if kwargs else it


def _not_a_source(source: object) -> NoReturn:
    raise GradrunnerError(
        f"data: {type(source).__name__} is not a data source; a data option must build an object with "
        "batches(device, dtype) or an iterable of (inputs, targets) pairs (a list, a DataLoader, ...)"
    )


def _cast_all(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """`cast` through dicts and through lists/tuples of tensors (a batch of keyword arguments); None, strings unchanged."""
    if isinstance(value, Mapping):
        return {k: _cast_all(v, device, dtype) for k, v in value.items()}
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, Mapping)):
        return type(value)(_cast_all(v, device, dtype) for v in value)
    return cast(value, device, dtype)


def _cycle(source: Iterable[Any], device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
    while True:
        yield from _one_pass(source, device, dtype)


def _one_pass(source: Iterable[Any], device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
    empty = True
    for item in source:
        empty = False
        if isinstance(item, Mapping):  # a batch of keyword arguments, HF style: the labels are the targets
            batch = _cast_all(item, device, dtype)
            yield batch, batch.get("labels")
            continue
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2:
            raise GradrunnerError(
                f"data: {type(source).__name__} yielded a {type(item).__name__}, not an (inputs, targets) pair "
                "nor a dict of keyword arguments for the model"
            )
        yield _cast_all(item[0], device, dtype), _cast_all(item[1], device, dtype)
    if empty:
        raise GradrunnerError(
            f"data: {type(source).__name__} yielded no batches; a data option must yield at least one "
            "(inputs, targets) pair (an iterable is cycled), or have batches(device, dtype) yield them"
        )


def to_plain(value: Any) -> Any:
    """OmegaConf containers (from the config) as plain lists, so `torch.tensor` accepts them.

    Example::

        to_plain(OmegaConf.create([1, 2]))    # [1, 2]
    """
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
