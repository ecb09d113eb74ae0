"""The built-in data sources (config group `data`): each yields `(inputs, targets)` batches forever.

| class | option | what it yields |
| --- | --- | --- |
| `Synthetic` | `data=synthetic` | seeded random inputs; regression targets or int64 class labels |
| `Tensors` | `data=tensors` | one literal batch (nested lists or scalars), the same every step |
| `Digits` | `data=digits` | scikit-learn's bundled 8x8 digits, (N, 1, 8, 8) in [0, 1], int64 labels |
| `Tokens` | `data=tokens` | seeded random token ids as keyword arguments (`model(**inputs)`), labels as targets |

`Synthetic` and `Tokens` also offer `held_out(seed)`: new examples of the same task, the default
evaluation set (`gradrunner.run.evaluation`); `Tensors` and `Digits` have none to offer.

Example::

    source = Synthetic(input_shape=[8], target_shape=[1], batch_size=4, seed=0)
    x, y = next(source.batches(torch.device("cpu"), torch.float64))  # (4, 8), (4, 1) float64
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gradrunner.data.batches import Batch, cast, to_plain
from gradrunner.errors import GradrunnerError

TASKS = ("regression", "classification")


class _Dataset:
    """A fixed set of examples served in batches of `batch_size`, epoch after epoch, last partial batch dropped."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int, shuffle: bool, seed: int) -> None:
        n = inputs.shape[0]
        if not 1 <= batch_size <= n:
            raise GradrunnerError(
                f"data.batch_size={batch_size} is not allowed; it must be between 1 and the number of examples ({n})"
            )
        self.inputs, self.targets = inputs, targets
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.inputs.shape[0] // self.batch_size

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        """Endless batches on `device` (the data is moved there once); reshuffled each epoch if `shuffle`."""
        x, y = cast(self.inputs, device, dtype), cast(self.targets, device, dtype)
        gen = torch.Generator().manual_seed(self.seed)
        n = x.shape[0]
        while True:
            order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
            order = order.to(device)
            for start in range(0, n - self.batch_size + 1, self.batch_size):
                idx = order[start : start + self.batch_size]
                yield x.index_select(0, idx), y.index_select(0, idx)


class Synthetic(_Dataset):
    """Seeded random inputs with learnable targets from a fixed random linear "teacher".

    Example::

        Synthetic(input_shape=[5, 16], target_shape=[5, 4], batch_size=8)            # regression
        Synthetic(input_shape=[8], target_shape=[], task="classification", num_classes=3)

    Regression: `targets = teacher(inputs) + noise * randn`, shape `(batch, *target_shape)`.
    Classification: int64 labels in `[0, num_classes)`, shape `(batch, *target_shape)`, the argmax
    of a teacher's `num_classes` logits per label.
    """

    def __init__(
        self,
        input_shape: Sequence[int] = (8,),
        target_shape: Sequence[int] = (1,),
        task: str = "regression",
        num_classes: int = 10,
        batch_size: int = 32,
        num_samples: int = 512,
        noise: float = 0.1,
        seed: int = 0,
        shuffle: bool = False,
    ) -> None:
        if task not in TASKS:
            raise GradrunnerError(f"data.task={task!r} is not allowed; allowed: {', '.join(TASKS)}")
        if task == "classification" and num_classes < 2:
            raise GradrunnerError(f"data.num_classes={num_classes} is not allowed; classification needs >= 2 classes")
        in_shape, out_shape = tuple(to_plain(input_shape)), tuple(to_plain(target_shape))
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((num_samples, *in_shape), generator=gen, dtype=torch.float64)
        d_in, d_out = math.prod(in_shape), math.prod(out_shape)
        width = d_out * (num_classes if task == "classification" else 1)
        self.teacher = torch.randn((d_in, width), generator=gen, dtype=torch.float64) / math.sqrt(d_in)
        self.task, self.num_classes, self.noise, self.out_shape = task, num_classes, noise, out_shape
        super().__init__(x, self._targets(x, gen), batch_size, shuffle, seed)

    def _targets(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The teacher's targets for inputs `x` (regression noise drawn from `gen`)."""
        n = x.shape[0]
        h = x.reshape(n, -1) @ self.teacher
        if self.task == "classification":
            return h.reshape(n, *self.out_shape, self.num_classes).argmax(dim=-1)
        return (h + self.noise * torch.randn(h.shape, generator=gen, dtype=torch.float64)).reshape(n, *self.out_shape)

    def held_out(self, seed: int) -> _Dataset:
        """As many new examples of the same task (the same teacher), inputs and noise drawn from `seed`.

        Example::

            train = Synthetic(seed=0); test = train.held_out(1_000_000)   # same teacher, other inputs
        """
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tuple(self.inputs.shape), generator=gen, dtype=torch.float64)
        return _Dataset(x, self._targets(x, gen), self.batch_size, False, seed)


