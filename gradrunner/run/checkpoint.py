"""Mid-run checkpoints (`train.checkpoint_every=K`) and resuming from them (`resume=true`).

A checkpoint lives in the job dir's hidden `.checkpoint/` folder (pyarrow and DuckDB globs skip it):

| file | what |
| --- | --- |
| `checkpoint.json` | written last, the commit point: the step, the config, the state file and every segment with its SHA-256, row count and run id; the SHA-256 of its own content |
| `state-<step>.pt` | model, optimizer, scheduler and GradScaler state dicts, RNG states (torch, cuda, numpy, random), where each data stream is (`run.data_position`); tensors and plain values only |
| `grads-<step>.parquet`, `steps-<step>.parquet` | the records of the steps since the checkpoint before (complete Parquet files) |

Every file is written under a temp name and moved into place, `checkpoint.json` last, so a kill at
any moment leaves the previous checkpoint whole. A checkpoint is used only if it verifies
(`records.checkpoint_files`: every file's digest, as `analysis.load` verifies finished records) and
was written with the same config (`train.checkpoint_every` aside); otherwise a warning names the
file and why, or the changed keys with both values, the checkpoint is removed and the job runs from
step 0 (its records are then those of an uninterrupted run). `state-*.pt` is read with
`torch.load(weights_only=True)`: no pickle of arbitrary objects.

A resumed job rebuilds the job from its config (seeded as the first run), loads the state, replays
the data streams to where the checkpoint left them (`run.data_position`: a shuffling DataLoader
starts each epoch as in the first run), replays the saved records into its fresh writers (with its
own run id; each segment pair of the two tables in one deferred-signal block, so an interrupt
leaves both tables with the same steps) and goes on: its records are those of an uninterrupted run.
The folder is removed once the job's records are closed.

Retention (`anomaly.replay=K`): every checkpoint's state file is kept while the job runs, and when the
records are closed they move to `<job dir>/checkpoints/` (`KEPT_DIR`, with `kept.json`: each state's
step and SHA-256, the run id and config); the replay (`run.replay`) then keeps only the ones a replay
or an autopsy of a flagged spike starts from. `train.branch_from` (`run.branch`) starts a new run there.

Example::

    ckpt = Checkpointer(job_dir, every=50, ...)
    start = ckpt.restore(job, scaler, grads, steps, run_id)   # 0 without a usable checkpoint
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch
import yaml

from gradrunner.records.checkpoint_files import CHECKPOINT_DIR as CHECKPOINT_DIR
from gradrunner.records.checkpoint_files import MANIFEST, file_digest, read_manifest, segment_problem, write_manifest
from gradrunner.run.branch_state import hyperparameters, take_fresh
from gradrunner.run.config_compare import config_diff
from gradrunner.run.data_position import MAX_DRAWS, Watched

if TYPE_CHECKING:
    import pyarrow as pa

    from gradrunner.records.columns import StepRecords
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.run.build import Job

log = logging.getLogger(__name__)

#: Where a finished job keeps the checkpoints `anomaly.replay` needs, and their manifest there.
KEPT_DIR, KEPT_MANIFEST = "checkpoints", "kept.json"


#: A complete single-process state file's name (temp names start with a dot; a torchrun job's are
#: `state-<step>.rank<r>.pt`, with its `dcp-<step>/`: not kept, `config.replay` refuses replay under torchrun).
_STATE_NAME = re.compile(r"state-(\d+)\.pt")


def _is_state(name: str) -> bool:
    """A complete single-process state file's name (`state-<step>.pt`)."""
    return _STATE_NAME.fullmatch(name) is not None


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


