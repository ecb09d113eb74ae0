"""`scheduler=warmup_cosine` (issue 36 item 6): warm-up, then cosine decay to min_ratio x lr AT the last step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import compose_cfg

from gradrunner.run.loop import train


def _nanogpt_lr(it: int, lr: float, warmup: int, decay_iters: int, min_lr: float) -> float:
    """nanoGPT's get_lr, written out: linear warm-up, cosine decay until `decay_iters`, then min_lr."""
    if it < warmup:
        return lr * (it + 1) / warmup
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@pytest.mark.parametrize("steps, warmup", [(8, 2), (5, 1), (12, 0)])
def test_warmup_cosine_reaches_min_ratio_at_the_last_step(tmp_path: Path, steps: int, warmup: int) -> None:
    cfg = compose_cfg("+experiment=mlp", f"steps={steps}", "scheduler=warmup_cosine", "optimizer.lr=0.2",
                      f"scheduler.lr_lambda.warmup_steps={warmup}", "scheduler.lr_lambda.min_ratio=0.1", "taps=[]",
                      "device=cpu")  # fmt: skip
    train(cfg, out_dir=tmp_path)
    lr = pd.read_parquet(tmp_path / "steps.parquet")["lr"].to_numpy()
    assert lr[-1] == pytest.approx(0.1 * 0.2, rel=1e-12)  # the README's promise: min_ratio x lr at the last step
    expected = [_nanogpt_lr(i, 0.2, warmup, steps - 1, 0.02) for i in range(steps)]
    np.testing.assert_allclose(lr, expected, rtol=1e-12)
    assert lr.max() == pytest.approx(0.2, rel=1e-12)  # and the peak is reached
