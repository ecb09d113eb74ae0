"""Calls whose dim 0 has the batch's size but not its rows (`per_example_rows`): null with the reason, never a number.

Each model is run so that the coincidence happens (B equal to the decoder's length); the reference is `per_example_reference.loop`
(each row alone, its loss scaled to its share), which every other parameter must still match (rtol 1e-5).
"""

from __future__ import annotations

import logging

import pytest
import torch
from per_example_reference import all_params, assert_matches, batched, loop
from torch import nn


def _quiet_transformers():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def _check(model: nn.Module, inputs: dict[str, torch.Tensor], rows_loss, nulls: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """`nulls` (name: a part of its reason) are None; every other parameter matches the loop."""
    params = all_params(model)
    got, reasons = batched(model, inputs, rows_loss, params)
    for name, why in nulls.items():
        assert got[name] is None and why in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, rows_loss, params)[0]
    rest = {n: r for n, r in ref.items() if n not in nulls and got[n] is not None}
    assert len(rest) >= len(ref) // 2, {n: reasons[n] for n in ref if got[n] is None}
    assert_matches(got, rest, reasons)


def test_t5_decoder_relative_buckets_when_the_batch_size_equals_the_decoder_length() -> None:
    """B == T_dec != T_enc: the decoder's relative-position buckets (T_dec, T_dec) were taken for rows (found
    2026-11-27: only the first input, the encoder's ids, was compared with B)."""
    tf = _quiet_transformers()
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=30, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = tf.T5ForConditionalGeneration(cfg)
    labels = torch.randint(3, 30, (4, 4))
    inputs = {"input_ids": torch.randint(3, 30, (4, 7)), "decoder_input_ids": model._shift_right(labels)}

    def rows_loss(out: object, i: int) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[0], labels[i], reduction="sum")  # type: ignore[attr-defined]

    _check(model, inputs, rows_loss, {"decoder.block.0.layer.0.SelfAttention.relative_attention_bias:weight":
                                      "made inside the forward"})  # fmt: skip
