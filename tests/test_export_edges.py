"""The exporters' edges (a hunt of `gradrunner.export`): what each target holds is read back with its own reader.

TensorBoard through `EventAccumulator`, MLflow through `MlflowClient` on a local `file:` store, W&B through its
offline `.wandb` file. Runs are tiny and written in-process by `gradrunner.record`.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from wandb_records import wandb_records
from written_jobs import recorded_run

import gradrunner
from gradrunner import export


def _norms(run_dir: Path, tap: str = "0:output") -> dict[int, float]:
    rows = pd.read_parquet(run_dir / "grads.parquet").query("tap == @tap")
    return {int(s): float(v) for s, v in zip(rows.step, rows.norm, strict=True)}


def _tensorboard(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len(events) == len({e.step for e in events}), tag  # one point per step
        out[tag] = {e.step: e.value for e in events}
    return out


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6)


def _one_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


# --- which jobs are read ----------------------------------------------------------------------------------


def test_a_completed_job_of_zero_steps_is_left_out_with_a_true_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    sweep = tmp_path / "sweep"
    recorded_run(sweep / "0", steps=0)
    recorded_run(sweep / "1", steps=2)
    assert export.main(["tensorboard", str(sweep), "--out", str(tmp_path / "tb")]) == 0
    err = capsys.readouterr().err
    assert f"{sweep / '0'}: recorded no rows" in err and "could not be read" not in err, err
    assert not (tmp_path / "tb" / "0").exists()
    _close(_tensorboard(tmp_path / "tb" / "1")["grads/0:output/norm"], _norms(sweep / "1"))
    # nothing with rows: said so, not "do not verify"
    assert export.main(["tensorboard", str(sweep / "0"), "--out", str(tmp_path / "tb0")]) == 2
    _one_error(capsys, "nothing to export", "recorded no rows")
    assert not (tmp_path / "tb0").exists()


def test_a_job_dir_named_run_is_a_job_like_any_other(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    parent = tmp_path / "parent"
    recorded_run(parent / "run", seed=1)
    recorded_run(parent / "other", seed=2)
    assert export.main(["tensorboard", str(parent), "--out", str(tmp_path / "tb")]) == 0
    for job in ("run", "other"):
        _close(_tensorboard(tmp_path / "tb" / job)["grads/0:output/norm"], _norms(parent / job))


def test_each_warning_is_printed_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        recorded_run(sweep / job)
    (sweep / "1" / "done.json").unlink()  # job 1 did not complete: load warns, reading grads and steps
    assert export.main(["tensorboard", str(sweep), "--out", str(tmp_path / "tb")]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "did not complete" in lines[0], lines


# --- TensorBoard: whose export a dir holds ------------------------------------------------------------------


def test_tensorboard_keeps_another_runs_export_in_the_same_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    import hashlib

    from gradrunner.records.locking import EXPORT_LOCK  # the lock file an export leaves in its target dir

    a, b, out = recorded_run(tmp_path / "a", seed=1), recorded_run(tmp_path / "b", seed=2), tmp_path / "tb"
    b_dir = out / f"run-{hashlib.sha256(str(b.resolve()).encode()).hexdigest()[:8]}"
    printed = []
    for run_dir in (a, b, a, b):  # a re-export of the same run replaces its own export, never the other's
        assert export.main(["tensorboard", str(run_dir), "--out", str(out)]) == 0
        printed.append(capsys.readouterr().out)
    for run_dir, logdir in ((a, out / "run"), (b, b_dir)):
        _close(_tensorboard(logdir)["grads/0:output/norm"], _norms(run_dir))
        assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in out.iterdir() if p.name != EXPORT_LOCK) == ["run", b_dir.name]
    assert ["(run)" in printed[0], f"({b_dir.name})" in printed[1]] == [True, True]  # the line names the dir written
    from gradrunner.export.tensorboard import MARKER

    old = tmp_path / "old"  # an export by an older gradrunner (no marker): replaced as before
    assert export.main(["tensorboard", str(a), "--out", str(old)]) == 0
    (old / "run" / MARKER).unlink()
    assert export.main(["tensorboard", str(b), "--out", str(old)]) == 0
    assert "(run)" in capsys.readouterr().out and sorted(p.name for p in old.iterdir() if p.name != EXPORT_LOCK) == ["run"]
    assert len(list((old / "run").glob("events.out.tfevents.*"))) == 1
    _close(_tensorboard(old / "run")["grads/0:output/norm"], _norms(b))
    assert json.loads((old / "run" / MARKER).read_text())["source"] == str(b.resolve())


# --- live logging: each step once, over an overwritten or resumed run ----------------------------------------


def _live(directory: Path, steps: int, seed: int, start: int | None = None, killed: bool = False,
          **options: Any) -> None:  # fmt: skip
    """`steps` steps logged live (from `start`); `killed`: the session ends by an exception, its run not completed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    with contextlib.suppress(KeyboardInterrupt):
        with gradrunner.record(model, ["0:output"], directory, log_to="tensorboard", **options) as rec:
            if start is not None:
                rec.start_at(start)
            for _ in range(steps):
                loss = model(torch.randn(5, 3)).pow(2).mean()
                rec.backward(loss)
                rec.step(loss)
            if killed:
                raise KeyboardInterrupt


