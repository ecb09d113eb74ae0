"""The checks of `anomaly.replay` and `train.branch_from` (docs/autopsy.md), called by `config.schema.validate`.

Example::

    validate_replay(cfg)       # GradrunnerError: anomaly.replay=5 needs train.checkpoint_every ...
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from gradrunner.errors import GradrunnerError, not_allowed


def validate_replay(cfg: DictConfig) -> None:
    """Check `anomaly.replay` > 0 comes with the detector on (`anomaly.enabled`: it flags the spikes to replay),
    `train.checkpoint_every` (replay starts from a checkpoint), in one process (a torchrun job's per-rank
    checkpoints are not replayed).

    Example::

        validate_replay(compose("config", overrides=["anomaly.replay=5"]))
        # GradrunnerError: anomaly.replay=5 needs train.checkpoint_every ...
    """
    replay = OmegaConf.select(cfg, "anomaly.replay", default=0)  # an integer >= 0: `schema.validate` checked it
    every = int(OmegaConf.select(cfg, "train.checkpoint_every", default=0) or 0)
    if replay > 0 and OmegaConf.select(cfg, "anomaly.enabled", default=True) is False:
        raise GradrunnerError(
            f"anomaly.replay={replay} needs the spike detector, and anomaly.enabled=false turns it off: no spike is "
            "flagged, so there is none to replay. Set anomaly.enabled=true (the default) to replay each flagged loss "
            "spike, or anomaly.replay=0."
        )
    if replay > 0 and every <= 0:
        raise GradrunnerError(
            f"anomaly.replay={replay} needs train.checkpoint_every: a replay re-runs the steps before a loss spike "
            "from the last mid-run checkpoint at or before them, and this run writes none (train.checkpoint_every=0). "
            f"Set train.checkpoint_every=K (e.g. train.checkpoint_every={max(replay, 10)}; the replay starts at most K "
            "steps earlier than it needs), or anomaly.replay=0 to turn replay off."
        )
    world = _world()
    if replay > 0 and world > 1:  # every rank says it before step 0 (a sweep's check before any job)
        raise GradrunnerError(
            f"anomaly.replay={replay} is not allowed under torchrun (WORLD_SIZE={world}): a replay re-runs the steps "
            "before a loss spike from a kept single-process checkpoint (state-<step>.pt), and a torchrun job keeps "
            "its state per rank and in torch.distributed.checkpoint's dcp-<step>/ folder, which replay and branching "
            "do not read. Run it with anomaly.replay=0 under torchrun, or make the run, and its replay, in a single "
            "process (python -m gradrunner ... anomaly.replay=K train.checkpoint_every=N, without torchrun)."
        )


def check_branch(train: DictConfig) -> None:
    """`train.branch_from` is null or "<run dir>:<step>" (what is there is checked when the job starts), in one
    process (under torchrun the branch's single-process state would not be used: refused).

    Example::

        check_branch(cfg.train)     # GradrunnerError for train.branch_from='runs/a' (no step)
    """
    branch = train.get("branch_from")
    reset = train.get("branch_reset_moments", False)
    if not isinstance(reset, bool):
        raise not_allowed("train.branch_reset_moments", reset, ["false", "true"])
    if branch is None:
        if reset:
            raise GradrunnerError("train.branch_reset_moments=true needs train.branch_from=<run dir>:<step> (the "
                                  "moments are dropped where the branch starts); set both, or neither.")  # fmt: skip
        return
    where, _, step = str(branch).rpartition(":")
    if not isinstance(branch, str) or not where or not step.isdigit():
        raise GradrunnerError(
            f"train.branch_from={branch!r} is not allowed; it must be '<run dir>:<step>', a run dir and a step that "
            "has a kept checkpoint there, e.g. train.branch_from='outputs/2026-11-26/10-00-00-000000:25' "
            "(python -m gradrunner.autopsy lists them), or null."
        )
    world = _world()
    if world > 1:  # every rank says it before step 0; the runner seeds a branch only in one process
        raise GradrunnerError(
            f"train.branch_from={branch!r} is not allowed under torchrun (WORLD_SIZE={world}): a branch starts from a "
            "kept single-process checkpoint (state-<step>.pt: one model, one stream of batches), which the ranks of a "
            "torchrun job, each taking every WORLD_SIZE-th batch (and under fsdp2 or hsdp a shard of each parameter), "
            "cannot continue. Run the branch in a single process (python -m gradrunner ... "
            f"train.branch_from={branch}, without torchrun), or drop train.branch_from."
        )


def _world() -> int:
    """The number of processes of this job (torchrun's WORLD_SIZE; 1 without it)."""
    return int(os.environ.get("WORLD_SIZE") or 1)
