"""Sharded data parallel inside one job: `train.parallel=fsdp2|hsdp` (and the `train.shard` globs) under torchrun.

`train.parallel` picks how the ranks of a `torchrun` job hold the model (`ddp`, the default, is
`run.distributed.wrap`):

| value | what each rank holds | mesh |
| --- | --- | --- |
| `ddp` | the whole model, gradients all-reduced (`DistributedDataParallel`) | none |
| `fsdp2` | a `1/world` shard of every parameter (`fully_shard`), gathered for each block's compute | `(world,)` |
| `hsdp` | a `1/shard_size` shard, replicated over `world/shard_size` groups | `(replicate, shard)` |

Which modules become FSDP2 units is set by `train.shard` (globs over module paths, as taps match
modules: `fnmatch`, an exact module path first (`capturing.taps.is_glob`), the root `''` never matched; each glob's outermost matches, so `transformer.h.*` is
each block of `transformer.h`, not every module inside them); null (the default) shards each direct child
holding parameters, children sharing a parameter with another child left to the root. The root is
always sharded last. Every rank takes every `world`-th batch, starting at its rank (as under DDP).

Everything a user can get wrong is one paragraph (`GradrunnerError`, exit 2) before any step and
before any record is written: fsdp2/hsdp with one process (the `torchrun` command to use), a glob that
matches no module (the candidates), parameters `fully_shard` refuses (named), an hsdp world size that
does not factor into `replicate x shard_size`.

Example::

    torchrun --standalone --nproc_per_node=2 -m gradrunner +experiment=mlp train.parallel=fsdp2
    torchrun --standalone --nproc_per_node=4 -m gradrunner +experiment=mlp train.parallel=hsdp train.shard_size=2
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradrunner.capturing.taps import is_glob
from gradrunner.config.schema import PARALLEL_MODES
from gradrunner.errors import GradrunnerError, not_allowed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from gradrunner.run.build import Job

log = logging.getLogger(__name__)
#: Module paths listed at most in a "matches no module" paragraph.
_CANDIDATES_SHOWN = 20


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a job's ranks hold the model: `train.parallel`, `train.shard`, `train.shard_size` (validated)."""

    parallel: str = "ddp"
    shard: tuple[str, ...] | None = None
    shard_size: int | None = None

    @classmethod
    def of(cls, train: Any) -> Plan:
        """The plan `train.*` (a config node or mapping) asks for; the values' types were checked by the schema."""
        shard = train.get("shard")
        size = train.get("shard_size")
        return cls(str(train.get("parallel", "ddp")), None if shard is None else tuple(str(g) for g in shard),
                   None if size is None else int(size))  # fmt: skip

    @property
    def sharded(self) -> bool:
        return self.parallel in ("fsdp2", "hsdp")


def check_world(plan: Plan, world: int | None) -> None:
    """Refuse a plan the job's process count cannot run (one paragraph); call it before joining the group.

    Example::

        check_world(Plan("hsdp"), 6)       # fine: 3 replicas x 2 shards
        check_world(Plan("hsdp"), 5)       # GradrunnerError: ... 5 does not [factor] ...
    """
    if plan.parallel not in PARALLEL_MODES:
        raise not_allowed("train.parallel", plan.parallel, PARALLEL_MODES)
    if not plan.sharded:
        return
    if world is None or world < 2:  # config.schema.validate_train says so first, with the torchrun command
        raise GradrunnerError(f"train.parallel={plan.parallel} needs several processes (torchrun); this job is one")
    if plan.parallel == "hsdp":
        hsdp_shape(world, plan.shard_size)


