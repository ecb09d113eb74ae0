"""Branching: a new run that starts from another run's kept checkpoint with a changed config (`train.branch_from`).

A run made with `anomaly.replay=K` keeps the checkpoints a replay or an autopsy starts from in
`<run dir>/checkpoints/` (`run.checkpoint.KEPT_DIR`). `train.branch_from='<run dir>:<step>'` starts a
new run (its own dir and run id) from the kept state before `<step>`: model, optimizer, scheduler,
GradScaler, generators and data position, as `resume=true` continues a run. From there the branch runs
its own config; a change of an `optimizer.*` hyperparameter (`lr`, `weight_decay`, `betas`, ...) is put
into the loaded optimizer state (`run.branch_state`: a changed `lr` scales every rate the optimizer and a
stock scheduler hold by new/old: `lr`, `initial_lr`, OneCycleLR's `max_lr`/`min_lr`, the scheduler's
base, last, max and min rates and `eta_min`; any other is each param group's value as a fresh run of the
branch's config builds it, so `optimizer.no_decay`'s group keeps `weight_decay` 0.0); a change of a
`scheduler.*` key (or another scheduler option) is the branch's own scheduler, built from its config and
stepped to `<step>`; a changed `optimizer._target_` or `optimizer.no_decay` is refused (the state cannot
take it); `train.branch_reset_moments=true` drops the optimizer's per-parameter state. The keys a branch
differs in by being one (`BRANCH_KEYS`: its `steps`, ...) change nothing else: a key that interpolates
them (`scheduler.T_max: ${steps}`) is compared at the source's value, so a branch that only runs longer
keeps the source's schedule. `<step>` 0 needs no checkpoint: the branch is the config run from its seed.

The branch's records start at `<step>` (the steps before are the source run's records, not the
branch's). Its provenance is its config (`done.json`) and `branch.json`: the source dir, run id and
step, the state file's SHA-256 and the changed keys. `seed(dir, cfg)` puts the state into the new
dir's `.checkpoint/` as the checkpoint a resume would use, so an interrupted branch resumes from its
own later checkpoints like any run, and a sweep of branches is re-runnable like any sweep.

`SkipBatches` (a data source) leaves out given batches of another source: a branch that skips a step.

Example::

    python -m gradrunner +experiment=mlp train.branch_from=outputs/a:25 optimizer.lr=0.05
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from gradrunner.data import Batch, as_batches
from gradrunner.errors import GradrunnerError
from gradrunner.records import rundir
from gradrunner.records.anomalies import run_id_source
from gradrunner.records.atomic import write_atomically
from gradrunner.records.checkpoint_files import CHECKPOINT_DIR, file_digest, read_manifest, write_manifest
from gradrunner.run.branch_state import changed_state
from gradrunner.run.checkpoint import KEPT_DIR, KEPT_MANIFEST
from gradrunner.run.config_compare import NEUTRAL_KEYS, config_dict, config_diff

log = logging.getLogger(__name__)

#: The branch's provenance in its run dir.
BRANCH_FILE = "branch.json"
#: Keys a branch differs in by being a branch (left out of `branch.json`'s changed keys).
BRANCH_KEYS = ("train.branch_from", "train.branch_reset_moments", "steps", "train.checkpoint_every", "anomaly.replay")


@dataclass(frozen=True)
class Kept:
    """A run's kept checkpoints (`kept.json`): its run id and config, and each state file by step."""

    run_dir: Path
    run_id: str
    config: dict[str, Any]
    states: dict[int, dict[str, Any]]

    def path(self, step: int) -> Path:
        return self.run_dir / KEPT_DIR / str(self.states[step]["name"])

    def before(self, step: int) -> int | None:
        """The last kept step at or before `step` (a branch from it reaches `step`), or None."""
        at = [s for s in self.states if s <= step]
        return max(at) if at else None