class _Hashing:
    """A write-only file that hashes what goes through it (`torch.save` into it: the digest without a re-read)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@dataclass
class Checkpointer:
    """Saves a checkpoint every `every` steps and restores the last one; tees the records into segments.

    `config` (the resolved config's YAML, without `resume`/`report`) must match for a checkpoint to be
    used. `every <= 0` resumes a checkpoint that is there and writes no new one.
    """

    directory: Path
    every: int
    config: str
    open_segment: Any  # (path, kind) -> a RecordWriter or StepsWriter writing a complete segment file
    _segments: list[dict[str, Any]] = field(default_factory=list)
    _state_name: str = ""
    #: Other files and folders of the checkpoint (`_store`'s, e.g. each rank's state and the DCP folder).
    _state_files: set[str] = field(default_factory=set)
    _run_id: str = ""
    _data: dict[str, Watched] = field(default_factory=dict)
    _grads: RecordWriter | None = None
    _steps: StepsWriter | None = None

    @property
    def folder(self) -> Path:
        return self.directory / CHECKPOINT_DIR

    @property
    def keeps(self) -> bool:
        """Whether every checkpoint's state is kept for replay (`anomaly.replay > 0` in the job's config)."""
        return int((self._config().get("anomaly") or {}).get("replay") or 0) > 0

    # -- records -------------------------------------------------------------------------------
    def write_step(self, step: int, records: StepRecords, micro_step: list[int | None] | None = None) -> None:
        if self._grads is not None:
            self._grads.write_step(step, records, micro_step=micro_step)

    def write(self, *args: Any, **kwargs: Any) -> None:
        if self._steps is not None:
            self._steps.write(*args, **kwargs)

    def _open_segments(self, end: int) -> None:
        if not self.writes:
            return
        self.folder.mkdir(exist_ok=True)
        keep = {MANIFEST, self._state_name, *self._state_files, *(s["name"] for s in self._segments)}
        kept = self.keeps
        for stale in self.folder.iterdir():  # temp files of a killed run, files no checkpoint.json lists
            if stale.name not in keep and not (kept and _is_state(stale.name)):
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        self._grads = self.open_segment(self.folder / f"grads-{end:09d}.parquet", "grads")
        self._steps = self.open_segment(self.folder / f"steps-{end:09d}.parquet", "steps")

    def start(self, step: int) -> None:
        """Open the segment that the checkpoint after `step` closes (nothing if none comes)."""
        if self.every > 0:
            self._open_segments(self._next_end(step))

    def _next_end(self, step: int) -> int:
        return (step // self.every + 1) * self.every

    # -- saving ---------------------------------------------------------------------------------
    def maybe_save(self, step: int, job: Job, scaler: torch.amp.GradScaler) -> None:
        """After `step` completed (its records written): save a checkpoint if one is due."""
        done = step + 1
        if self.every <= 0 or done % self.every:
            return
        if self.writes:
            assert self._grads is not None and self._steps is not None
            self._grads.close()
            self._steps.close()
            self._segments += [self._entry(f"{kind}-{done:09d}.parquet") for kind in ("grads", "steps")]
        state = {
            "step": done,
            "data": {name: w.state() for name, w in self._data.items()},
            "scheduler": None if job.scheduler is None else job.scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": rng_state(),
        }
        fields = self._store(done, state, job)
        if not self.writes:
            return
        write_manifest(self.folder, {"step": done, "config": self._config(), **fields, "segments": self._segments})
        self._state_name, self._state_files = fields["state"]["name"], _listed(fields)
        for old in [] if self.keeps else self.folder.glob("state-*.pt"):
            if old.name != self._state_name and old.name not in self._state_files:
                old.unlink(missing_ok=True)
        log.info("checkpoint after step %d in %s", step, self.folder)
        self._open_segments(self._next_end(done))

    @property
    def world_size(self) -> int:
        """The processes of the job (a checkpoint is resumed by a job of as many)."""
        return 1

    @property
    def writes(self) -> bool:
        """Whether this process writes the segments and `checkpoint.json` (one process; under torchrun, rank 0)."""
        return True

    def _store(self, done: int, state: dict[str, Any], job: Job) -> dict[str, Any]:
        """Save `state` with the model and optimizer in one file; the manifest's fields naming what was saved."""
        state = {**state, "model": _unwrap(job.model).state_dict(), "optimizer": job.optimizer.state_dict()}
        name = f"state-{done:09d}.pt"
        return {"state": {"name": name, "sha256": self._save(state, name)}}

    def _load(self, manifest: dict[str, Any], state: dict[str, Any], job: Job) -> None:
        """Load the model and optimizer of a verified checkpoint (`state` is this process's state file)."""
        _unwrap(job.model).load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optimizer"])

    def tee(self, writer: Any) -> Any:
        """`writer` writing into this checkpoint's open segment too."""
        return Tee(writer, self)

    def _entry(self, name: str) -> dict[str, Any]:
        """A closed segment as `checkpoint.json` lists it: what verifies it when resuming."""
        import pyarrow.parquet as pq

        path = self.folder / name
        return {"name": name, "sha256": file_digest(path), "rows": pq.read_metadata(path).num_rows,
                "run_id": self._run_id}  # fmt: skip

    def _save(self, state: dict[str, Any], name: str) -> str:
        """`torch.save` under a temp name, then moved into place; the file's SHA-256."""
        temp = self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as f:
                hashing = _Hashing(f)
                torch.save(state, hashing)  # type: ignore[arg-type]  # a file-like object with write()
            os.replace(temp, self.folder / name)
        finally:
            temp.unlink(missing_ok=True)
        return hashing.sha.hexdigest()

    def _config(self) -> dict[str, Any]:
        data = yaml.safe_load(self.config) or {}
        assert isinstance(data, dict), type(data)
        return data

    def abort(self) -> None:
        """Drop the open segment (the job ends between checkpoints)."""
        for w in (self._grads, self._steps):
            if w is not None:
                w.abort()
        self._grads = self._steps = None

    def finish(self) -> None:
        """The job's records are closed: the checkpoint is no longer needed (its states kept, with `keeps`)."""
        self.abort()
        if self.keeps and self.folder.is_dir():
            self._keep_states()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _keep_states(self) -> None:
        """Move every state file into `KEPT_DIR`, listed with its digest in `KEPT_MANIFEST` (written last)."""
        from gradrunner.records.atomic import write_atomically

        kept = self.directory / KEPT_DIR
        kept.mkdir(exist_ok=True)
        states = []
        for path in sorted(p for p in self.folder.iterdir() if _is_state(p.name)):
            os.replace(path, kept / path.name)
            match = _STATE_NAME.fullmatch(path.name)
            assert match is not None, path.name
            states.append({"step": int(match.group(1)), "name": path.name, "sha256": file_digest(kept / path.name)})
        body = {"run_id": self._run_id, "config": self._config(), "states": states}
        write_atomically(kept / KEPT_MANIFEST, json.dumps(body, indent=1) + "\n")

    # -- restoring --------------------------------------------------------------------------------
    def restore(self, job: Job, scaler: torch.amp.GradScaler, grads: Any, steps: Any, run_id: str) -> int:
        """Load the last checkpoint, if any, into `job` and `scaler`, replay its records into `grads`/`steps`;
        return the step to start from (0 without a usable checkpoint). Call it before the first step. A branch's
        start (`run.branch.seed`) takes what it marks from the job as built (`run.branch_state.take_fresh`)."""
        self._run_id = run_id
        self._watch(job)
        usable = self._usable()
        if usable is None:
            return 0
        manifest, state = usable
        fresh = hyperparameters(job.optimizer)  # as setup built them: what a branch's changed keys take
        self._load(manifest, state, job)
        if job.scheduler is not None and state["scheduler"] is not None:
            job.scheduler.load_state_dict(state["scheduler"])
        take_fresh(job.optimizer, job.scheduler, fresh, state)
        scaler.load_state_dict(state["scaler"])
        for name, watched in self._data.items():
            watched.replay(state["data"][name])
        self._replay_records(manifest["segments"], grads, steps, run_id)
        self._segments, self._state_name = list(manifest["segments"]), str(manifest["state"]["name"])
        self._state_files = _listed(manifest)
        set_rng_state(state["rng"])
        log.info("resumed from the checkpoint in %s: steps 0-%d replayed from it", self.folder, state["step"] - 1)
        return int(state["step"])

    def _watch(self, job: Job) -> None:
        """Count the data streams' batches from the start (`run.data_position`), to save and replay their position."""
        self._data = {"train": Watched(job.batches, "training data")}
        job.batches = self._data["train"]  # the eval set is drawn once before step 0 (`run.evaluation`): nothing to replay

    def _usable(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The verified manifest and the loaded state of the checkpoint here; None (said why, removed) if unusable."""
        found = self._verified()
        if isinstance(found, str):
            log.warning("the checkpoint in %s is not used: %s. It is removed, and the job runs from step 0 (its "
                        "records will be those of an uninterrupted run).", self.folder, found.rstrip("."))  # fmt: skip
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        return found

    def _verified(self) -> tuple[dict[str, Any], dict[str, Any]] | str | None:
        """The checkpoint here, verified and loaded; why it cannot be used; or None without one."""
        manifest, problem = read_manifest(self.directory)
        if problem is not None:
            return problem
        if manifest is None:
            return None
        diff = config_diff(manifest.get("config") or {}, self._config())  # `config_compare.NEUTRAL_KEYS` left out
        if diff:
            return f"it was written by a run of another config ({'; '.join(diff)})"
        if int(manifest.get("world_size", 1)) != self.world_size:
            return f"it was written by a job of {manifest.get('world_size', 1)} process(es), this one has {self.world_size}"
        entry = manifest["state"]
        path = self.folder / str(entry["name"])
        problem = segment_problem(path, entry) if not path.is_file() else _state_problem(path, entry["sha256"])
        if problem is not None:
            return problem
        for segment in manifest["segments"]:
            problem = segment_problem(self.folder / str(segment["name"]), segment)
            if problem is not None:
                return problem
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # verified bytes that still do not load: a torch that cannot read them
            return f"{path.name} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())})"
        overflow = [name for name, data in state["data"].items() if data["overflow"]]
        if overflow or set(state["data"]) != set(self._data):
            return (
                f"the {' and '.join(overflow)} data drew from torch's random generator at more than {MAX_DRAWS} "
                "batches (a random transform in the main process?), too many to replay exactly; give the DataLoader "
                "workers (num_workers > 0) so that transforms draw in them"
                if overflow else "it was written by a job with other data streams (an older gradrunner)"
            )  # fmt: skip
        return manifest, state

    def _replay_records(self, segments: list[dict[str, Any]], grads: Any, steps: Any, run_id: str) -> None:
        """Each pair of segments (the two tables' rows of the same steps) into the writers, signals deferred meanwhile."""
        from gradrunner.records.writer import deferred_signals

        for g, s in zip(segments[0::2], segments[1::2], strict=True):
            assert str(g["name"]).startswith("grads-") and str(s["name"]).startswith("steps-"), (g, s)
            rows = [_read_segment(self.folder / str(e["name"]), writer.schema, run_id)
                    for e, writer in ((g, grads), (s, steps))]  # fmt: skip
            with deferred_signals():  # an interrupt leaves both tables with the same steps
                for table, writer in zip(rows, (grads, steps), strict=True):
                    for batch in table.to_batches():
                        writer.write_batch(batch)
                grads.steps_written += rows[1].num_rows
                steps.steps_written += rows[1].num_rows


def _listed(fields: dict[str, Any]) -> set[str]:
    """The names of the per-rank state files and the DCP folder a manifest lists (none for one process)."""
    return {str(e["name"]) for e in fields.get("ranks", [])} | ({str(fields["dcp"]["name"])} if "dcp" in fields else set())


def _state_problem(path: Path, sha256: str) -> str | None:
    """Why the state file at `path` is not the one `checkpoint.json` recorded, or None."""
    try:
        same = file_digest(path) == sha256
    except OSError as e:
        return f"{path.name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    return None if same else f"{path.name} is not the file {MANIFEST} recorded (its bytes changed)"


def _read_segment(path: Path, schema: pa.Schema, run_id: str) -> pa.Table:
    """A verified segment's rows, every page's checksum checked, as `run_id`'s rows in `schema`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path, page_checksum_verification=True).read()
    table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                             pa.array([run_id] * table.num_rows, pa.string()))  # fmt: skip
    return table.cast(schema)


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
