"""gradrunner.data: the built-in data sources and `as_batches` for anything iterable."""

from __future__ import annotations

import sys
from itertools import islice

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gradrunner.data import Digits, Synthetic, Tensors, as_batches, cast
from gradrunner.errors import GradrunnerError

CPU = torch.device("cpu")


def take(source: object, n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(islice(as_batches(source, CPU, dtype), n))


def test_synthetic_regression_shapes_and_dtype() -> None:
    x, y = take(Synthetic(input_shape=[5, 16], target_shape=[5, 4], batch_size=8, num_samples=32), 1, torch.float64)[0]
    assert x.shape == (8, 5, 16) and y.shape == (8, 5, 4)
    assert x.dtype == y.dtype == torch.float64


def test_synthetic_is_seeded() -> None:
    a = take(Synthetic(seed=3), 2)
    b = take(Synthetic(seed=3), 2)
    c = take(Synthetic(seed=4), 1)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])


def test_synthetic_classification_gives_int64_labels_in_range() -> None:
    src = Synthetic(input_shape=[8], target_shape=[], task="classification", num_classes=3, batch_size=64)
    x, y = take(src, 1, torch.bfloat16)[0]
    assert x.dtype == torch.bfloat16 and y.dtype == torch.int64 and y.shape == (64,)
    assert 0 <= int(y.min()) and int(y.max()) < 3 and len(y.unique()) > 1


def test_synthetic_regression_targets_are_learnable_not_noise() -> None:
    src = Synthetic(input_shape=[4], target_shape=[1], noise=0.0, num_samples=64, batch_size=64)
    x, y = take(src, 1, torch.float64)[0]
    solution = torch.linalg.lstsq(x, y).solution
    assert torch.allclose(x @ solution, y, atol=1e-8)