def kept(run_dir: str | Path) -> Kept:
    """The kept checkpoints of `run_dir`; `GradrunnerError` (one paragraph) when it has none.

    Example::

        kept("outputs/a").states.keys()     # dict_keys([25])
    """
    d = Path(run_dir)
    path = d / KEPT_DIR / KEPT_MANIFEST
    if not d.is_dir():
        raise GradrunnerError(f"{d} does not exist; give the dir of a run made with anomaly.replay=K and "
                              "train.checkpoint_every=N (it keeps the checkpoints a branch starts from)")  # fmt: skip
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        states = {int(s["step"]): s for s in data["states"]}
        found = Kept(d, str(data["run_id"]), dict(data["config"]), states)
    except FileNotFoundError:
        raise GradrunnerError(
            f"{d} has no kept checkpoints ({KEPT_DIR}/{KEPT_MANIFEST}); a branch starts from one. Run the source "
            "with train.checkpoint_every=N and anomaly.replay=K (it keeps the checkpoints before its loss spikes), "
            "or branch from step 0 (train.branch_from=<run dir>:0)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GradrunnerError(f"{path} cannot be read ({type(e).__name__}: {e}); it is not a manifest gradrunner "
                              "wrote. Make the source run again with anomaly.replay=K") from e  # fmt: skip
    _check_own(found, path)
    return found


def _check_own(found: Kept, path: Path) -> None:
    """`kept.json` names the run dir's own run (`done.json`'s id, else its records'), as `anomalies.parquet` must."""
    try:
        own = run_id_source(found.run_dir)
    except rundir.Damaged as e:
        raise GradrunnerError(f"the run id of {found.run_dir} cannot be read ({e}), so its kept checkpoints "
                              f"({path}) cannot be told to be its own; make the run again") from e  # fmt: skip
    if own is not None and own[0] != found.run_id:
        raise GradrunnerError(
            f"{path} was written for run {found.run_id}, not for run {own[0]} ({own[1]} of {found.run_dir}): the kept "
            f"checkpoints of another run (copied or moved into {found.run_dir / KEPT_DIR}), which no branch or autopsy "
            f"of this run starts from; nothing was run. Put back this run's own {KEPT_DIR}/ folder, or branch from the "
            "run that wrote them (train.branch_from=<its dir>:<step>)"
        )


def parse(branch_from: str) -> tuple[Path, int]:
    """`'<run dir>:<step>'` as (dir, step) (`config.replay.check_branch` checked the form)."""
    where, _, step = branch_from.rpartition(":")
    return Path(where).expanduser().resolve(), int(step)


def _job_config(cfg: DictConfig) -> dict[str, Any]:
    """The config as `run.loop` writes it into a checkpoint (neutral keys left out), as plain values."""
    text = OmegaConf.to_yaml({k: v for k, v in config_dict(cfg).items() if k not in NEUTRAL_KEYS})
    data = yaml.safe_load(text) or {}
    assert isinstance(data, dict)
    return data


_MISSING = object()


def _as_source(cfg: DictConfig, source: dict[str, Any]) -> DictConfig:
    """`cfg` with the `BRANCH_KEYS` the source's config has at the source's values: what the branch changes.

    A key that interpolates one (`scheduler.T_max: ${steps}`) is then the source's too: a branch that only runs
    longer or shorter keeps the source's schedule."""
    same = copy.deepcopy(cfg)
    for key in BRANCH_KEYS:
        node: Any = source
        for part in key.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            OmegaConf.update(same, key, node, merge=False)
    return same