class Tensors:
    """One literal batch, repeated every step: `inputs` and `targets` as nested lists or scalars.

    Example::

        Tensors(inputs=[[1.0]], targets=[[1.0], [0.0]])   # x (1, 1), y (2, 1)
        Tensors(inputs=3.0, targets=0.0)                  # 0-d tensors

    `inputs_dtype`: `float` (cast to the run's dtype) or `int64` (token ids). `targets_dtype`:
    `auto` (integers stay int64 labels, floats take the run's dtype), `float` or `int64`.
    """

    def __init__(
        self, inputs: Any, targets: Any, inputs_dtype: str = "float", targets_dtype: str = "auto"
    ) -> None:
        kinds = {"float": torch.float64, "int64": torch.int64}
        if inputs_dtype not in kinds:
            raise GradrunnerError(f"data.inputs_dtype={inputs_dtype!r} is not allowed; allowed: float, int64")
        if targets_dtype not in (*kinds, "auto"):
            raise GradrunnerError(f"data.targets_dtype={targets_dtype!r} is not allowed; allowed: auto, float, int64")
        self.inputs = _literal("inputs", inputs, kinds[inputs_dtype])
        self.targets = _literal("targets", targets, kinds.get(targets_dtype))

    def __len__(self) -> int:
        """Batches per epoch: the one batch (an evaluation set holds it once: `run.evaluation.fixed_batches`)."""
        return 1

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        """The same batch forever (fresh leaf tensors each step, sharing the data)."""
        x, y = cast(self.inputs, device, dtype), cast(self.targets, device, dtype)
        while True:
            yield x.detach(), y.detach()


def _literal(name: str, value: Any, dtype: torch.dtype | None) -> torch.Tensor:
    plain = to_plain(value)
    try:
        t = torch.tensor(plain)
        if t.is_floating_point():  # parse again in float64: torch.tensor's default float32 loses digits
            t = torch.tensor(plain, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise GradrunnerError(
            f"data.{name}={plain!r} is not a tensor literal ({e}); give a number or nested lists of "
            f"numbers with equal lengths, e.g. data.{name}=[[1.0],[0.0]] or data.{name}=3.0"
        ) from None
    if dtype is None:
        return t.double() if t.is_floating_point() or t.dtype == torch.bool else t.long()
    return t.to(dtype)


class Digits(_Dataset):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, no download).

    Example::

        x, y = next(Digits(batch_size=4).batches(torch.device("cpu"), torch.float32))
        # x: (4, 1, 8, 8) float32 in [0, 1]; y: (4,) int64 in 0..9

    Needs scikit-learn: `pip install 'gradrunner[digits]'`.
    """

    def __init__(self, batch_size: int = 64, shuffle: bool = True, seed: int = 0) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise GradrunnerError(
                "data=digits needs scikit-learn, which is not installed: pip install 'gradrunner[digits]' "
                "(or pip install scikit-learn), or pick another data option, e.g. data=synthetic"
            ) from None
        bunch = load_digits()
        x = torch.as_tensor(bunch.images, dtype=torch.float64).unsqueeze(1) / 16.0
        y = torch.as_tensor(bunch.target, dtype=torch.int64)
        super().__init__(x, y, batch_size, shuffle, seed)


class Tokens:
    """Seeded random token ids for HuggingFace-style models, as a dict of keyword arguments.

    Example::

        inputs, labels = next(Tokens(vocab_size=100, seq_len=8, batch_size=2).batches(torch.device("cpu"), torch.float32))
        sorted(inputs)      # ['attention_mask', 'input_ids', 'labels']; the runner calls model(**inputs)

    Each batch is `(inputs, labels)`: `inputs` holds `input_ids` (int64, `(batch_size, seq_len)`, in
    `[0, vocab_size)`), `attention_mask` (ones) and, when `labels_in_inputs`, `labels` (a copy of
    `input_ids`, so the model computes its own `.loss`: `loss=model_loss`); the targets are the labels
    again, for losses that take them (`loss=lm_cross_entropy`). `num_batches` distinct batches are cycled.
    """

    def __init__(
        self, vocab_size: int = 100, seq_len: int = 16, batch_size: int = 4, num_batches: int = 8, seed: int = 0,
        labels_in_inputs: bool = True,
    ) -> None:  # fmt: skip
        for name, value, low in (("vocab_size", vocab_size, 2), ("seq_len", seq_len, 1),
                                 ("batch_size", batch_size, 1), ("num_batches", num_batches, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GradrunnerError(
                    f"data.{name}={value!r} is not allowed; it must be an integer >= {low}, e.g. data.{name}={max(low, 8)}"
                )
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_batches, batch_size, seq_len), generator=gen)
        self.vocab_size, self.labels_in_inputs = vocab_size, labels_in_inputs

    def __len__(self) -> int:
        """Batches per epoch: the `num_batches` distinct ones (an evaluation set holds each once at most)."""
        return int(self.ids.shape[0])

    def held_out(self, seed: int) -> Tokens:
        """Other token ids of the same shapes, drawn from `seed`.

        Example::

            Tokens(seed=0).held_out(1_000_000).ids.shape     # torch.Size([8, 4, 16])
        """
        n, batch, seq = self.ids.shape
        return Tokens(self.vocab_size, seq, batch, n, seed, self.labels_in_inputs)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Endless `(inputs, labels)` batches on `device`; token ids stay int64 whatever the run's dtype."""
        ids = self.ids.to(device)
        mask = torch.ones_like(ids[0])
        while True:
            for batch in ids:
                inputs = {"input_ids": batch, "attention_mask": mask}
                if self.labels_in_inputs:
                    inputs["labels"] = batch
                yield inputs, batch
