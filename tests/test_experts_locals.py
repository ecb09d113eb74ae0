"""Local-variable taps inside transformers' experts (`MixtralExperts`): their forward dispatches to an experts
implementation (`config._experts_implementation`); only "eager" runs the forward() whose locals are tapped."""

from __future__ import annotations

import logging

import pytest
import torch

from gradrunner import capture

EXPERTS = "model.layers.0.mlp.experts"


def mixtral(impl: str) -> torch.nn.Module:
    import transformers as tf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    cfg._experts_implementation = impl
    return tf.MixtralForCausalLM(cfg)


@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
def test_a_local_the_implementation_does_not_run_says_which_ran(impl: str) -> None:
    """Found 2026-11-27: under batched_mm / grouped_mm (transformers 5.24's default), `experts:current_state` was
    'not assigned in this step (module not called, or ...)' although the module was called."""
    model = mixtral(impl)
    taps = [f"{EXPERTS}:current_state", f"{EXPERTS}:output"]
    with capture(model, taps) as cap:
        out = model(input_ids=torch.randint(0, 40, (2, 3)))
        loss = out.logits.square().mean()
        cap.backward(loss)
        recs = cap.records(loss)
    rows = [recs.row(i) for i in range(len(recs))]
    local = [r for r in rows if r["tap"] == taps[0]]
    assert all(r["has_grad"] for r in rows if r["tap"] == taps[1])
    if impl == "eager":
        assert local and all(r["has_grad"] and r["reason"] is None for r in local)
    else:
        assert len(local) == 1 and not local[0]["has_grad"]
        assert f"experts implementation {impl!r}" in local[0]["reason"] and "'eager'" in local[0]["reason"]
