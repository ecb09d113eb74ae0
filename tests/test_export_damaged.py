"""Export verifies what it reads (issue 38 item 4): seeded damaged, foreign and partial run dirs.

A sweep of three completed jobs is copied and its job 1 damaged in one of `DAMAGES`' ways at seeded
positions; then `python -m gradrunner.export` runs on it, refusing (the default) and with
`--on-damaged skip`. Every export must end in exit 0 or 2 with no traceback, and never be silently
wrong: what it wrote for a job is what the undamaged job exports (read back with TensorBoard's own
`EventAccumulator`, an MLflow file store, W&B's offline files), and a job it did not write is named
on stderr. Damage to the records themselves is refused by name.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import compose_cfg

from gradrunner import export
from gradrunner.run.job import run

JOBS = ("0", "1", "2")
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three completed jobs (one with accumulation, one with histograms) and, beside them, a foreign job."""
    root = tmp_path_factory.mktemp("damage")
    extra = {"0": [], "1": ["train.accumulate=2"], "2": ["capture.histogram=true"], "foreign": ["seed=9"]}
    for name, more in extra.items():
        cfg = compose_cfg("+experiment=mlp", "steps=3", "model.depth=2", "device=cpu", *more)
        run(cfg, out_dir=root / ("sweep" if name != "foreign" else "") / name)
    return root


def _flip(path: Path, rng: random.Random, lo: float, hi: float) -> None:
    data = bytearray(path.read_bytes())
    at = rng.randrange(int(len(data) * lo), max(int(len(data) * hi), int(len(data) * lo) + 1))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _footer_flip(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[-8:-4], "little")
    at = rng.randrange(len(data) - 8 - length, len(data) - 8)
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def _marker(job: Path, **change: object) -> None:
    done = json.loads((job / "done.json").read_text())
    done.update(change)
    (job / "done.json").write_text(json.dumps(done))


#: name -> damage(job dir, rng, foreign job dir); each leaves job 1 of the copy damaged.
DAMAGES: dict[str, Callable[[Path, random.Random, Path], None]] = {
    "grads page flip": lambda j, r, f: _flip(j / "grads.parquet", r, 0.05, 0.6),
    "grads footer flip": lambda j, r, f: _footer_flip(j / "grads.parquet", r),
    "steps page flip": lambda j, r, f: _flip(j / "steps.parquet", r, 0.05, 0.6),
    "steps footer flip": lambda j, r, f: _footer_flip(j / "steps.parquet", r),
    "grads truncated": lambda j, r, f: os.truncate(j / "grads.parquet", int((j / "grads.parquet").stat().st_size * r.uniform(0.1, 0.95))),
    "steps truncated": lambda j, r, f: os.truncate(j / "steps.parquet", int((j / "steps.parquet").stat().st_size * r.uniform(0.1, 0.95))),
    "grads empty": lambda j, r, f: (j / "grads.parquet").write_bytes(b""),
    "grads garbage": lambda j, r, f: (j / "grads.parquet").write_bytes(r.randbytes((j / "grads.parquet").stat().st_size)),
    "grads foreign": lambda j, r, f: shutil.copy(f / "grads.parquet", j / "grads.parquet"),
    "steps foreign": lambda j, r, f: shutil.copy(f / "steps.parquet", j / "steps.parquet"),
    "grads missing": lambda j, r, f: (j / "grads.parquet").unlink(),
    "steps missing": lambda j, r, f: (j / "steps.parquet").unlink(),
    "grads fewer rows": lambda j, r, f: pd.read_parquet(j / "grads.parquet").iloc[: r.randrange(1, 20)].to_parquet(j / "grads.parquet"),
    "grads foreign schema": lambda j, r, f: pd.DataFrame({"a": [1.0, 2.0]}).to_parquet(j / "grads.parquet"),
    "grads is a dir": lambda j, r, f: ((j / "grads.parquet").unlink(), (j / "grads.parquet").mkdir()) and None,
    "done missing": lambda j, r, f: (j / "done.json").unlink(),
    "done garbage": lambda j, r, f: (j / "done.json").write_bytes(r.randbytes(40)),
    "done other run id": lambda j, r, f: _marker(j, run_id="0" * 32),
    "failed job": lambda j, r, f: ((j / "done.json").unlink(), (j / "failed.json").write_text('{"error": "boom"}')) and None,
    "overrides garbage": lambda j, r, f: ((j / ".hydra").mkdir(), (j / ".hydra" / "overrides.yaml").write_text("[: {")) and None,
    "temp leftover": lambda j, r, f: (j / ".grads.parquet.abc.tmp").write_bytes(r.randbytes(100)),
}
#: Damages to the records themselves: refused under the default, skipped with a warning under skip. (A page
#: flip may land in a page header's statistics, which no value read depends on: refused, or exported equal.)
REFUSED = {k for k in DAMAGES if k.startswith(("grads", "steps")) and "page flip" not in k} | {"done other run id"}
#: Damages that change nothing of the records: every job exported, equal, exit 0.
HARMLESS = {"overrides garbage", "temp leftover"}