def test_synthetic_cycles_forever_with_full_batches() -> None:
    batches = take(Synthetic(batch_size=30, num_samples=100), 7)  # 3 full batches per epoch
    assert all(x.shape[0] == 30 for x, _ in batches)
    assert torch.equal(batches[0][0], batches[3][0])  # no shuffle: epoch 2 repeats epoch 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"task": "ranking"}, "data.task='ranking'.*regression, classification"),
        ({"task": "classification", "num_classes": 1}, "num_classes=1"),
        ({"batch_size": 0}, "data.batch_size=0"),
        ({"batch_size": 600, "num_samples": 512}, "data.batch_size=600"),
    ],
)
def test_synthetic_rejects_bad_settings(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(GradrunnerError, match=match):
        Synthetic(**kwargs)  # type: ignore[arg-type]


def test_tensors_literal_nested_lists_repeat_every_step() -> None:
    batches = take(Tensors(inputs=[[1.0]], targets=[[1.0], [0.0]]), 3)
    for x, y in batches:
        assert x.tolist() == [[1.0]] and y.tolist() == [[1.0], [0.0]]
        assert x.dtype == y.dtype == torch.float32
    assert batches[0][0] is not batches[1][0]  # fresh leaf tensors: no state carried between steps


def test_tensors_scalars_are_zero_dim() -> None:
    x, y = take(Tensors(inputs=3.0, targets=0.5), 1, torch.float64)[0]
    assert x.shape == () and float(x) == 3.0 and x.dtype == torch.float64 and float(y) == 0.5


def test_tensors_integer_inputs_become_float_and_integer_targets_stay_labels() -> None:
    x, y = take(Tensors(inputs=[[1, 2]], targets=[1]), 1)[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64


def test_tensors_dtype_options() -> None:
    x, y = take(Tensors(inputs=[3, 4], targets=[1, 0], inputs_dtype="int64", targets_dtype="float"), 1)[0]
    assert x.dtype == torch.int64 and y.dtype == torch.float32
    with pytest.raises(GradrunnerError, match="targets_dtype='half'"):
        Tensors(inputs=1.0, targets=1.0, targets_dtype="half")


def test_tensors_ragged_literal_is_a_clear_error() -> None:
    with pytest.raises(GradrunnerError, match=r"data.inputs=\[\[1.0\], \[1.0, 2.0\]\] is not a tensor literal"):
        Tensors(inputs=[[1.0], [1.0, 2.0]], targets=1.0)


def test_tensors_instantiates_from_a_config_with_omegaconf_lists() -> None:
    node = OmegaConf.create({"_target_": "gradrunner.data.Tensors", "inputs": [[1.0]], "targets": [[1.0], [0.0]]})
    x, y = take(instantiate(node), 1)[0]  # without _convert_: ListConfig arguments
    assert y.shape == (2, 1)


def test_digits_shapes_range_and_labels() -> None:
    pytest.importorskip("sklearn")
    src = Digits(batch_size=16, seed=0)
    x, y = take(src, 1)[0]
    assert x.shape == (16, 1, 8, 8) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and set(y.tolist()) <= set(range(10))
    assert len(src) == 1797 // 16


def test_digits_shuffling_is_seeded() -> None:
    pytest.importorskip("sklearn")
    a, b, c = (take(Digits(batch_size=8, seed=s), 1)[0][1] for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_digits_without_sklearn_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(GradrunnerError, match=r"pip install 'gradrunner\[digits\]'"):
        Digits()


def test_as_batches_cycles_any_iterable_and_casts_floats_only() -> None:
    pairs = [(torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1])), ([1.0, 2.0], [0.5, 0.5])]
    out = take(pairs, 5)
    assert [x.dtype for x, _ in out] == [torch.float32] * 5
    assert out[0][1].dtype == torch.int64 and torch.equal(out[0][0], out[2][0])


@pytest.mark.parametrize(
    "source, match", [(42, "not a data source"), ([], "yielded no batches"), ([torch.zeros(2)], "not an .inputs")]
)
def test_as_batches_rejects_what_is_not_data(source: object, match: str) -> None:
    with pytest.raises(GradrunnerError, match=match):
        take(source, 1)


def test_cast_keeps_integers_and_moves_floats_to_dtype() -> None:
    assert cast([1, 2], CPU, torch.float16).dtype == torch.int64
    assert cast(torch.ones(2), CPU, torch.float16).dtype == torch.float16


def test_tensors_keep_float64_precision_of_the_literal() -> None:
    x, _ = take(Tensors(inputs=[0.3776], targets=0.1), 1, torch.float64)[0]
    assert x.item() == 0.3776


def test_tokens_are_seeded_keyword_batches_with_labels_as_targets() -> None:
    from gradrunner.data import Tokens

    batches = Tokens(vocab_size=7, seq_len=5, batch_size=3, num_batches=2, seed=4).batches(torch.device("cpu"), torch.float64)
    (a, ya), (b, _), (c, _) = next(batches), next(batches), next(batches)
    assert sorted(a) == ["attention_mask", "input_ids", "labels"]
    assert a["input_ids"].shape == (3, 5) and a["input_ids"].dtype == torch.int64  # ids stay int64 in a float64 run
    assert int(a["input_ids"].min()) >= 0 and int(a["input_ids"].max()) < 7
    assert torch.equal(a["labels"], a["input_ids"]) and torch.equal(ya, a["input_ids"])
    assert torch.equal(a["attention_mask"], torch.ones(3, 5, dtype=torch.int64))
    assert not torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(c["input_ids"], a["input_ids"])  # cycled
    reference = torch.randint(0, 7, (2, 3, 5), generator=torch.Generator().manual_seed(4))
    assert torch.equal(a["input_ids"], reference[0]) and torch.equal(b["input_ids"], reference[1])
    inputs, _ = next(Tokens(labels_in_inputs=False).batches(torch.device("cpu"), torch.float32))
    assert "labels" not in inputs


@pytest.mark.parametrize(("key", "value"), [("vocab_size", 1), ("seq_len", 0), ("batch_size", 2.5)])
def test_tokens_refuse_bad_sizes_naming_the_key(key: str, value: object) -> None:
    from gradrunner.data import Tokens

    with pytest.raises(GradrunnerError, match=rf"data\.{key}={value!r} is not allowed; it must be an integer >="):
        Tokens(**{key: value})  # type: ignore[arg-type]