def test_live_tensorboard_of_an_overwritten_run_holds_the_new_run_only(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _live(tmp_path / "r", steps=3, seed=1)
    _live(tmp_path / "r", steps=2, seed=2, overwrite=True)
    live = _tensorboard(tmp_path / "r" / "tensorboard")
    _close(live["grads/0:output/norm"], _norms(tmp_path / "r"))  # steps 0, 1 of the new run; not step 2 of the old
    assert sorted(live["steps/loss"]) == [0, 1]


def test_live_tensorboard_of_an_overwritten_run_numbered_from_a_later_step_holds_the_new_run_only(tmp_path: Path) -> None:
    """overwrite=True deletes the live log with the records: a new run numbered from step 2 (a training restored
    from the user's own checkpoint) kept the deleted run's points of steps 0 and 1."""
    pytest.importorskip("tensorboard")
    _live(tmp_path / "r", steps=3, seed=1)
    _live(tmp_path / "r", steps=2, seed=2, start=2, overwrite=True)
    live = _tensorboard(tmp_path / "r" / "tensorboard")
    assert sorted(live["steps/loss"]) == [2, 3]
    _close(live["grads/0:output/norm"], _norms(tmp_path / "r"))


def test_live_tensorboard_of_a_resumed_run_holds_each_step_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _live(tmp_path / "r", steps=3, seed=1, killed=True)
    before = _norms(tmp_path / "r")
    # A resumed process's file may sort before the killed session's (the same second, another pid; a clock set
    # back): the killed session's file is named as if started later than now.
    for old in (tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"):
        stamp, _, rest = old.name[len("events.out.tfevents."):].partition(".")
        old.rename(old.with_name(f"events.out.tfevents.{int(stamp) + 100:010d}.{rest}"))
    _live(tmp_path / "r", steps=2, seed=2, start=1, resume=True)  # steps 1, 2 recorded again
    after = _norms(tmp_path / "r")
    assert after[0] == before[0] and after[1] != before[1]
    _close(_tensorboard(tmp_path / "r" / "tensorboard")["grads/0:output/norm"], after)


# --- MLflow ------------------------------------------------------------------------------------------------


def _mlflow_runs(store: Path, experiment: str = "gradrunner") -> tuple[Any, list[Any]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    found = client.get_experiment_by_name(experiment)
    return client, [] if found is None else client.search_runs([found.experiment_id])  # active runs


def _history(client: Any, run: Any, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


class _Odd(nn.Module):
    """Modules whose tap names MLflow cannot take as they are: two that clean to one key, two over 250 characters."""

    LONG = "k" * 300

    def __init__(self) -> None:
        super().__init__()
        names = ["[x]", "_x_", f"{self.LONG}1", f"{self.LONG}2"]
        self.blocks = nn.ModuleDict({n: nn.Linear(3, 3 if i < 3 else 1) for i, n in enumerate(names)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def test_mlflow_gives_each_tap_and_param_a_key_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    taps = ["blocks.[[]x]:output", "blocks._x_:output", f"blocks.{_Odd.LONG}1:output", f"blocks.{_Odd.LONG}2:output"]
    run_dir = recorded_run(tmp_path / "r", steps=2, taps=taps, model=_Odd())
    truth = pd.read_parquet(run_dir / "grads.parquet")
    (job,) = export.jobs(run_dir)
    job.params = {"a@b": "1", "a_b": "2", f"{'p' * 300}1": "3", f"{'p' * 300}2": "4"}
    for _ in range(2):  # a re-export maps every key the same way
        export.to_mlflow([job], tmp_path / "mlruns")
    client, (run,) = _mlflow_runs(tmp_path / "mlruns")
    data = run.data
    assert sorted(data.params.values()) == ["1", "2", "3", "4"] and all(len(k) <= 250 for k in data.params)
    norms = [k for k in data.metrics if k.endswith("/norm")]
    assert len(norms) == 4 and all(len(k) <= 250 for k in data.metrics)
    keys = json.loads((Path(client.download_artifacts(run.info.run_id, "gradrunner/keys.json", str(tmp_path)))).read_text())
    for tap in ("blocks.[x]:output", "blocks._x_:output", f"blocks.{_Odd.LONG}1:output", f"blocks.{_Odd.LONG}2:output"):
        rows = truth[truth.tap == tap]
        key = keys["metrics"].get(f"grads/{tap}/norm", f"grads/{tap}/norm")
        _close(_history(client, run, key), dict(zip(rows.step.astype(int), rows.norm, strict=True)))
    assert {keys["params"].get(k, k): v for k, v in job.params.items()} == data.params


def test_mlflow_reexport_replaces_the_run_of_a_path_with_quotes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = recorded_run(tmp_path / "it's \\ odd" / "r")
    for _ in range(3):
        assert export.main(["mlflow", str(run_dir), "--out", str(tmp_path / "mlruns")]) == 0
    client, runs = _mlflow_runs(tmp_path / "mlruns")
    assert len(runs) == 1
    _close(_history(client, runs[0], "grads/0:output/norm"), _norms(run_dir))
    # a run an older gradrunner exported, tagged with the source only, is replaced too
    plain = recorded_run(tmp_path / "plain")
    assert export.main(["mlflow", str(plain), "--out", str(tmp_path / "old")]) == 0
    client, (old,) = _mlflow_runs(tmp_path / "old")
    client.delete_tag(old.info.run_id, "gradrunner.source_id")
    assert export.main(["mlflow", str(plain), "--out", str(tmp_path / "old")]) == 0
    client, runs = _mlflow_runs(tmp_path / "old")
    assert [r.info.run_id != old.info.run_id for r in runs] == [True]


def test_a_reexport_of_a_dir_that_holds_another_run_now_replaces_its_mlflow_and_wandb_export(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """record(overwrite=True) (or a failed run re-run from step 0) puts another run in the job dir: exporting it
    again replaces the earlier run's MLflow run and W&B offline run, as it replaces its TensorBoard events (the
    earlier export was keyed by the dir's run id, so both stayed beside the new one, under the same name)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    run_dir, store, out = tmp_path / "r", tmp_path / "mlruns", tmp_path / "w"
    for seed, overwrite in ((0, False), (1, True)):
        recorded_run(run_dir, seed=seed, overwrite=overwrite)
        assert export.main(["mlflow", str(run_dir), "--out", str(store)]) == 0
        done = subprocess.run([sys.executable, "-m", "gradrunner.export", "wandb", str(run_dir), "--out", str(out)],
                              capture_output=True, text=True, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
    want = _norms(run_dir)  # the second run's
    client, runs = _mlflow_runs(store)
    assert len(runs) == 1, [r.data.tags.get("gradrunner.source") for r in runs]
    _close(_history(client, runs[0], "grads/0:output/norm"), want)
    files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    from wandb.proto import wandb_internal_pb2

    logged: dict[int, float] = {}
    for data in wandb_records(files[0].read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            logged[rec.history.step.num] = float(items["grads/0:output/norm"])
    _close(logged, want)


def test_mlflow_export_that_fails_partway_leaves_the_earlier_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir, store = recorded_run(tmp_path / "r"), tmp_path / "mlruns"
    assert export.main(["mlflow", str(run_dir), "--out", str(store)]) == 0
    _, (before,) = _mlflow_runs(store)
    real = MlflowClient.log_batch

    def failing(self: MlflowClient, run_id: str, metrics: Sequence[object] = (), **kw: Any) -> None:
        if metrics:
            raise MlflowException("the store went away")
        real(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    assert export.main(["mlflow", str(run_dir), "--out", str(store)]) == 2
    _one_error(capsys, "the store went away")
    client, runs = _mlflow_runs(store)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(before.info.run_id, "FINISHED")]
    _close(_history(client, runs[0], "grads/0:output/norm"), _norms(run_dir))


def test_mlflow_takes_a_file_uri_and_a_path_as_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # recorded, so the test leaves it as it found it
    run_dir = recorded_run(tmp_path / "r")
    for store, uri in ((tmp_path / "a", (tmp_path / "a").as_uri()), (tmp_path / "b", str(tmp_path / "b"))):
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
        assert export.main(["mlflow", str(run_dir), "--uri", uri]) == 0, capsys.readouterr().err
        assert f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {store.as_uri()}" in capsys.readouterr().out
        client, (run,) = _mlflow_runs(store)
        _close(_history(client, run, "grads/0:output/norm"), _norms(run_dir))


# --- bad --out, --project, --uri: one paragraph, exit 2, nothing written -----------------------------------------


def test_a_bad_out_project_or_uri_is_one_paragraph_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = recorded_run(tmp_path / "r")
    afile = tmp_path / "afile"
    afile.write_text("")
    before = sorted(p for p in tmp_path.rglob("*"))
    cases = [
        (["tensorboard", "--out", str(afile)], [str(afile), "is not a directory"]),
        (["tensorboard", "--out", str(afile / "below")], [str(afile), "is not a directory"]),
        (["mlflow", "--out", str(afile)], [str(afile), "is not a directory"]),
        (["mlflow", "--uri", afile.as_uri()], [str(afile), "is not a directory"]),
        (["mlflow", "--out", str(tmp_path / "m"), "--project", ""], ["--project ''", "allowed"]),
        (["mlflow", "--uri", "foo://bar"], ["'foo://bar'", "file: URI"]),
    ]
    if importlib.util.find_spec("wandb") is not None:
        cases += [(["wandb", "--out", str(afile)], [str(afile), "is not a directory"]),
                  (["wandb", "--out", str(tmp_path / "w"), "--project", "a:b"], ["--project 'a:b'", "allowed"])]  # fmt: skip
    for (target, *rest), words in cases:
        assert export.main([target, str(run_dir), *rest]) == 2, (target, rest)
        _one_error(capsys, *words)
        assert sorted(p for p in tmp_path.rglob("*")) == before, (target, rest)  # nothing written


def test_mlflow_refuses_a_deleted_experiment_saying_how_to_restore_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir, store = recorded_run(tmp_path / "r"), tmp_path / "mlruns"
    assert export.main(["mlflow", str(run_dir), "--out", str(store), "--project", "p"]) == 0
    client, (run,) = _mlflow_runs(store, "p")
    client.delete_experiment(client.get_experiment_by_name("p").experiment_id)
    from gradrunner.records.locking import EXPORT_LOCK  # its holder record names whichever export took it last

    files = sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*") if p.name != EXPORT_LOCK)
    assert export.main(["mlflow", str(run_dir), "--out", str(store), "--project", "p"]) == 2
    _one_error(capsys, "'p'", "deleted", "restore", "another --project")
    assert sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*") if p.name != EXPORT_LOCK) == files
    assert export.main(["mlflow", str(run_dir), "--out", str(store), "--project", "q"]) == 0  # another name: written
    client, (run,) = _mlflow_runs(store, "q")
    _close(_history(client, run, "grads/0:output/norm"), _norms(run_dir))


# --- W&B: the default layout ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_wandb_default_out_is_the_run_dirs_wandb_and_the_printed_sync_path_is_true(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    run_dir = recorded_run(tmp_path / "my run")  # a space: the printed path is quoted
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "gradrunner.export", "wandb", str(run_dir)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # <dir>/wandb/offline-run-*, as the README says
    assert not (run_dir / "wandb" / "wandb").exists()
    command = shlex.split(done.stdout.split("upload with: ", 1)[1])
    assert command[:2] == ["wandb", "sync"] and glob.glob(command[2]) == [str(file.parent)]
    logged: dict[int, float] = {}
    for data in wandb_records(file.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            logged[rec.history.step.num] = float(items["grads/0:output/norm"])
    _close(logged, _norms(run_dir))