def _damaged(pristine: Path, tmp: Path, kind: str, seed: int) -> Path:
    root = tmp / f"{kind.replace(' ', '_')}-{seed}"
    shutil.copytree(pristine / "sweep", root)
    DAMAGES[kind](root / "1", random.Random(f"{kind}/{seed}"), pristine / "foreign")
    return root


def _tensorboard(out: Path, job: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / job), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def truth(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[tuple[int, float]]]]:
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("truth")
    assert export.main(["tensorboard", str(pristine / "sweep"), "--out", str(out)]) == 0
    return {j: _tensorboard(out, j) for j in JOBS}


def _equal(got: dict[str, list[tuple[int, float]]], want: dict[str, list[tuple[int, float]]], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for tag in want:
        np.testing.assert_array_equal(np.array(got[tag]), np.array(want[tag]), err_msg=f"{where} {tag}")


def _export(target: str, root: Path, out: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    args = [target, str(root), "--out", str(out), "--on-damaged", mode]
    rc = export.main(args)  # any exception but a user's mistake escapes here: a traceback, the test fails
    err = capsys.readouterr().err
    assert rc in (0, 2) and "Traceback" not in err, (rc, err)
    return rc, err


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_a_damaged_job_is_refused_or_skipped_never_exported_wrong(
    kind: str, pristine: Path, truth: dict[str, dict[str, list[tuple[int, float]]]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for seed in SEEDS:
        root = _damaged(pristine, tmp_path, kind, seed)
        for mode in ("raise", "skip"):
            out = tmp_path / f"out-{mode}-{seed}"
            rc, err = _export("tensorboard", root, out, mode, capsys)
            where = f"{kind} (seed {seed}, --on-damaged {mode})"
            if rc == 2:
                assert mode == "raise" and str(root / "1") in err, (where, err)  # refused, by name
                assert not out.exists(), where  # nothing half-written
                continue
            assert kind not in REFUSED or mode == "skip", (where, err)
            for job in JOBS:
                if (out / job).is_dir():
                    _equal(_tensorboard(out, job), truth[job], f"{where} job {job}")
                else:  # left out: said so, naming it
                    assert job == "1" and kind not in HARMLESS and str(root / "1") in err, (where, err)


def test_a_damaged_single_run_dir_is_refused_by_name(pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for kind in sorted(REFUSED):
        job = tmp_path / kind.replace(" ", "_")
        shutil.copytree(pristine / "sweep" / "1", job)
        DAMAGES[kind](job, random.Random(kind), pristine / "foreign")
        for mode in ("raise", "skip"):  # a single run has nothing else to export: refused either way
            rc, err = _export("tensorboard", job, tmp_path / "out", mode, capsys)
            assert rc == 2 and str(job) in err, (kind, mode, err)


@pytest.mark.parametrize("kind", ["grads truncated", "grads foreign", "steps missing", "done missing"])
def test_mlflow_export_skips_the_damaged_job(kind: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    root = _damaged(pristine, tmp_path, kind, 0)
    clean = tmp_path / "clean"
    shutil.copytree(pristine / "sweep", clean)
    assert _export("mlflow", root, tmp_path / "mlruns", "raise", capsys)[0] == (2 if kind in REFUSED else 0)
    rc, err = _export("mlflow", root, tmp_path / "mlruns", "skip", capsys)
    assert rc == 0 and str(root / "1") in err
    assert _export("mlflow", clean, tmp_path / "clean-mlruns", "raise", capsys)[0] == 0

    def metrics(store: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
        client = MlflowClient(tracking_uri=store.as_uri())
        runs = client.search_runs([client.get_experiment_by_name("gradrunner").experiment_id])
        return {r.info.run_name: {k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
                                  for k in r.data.metrics} for r in runs}  # fmt: skip

    got, want = metrics(tmp_path / "mlruns"), metrics(tmp_path / "clean-mlruns")
    assert sorted(got) == ["0", "2"]
    for job in got:
        _equal(got[job], want[job], f"mlflow {kind} job {job}")


@pytest.mark.slow
def test_wandb_export_skips_the_damaged_job(pristine: Path, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    root = _damaged(pristine, tmp_path, "grads foreign", 0)
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "gradrunner.export", "wandb", str(root), "--out", str(tmp_path / "w")]
    refused = subprocess.run(command, capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and str(root / "1") in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "w" / "wandb").exists()
    done = subprocess.run([*command, "--on-damaged", "skip"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and str(root / "1") in done.stderr and "Traceback" not in done.stderr
    assert len(list((tmp_path / "w" / "wandb").glob("offline-run-*"))) == 2  # jobs 0 and 2
