"""`train.eval_every` (issue 36 items 1, 2): a fixed held-out set, the same batches every evaluation.

The reference is written here in plain torch: the synthetic task's teacher and its held-out inputs
drawn from `seed + 1000000` as the README says, an SGD loop over the training batches, the held-out
batches' MSE in eval mode after each evaluated step.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from awkward import two_batches
from conftest import compose_cfg
from torch import nn

from gradrunner.models import MLP
from gradrunner.run.build import setup
from gradrunner.run.loop import train

SHAPE = {"in_features": 8, "hidden": 8, "depth": 2, "out_features": 1}


def _weights(tmp_path: Path) -> Path:
    torch.manual_seed(7)
    path = tmp_path / "init.pt"
    torch.save(MLP(**SHAPE).state_dict(), path)
    return path


def _mlp_run(tmp_path: Path, *overrides: str, steps: int = 6) -> pd.DataFrame:
    cfg = compose_cfg(
        "+experiment=mlp", f"steps={steps}", f"+model.init_from={_weights(tmp_path)}", "model.hidden=8", "model.depth=2",
        "taps=[fc1:output]", "device=cpu", "data.batch_size=16", "data.num_samples=64", *overrides,
    )  # fmt: skip
    out = tmp_path / "run"
    train(cfg, out_dir=out)
    return pd.read_parquet(out / "steps.parquet")


def _synthetic(seed: int, teacher_seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression as the README describes it: inputs N(0, 1), targets x @ teacher + 0.1 noise."""
    gen = torch.Generator().manual_seed(teacher_seed)
    x_train = torch.randn((n, 8), generator=gen, dtype=torch.float64)
    teacher = torch.randn((8, 1), generator=gen, dtype=torch.float64) / math.sqrt(8)
    if seed == teacher_seed:
        x, noise_gen = x_train, gen
    else:
        noise_gen = torch.Generator().manual_seed(seed)
        x = torch.randn((n, 8), generator=noise_gen, dtype=torch.float64)
    y = x @ teacher + 0.1 * torch.randn((n, 1), generator=noise_gen, dtype=torch.float64)
    return x.float(), y.float()


def test_default_eval_set_is_fixed_held_out_data_from_another_seed(tmp_path: Path) -> None:
    steps = _mlp_run(tmp_path, "train.eval_every=2", "train.eval_batches=2", "optimizer.lr=0.05")
    model = MLP(**SHAPE)
    model.load_state_dict(torch.load(tmp_path / "init.pt", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _synthetic(0, 0)
    xe, ye = _synthetic(1_000_000, 0)  # the same teacher, other inputs and noise
    expected = []
    for step in range(6):
        b = slice((step % 4) * 16, (step % 4 + 1) * 16)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[b]), y[b]).backward()
        opt.step()
        with torch.no_grad():
            held = [nn.functional.mse_loss(model(xe[i * 16 : (i + 1) * 16]), ye[i * 16 : (i + 1) * 16]).double() for i in (0, 1)]
        expected.append(float(sum(held)) / 2 if step % 2 == 1 else math.nan)
    np.testing.assert_allclose(steps["eval_loss"], expected, rtol=1e-5)
    assert steps["eval_loss"].iloc[5] < steps["eval_loss"].iloc[1]  # it learns the teacher, not the training set


def test_eval_loss_does_not_move_when_the_model_does_not(tmp_path: Path) -> None:
    steps = _mlp_run(tmp_path, "train.eval_every=1", "train.eval_batches=3", "optimizer.lr=0", steps=5)
    assert steps["eval_loss"].notna().all()
    assert steps["eval_loss"].nunique() == 1, steps["eval_loss"].tolist()  # the same batches every time
    assert steps["loss"].nunique() > 1  # while the training batches change


