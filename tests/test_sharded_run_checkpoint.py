"""Checkpoints and resume of a 2-rank torchrun job (DDP and FSDP2) through torch.distributed.checkpoint.

Every rank of the job holds at a batch after a checkpoint (`HoldAt`, below), the test SIGKILLs torchrun
and every rank at once (a lost node), and the same command with `resume=true` goes on from the
checkpoint: its records are those of an uninterrupted run, every column but the run id and timings.
Adam, so the optimizer's state (moments, step counts) has to come back through DCP too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import procs
import pytest
import torch
from conftest import cli_env
from rank_launch import gradrunner_torchrun
from warm import descendants

from gradrunner.data import Batch, Synthetic, as_batches
from gradrunner.records.checkpoint_files import CHECKPOINT_DIR, read_manifest

pytestmark = pytest.mark.slow

RUN_COLUMNS = ["run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"]
HOLD_AT = 10  # the base stream's batch 10: step 5 on both ranks (rank r draws batches r, r + 2, ...), after the
# checkpoint of 4 steps (train.checkpoint_every=2)


class HoldAt:
    """Synthetic batches; at batch `at_batch` of the stream, once per rank (a marker file per rank), wait to be killed."""

    def __init__(self, at_batch: int, marker: str, **synthetic: Any) -> None:
        self.at_batch, self.marker, self.inner = at_batch, marker, Synthetic(**synthetic)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.inner, device, dtype)):
            mine = Path(f"{self.marker}.rank{os.environ.get('RANK', '0')}")
            if i == self.at_batch and not mine.exists():
                mine.touch()
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:  # the test kills this process; a lost test does not leave it
                    time.sleep(0.05)
                raise RuntimeError("HoldAt: nobody killed this rank")
            yield batch


def _args(out: Path, marker: Path, mode: str) -> list[str]:
    return ["+experiment=mlp", "steps=8", "optimizer=adam", "optimizer.lr=0.01", f"train.parallel={mode}",
            "train.checkpoint_every=2", "taps=[fc1:output,relu2:output,head:output]",
            f"data._target_={__name__}.HoldAt", f"+data.at_batch={HOLD_AT}", f"+data.marker={marker}",
            f"hydra.run.dir={out}"]  # fmt: skip


def _records(out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    key = ["step", "rank"]
    grads = pd.read_parquet(out / "grads.parquet").drop(columns=RUN_COLUMNS, errors="ignore")
    steps = pd.read_parquet(out / "steps.parquet").drop(columns=RUN_COLUMNS, errors="ignore")
    return (grads.sort_values([*key, "tap", "call"]).reset_index(drop=True),
            steps.sort_values(key).reset_index(drop=True))  # fmt: skip


def _kill_when_held(cwd: Path, args: list[str], marker: Path) -> None:
    """Start the job; once both ranks hold, SIGKILL torchrun and every rank together; none is left."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "gradrunner",
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    held = [Path(f"{marker}.rank{r}") for r in (0, 1)]
    try:
        deadline = time.monotonic() + 300
        while not all(p.exists() for p in held) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in held), f"the ranks never held (exit {proc.poll()})"
    finally:
        group = [*descendants(proc.pid), proc.pid]
        for pid in group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 60
        while [p for p in group if procs.running(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in group if procs.running(p)], "a rank outlived the kill"
    assert proc.returncode == -signal.SIGKILL, err[-2000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_sigkilled_rank_group_resumes_to_the_uninterrupted_records(tmp_path: Path, mode: str) -> None:
    ref, out = tmp_path / "ref", tmp_path / "killed"
    (tmp_path / "never.rank0").touch()
    (tmp_path / "never.rank1").touch()  # the reference never holds
    result = gradrunner_torchrun(tmp_path, *_args(ref, tmp_path / "never", mode))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (ref / CHECKPOINT_DIR).exists()  # removed once the records were closed

    _kill_when_held(tmp_path, _args(out, tmp_path / "held", mode), tmp_path / "held")
    manifest, problem = read_manifest(out)
    assert manifest is not None, problem
    assert manifest["step"] == 4 and manifest["world_size"] == 2
    folder = out / CHECKPOINT_DIR
    assert [e["name"] for e in manifest["ranks"]] == ["state-000000004.rank0.pt", "state-000000004.rank1.pt"]
    assert sorted(p.name for p in (folder / manifest["dcp"]["name"]).iterdir()) == sorted(
        e["name"] for e in manifest["dcp"]["files"]
    )
    assert not (out / "done.json").exists()

    again = gradrunner_torchrun(tmp_path, *_args(out, tmp_path / "held", mode), "resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "[rank 0] resumed from the checkpoint" in said and "[rank 1] resumed from the checkpoint" in said
    assert "steps 0-3 replayed from it" in said
    want, got = _records(ref), _records(out)
    pd.testing.assert_frame_equal(got[1], want[1])  # loss, grad_norm, lr, update norms of every step and rank
    pd.testing.assert_frame_equal(got[0], want[0])
    assert len(want[0]) == 8 * 2 * 3 and (out / "done.json").exists() and not folder.exists()
