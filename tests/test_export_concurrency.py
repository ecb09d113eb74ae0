"""A TensorBoard export killed partway, or run while another writes the same target: read back with TensorBoard's reader.

The fault is placed, not timed: a child process exports with TensorBoard's `RecordWriter.write` wrapped so that,
after a given number of records, it flushes, says so on stdout and waits for a line on stdin. The test then
kills it, or runs a second export and lets it go on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from written_jobs import recorded_run

from gradrunner import export

#: The child: `python -c CHILD <records to write before waiting> <export arguments>...`.
CHILD = r"""
import sys
from tensorboard.summary.writer import record_writer
from gradrunner.export import main

after, written, write = int(sys.argv[1]), [0], record_writer.RecordWriter.write

def paused(self, data):
    write(self, data)
    written[0] += 1
    if written[0] == after:
        self.flush()
        print("paused", flush=True)
        sys.stdin.readline()  # a line: go on; or the test kills this process here

record_writer.RecordWriter.write = paused
sys.exit(main(sys.argv[2:]))
"""



def _record(directory: Path, steps: int = 6) -> Path:
    return recorded_run(directory, steps=steps)


def _runs(logdir: Path) -> dict[str, dict[str, dict[int, float]]]:
    """What TensorBoard shows of `logdir` (its multiplexer, as `tensorboard --logdir` reads): run -> tag -> step -> value;
    each step of a tag at most once."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.util import tensor_util

    mux = EventMultiplexer(tensor_size_guidance={"scalars": 0})
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out: dict[str, dict[str, dict[int, float]]] = {}
    for run in mux.Runs():
        acc = mux.GetAccumulator(run)
        out[run] = {}
        for tag in acc.Tags()["tensors"]:
            if tag.startswith("_hparams_"):
                continue
            events = acc.Tensors(tag)
            assert len(events) == len({e.step for e in events}), (run, tag, [e.step for e in events])
            out[run][tag] = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events}
    return out


def _paused_export(run: Path, after: int) -> subprocess.Popen[str]:
    """An export of `run` to TensorBoard in a child process, paused after writing `after` records (it said so)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(after), "tensorboard", str(run)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert child.stdout is not None
    said = child.stdout.readline()
    if said != "paused\n":
        child.kill()
        pytest.fail(f"the export did not pause: {said!r} {child.communicate()}")
    return child


def test_a_killed_tensorboard_export_leaves_the_previous_one_and_nothing_tensorboard_shows(tmp_path: Path) -> None:
    run = _record(tmp_path / "run")
    assert export.main(["tensorboard", str(run)]) == 0
    before = _runs(run / "tensorboard")
    assert list(before) == ["run"] and sorted(before["run"]["steps/loss"]) == list(range(6))

    child = _paused_export(run, after=20)  # the version record, the hparams, 17 scalars
    child.kill()
    child.communicate()
    assert _runs(run / "tensorboard") == before

    assert export.main(["tensorboard", str(run)]) == 0  # the next export: whole, the killed one's file gone
    assert _runs(run / "tensorboard") == before
    left = [p.relative_to(run / "tensorboard").as_posix() for p in (run / "tensorboard").rglob("*") if p.is_file()]
    assert {n for n in left if "tfevents" not in n} <= {"run/.gradrunner-export.json", ".gradrunner-export.lock"}, left
    assert len([n for n in left if "tfevents" in n]) == 1, left


def test_a_second_tensorboard_export_while_one_writes_is_refused_naming_it_and_the_first_ends_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _record(tmp_path / "run")
    assert export.main(["tensorboard", str(run)]) == 0
    before = _runs(run / "tensorboard")
    child = _paused_export(run, after=20)
    capsys.readouterr()
    try:
        second = export.main(["tensorboard", str(run)])
    finally:
        out, err = child.communicate("go\n")  # the first export goes on
    message = capsys.readouterr().err
    assert second == 2, message
    assert "Traceback" not in message and len(message.strip().splitlines()) == 1, message
    assert f"pid {child.pid}" in message and "wrote nothing" in message, message
    assert child.returncode == 0 and "wrote 1 run(s)" in out, (out, err)
    assert _runs(run / "tensorboard") == before  # one run, each step once


def test_a_wandb_export_while_another_writes_its_dir_is_refused_naming_it(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from gradrunner.records.locking import EXPORT_LOCK, FileLock

    run = _record(tmp_path / "run", steps=2)
    capsys.readouterr()
    with FileLock(run / "wandb" / EXPORT_LOCK):  # what a live W&B export of this dir holds
        assert export.main(["wandb", str(run)]) == 2
    message = capsys.readouterr().err
    assert len(message.strip().splitlines()) == 1 and f"pid {os.getpid()}" in message, message
    assert not list((run / "wandb").glob("offline-run-*"))
    assert export.main(["wandb", str(run)]) == 0  # the lock dies with its holder's hold


def test_a_second_mlflow_export_into_a_local_store_while_one_writes_is_refused_and_one_run_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = _record(tmp_path / "run", steps=3)
    assert export.main(["mlflow", str(run)]) == 0
    second: list[int | None] = []
    create_run = MlflowClient.create_run

    def after_the_second(self: MlflowClient, *args: object, **kwargs: object) -> object:
        if not second:  # the first export has looked for its earlier run: the second one runs now, whole
            second.append(None)
            second[0] = export.main(["mlflow", str(run)])
        return create_run(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", after_the_second)
    capsys.readouterr()
    assert export.main(["mlflow", str(run)]) == 0
    message = capsys.readouterr().err
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [(r.info.run_name, r.info.status) for r in runs]
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "steps/loss")) == [0, 1, 2]
    assert second == [2] and f"pid {os.getpid()}" in message and len(message.strip().splitlines()) == 1, message
