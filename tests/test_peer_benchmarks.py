"""benchmarks/peers.py and gpu_realistic.py: the variants they compare, and the statistics they give the peers."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import python_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

pytest.importorskip("transformers")


def test_peer_reductions_are_the_seven_gradrunner_reads() -> None:
    from peers import reductions

    g = torch.tensor([[1.5, -2.0, 0.0], [-0.0, float("inf"), 3.0]])
    d = g.double().numpy()
    got = reductions(g).tolist()
    assert got[0] == float(d.sum()) and math.isinf(got[1])
    assert got[2:] == [-2.0, float("inf"), 4.0, 0.0, 1.0]
    g = torch.randn(50, 7, dtype=torch.float32)
    d = g.double().numpy()
    got = reductions(g).tolist()
    assert got[0] == pytest.approx(d.sum(), rel=1e-12) and got[1] == pytest.approx((d * d).sum(), rel=1e-6)


def test_gpu_realistic_taps_every_block_part_and_parameter() -> None:
    from gpu_realistic import taps_for
    from peers import gpt2

    from gradrunner.capturing.taps import resolve_taps

    model = gpt2(3, 16, 2, 50, 8, "cpu")
    taps = taps_for(model)
    assert len(resolve_taps(model, taps)) == len(taps) == 3 * 3 + len(list(model.parameters()))
    assert "transformer.h.2.attn:output.0" in taps and "transformer.wte:weight" in taps


def _run(script: str, tmp_path: Path) -> dict[str, dict[str, object]]:
    out = tmp_path / "result.json"
    # `python benchmarks/<script> --tiny` inside this process (conftest.python_script), as test_benchmarks runs them
    done = python_script(tmp_path, BENCHMARKS / script, "--tiny", "--out", str(out), env={"WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-2000:]
    return {r["variant"]: r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.slow
def test_peers_tiny_compares_gradrunner_plain_hooks_and_installed_peers(tmp_path: Path) -> None:
    rows = _run("peers.py", tmp_path)
    for name in ("none", "gradrunner", "plain_hooks"):
        assert np.isfinite(rows[name]["ratio"]), rows[name]
    assert ("nnsight" in rows and "skipped" not in rows["nnsight"]) == (importlib.util.find_spec("nnsight") is not None)
    assert "skipped" in rows["transformer_lens"] or importlib.util.find_spec("transformer_lens") is not None


@pytest.mark.slow
def test_gpu_realistic_tiny_runs_every_strategy_on_cpu(tmp_path: Path) -> None:
    rows = _run("gpu_realistic.py", tmp_path)
    assert {"none", "hook", "retain_grad", "autograd_grad", "plain_hooks"} <= set(rows)
