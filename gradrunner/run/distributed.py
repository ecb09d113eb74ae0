"""Distributed data parallel inside one job: `torchrun --nproc_per_node=2 -m gradrunner +experiment=mlp`.

When `WORLD_SIZE > 1` (torchrun sets it), each rank joins one process group (gloo on CPU, nccl on
CUDA, each rank on `cuda:<LOCAL_RANK>`), wraps the model in `DistributedDataParallel`, and takes
every `WORLD_SIZE`-th batch of the data starting at its rank (a partition of the batch stream, as
`DistributedSampler` does for a dataset). Taps are placed on the inner module, so tap names are the
plain model's. What the records hold:

- activation (output/input/local) gradients: per rank, each from its own batch;
- parameter gradients: as DDP leaves them after backward, averaged over the ranks, the same on
  every rank, whatever the strategy: the capture reads a parameter tap from `.grad` at the end of a
  backward that synchronised (`capture_target`), after DDP's all-reduce. Under gradient accumulation
  DDP synchronises only on the step's last micro-batch (`micro_batch`), as nanoGPT does.
  `autograd_grad` computes its taps with `torch.autograd.grad` and lets `loss.backward()` fill
  `.grad` (DDP's reducer must see that backward), so the optimiser step is the same for all three.

Records: rank 0 gathers every rank's rows each captured step and writes one `grads.parquet` (and
`steps.parquet`) with a `rank` column, so a job is still one file and no two ranks write the same
file. Rank 0 keeps the books (the run dir, `done.json`, the report); the other ranks move their
Hydra log into rank 0's run dir as `gradrunner.rank<N>.log` and remove their own empty run dir.

Example::

    torchrun --standalone --nproc_per_node=2 -m gradrunner +experiment=mlp steps=10
    df = pd.read_parquet("outputs/.../grads.parquet"); df.groupby("rank").norm.mean()
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradrunner.capturing.params import ddp_synced
from gradrunner.errors import GradrunnerError
from gradrunner.run import parallel
from gradrunner.run.parallel import Plan

if TYPE_CHECKING:
    from gradrunner.records.writer import RecordWriter, StepsWriter  # pyarrow: imported when writing starts
    from gradrunner.run.build import Job

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def world_from_env() -> tuple[int, int, int] | None:
    """`(rank, world_size, local_rank)` from torchrun's environment, or None outside a multi-process job.

    Example::

        world_from_env()   # (1, 2, 1) in the second process of `torchrun --nproc_per_node=2`
    """
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return None
    rank = int(os.environ.get("RANK", "0") or 0)
    return rank, size, int(os.environ.get("LOCAL_RANK", str(rank)) or rank)


@dataclass
class Distributed:
    """This process's place in the job, and the few collectives the runner needs."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    #: The job's run id, the same on every rank (rank 0's).
    run_id: str = ""
    #: How the ranks hold the model (`train.parallel`, `train.shard`: `run.parallel`); DDP by default.
    plan: Plan = dataclasses.field(default_factory=Plan)

    @classmethod
    def joined(cls, local_rank: int | None = None) -> Distributed:
        """This process's place in the process group already initialised, with rank 0's run id on every rank.

        Example::

            d = Distributed.joined()     # under torchrun, Lightning's DDP or HF's accelerate
            d.run_id                     # the same on every rank

        The one place where a job's run id goes to every rank (a collective: call it on every rank).
        """
        rank = dist.get_rank()
        local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        d = cls(rank, dist.get_world_size(), local, str(dist.get_backend()))
        d.run_id = d.broadcast(uuid.uuid4().hex)
        return d

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes the records and keeps the books."""
        return self.rank == 0

    def broadcast(self, obj: _T) -> _T:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_main(self, fn: Callable[[], _T]) -> _T:
        """`fn()` run on rank 0 only, its result on every rank, or what it raised raised on every rank (a collective:
        call it on every rank).

        Example::

            start = d.from_main(open_books)     # rank 0 reads the run dir's books; every rank learns the step
                                                # or raises rank 0's Refused (the dir already holds records)

        Without the raise the other ranks went on into training and waited in their first collective for a rank 0
        that had stopped (a hang). An exception that does not pickle comes as a RuntimeError naming it.
        """
        if not self.is_main:
            asked: tuple[bool, Any] = (True, None)  # replaced by rank 0's (ok, result or exception)
            ok, value = self.broadcast(asked)
            if not ok:
                raise value
            return cast(_T, value)
        try:
            value = fn()
        except Exception as e:
            self.broadcast((False, _portable(e)))
            raise
        self.broadcast((True, value))
        return value

    def gather(self, obj: _T) -> list[_T]:
        """Every rank's `obj`, in rank order, on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def device_config(self, cfg: DictConfig) -> DictConfig:
        """`cfg` with `device=cuda:<LOCAL_RANK>` when the job runs on CUDA; unchanged on CPU."""
        if self.backend != "nccl" or str(cfg.device).startswith("cuda:"):
            return cfg
        local = cfg.copy()
        local.device = f"cuda:{self.local_rank}"
        return local

    def shared_dir(self, own: Path) -> Path:
        """Rank 0's run dir, for every rank; another rank moves its log there and drops its own empty dir."""
        main = Path(self.broadcast(str(own)))
        if main != own:
            _move_into(own, main, self.rank)
        return main


def joined_group() -> Distributed | None:
    """This process's place when a process group of several processes is initialised (a collective), else None.

    Example::

        joined_group()      # None in a plain script; under torchrun, `Distributed.joined()`
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    return Distributed.joined()


def _portable(e: Exception) -> Exception:
    """`e` if it pickles (to be raised on the other ranks), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(f"rank 0 raised {type(e).__name__}: {e}")
    return e


def _backend(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _check_own_gpu(rank: int, local_rank: int, device: str) -> None:
    """Refuse (one paragraph) a rank that has no GPU of its own: nccl gives local rank L the device cuda:L."""
    gpus = torch.cuda.device_count()
    if local_rank >= gpus:
        raise GradrunnerError(
            f"rank {rank} is process {local_rank + 1} on its machine, but the machine has {gpus} CUDA device(s), and "
            f"device={device} gives each process a GPU of its own (nccl). Start at most {gpus} process(es) per "
            f"machine (torchrun --nproc_per_node={gpus}), or train on the CPU with device=cpu (gloo)."
        )


@contextlib.contextmanager
def session(cfg: DictConfig) -> Iterator[Distributed | None]:
    """The job's place in the process group (None when not under torchrun); joined once per process.

    Example::

        with session(cfg) as dist:
            if dist is not None: print(dist.rank, dist.world_size)
    """
    world = world_from_env()
    plan = Plan.of(cfg.train)
    parallel.check_world(plan, None if world is None else world[1])  # before the group: one paragraph, exit 2
    if world is None:
        yield None
        return
    rank, size, local_rank = world
    backend = _backend(str(cfg.device))
    if backend == "nccl":
        _check_own_gpu(rank, local_rank, str(cfg.device))
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # Once per process, for every job of a sweep: re-creating the group per job races on torchrun's store.
        dist.init_process_group(backend=backend)
        atexit.register(_leave)
    d = Distributed.joined(local_rank)
    d.plan = plan
    prefix, handlers = _RankPrefix(rank), list(logging.getLogger().handlers)
    for handler in handlers:  # every rank logs to the terminal: say which one each line is from
        handler.addFilter(prefix)
    try:
        log.info("rank %d of %d (%s, %s)", rank, size, backend, plan.parallel)
        yield d
    finally:
        for handler in handlers:
            handler.removeFilter(prefix)


class _RankPrefix(logging.Filter):
    """Prefixes each log line with `[rank N] ` once (the record is shared by every handler)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "gradrunner_rank_prefixed", False):
            record.msg = self.prefix + str(record.msg)
            record.gradrunner_rank_prefixed = True
        return True


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _move_into(own: Path, main: Path, rank: int) -> None:
    """Move this rank's Hydra log into `main`; remove `own` if nothing but Hydra's files is left."""
    main.mkdir(parents=True, exist_ok=True)
    for logfile in own.glob("*.log"):
        with contextlib.suppress(OSError):  # the open log handler follows the file (same filesystem)
            os.replace(logfile, main / f"{logfile.stem}.rank{rank}.log")
    if {p.name for p in own.iterdir()} <= {".hydra"}:
        shutil.rmtree(own, ignore_errors=True)
        with contextlib.suppress(OSError):
            own.parent.rmdir()  # the date dir, only if this was its last run


def wrap(job: Job, d: Distributed) -> Job:
    """The job with its model in DDP (or sharded: `d.plan`, `run.parallel`) and its batch stream partitioned over the ranks.

    Example::

        job = wrap(setup(cfg), d)     # job.model: DDP; unwrap(job.model): the user's model
    """
    if d.plan.sharded:
        return parallel.shard_job(job, d.plan, d.rank, d.world_size)
    try:
        ddp = DistributedDataParallel(job.model, device_ids=[job.device.index] if job.device.type == "cuda" else None)
    except (RuntimeError, ValueError, AssertionError) as e:
        raise GradrunnerError(
            f"could not wrap the model in DistributedDataParallel for {d.world_size} processes: "
            f"{' '.join(str(e).split())}. Run it as one process (without torchrun), or give it trainable parameters."
        ) from e
    batches = itertools.islice(job.batches, d.rank, None, d.world_size)
    return dataclasses.replace(job, model=ddp, batches=batches)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapper (the model itself otherwise): taps are resolved on it."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def capture_target(model: nn.Module) -> tuple[nn.Module, Callable[[], bool] | None]:
    """What a capture session taps for `model`, and (under DDP) whether a backward that ended synchronised.

    Example::

        inner, synced = capture_target(ddp_model)
        capture(inner, taps, params_synced=synced)      # parameter taps: `.grad` after DDP's all-reduce

    The rule for `synced` is `capturing.params.ddp_synced` (what `capture(ddp_model, ...)` takes itself).
    """
    return unwrap(model), ddp_synced(model)


def micro_batch(model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """Around one micro-batch's forward and backward: DDP synchronises the gradients only on the `last` one.

    Example::

        for m in range(n):
            with micro_batch(job.model, last=m == n - 1):
                loss = model(x); loss.backward()
    """
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    if not last and parallel.is_sharded(model):
        return parallel.gradient_sync(model, False)  # FSDP2: reduce-scatter on the last micro-batch only
    return contextlib.nullcontext()


class GatheredWriter:
    """A writer every rank calls; rank 0 writes each rank's rows, with its `rank`, through one real writer.

    Example::

        grads, steps = open_writers(stack, files, d)     # (gradrunner.run.writers)
        grads.write_step(step, records)        # on every rank, the same steps in the same order
        steps.write(step, ...)                 # the step's grads rows are written now, with its steps row

    A step's rows reach the files only once both tables' rows of that step are gathered (the grads
    rows wait for the steps row), and then in one block with signals deferred: a rank that dies
    between the two gathers leaves neither table with the step, as on the single-process path.
    """

    def __init__(self, d: Distributed, writer: RecordWriter | StepsWriter | None,
                 pending: list[tuple[GatheredWriter, str, list[Any]]] | None = None,
                 completes_step: bool = False) -> None:  # fmt: skip
        self.dist, self.writer = d, writer
        self.steps_written = 0
        #: Gathered calls waiting for the step's last table (shared by a job's two writers).
        self.pending: list[tuple[GatheredWriter, str, list[Any]]] = [] if pending is None else pending
        self.completes_step = completes_step
        #: Rank 0: the last call's arguments from every rank, in rank order (the spike detector's mean loss).
        self.last: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def write_step(self, step: int, records: Any, **kwargs: Any) -> None:
        self._write_all("write_step", step, records, **kwargs)

    def write(self, *args: Any, **kwargs: Any) -> None:
        self._write_all("write", *args, **kwargs)

    def _write_all(self, method: str, *args: Any, **kwargs: Any) -> None:
        gathered = self.dist.gather((args, kwargs))
        self.steps_written += 1
        if self.writer is None:
            return
        self.last = gathered
        self.pending.append((self, method, gathered))
        if not self.completes_step:
            return
        from gradrunner.records.writer import deferred_signals

        queued, self.pending[:] = list(self.pending), []
        with deferred_signals():  # both tables' rows of the step, or neither
            for owner, name, per_rank in queued:
                assert owner.writer is not None
                for rank, (rank_args, rank_kwargs) in enumerate(per_rank):
                    owner.writer.rank = rank
                    getattr(owner.writer, name)(*rank_args, **rank_kwargs)
