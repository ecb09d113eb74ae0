"""What the tap explorer offers is what `capture` takes: every tap `list_taps` lists as able to carry a gradient is
accepted by `capture(...)` on a real backward and gets a gradient or a row with an honest reason, and every tap it
marks (`no_gradient`) is refused by name or recorded without a gradient. The whole listing is checked, one tap per
session, for stock torch layers and tiny random-init transformers models.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradrunner import GradrunnerError, capture, list_taps
from gradrunner.capturing.explore import UNASSIGNED, TapListing
from gradrunner.capturing.grad_context import NO_PART, NOT_ASSIGNED

Call = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _conv_bn_dropout() -> Call:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(), nn.Linear(72, 3))
    return model, (torch.randn(4, 1, 8, 8),), {}


def _encoder_layer() -> Call:
    return nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), (torch.randn(2, 5, 16),), {}


def _lstm() -> Call:
    return nn.LSTM(4, 3, num_layers=2), (torch.randn(5, 2, 4),), {}


def _embedding_gru() -> Call:
    model = nn.Sequential(nn.Embedding(10, 4), nn.GRU(4, 3, batch_first=True))
    return model, (torch.randint(0, 10, (2, 5)),), {}


def _gpt2() -> Call:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50, n_positions=16)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


MODELS: dict[str, Callable[[], Call]] = {
    "conv_bn_dropout": _conv_bn_dropout, "TransformerEncoderLayer": _encoder_layer, "LSTM": _lstm,
    "embedding_gru": _embedding_gru, "gpt2": _gpt2,
}  # fmt: skip


def _loss(out: Any) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss  # type: ignore[no-any-return]
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out.pow(2).sum()


def _one_tap(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tap: str) -> list[tuple[bool, str | None]]:
    """(has_grad, reason) of each row of one step capturing `tap` alone; raises what `capture` raises."""
    with warnings.catch_warnings(), capture(model, [tap]) as cap:
        warnings.simplefilter("ignore")
        loss = _loss(model(*args, **kwargs))
        cap.backward(loss)
        records = cap.records(loss.detach())
    model.zero_grad(set_to_none=True)
    rows = [records.row(i) for i in range(len(records.keys))]
    return [(bool(r["has_grad"]), r["reason"]) for r in rows]  # type: ignore[misc]


def _split(listing: TapListing) -> tuple[list[str], list[str]]:
    return [t for m in listing.modules for t in m.taps()], [t for m in listing.modules for t in m.taps(tappable=False)]


@pytest.mark.parametrize("name", MODELS)
def test_every_offered_tap_is_captured_and_every_marked_one_is_refused_or_recorded_without_gradient(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    offered, marked = _split(list_taps(model, *args, **kwargs))
    assert offered and not set(offered) & set(marked)
    refused: dict[str, str] = {}
    no_gradient: dict[str, list[str | None]] = {}
    for tap in offered + marked:
        try:
            rows = _one_tap(model, args, kwargs, tap)
        except GradrunnerError as e:
            refused[tap] = str(e)
            continue
        assert rows, tap  # no tap is silently missing from a captured step
        if not any(has for has, _ in rows):
            no_gradient[tap] = [why for _, why in rows]
    assert [t for t in offered if t in refused] == []
    # an offered tap without any gradient says why, and it is a reason of this step, not of the value
    assert {t: w for t, w in no_gradient.items() if t in offered and not set(w) <= {NO_PART, NOT_ASSIGNED}} == {}
    assert [t for t in marked if t not in refused and t not in no_gradient] == []
    assert all(f"tap {t!r} cannot carry a gradient" in refused[t] for t in marked if t in refused)


def test_the_marks_of_a_gpt2_say_what_each_slot_held() -> None:
    model, _, kwargs = _gpt2()
    listing = list_taps(model, **kwargs)
    slots = {f"{m.path}:{s.name}": s for m in listing.modules for s in m.outputs + m.inputs + m.parameters + m.locals}
    got = {t: (slots[t].shape, slots[t].dtype, slots[t].kind, slots[t].no_gradient) for t in [
        ":input.input_ids", ":output.cache", ":output.logits", "transformer.h.0:input.use_cache",
        "transformer.h.0:input.0", "transformer:i", "transformer:block", "transformer.h.0:_",
        "transformer.h.0:cross_attn_output",
    ]}  # fmt: skip
    assert got == {
        ":input.input_ids": ([2, 5], "int64", "tensor", "not a floating-point tensor (torch.int64)"),
        ":output.cache": (None, None, "DynamicCache", "not a tensor (a DynamicCache)"),
        ":output.logits": ([2, 5, 50], "float32", "tensor", None),
        "transformer.h.0:input.use_cache": (None, None, "bool", "not a tensor (a bool)"),
        "transformer.h.0:input.0": ([2, 5, 8], "float32", "tensor", None),
        "transformer:i": (None, None, "int", "not a tensor (an int)"),
        "transformer:block": (None, None, "GPT2Block", "not a tensor (a GPT2Block)"),
        "transformer.h.0:_": (None, None, "NoneType", "not a tensor (a NoneType)"),
        "transformer.h.0:cross_attn_output": (None, None, UNASSIGNED, None),
    }
    text = str(listing).splitlines()
    assert any(line.split() == ["input.use_cache", "(bool)", "--", "no", "gradient:", "not", "a", "tensor", "(a", "bool)"]
               for line in text)  # fmt: skip
    # a local that is None at one assignment and a tensor at the other: capture refuses it at the first
    assert slots[":loss"].shape == [] and slots[":loss"].no_gradient == "not a tensor (a NoneType), in 1 of 2 assignments"


def test_an_input_computed_only_from_inputs_and_a_frozen_parameter_are_marked() -> None:
    model = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    model.linear2.requires_grad_(False)
    listing = list_taps(model, torch.randn(2, 3, 8))
    slots = {f"{m.path}:{s.name}": s for m in listing.modules for s in m.outputs + m.inputs + m.parameters + m.locals}
    assert slots["linear2:weight"].no_gradient == "parameter does not require grad (frozen)"
    assert slots[":x"].no_gradient.startswith("does not require grad (computed only from inputs")  # type: ignore[union-attr]
    assert slots[":x"].no_gradient.endswith(", in 1 of 3 assignments")  # type: ignore[union-attr]
    assert slots[":input"].no_gradient is None  # an input leaf: the tap makes it require grad


def test_list_taps_inside_an_open_session_is_refused_and_the_step_is_recorded_as_without_it() -> None:
    """`list_taps(model, x)` inside `with capture(model, ...)`: its forward pass was counted into the step, call 0
    of `0:output` with no gradient ("takes no part in the loss") and the training forward call 1. Refused now, in
    one paragraph; the session's step is then what a session without the call records. A session on another
    model does not stop it."""
    x = torch.randn(5, 4)

    def step(explore: bool) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        with capture(model, ["0:output"]) as cap, capture(nn.Linear(2, 2), [":output"]):
            if explore:
                with pytest.raises(GradrunnerError, match=r"^list_taps\(\.\.\.\) runs a forward pass of the model, on"):
                    list_taps(model[0], x)
            loss = model(x).pow(2).mean()
            cap.backward(loss)
            recs = cap.records(loss)
        assert [m.path for m in list_taps(model, x).modules][:2] == ["", "0"]  # after the block, as ever
        return recs

    want, got = step(False), step(True)
    assert got.keys == want.keys and got.reason == want.reason == [None]
    assert list(got.stats["norm"]) == list(want.stats["norm"])