def hsdp_shape(world: int, shard_size: int | None) -> tuple[int, int]:
    """The `(replicate, shard)` mesh of an HSDP job of `world` processes; both at least 2.

    `shard_size` null: the smallest factor of `world` from 2 that leaves at least 2 replicas.

    Example::

        hsdp_shape(4, None)     # (2, 2)
        hsdp_shape(8, 4)        # (2, 4)
    """
    if shard_size is None:
        for size in range(2, world // 2 + 1):
            if world % size == 0:
                return world // size, size
        raise GradrunnerError(
            f"train.parallel=hsdp needs the {world} processes to factor into replicas x shard groups, both at least 2 "
            f"(a 2-D mesh), and {world} does not. Start a world size that does (4: 2 x 2, 6: 3 x 2, 8: 4 x 2), or use "
            "train.parallel=fsdp2 (one shard group of every process)."
        )
    if shard_size < 2 or world % shard_size or world // shard_size < 2:
        raise GradrunnerError(
            f"train.shard_size={shard_size} does not factor the {world} processes of this hsdp job into replicas x "
            f"shard groups of {shard_size}, both at least 2; allowed here: "
            f"{', '.join(str(s) for s in range(2, world // 2 + 1) if world % s == 0) or 'none (see train.parallel=fsdp2)'}."
            " Fix train.shard_size (null picks one) or start another world size."
        )
    return world // shard_size, shard_size


def shard_targets(model: nn.Module, globs: Sequence[str] | None) -> list[str]:
    """The module paths `fully_shard` wraps for `train.shard` (`globs`), innermost first, without the root.

    Example::

        shard_targets(mlp, None)           # ['fc1', 'fc2', 'head']: each child holding parameters
        shard_targets(gpt2, ["transformer.h.*"])   # ['transformer.h.0', 'transformer.h.1']

    A glob matching no module is one paragraph listing the module paths it could have matched.
    """
    if globs is None:
        return _default_targets(model)
    names = [n for n, _ in model.named_modules() if n]
    chosen: list[str] = []
    for glob in globs:
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)] if is_glob(glob, names) else [glob] if glob in names else []
        if not hits:
            shown = ", ".join(names[:_CANDIDATES_SHOWN]) + (", ..." if len(names) > _CANDIDATES_SHOWN else "")
            raise GradrunnerError(
                f"train.shard glob {glob!r} matches no module of {type(model).__name__}; globs match module paths "
                f"(fnmatch: `*` spans dots, each glob's outermost matches are sharded, the root is never matched). Module paths: {shown or 'none'}. Fix the glob, "
                "or leave train.shard out (null: each child block holding parameters, then the root)."
            )
        hit = set(hits)  # a glob's outermost matches: `h.*` is each block, not every module inside one too
        chosen += [h for h in hits if h not in chosen and not any(a in hit for a in _ancestors(h))]
    order = {n: i for i, n in enumerate(names)}
    return sorted(chosen, key=lambda n: (-n.count("."), order[n]))  # a block inside another is wrapped first


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _default_targets(model: nn.Module) -> list[str]:
    """Each direct child holding parameters, except children sharing a parameter with another (left to the root)."""
    owners: dict[int, set[str]] = {}
    children = list(model.named_children())
    for name, child in children:
        for p in child.parameters():
            owners.setdefault(id(p), set()).add(name)
    shared = {n for names in owners.values() if len(names) > 1 for n in names}
    return [n for n, c in children if n not in shared and any(True for _ in c.parameters())]


def unshardable(model: nn.Module) -> list[str]:
    """Parameters `fully_shard` cannot shard (0-dimensional ones: it shards dim 0), by name.

    Example::

        unshardable(CosineRegression())     # ['a', 'b']
    """
    return [n for n, p in model.named_parameters() if p.dim() == 0]


