"""`optimizer=adamw` and `optimizer.no_decay` (issue 36 item 17), against the HF Trainer's own decay rule.

The reference is a plain AdamW loop over a GPT-2 from `transformers`, its parameter groups from
`Trainer.get_decay_parameter_names` (biases and LayerNorm parameters undecayed): code nobody here wrote.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import compose_cfg
from torch import nn

from gradrunner.errors import GradrunnerError
from gradrunner.run.build import setup
from gradrunner.run.loop import train
from gradrunner.run.param_groups import decay_groups, is_norm, no_decay_names

transformers = pytest.importorskip("transformers")

NO_DROPOUT = ["+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0", "+model.config.attn_pdrop=0"]


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=100, bos_token_id=0,
                                     eos_token_id=0, use_cache=False, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _reference_losses(weights: Path, decayed: set[str] | None, steps: int) -> list[float]:
    model = _gpt2()
    model.load_state_dict(torch.load(weights, weights_only=True))
    names = dict(model.named_parameters())
    if decayed is None:
        groups = [{"params": list(names.values())}]
    else:
        groups = [{"params": [p for n, p in names.items() if n in decayed]},
                  {"params": [p for n, p in names.items() if n not in decayed], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.5)
    ids = torch.randint(0, 100, (8, 4, 16), generator=torch.Generator().manual_seed(0))  # data=tokens, seed 0
    losses = []
    for step in range(steps):
        batch = ids[step % 8]
        loss = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_adamw_skips_biases_and_norms_as_the_hf_trainer_does(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = _gpt2()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    hf = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    assert no_decay_names(model, ["bias", "norm"]) == set(dict(model.named_parameters())) - hf
    cfg = compose_cfg("+experiment=gpt2", "optimizer=adamw", "optimizer.lr=0.01", "optimizer.weight_decay=0.5", "steps=6",
                      f"+model.init_from={tmp_path / 'init.pt'}", "taps=[]", "device=cpu", *NO_DROPOUT)  # fmt: skip
    train(cfg, out_dir=tmp_path / "run")
    got = pd.read_parquet(tmp_path / "run" / "steps.parquet")["loss"].to_numpy()
    np.testing.assert_allclose(got, _reference_losses(tmp_path / "init.pt", hf, 6), rtol=1e-6)
    everything = _reference_losses(tmp_path / "init.pt", None, 6)  # decaying every parameter is another run
    assert not np.allclose(got[-1], everything[-1], rtol=1e-6, atol=0)


def test_no_decay_groups_and_globs() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert [is_norm(m) for m in model] == [False, True, False]
    (decay, plain) = decay_groups(model, ["bias", "norm", "0.*"])
    assert [p.shape for p in decay["params"]] == [torch.Size([2, 4])] and "weight_decay" not in decay
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 4  # embedding, LayerNorm weight and bias, Linear bias
    assert len(decay_groups(model, [])) == 1  # nothing skipped: one group


def test_a_no_decay_that_selects_nothing_is_refused_before_step_0(tmp_path: Path) -> None:
    cfg = compose_cfg("+experiment=mlp", "optimizer=adamw", "optimizer.no_decay=[bias,norm]", "taps=[]")
    with pytest.raises(GradrunnerError, match=r"optimizer.no_decay entry 'norm' selects no parameter of MLP"):
        setup(cfg)
    job = setup(compose_cfg("+experiment=mlp", "optimizer=adamw", "optimizer.no_decay=[bias]", "taps=[]"))
    assert [g["weight_decay"] for g in job.optimizer.param_groups] == [0.01, 0.0]
    assert len(job.optimizer.param_groups[1]["params"]) == 4  # the MLP's four biases


def test_a_module_path_holding_glob_characters_is_that_path_first() -> None:
    """`nn.ModuleDict` keys may hold `?`, `*`, `[`: such a name selects itself, as a tap on it does
    (`capturing.taps.is_glob`); `train.shard` reads its globs the same way."""
    from gradrunner.run.parallel import shard_targets

    model = nn.Module()
    model.blocks = nn.ModuleDict({"q?": nn.Linear(2, 2), "qa": nn.Linear(2, 2), "x[0]": nn.Linear(2, 2)})
    assert no_decay_names(model, ["blocks.q?.weight"]) == {"blocks.q?.weight"}
    assert no_decay_names(model, ["blocks.[q]?.weight"]) == {"blocks.q?.weight", "blocks.qa.weight"}  # the glob reading
    assert no_decay_names(model, ["blocks.x[0].bias"]) == {"blocks.x[0].bias"}
    assert shard_targets(model, ["blocks.q?"]) == ["blocks.q?"]
    assert shard_targets(model, ["blocks.x[0]"]) == ["blocks.x[0]"]
    assert sorted(shard_targets(model, ["blocks.[q]?"])) == ["blocks.q?", "blocks.qa"]
