"""Mid-run checkpoints (`train.checkpoint_every=K`) and resuming from them (`resume=true`).

A checkpoint lives in the job dir's hidden `.checkpoint/` folder (pyarrow and DuckDB globs skip it):

| file | what |
| --- | --- |
| `state.pt` | model, optimizer, scheduler and GradScaler state dicts, RNG states (torch, cuda, numpy, random), the next step and the batches consumed; tensors and plain values only |
| `grads-<step>.parquet`, `steps-<step>.parquet` | the records of the steps since the checkpoint before (complete Parquet files) |

Every file is written under a temp name and moved into place (`os.replace`); `state.pt` last, and it
lists the segments it needs, so a kill at any moment leaves the previous checkpoint whole. It is read
with `torch.load(weights_only=True)`: no pickle of arbitrary objects. A resumed job rebuilds the job
from its config (seeded as the first run), loads the state, replays the saved records into its fresh
writers (with its own run id), skips the batches already consumed (the data source is replayed from
its seed: cheap for generated data, a re-read for a file) and goes on: its records are those of an
uninterrupted run. The folder is removed once the job's records are closed.

Example::

    ckpt = Checkpointer(job_dir, every=50, ...)
    start = ckpt.restore(job, scaler, grads, steps)   # 0 without a checkpoint
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradrunner.errors import GradrunnerError, one_paragraph

if TYPE_CHECKING:
    from gradrunner.records.columns import StepRecords
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.run.build import Job

log = logging.getLogger(__name__)

#: The checkpoint folder inside a job dir.
CHECKPOINT_DIR = ".checkpoint"
STATE = "state.pt"


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (loadable with `weights_only=True`)."""
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "random": {"version": py_version, "internal": torch.tensor(py_internal, dtype=torch.int64), "gauss": py_gauss},
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    r = state["random"]
    random.setstate((r["version"], tuple(int(v) for v in r["internal"].tolist()), r["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Checkpointer:
    """Saves a checkpoint every `every` steps and restores the last one; tees the records into segments.

    `config` (the resolved config's YAML, without `resume`/`report`) must match for a checkpoint to be used.
    """

    directory: Path
    every: int
    config: str
    open_segment: Any  # (path, kind) -> a RecordWriter or StepsWriter writing a complete segment file
    #: Batches each step takes (train.accumulate), evaluation's batches and period: the data position.
    batches_per_step: int = 1
    eval_batches: int = 0
    eval_every: int = 0
    _segments: list[str] = field(default_factory=list)
    _grads: RecordWriter | None = None
    _steps: StepsWriter | None = None

    @property
    def folder(self) -> Path:
        return self.directory / CHECKPOINT_DIR

    # -- records -------------------------------------------------------------------------------
    def write_step(self, step: int, records: StepRecords, micro_step: list[int | None] | None = None) -> None:
        if self._grads is not None:
            self._grads.write_step(step, records, micro_step=micro_step)

    def write(self, *args: Any, **kwargs: Any) -> None:
        if self._steps is not None:
            self._steps.write(*args, **kwargs)

    def _open_segments(self, end: int) -> None:
        self.folder.mkdir(exist_ok=True)
        keep = {STATE, *self._segments}
        for stale in self.folder.iterdir():  # temp files of a killed run, segments no state.pt lists
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
        self._grads = self.open_segment(self.folder / f"grads-{end:09d}.parquet", "grads")
        self._steps = self.open_segment(self.folder / f"steps-{end:09d}.parquet", "steps")

    def start(self, step: int) -> None:
        """Open the segment that the checkpoint after `step` closes (nothing if none comes)."""
        self._open_segments(self._next_end(step))

    def _next_end(self, step: int) -> int:
        return (step // self.every + 1) * self.every

    # -- saving ---------------------------------------------------------------------------------
    def maybe_save(self, step: int, job: Job, scaler: torch.amp.GradScaler) -> None:
        """After `step` completed (its records written): save a checkpoint if one is due."""
        done = step + 1
        if done % self.every:
            return
        assert self._grads is not None and self._steps is not None
        self._grads.close()
        self._steps.close()
        self._segments += [f"grads-{done:09d}.parquet", f"steps-{done:09d}.parquet"]
        state = {
            "step": done,
            "config": self.config,
            "segments": list(self._segments),
            "batches_consumed": done * self.batches_per_step,
            "eval_batches_consumed": (done // self.eval_every) * self.eval_batches if self.eval_every else 0,
            "model": _unwrap(job.model).state_dict(),
            "optimizer": job.optimizer.state_dict(),
            "scheduler": None if job.scheduler is None else job.scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
        }
        temp = self.folder / f".{STATE}.{os.getpid()}.tmp"
        try:
            torch.save(state, temp)
            os.replace(temp, self.folder / STATE)
        finally:
            temp.unlink(missing_ok=True)
        log.info("checkpoint after step %d in %s", step, self.folder)
        self._open_segments(self._next_end(done))

    def abort(self) -> None:
        """Drop the open segment (the job ends between checkpoints)."""
        for w in (self._grads, self._steps):
            if w is not None:
                w.abort()
        self._grads = self._steps = None

    def finish(self) -> None:
        """The job's records are closed: the checkpoint is no longer needed."""
        self.abort()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------------------
    def restore(self, job: Job, scaler: torch.amp.GradScaler, grads: Any, steps: Any, run_id: str) -> int:
        """Load the last checkpoint, if any, into `job` and `scaler`, replay its records into `grads`/`steps`;
        return the step to start from (0 without a usable checkpoint)."""
        path = self.folder / STATE
        if not path.is_file():
            return 0
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise GradrunnerError(
                f"the checkpoint {path} cannot be read ({one_paragraph(e)}); delete {self.folder} to run the job "
                "again from step 0."
            ) from e
        if state["config"] != self.config:
            log.warning("the checkpoint in %s is of another config: not used, the job runs from step 0", self.folder)
            shutil.rmtree(self.folder, ignore_errors=True)
            return 0
        import pyarrow as pa
        import pyarrow.parquet as pq

        for name in state["segments"]:
            writer = grads if name.startswith("grads-") else steps
            table = pq.read_table(self.folder / name)
            table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                                     pa.array([run_id] * table.num_rows, pa.string()))  # fmt: skip
            for batch in table.cast(writer.schema).to_batches():
                writer.write_batch(batch)
            if name.startswith("steps-"):
                grads.steps_written += table.num_rows
                steps.steps_written += table.num_rows
        _unwrap(job.model).load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optimizer"])
        if job.scheduler is not None and state["scheduler"] is not None:
            job.scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        for _ in range(state["batches_consumed"]):
            next(job.batches)
        self._segments = list(state["segments"])
        set_rng_state(state["rng"])
        log.info("resumed from the checkpoint in %s: steps 0-%d replayed from it", self.folder, state["step"] - 1)
        return int(state["step"])


class Tee:
    """A records writer that also writes into the checkpoint's open segment (`write_step` and `write`)."""

    def __init__(self, main: Any, ckpt: Checkpointer) -> None:
        self.main, self.ckpt = main, ckpt

    def write_step(self, step: int, records: StepRecords, micro_step: list[int | None] | None = None) -> None:
        self.main.write_step(step, records, micro_step=micro_step)
        self.ckpt.write_step(step, records, micro_step=micro_step)

    def write(self, *args: Any, **kwargs: Any) -> None:
        self.main.write(*args, **kwargs)
        self.ckpt.write(*args, **kwargs)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