def seed(directory: Path, cfg: DictConfig) -> None:
    """Before the branch's first step: its starting state as the checkpoint in `directory`, and `branch.json`.

    Example::

        seed(job_dir, cfg)     # nothing without train.branch_from; a checkpoint of the branch's own is kept

    A checkpoint the branch wrote itself (an interrupted branch) is left for `resume` to continue from.
    Bad input is one paragraph: a source with no kept checkpoints, a step with none (the kept steps
    listed), a state file whose bytes changed.
    """
    branch_from = OmegaConf.select(cfg, "train.branch_from", default=None)
    if branch_from is None:
        return
    source, step = parse(str(branch_from))
    manifest, _ = read_manifest(directory)
    if manifest is not None and int(manifest.get("step", -1)) >= step:
        return  # the branch's own checkpoint (or its seed): a resume continues from there
    own = _job_config(cfg)
    provenance: dict[str, Any] = {"from": str(source), "step": step, "run_id": None, "state_sha256": None}
    if step > 0:
        k = kept(source)
        if step not in k.states:
            steps = ", ".join(map(str, sorted(k.states))) or "none"
            raise GradrunnerError(
                f"train.branch_from={branch_from!r}: {source} has no kept checkpoint before step {step}; it keeps the "
                f"checkpoints before steps {steps} (or branch from step 0: the config run from its seed)"
            )
        path = k.path(step)
        if not path.is_file():
            raise GradrunnerError(f"train.branch_from={branch_from!r}: {path}, the state {KEPT_MANIFEST} lists for step "
                                  f"{step}, is missing (deleted or moved); make the source run again")  # fmt: skip
        if file_digest(path) != k.states[step]["sha256"]:
            raise GradrunnerError(f"train.branch_from={branch_from!r}: {path} is not the file {KEPT_MANIFEST} recorded "
                                  "(its bytes changed after it was written); make the source run again")  # fmt: skip
        state = torch.load(path, map_location="cpu", weights_only=True)
        compared = _job_config(_as_source(cfg, k.config))  # the branch's horizon and books set aside
        changed_state(state, k.config, compared, bool(OmegaConf.select(cfg, "train.branch_reset_moments", default=False)))
        folder = directory / CHECKPOINT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        name = f"state-{step:09d}.pt"
        torch.save(state, folder / f".{name}.tmp")
        (folder / f".{name}.tmp").replace(folder / name)
        write_manifest(folder, {"step": step, "config": own, "state": {"name": name, "sha256": file_digest(folder / name)},
                                "segments": []})  # fmt: skip
        provenance.update(run_id=k.run_id, state_sha256=k.states[step]["sha256"],
                          changed=[d for d in config_diff(k.config, compared) if d.split(":")[0] not in BRANCH_KEYS])  # fmt: skip
    write_atomically(directory / BRANCH_FILE, json.dumps(provenance, indent=1) + "\n")
    log.info("branch from %s before step %d (%s)", source, step, ", ".join(provenance.get("changed") or []) or "no change")


class SkipBatches:
    """The batches of `inner` without those numbered in `skip` (counted from 0 over `inner`'s batches).

    Example::

        SkipBatches(inner=Synthetic(), skip=[30])    # a branch that leaves out step 30's batch

    With `train.accumulate=N`, step S takes batches S*N .. S*N+N-1. Its evaluation data (`held_out`) is the
    inner source's, so `train.eval_every` measures the branch on the run's evaluation set.
    """

    def __init__(self, inner: object, skip: Sequence[int]) -> None:
        self.inner, self.skip = inner, frozenset(int(i) for i in skip)

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Batch]:
        for i, batch in enumerate(as_batches(self.inner, device, dtype)):
            if i not in self.skip:
                yield batch

    @property
    def held_out(self) -> Any:
        """The inner source's `held_out(seed)`, or None: the branch evaluates on the run's own held-out set."""
        return getattr(self.inner, "held_out", None)


def skipping(skip_target: str, skip_batches: Sequence[int], **options: Any) -> SkipBatches:
    """The data source `skip_target(**options)` without the batches `skip_batches`: a data option with two more keys.

    Example::

        # data: {_target_: gradrunner.run.branch.skipping, skip_target: gradrunner.data.Synthetic,
        #        skip_batches: [30], batch_size: 32, ...}     (the autopsy's skip_batch)
    """
    from hydra.utils import get_method

    return SkipBatches(get_method(skip_target)(**options), skip_batches)
