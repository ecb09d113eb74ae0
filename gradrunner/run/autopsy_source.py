"""What `python -m gradrunner.autopsy` branches from, checked before any branch runs: the run's config, and its kept state.

`source_config(run_dir)` is the config the run ran with (`done.json`'s, or the kept checkpoints' for a run
stopped on its spike), refusing in one paragraph what cannot be autopsied: a torchrun run (its branches would run
in one process, on other batches), a `record()` or callback run dir (no runner config to rebuild the job from), a
run dir that is not one. `check_state` checks the kept state file a branch starts from.

Example::

    config = source_config(Path("outputs/a"))     # GradrunnerError for a torchrun run dir
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.checkpoint_files import file_digest
from gradrunner.run import branch
from gradrunner.run.checkpoint import KEPT_DIR, KEPT_MANIFEST


def source_config(run_dir: Path) -> dict[str, Any]:
    """The config the run ran with: `done.json`'s, or, for a run that stopped on its spike
    (`capture.on_nonfinite=stop`: `failed.json`), that of the checkpoints it kept. One paragraph when neither."""
    state = rundir.job_state(run_dir) if run_dir.is_dir() else None
    has_steps = (run_dir / "steps.parquet").is_file()
    if state is not None and state.marker is not None and has_steps:
        _refuse_ranks(run_dir, int(state.marker.get("world_size") or 1))
        _refuse_recorded(run_dir, state.marker.get("config"))
        return dict(state.marker["config"])
    if state is not None and state.status == "failed" and has_steps:
        if (run_dir / KEPT_DIR / KEPT_MANIFEST).is_file():
            return dict(branch.kept(run_dir).config)
        raise GradrunnerError(f"{run_dir} is a run that failed ({one_paragraph(state.error or 'failed.json')}) and kept "
                              "no checkpoint, so nothing can branch from before its spike; make it again with "
                              "train.checkpoint_every=N anomaly.replay=K (a run stopped on its spike keeps them too)")  # fmt: skip
    raise GradrunnerError(f"{run_dir} is not a completed run dir (no done.json and steps.parquet); pass the dir "
                          "of a run made with train.checkpoint_every=N anomaly.replay=K")  # fmt: skip


def _refuse_ranks(run_dir: Path, world: int) -> None:
    """A torchrun run (`done.json`'s `world_size` > 1) is refused: its branches would not be the run's steps."""
    if world > 1:
        raise GradrunnerError(
            f"{run_dir} is a torchrun run (world_size {world} in {rundir.DONE}): an autopsy branches from a kept "
            "single-process checkpoint and runs each branch in one process, which takes other batches than the run's "
            f"{world} ranks took at each step, so its branches would not be the run's (not even the unchanged "
            "baseline); nothing was run or written. Autopsy a run made in a single process (python -m gradrunner ... "
            "train.checkpoint_every=N anomaly.replay=K, without torchrun), as anomaly.replay is refused under torchrun."
        )


#: What a branch is rebuilt from: the runner's config groups (a `record()` or callback session has none of them).
RUNNER_KEYS = ("model", "data", "loss", "optimizer", "train")


def _refuse_recorded(run_dir: Path, config: object) -> None:
    """A run dir `gradrunner.record()` or a Lightning/HF callback wrote is refused: no runner config to rebuild from."""
    missing = [k for k in RUNNER_KEYS if not isinstance(config, dict) or k not in config]
    if missing:
        source = config.get("source") if isinstance(config, dict) else None
        by = f"was written by {source}() or a Lightning/HF callback" if source else "was not written by the runner"
        raise GradrunnerError(
            f"{run_dir} {by}: its {rundir.DONE} config has no {', '.join(missing)}, and an autopsy rebuilds the job "
            "from the runner's config (python -m gradrunner) to branch from the run's kept checkpoints; a session's "
            "model, data and loop are your own code, which the run dir does not hold; nothing was run or written. "
            "Autopsy a run made with python -m gradrunner ... train.checkpoint_every=N anomaly.replay=K."
        )


def check_state(found: branch.Kept, step: int) -> None:
    """The kept state a branch starts from is there with the bytes `kept.json` recorded (before any branch runs)."""
    path = found.path(step)
    try:
        same = file_digest(path) == found.states[step]["sha256"]
    except OSError as e:
        raise GradrunnerError(f"{path} cannot be read ({type(e).__name__}: {one_paragraph(e)}), and every branch of "
                              f"this autopsy starts from it (listed in {KEPT_MANIFEST}); put it back, or make the run "
                              "again with train.checkpoint_every=N anomaly.replay=K") from e  # fmt: skip
    if not same:
        raise GradrunnerError(f"{path} is not the file {KEPT_MANIFEST} recorded (its bytes changed after it was "
                              "written), and every branch of this autopsy starts from it; make the run again")  # fmt: skip
