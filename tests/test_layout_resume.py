"""A sweep written before the package moved into layers (commit a8c2a3e) still resumes and loads.

`tests/data/sweep_before_layers` is a real two-job sweep (`+experiment=cosine steps=2
capture.strategy=hook,retain_grad`) written by the old layout; its `done.json` and `.hydra/` files
store the `_target_` paths of that time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import check_ok, gradrunner_in_process

from gradrunner.analysis import load

OLD_SWEEP = Path(__file__).parent / "data" / "sweep_before_layers"


def _fingerprint(job: Path) -> dict[str, tuple[int, int]]:
    return {n: ((job / n).stat().st_ino, (job / n).stat().st_mtime_ns) for n in ("grads.parquet", "steps.parquet")}


@pytest.mark.slow
def test_a_sweep_from_the_old_layout_resumes_running_only_the_new_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The shipped old jobs were computed on the CPU: device=auto must pick it here too (a GPU's sums differ in
    # their last bits; seen on an H100)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sweep = tmp_path / "sw"
    shutil.copytree(OLD_SWEEP, sweep)
    before = {job: _fingerprint(sweep / job) for job in ("0", "1")}
    result = gradrunner_in_process(tmp_path, "-m", "hydra.sweep.dir=sw", "+experiment=cosine", "steps=2",
                        "capture.strategy=hook,retain_grad,autograd_grad")  # fmt: skip
    check_ok(result)
    assert {job: _fingerprint(sweep / job) for job in ("0", "1")} == before  # completed jobs untouched
    df = load(sweep)
    assert sorted(df["strategy"].unique()) == ["autograd_grad", "hook", "retain_grad"]
    assert df.groupby("strategy").size().nunique() == 1  # the same rows per job
    old_model = df.loc[df.strategy == "hook", ["step", "tap", "call", "norm"]].reset_index(drop=True)
    new_model = df.loc[df.strategy == "autograd_grad", ["step", "tap", "call", "norm"]].reset_index(drop=True)
    assert old_model.equals(new_model)  # the old job's gradients are the new code's gradients
