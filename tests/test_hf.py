"""HuggingFace models from config, no glue: data=tokens, loss=model_loss / lm_cross_entropy, +experiment=gpt2."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_ok, compose_cfg, gradrunner_in_process

from gradrunner.analysis import compare_strategies, load
from gradrunner.cli.explore import listing
from gradrunner.data import Tokens
from gradrunner.errors import GradrunnerError
from gradrunner.losses import LMCrossEntropy, ModelLoss

transformers = pytest.importorskip("transformers")

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=100,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def first_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs, labels = next(Tokens(vocab_size=100, seq_len=16, batch_size=4, seed=0).batches(torch.device("cpu"), torch.float32))
    return inputs, labels


def test_model_loss_is_the_outputs_own_loss_and_lm_cross_entropy_shifted_equals_it() -> None:
    model = tiny_gpt2()
    inputs, labels = first_batch()
    out = model(**inputs)
    assert ModelLoss()(out, labels) is out.loss
    # the causal LM loss by hand: position t predicts token t+1
    logits = out.logits[:, :-1].reshape(-1, 100)
    by_hand = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
    torch.testing.assert_close(LMCrossEntropy(shift=True)(out, labels), by_hand)
    torch.testing.assert_close(LMCrossEntropy(shift=True)(out, labels), out.loss)
    unshifted = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 100), labels.reshape(-1))
    torch.testing.assert_close(LMCrossEntropy()(out.logits, labels), unshifted)


def test_losses_that_cannot_take_the_output_say_what_it_holds() -> None:
    with pytest.raises(GradrunnerError, match=r"needs the model's output to have \.loss.*'logits'.*labels"):
        ModelLoss()({"logits": torch.zeros(1, 2, 3)}, None)
    with pytest.raises(GradrunnerError, match=r"logits of shape \(2, 3\) do not fit labels of shape \(2, 3\)"):
        LMCrossEntropy()(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))


def test_the_gpt2_experiment_lists_its_taps_with_dict_inputs() -> None:
    modules = {m.path: m for m in listing(compose_cfg("+experiment=gpt2")).modules}
    root = modules[""]
    assert [(s.name, s.shape) for s in root.outputs] == [("output.loss", []), ("output.logits", [4, 16, 100])]
    assert [s.name for s in root.inputs] == ["input.input_ids", "input.attention_mask", "input.labels"]
    assert [(s.name, s.shape) for s in modules["transformer.h.0.mlp"].locals] == [("hidden_states", [4, 16, 256])]  # c_fc's, first
    assert modules["transformer.h.1.attn"].outputs[0].shape == [4, 16, 64]


@pytest.mark.slow
def test_a_three_strategy_gpt2_sweep_agrees_and_its_first_loss_is_the_models_own(tmp_path: Path) -> None:
    check_ok(gradrunner_in_process(tmp_path, "-m", "+experiment=gpt2", f"capture.strategy={','.join(STRATEGIES)}", "steps=2"))
    df = load(next(tmp_path.glob("multirun/*/*")))
    assert sorted(df.strategy.unique()) == sorted(STRATEGIES)
    assert df.has_grad.all() and df.groupby("strategy").size().nunique() == 1
    assert {"transformer.h.1.mlp:hidden_states", "transformer.wte:weight", "lm_head:output"} <= set(df.tap)
    assert df.groupby(["strategy", "step", "tap"])["call"].max().max() == 3  # hidden_states: 4 assignments
    cmp = compare_strategies(df)
    worst = cmp[cmp.stat.isin(["norm", "abs_max"])].rel_diff.max()
    assert worst < 1e-4, cmp.sort_values("rel_diff").tail()
    model = tiny_gpt2()
    inputs, _ = first_batch()
    reference = float(model(**inputs).loss.detach())
    losses = df[df.step == 0].groupby("strategy")["loss"].first()
    np.testing.assert_allclose(losses.to_numpy(), reference, rtol=1e-5)


LLAMA = """\
    _target_: transformers.LlamaForCausalLM
    config:
      _target_: transformers.LlamaConfig
      vocab_size: 100
      hidden_size: 32
      intermediate_size: 64
      num_hidden_layers: 2
      num_attention_heads: 4
      num_key_value_heads: 2
      max_position_embeddings: 64
      bos_token_id: 0
      eos_token_id: 0
      pad_token_id: 0
      use_cache: false
"""
BERT = """\
    _target_: transformers.BertForMaskedLM
    config:
      _target_: transformers.BertConfig
      vocab_size: 100
      hidden_size: 32
      intermediate_size: 64
      num_hidden_layers: 2
      num_attention_heads: 4
      max_position_embeddings: 64
"""
EXPERIMENT = """\
    # @package _global_
    defaults:
      - override /model: {name}
      - override /data: tokens
      - override /loss: {loss}
      - override /optimizer: adam
    experiment: {name}
    steps: 2
    taps: {taps}
"""


@pytest.mark.slow
def test_llama_and_bert_from_a_user_config_dir_run_the_same_way(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    for group in ("model", "experiment"):
        (conf / group).mkdir(parents=True)
    (conf / "model" / "tiny_llama.yaml").write_text(textwrap.dedent(LLAMA))
    (conf / "model" / "tiny_bert.yaml").write_text(textwrap.dedent(BERT))
    llama_taps = '["model.layers.*.mlp:output", "model.layers.*.self_attn:output.0", "lm_head:output"]'
    bert_taps = '["bert.encoder.layer.?.output.dense:output", "cls.predictions.decoder:output"]'
    for name, loss, taps in (("tiny_llama", "model_loss", llama_taps), ("tiny_bert", "lm_cross_entropy", bert_taps)):
        text = textwrap.dedent(EXPERIMENT).format(name=name, loss=loss, taps=taps)
        (conf / "experiment" / f"{name}.yaml").write_text(text)
    result = gradrunner_in_process(tmp_path, "-m", "--config-dir", str(conf), "+experiment=tiny_llama,tiny_bert")
    check_ok(result)
    df = load(next(tmp_path.glob("multirun/*/*")))
    assert set(df.experiment) == {"tiny_llama", "tiny_bert"}
    counts = df.groupby("experiment").tap.nunique().to_dict()
    assert counts == {"tiny_llama": 5, "tiny_bert": 3}
    assert df.has_grad.all() and np.isfinite(df.norm).all() and (df.norm > 0).all()