@pytest.mark.parametrize("experiment", ["mlp", "gpt2", "gpt2_pretrain"])
def test_eval_every_runs_on_every_builtin_data_source_that_interpolates_seed(tmp_path: Path, experiment: str) -> None:
    if experiment.startswith("gpt2"):
        pytest.importorskip("transformers")
    cfg = compose_cfg(f"+experiment={experiment}", "steps=2", "train.eval_every=1", "device=cpu", "taps=[]",
                      "train.checkpoint_every=0")  # fmt: skip
    out = tmp_path / "run"
    train(cfg, out_dir=out)
    eval_loss = pd.read_parquet(out / "steps.parquet")["eval_loss"]
    assert eval_loss.notna().all() and (eval_loss > 0).all()


def test_eval_data_may_interpolate_seed(tmp_path: Path) -> None:
    steps = _mlp_run(tmp_path, "train.eval_every=1", "optimizer.lr=0",
                     "+eval_data={_target_: gradrunner.data.Synthetic, num_samples: 64, batch_size: 16, seed: '${seed}'}",
                     steps=2)  # fmt: skip
    model = MLP(**SHAPE)
    model.load_state_dict(torch.load(tmp_path / "init.pt", weights_only=True))
    x, y = _synthetic(0, 0)  # eval_data with seed=${seed}: the training data's own first batch
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x[:16]), y[:16]).item()
    np.testing.assert_allclose(steps["eval_loss"], [expected] * 2, rtol=1e-6)


def test_evaluation_changes_nothing_of_training(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    runs = []
    for i, extra in enumerate([[], ["train.eval_every=1", "train.eval_batches=2"]]):
        cfg = compose_cfg("+experiment=gpt2", "steps=3", "device=cpu", "taps=[lm_head:output]",
                          "+model.config.resid_pdrop=0.5", *extra)  # fmt: skip  dropout draws from torch's RNG
        train(cfg, out_dir=tmp_path / str(i))
        runs.append(pd.read_parquet(tmp_path / str(i) / "grads.parquet"))
    assert runs[0]["norm"].tolist() == runs[1]["norm"].tolist()
    assert runs[0]["loss"].tolist() == runs[1]["loss"].tolist()


def test_a_source_without_held_out_data_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_cfg("+experiment=mlp", "steps=1", "data=tensors", "model.in_features=1", "train.eval_every=1",
                      "taps=[]", "device=cpu")  # fmt: skip
    with caplog.at_level(logging.INFO):
        train(cfg, out_dir=tmp_path / "run")
    assert "offers no held-out examples (no held_out(seed) method)" in caplog.text
    assert "the training data as configured (no seed key to change)" in caplog.text  # Tensors has no seed
    assert "rebuilt" not in caplog.text
    assert "evaluation every 1 steps on a fixed set of 1 batch(es)" in caplog.text


def test_evaluation_leaves_a_block_the_model_keeps_in_eval_mode_in_eval_mode(tmp_path: Path) -> None:
    frozen = ("+experiment=mlp", "steps=4", "device=cpu", "model._target_=awkward.FrozenBackbone", "taps=[head:output]")
    cfg = compose_cfg(*frozen, "train.eval_every=2")
    job = setup(cfg)  # with the eval set's check before step 0
    assert job.model.training and not any(m.training for m in job.model.backbone.modules())
    train(cfg, out_dir=tmp_path / "run")
    got = pd.read_parquet(tmp_path / "run" / "steps.parquet")["loss"].tolist()
    # plain torch over the same weights, batches and optimizer, no evaluation: the backbone's BatchNorm uses its
    # running statistics and its Dropout is off at every step
    ref_job = setup(compose_cfg(*frozen, "train.eval_every=0"))
    model, opt, expected = ref_job.model, ref_job.optimizer, []
    for _ in range(4):
        x, y = next(ref_job.batches)
        loss = ref_job.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _init_model(tmp_path: Path) -> MLP:
    model = MLP(**SHAPE)
    model.load_state_dict(torch.load(tmp_path / "init.pt", weights_only=True))
    return model.eval()


def test_eval_data_with_fewer_batches_than_asked_is_read_once_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        steps = _mlp_run(tmp_path, "train.eval_every=1", "train.eval_batches=3", "optimizer.lr=0",
                         "+eval_data._target_=awkward.two_batches", steps=1)  # fmt: skip
    model = _init_model(tmp_path)
    with torch.no_grad():  # plain torch: each of the two batches once
        expected = float(np.mean([nn.functional.mse_loss(model(x), y).item() for x, y in two_batches()]))
    np.testing.assert_allclose(steps["eval_loss"], [expected], rtol=1e-6)
    assert "train.eval_batches=3, but the evaluation data (list) holds 2 batch(es) in one pass" in caplog.text
    assert "on a fixed set of 2 batch(es)" in caplog.text


def test_the_held_out_set_is_one_epoch_at_most(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):  # 64 held-out examples in batches of 16: 4 batches, 6 asked
        steps = _mlp_run(tmp_path, "train.eval_every=1", "train.eval_batches=6", "optimizer.lr=0", steps=1)
    model = _init_model(tmp_path)
    xe, ye = _synthetic(1_000_000, 0)
    with torch.no_grad():
        expected = float(np.mean([nn.functional.mse_loss(model(xe[i : i + 16]), ye[i : i + 16]).item()
                                  for i in range(0, 64, 16)]))  # fmt: skip
    np.testing.assert_allclose(steps["eval_loss"], [expected], rtol=1e-6)
    assert "holds 4 batch(es) in one pass" in caplog.text


def test_a_wrapped_sources_seed_is_reseeded_and_named(caplog: pytest.LogCaptureFixture) -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    cfg = compose_cfg("+experiment=cnn", "steps=1", "device=cpu", "train.eval_every=1", "data=corrupted",
                      "data.at_batch=1000", "~data.inner",
                      "+data.inner={_target_: gradrunner.data.Digits, batch_size: 64, shuffle: true, seed: '${seed}'}")  # fmt: skip
    with caplog.at_level(logging.INFO):
        job = setup(cfg)
    assert "(its held_out is None)" in caplog.text and "rebuilt with data.inner.seed=1000000" in caplog.text
    # the digits shuffled with the held-out seed, as the log says: not the first batch training sees
    digits = datasets.load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(1_000_000))[:64]
    expected = torch.as_tensor(digits.images, dtype=torch.float32)[order] / 16.0
    assert torch.equal(job.eval_set[0][0].squeeze(1), expected)
    assert not torch.equal(job.eval_set[0][0], next(job.batches)[0])


