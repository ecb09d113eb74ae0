"""The dropout / noise draw as the README documents it reproduces the records (issue 36 item 18).

The README's recipe block is run as written (after the command it names); then the same documented
rule is checked where it is least obvious: two random edits on one tap, under gradient accumulation.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import check_ok, compose_cfg, gradrunner_in_process

from gradrunner.capturing.edits import generator_seed
from gradrunner.run.loop import train

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_recipe_reproduces_a_dropout_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    found = re.search(r"<!-- doc-test: before python -m gradrunner (.*?) -->\n```python\n(.*?)```", text[text.index("**Seeded**"):], re.S)
    assert found is not None and "generator_seed(" in found.group(2)
    check_ok(gradrunner_in_process(tmp_path, *[a.strip("'") for a in re.findall(r"'[^']*'|\S+", found.group(1))]))
    monkeypatch.chdir(tmp_path)
    exec(compile(found.group(2), "README.md", "exec"), {})  # asserts the record's edited_norm


def _documented(g: torch.Tensor, seed: int, step: int, key: str, call: int, op: str, v: float) -> torch.Tensor:
    """The README's rule, written out."""
    gen = torch.Generator(device=g.device).manual_seed(generator_seed(seed, step, key, call))
    if op == "dropout":
        u = torch.rand(g.shape, generator=gen, device=g.device, dtype=torch.float32)
        return torch.where(u >= v, g * (1 / (1 - v)), torch.zeros((), dtype=g.dtype))
    n = torch.randn(g.shape, generator=gen, device=g.device, dtype=torch.float32)
    return g + v * n.to(g.dtype)


def test_two_random_edits_under_accumulation_follow_the_documented_draw(tmp_path: Path) -> None:
    edits = '[{tap: "relu2:output", dropout: 0.3}, {tap: "fc1:output", scale: 1.0}, {tap: "relu2:output", noise_std: 0.01}]'
    cfg = compose_cfg("+experiment=mlp", "steps=3", "seed=4", "train.accumulate=2", "capture.values=full",
                      "taps=[relu2:output]", f"edits={edits}", "device=cpu")  # fmt: skip
    train(cfg, out_dir=tmp_path)
    df = pd.read_parquet(tmp_path / "grads.parquet").query("tap == 'relu2:output'")
    assert len(df) == 6 and df.edited.all()  # 3 steps x 2 micro-batches
    for r in df.itertuples():
        g = torch.tensor(r.values).reshape(*r.shape)
        backward = r.step * 2 + int(r.micro_step)  # the session's backward count
        edited = _documented(g, 4, backward, "relu2:output", 0, "dropout", 0.3)
        edited = _documented(edited, 4, backward, "relu2:output#2", 0, "noise_std", 0.01)  # entry 2 in edits
        assert float(edited.norm()) == pytest.approx(r.edited_norm, rel=1e-6), (r.step, r.micro_step)
    assert np.isfinite(df.edited_norm).all()
