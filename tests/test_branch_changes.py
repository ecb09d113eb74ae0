"""What a branch (`train.branch_from`) does with changed optimizer and scheduler keys, against plain torch.

The source runs are the MLP experiment on synthetic data, 8 steps, a checkpoint every 2 steps kept for the
replay of the spikes a low threshold flags (`anomaly.z=0.5`). Every run is `run.job.run` in-process; the
references are torch's own optimizers and schedulers over the kept state, stepped by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from conftest import compose_cfg

from gradrunner.run.build import setup
from gradrunner.run.job import run

MLP = ("+experiment=mlp", "steps=8", "device=cpu", "taps=[]")
KEEP = ("train.checkpoint_every=2", "anomaly.replay=1", "anomaly.warmup=2", "anomaly.z=0.5")
ADAMW = (*MLP, "optimizer=adamw", "optimizer.no_decay=[bias]", "optimizer.lr=0.05")


def _source(out: Path, *overrides: str) -> tuple[Path, int, dict[str, Any]]:
    """A run that keeps checkpoints; its first kept step and that step's state."""
    run(compose_cfg(*overrides, *KEEP), out_dir=out)
    kept = json.loads((out / "checkpoints" / "kept.json").read_text())
    step = min(s["step"] for s in kept["states"])
    assert step > 0
    state = torch.load(out / "checkpoints" / f"state-{step:09d}.pt", weights_only=True)
    return out, step, state


def _column(run_dir: Path, name: str) -> pd.Series:
    return pd.read_parquet(run_dir / "steps.parquet").set_index("step")[name]


def test_a_changed_weight_decay_leaves_the_no_decay_group_at_zero(tmp_path: Path) -> None:
    source, step, state = _source(tmp_path / "source", *ADAMW)
    out = tmp_path / "branch"
    run(compose_cfg(*ADAMW, "optimizer.weight_decay=0.5", f"train.branch_from={source}:{step}"), out_dir=out)
    got = _column(out, "loss")
    # plain torch: the kept weights and moments in an AdamW over (weights: 0.5, biases: 0.0), the same batches
    job = setup(compose_cfg(*MLP))
    model = job.model
    model.load_state_dict(state["model"])
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not n.endswith("bias")]},
                             {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                            lr=0.05, weight_decay=0.5)  # fmt: skip
    saved = state["optimizer"]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": s["params"]}
              for g, s in zip(opt.state_dict()["param_groups"], saved["param_groups"], strict=True)]  # fmt: skip
    opt.load_state_dict({"state": saved["state"], "param_groups": groups})
    for _ in range(step):
        next(job.batches)  # where the checkpoint left the data
    expected = []
    for _ in range(step, 8):
        x, y = next(job.batches)
        loss = job.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    assert got.index.tolist() == list(range(step, 8))
    np.testing.assert_allclose(got.to_numpy(), expected, rtol=1e-6)
    assert "optimizer.weight_decay: 0.01 -> 0.5" in json.loads((out / "branch.json").read_text())["changed"]