def test_a_token_source_eval_set_holds_each_of_its_batches_once(caplog: pytest.LogCaptureFixture) -> None:
    """data=tokens cycles `num_batches` distinct batches: asked for more, the set is those once, with the warning
    (the held-out batches were drawn again, the first two counted twice in eval_loss, without a word)."""
    pytest.importorskip("transformers")
    cfg = compose_cfg("+experiment=gpt2", "steps=1", "device=cpu", "train.eval_every=1", "train.eval_batches=6",
                      "data.num_batches=4")  # fmt: skip
    with caplog.at_level(logging.INFO):
        job = setup(cfg)
    # plain torch: Tokens' held-out ids, (num_batches, batch_size, seq_len) drawn from seed + 1000000
    expected = torch.randint(0, 100, (4, 4, 16), generator=torch.Generator().manual_seed(1_000_000))
    assert [b[0]["input_ids"].tolist() for b in job.eval_set] == expected.tolist()
    assert "train.eval_batches=6, but the evaluation data (Tokens) holds 4 batch(es) in one pass" in caplog.text


def test_a_literal_batch_eval_set_holds_it_once(caplog: pytest.LogCaptureFixture) -> None:
    """data=tensors is one batch repeated: the set is that batch once, with the warning, not three copies."""
    cfg = compose_cfg("+experiment=cosine", "steps=1", "device=cpu", "train.eval_every=1", "train.eval_batches=3")
    with caplog.at_level(logging.INFO):
        job = setup(cfg)
    assert len(job.eval_set) == 1
    assert job.eval_set[0][0].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]  # the experiment's inputs
    assert "holds 1 batch(es) in one pass" in caplog.text and "on a fixed set of 1 batch(es)" in caplog.text