def mesh_for(plan: Plan, world: int, device: torch.device) -> DeviceMesh:
    """The device mesh the plan shards over: `(world,)` for fsdp2, `(replicate, shard)` (named) for hsdp."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = device.type
    if plan.parallel == "hsdp":
        return init_device_mesh(kind, hsdp_shape(world, plan.shard_size), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (world,))


def shard_model(model: nn.Module, targets: Sequence[str], mesh: DeviceMesh) -> None:
    """`fully_shard` each target module, then the root; a parameter FSDP2 refuses is one paragraph naming it.

    Example::

        shard_model(model, shard_targets(model, None), init_device_mesh("cpu", (2,)))
    """
    from torch.distributed.fsdp import fully_shard

    bad = unshardable(model)
    if bad:
        raise GradrunnerError(
            f"train.parallel=fsdp2/hsdp cannot shard {type(model).__name__}: FSDP2 shards every parameter along its "
            f"first dimension, and {', '.join(bad)} {'is a 0-dimensional parameter' if len(bad) == 1 else 'are 0-dimensional parameters'}"
            " (a scalar). Make them 1-element vectors in the model (nn.Parameter(torch.tensor([v]))), or run it with "
            "train.parallel=ddp."
        )
    split = split_parameters(model, targets)
    if split:
        raise GradrunnerError(
            f"train.shard={list(targets)} puts one parameter into two FSDP2 units of {type(model).__name__}: "
            f"{'; '.join(split)}. FSDP2 needs a shared (tied) parameter in one unit: shard a module holding all of "
            "its users (or none of them: the root then holds it), or run it with train.parallel=ddp."
        )
    modules = dict(model.named_modules())
    for name in [*targets, ""]:
        try:
            fully_shard(modules[name], mesh=mesh)
        except (ValueError, RuntimeError, AssertionError) as e:
            where = f"module {name!r}" if name else "the root module"
            raise GradrunnerError(
                f"FSDP2 could not shard {where} of {type(model).__name__} (train.shard={list(targets)}): "
                f"{' '.join(str(e).split())} Choose other train.shard globs (e.g. put modules that share a parameter "
                "under one parent and shard the parent), or run it with train.parallel=ddp."
            ) from e


def split_parameters(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Tied parameters that `targets` would put into two units (each unit holds what no inner unit does), described.

    Example::

        split_parameters(gpt2, ["transformer", "lm_head"])
        # ["transformer.wte.weight (also lm_head.weight) in units 'transformer' and 'lm_head'"]
    """
    units: dict[int, dict[str, str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        unit = max((t for t in targets if owner == t or owner.startswith(t + ".")), key=len, default="")
        units.setdefault(id(p), {}).setdefault(unit, name)
    out = []
    for where in units.values():
        if len(where) > 1:
            (first, *others) = where.values()
            out.append(
                f"{first} (also {', '.join(others)}) in units {' and '.join(repr(u or '<root>') for u in where)}"
            )
    return out


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter],
                      after: dict[str, nn.Parameter]) -> None:  # fmt: skip
    """Point `optimizer` (built before sharding, no state yet) at the sharded parameters, name by name."""
    by_id = {id(p): after[n] for n, p in before.items() if n in after}
    for group in optimizer.param_groups:
        group["params"] = [by_id.get(id(p), p) for p in group["params"]]
    assert not optimizer.state, "the optimizer stepped before the model was sharded"


def shard_job(job: Job, plan: Plan, rank: int, world: int) -> Job:
    """The job with its model sharded by `plan`, its optimizer over the shards, its batches partitioned.

    Example::

        job = shard_job(setup(cfg), Plan("fsdp2"), rank, world)    # job.model: the same module, now an FSDPModule
    """
    model = job.model
    targets = shard_targets(model, plan.shard)
    before = dict(model.named_parameters())
    shard_model(model, targets, mesh_for(plan, world, job.device))
    after = dict(model.named_parameters())
    repoint_optimizer(job.optimizer, before, after)
    held = sum(_local(p).numel() for p in after.values())
    log.info("%s: sharded %s, then the root; this rank holds %d of %d parameter elements", plan.parallel,
             ", ".join(targets) or "nothing else", held, sum(p.numel() for p in after.values()))  # fmt: skip
    batches = itertools.islice(job.batches, rank, None, world)
    return dataclasses.replace(job, batches=batches)


def _local(p: torch.Tensor) -> torch.Tensor:
    local = getattr(p, "to_local", None)  # a DTensor's own piece
    return local() if callable(local) else p


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is an FSDP2 module (`fully_shard` was applied to it); imports nothing when FSDP2 never was."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Around one micro-batch of an FSDP2 model: reduce-scatter the gradients only when `sync` (the step's last)."""
    if sync:
        yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDPModule's; recurses into the units
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
