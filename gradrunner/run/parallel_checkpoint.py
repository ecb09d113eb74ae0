"""Mid-run checkpoints of a torchrun job (DDP, FSDP2, HSDP): the model and optimizer through `torch.distributed.checkpoint`.

The single-process checkpoint (`run.checkpoint`) holds everything in one `state-<step>.pt`. Under
torchrun each rank holds its own piece of the state, so a checkpoint's folder (the job dir's
`.checkpoint/`, the same one, verified the same way) holds:

| file | written by | what |
| --- | --- | --- |
| `dcp-<step>/` | every rank (a collective) | `torch.distributed.checkpoint` of the model and optimizer state dicts (`get_state_dict`: DDP's whole tensors, FSDP2's shards as `DTensor`s) |
| `state-<step>.rank<r>.pt` | rank r | its scheduler, GradScaler, RNG states and data position (each rank draws its own batches) |
| `grads-<step>.parquet`, `steps-<step>.parquet` | rank 0 | every rank's records of the steps since the last checkpoint (rank 0 writes the job's records) |
| `checkpoint.json` | rank 0, last | the step, the config, `world_size`, every file above with its SHA-256 (the DCP folder's files each) |

Saving: every rank saves its DCP piece into a hidden temp folder and its state file, then rank 0
gathers their digests, moves the DCP folder into place and writes the manifest: a kill at any moment
leaves the previous checkpoint whole. Resuming: rank 0 verifies every file (the records' segments,
each rank's state file, each DCP file) and the config and world size; its answer goes to every rank;
each rank then loads the DCP state (`set_state_dict`) and its own state file, and rank 0 replays the
segments into the job's records. A checkpoint of another world size or config is not used (the job
runs from step 0, said in a warning), as a single-process one.

Example::

    torchrun --standalone --nproc_per_node=2 -m gradrunner +experiment=mlp train.parallel=fsdp2 \\
        train.checkpoint_every=50 hydra.run.dir=runs/a          # killed at step 130
    torchrun ... (the same) resume=true                         # goes on from step 100
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradrunner.records.checkpoint_files import MANIFEST, file_digest
from gradrunner.run.checkpoint import Checkpointer, Tee

if TYPE_CHECKING:
    from gradrunner.run.build import Job
    from gradrunner.run.distributed import Distributed

log = logging.getLogger(__name__)


@dataclass
class ShardedCheckpointer(Checkpointer):
    """`Checkpointer` for one rank of a torchrun job (`dist`): DCP for the model and optimizer, rank 0 keeps the books."""

    dist: Distributed | None = None

    @property
    def _d(self) -> Distributed:
        assert self.dist is not None, "a ShardedCheckpointer needs the job's Distributed"
        return self.dist

    @property
    def world_size(self) -> int:
        return self._d.world_size

    @property
    def writes(self) -> bool:
        return self._d.is_main

    # -- saving ---------------------------------------------------------------------------------
    def _store(self, done: int, state: dict[str, Any], job: Job) -> dict[str, Any]:
        """Every rank: its DCP piece and its state file; rank 0: the DCP folder moved into place, the manifest's fields."""
        import torch.distributed.checkpoint as dcp

        d = self._d
        self.folder.mkdir(exist_ok=True)
        name = f"dcp-{done:09d}"
        temp = self.folder / f".{name}.tmp"
        dcp.save(_model_state(job), checkpoint_id=temp)  # a collective: every rank's piece is written when it returns
        own = f"state-{done:09d}.rank{d.rank}.pt"
        entries = d.gather({"name": own, "sha256": self._save(state, own)})
        if not d.is_main:
            return {}
        final = self.folder / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temp, final)
        files = [{"name": p.name, "sha256": file_digest(p)} for p in sorted(final.iterdir())]
        return {
            "state": entries[0],
            "ranks": entries,
            "world_size": d.world_size,
            "dcp": {"name": name, "files": files},
        }

    def tee(self, writer: Any) -> Any:
        """The gathered `writer` (every rank's) with rank 0's real writer writing into the open segment too."""
        if getattr(writer, "writer", None) is not None:
            writer.writer = RankTee(writer.writer, self)
        return writer

    def finish(self) -> None:
        """The job's records are closed: rank 0 removes the checkpoint."""
        if self._d.is_main:
            super().finish()
        else:
            self.abort()

    # -- restoring --------------------------------------------------------------------------------
    def _usable(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Rank 0 verifies (and removes an unusable checkpoint, saying why); every rank loads its own state file."""
        d = self._d
        manifest = None
        if d.is_main:
            found = super()._usable()
            manifest = None if found is None else found[0]
        manifest = d.broadcast(manifest)
        if manifest is None:
            return None
        own = manifest["ranks"][d.rank]
        return manifest, torch.load(self.folder / str(own["name"]), map_location="cpu", weights_only=True)

    def _verified(self) -> tuple[dict[str, Any], dict[str, Any]] | str | None:
        found = super()._verified()
        if not isinstance(found, tuple):
            return found
        manifest = found[0]
        for entry in manifest["ranks"]:
            problem = _problem(self.folder / str(entry["name"]), entry)
            if problem is not None:
                return problem
        folder = self.folder / str(manifest["dcp"]["name"])
        listed = {str(e["name"]) for e in manifest["dcp"]["files"]}
        extra = sorted({p.name for p in folder.iterdir()} - listed) if folder.is_dir() else []
        if extra:
            return f"{folder.name}/ holds files {MANIFEST} does not list ({', '.join(extra)})"
        for entry in manifest["dcp"]["files"]:
            problem = _problem(folder / str(entry["name"]), entry)
            if problem is not None:
                return f"{folder.name}/{problem}"
        return found

    def _load(self, manifest: dict[str, Any], state: dict[str, Any], job: Job) -> None:
        """Every rank: the model and optimizer from the DCP folder (a collective), resharded as this job holds them."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        loaded = _model_state(job)
        dcp.load(loaded, checkpoint_id=self.folder / str(manifest["dcp"]["name"]))
        set_state_dict(job.model, job.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    def _replay_records(self, segments: list[dict[str, Any]], grads: Any, steps: Any, run_id: str) -> None:
        """Rank 0 replays the segments into the job's real writers; every rank counts the steps."""
        if self._d.is_main:
            super()._replay_records(segments, grads.writer, steps.writer, run_id)
        done = sum(int(s["rows"]) for s in segments if str(s["name"]).startswith("steps-")) // self._d.world_size
        grads.steps_written += done
        steps.steps_written += done


def _problem(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the file at `path` is not the one the manifest recorded (missing, unreadable, other bytes), or None."""
    try:
        same = file_digest(path) == entry["sha256"]
    except OSError as e:
        return f"{path.name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    return None if same else f"{path.name} is not the file {MANIFEST} recorded (its bytes changed)"


def _model_state(job: Job) -> dict[str, Any]:
    """The model and optimizer state dicts as DCP saves and loads them (DDP unwrapped, FSDP2 as DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


class RankTee(Tee):
    """Rank 0's real writer and the checkpoint's segment, both told which rank's rows come next (`rank`)."""

    @property
    def rank(self) -> int:
        return int(self.main.rank)

    @rank.setter
    def rank(self, rank: int) -> None:
        self.main.rank = rank
        for segment in (self.ckpt._grads, self.ckpt._steps):
            if segment is not None:
                segment.rank = rank
