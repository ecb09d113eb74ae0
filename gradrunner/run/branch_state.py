"""What a branch (`train.branch_from`, `run.branch`) changes in the state it starts from, and when.

Two moments, one rule each:

    changed_state(state, old, new, reset)                   -- `run.branch.seed`: into the kept state, before the build
    take_fresh(optimizer, scheduler, fresh, state)          -- `Checkpointer.restore`: once the state is loaded

A changed `optimizer.lr` scales every rate the loaded optimizer and a stock scheduler hold by new/old
(`scale_rates`): the run's schedule at the new rate. Any other changed `optimizer.*` hyperparameter
(`weight_decay`, `betas`, `eps`, ...) is taken, group by group, from the branch's own optimizer as
`run.build.setup` built it before the state was loaded: the param groups as a fresh run of the branch's
config has them (with `optimizer.no_decay`, the no-decay group keeps its `weight_decay` 0.0,
`run.param_groups`). A changed `scheduler.*` key (another option, a changed value, one added or removed)
drops the source's scheduler state: every param group's settings are the fresh build's, and its scheduler
is stepped to the branch's step (`last_epoch` = step, as a fresh run's is there), so the branch trains on
its own config's schedule; `optimizer.lr` then is the fresh run's too, not a scaled copy of the source's.
`changed_state` writes what the fresh build decides into the state (`BRANCH_STATE`) for `take_fresh`.

Refused, one paragraph each: a changed `optimizer._target_` (another optimizer class cannot take the
state) or `optimizer.no_decay` (the param groups, and each parameter's moments in them, are the source's).

Example::

    changed_state(state, kept.config, branch_config, reset=False)    # in run.branch.seed
    fresh = hyperparameters(job.optimizer)                           # in Checkpointer.restore, then the load
    take_fresh(job.optimizer, job.scheduler, fresh, state)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gradrunner.errors import GradrunnerError

#: The state file's entry naming what the branch's own build decides (`take_fresh`):
#: {"optimizer": [changed keys], "schedule": whether the scheduler is the branch's own}.
BRANCH_STATE = "branch"
#: Changed `optimizer.*` keys a branch refuses, and why (the loaded state cannot take them).
REFUSED = {
    "_target_": "another optimizer class cannot take the source's optimizer state",
    "no_decay": "the param groups, and each parameter's moments in them, are the ones the source's no_decay made",
}
#: The rates a scheduler keeps in each param group (OneCycleLR recomputes lr from max_lr and min_lr each step).
GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")
#: The rates a stock scheduler keeps in its state: base and last rates, CyclicLR's max_lrs,
#: ReduceLROnPlateau's min_lrs, the cosine schedules' eta_min (the floor they approach).
SCHEDULER_RATES = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min")


def changed_state(state: dict[str, Any], old: dict[str, Any], new: dict[str, Any], reset: bool) -> None:
    """The branch config `new`'s changes from the source config `old` put into (or marked in) the kept `state`.

    Example::

        changed_state(state, {"optimizer": {"lr": 0.1}}, {"optimizer": {"lr": 0.05}}, reset=False)  # rates halved

    `reset` (`train.branch_reset_moments`) drops the optimizer's per-parameter state.
    """
    before, after = old.get("optimizer") or {}, new.get("optimizer") or {}
    for key, why in REFUSED.items():
        if before.get(key) != after.get(key):
            raise GradrunnerError(
                f"train.branch_from: optimizer.{key} is changed ({before.get(key)!r} -> {after.get(key)!r}), but a "
                f"branch continues the source's optimizer state and {why}; nothing was run. A branch may change the "
                "optimizer's hyperparameters (optimizer.lr, optimizer.weight_decay, ...), the scheduler.* keys and "
                f"keys outside the optimizer; for another optimizer.{key}, run the config afresh or branch from step "
                "0 (train.branch_from=<run dir>:0: the config from its seed)."
            )
    fresh = sorted(k for k in set(before) | set(after) if not k.startswith("_") and k not in ("lr", *REFUSED)
                   and before.get(k) != after.get(k))  # fmt: skip
    groups = state["optimizer"]["param_groups"]
    for key in fresh:
        if not all(key in g for g in groups):
            raise GradrunnerError(
                f"train.branch_from: optimizer.{key} is changed ({before.get(key, '<unset>')!r} -> "
                f"{after.get(key, '<unset>')!r}), but the source's optimizer keeps no {key!r} in its param groups, so "
                "the branch cannot put the new value into the loaded optimizer; nothing was run. A branch may change "
                f"the hyperparameters the optimizer keeps ({', '.join(sorted(k for k in groups[0] if k != 'params'))}); "
                "run another constructor argument afresh, not as a branch."
            )
    if before.get("lr") != after.get("lr"):
        if before.get("lr") is None or after.get("lr") is None:
            raise GradrunnerError(
                f"train.branch_from: optimizer.lr is {'added' if before.get('lr') is None else 'removed'} "
                f"({before.get('lr', '<unset>')!r} -> {after.get('lr', '<unset>')!r}), but a branch scales every "
                "rate of the source's optimizer state by new/old optimizer.lr, and without one of them (the "
                "optimizer's own default rate) there is no ratio; nothing was run. Keep optimizer.lr as the source "
                "has it, or make the source run with optimizer.lr set."
            )
        scale_rates(state, float(after["lr"]) / float(before["lr"]))
    marked = state.get(BRANCH_STATE) or {}  # a branch's own start, branched again: its marks hold too
    schedule = (old.get("scheduler") or None) != (new.get("scheduler") or None) or bool(marked.get("schedule"))
    if schedule:
        state["scheduler"] = None  # the source's: the branch's own is built and stepped to here (`take_fresh`)
    state[BRANCH_STATE] = {"optimizer": sorted(set(fresh) | set(marked.get("optimizer") or [])), "schedule": schedule}
    if reset:
        state["optimizer"]["state"] = {}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (all but its `params`): what `take_fresh` takes from a freshly built optimizer."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def take_fresh(
    optimizer: torch.optim.Optimizer, scheduler: Any, fresh: list[dict[str, Any]], state: dict[str, Any]
) -> None:
    """What `state` marks (`changed_state`) taken from `fresh` (`hyperparameters` of the freshly built `optimizer`).

    Example::

        take_fresh(job.optimizer, job.scheduler, fresh, state)    # weight_decay 0.5, 0.0 in the no-decay group

    The marked keys of each param group; with a changed schedule every setting of every group, and the
    `scheduler` (the branch's own, as built) stepped `state["step"]` times. Nothing without a mark (a
    resume, a run's own checkpoint).
    """
    mark = state.get(BRANCH_STATE) or {}
    groups = optimizer.param_groups
    assert len(groups) == len(fresh), (len(groups), len(fresh))  # the same config's groups, over the same model
    for g, f in zip(groups, fresh, strict=True):
        if mark.get("schedule"):
            for key in [k for k in g if k != "params" and k not in f]:
                del g[key]  # a setting only the source's scheduler put there (OneCycleLR's max_lr, ...)
        for key in f if mark.get("schedule") else mark.get("optimizer") or []:
            g[key] = f[key]  # `changed_state` checked that every group keeps a marked key
    if mark.get("schedule") and scheduler is not None:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": the steps before the branch
            warnings.simplefilter("ignore")
            for _ in range(int(state["step"])):
                scheduler.step()


def scale_rates(state: dict[str, Any], ratio: float) -> None:
    """A changed `optimizer.lr` (new/old = `ratio`): every rate the optimizer and the scheduler hold scaled by it,
    so the branch's rate is `ratio` x the run's at every step, whatever the stock scheduler recomputes it from."""
    for g in state["optimizer"]["param_groups"]:
        for name in GROUP_RATES:
            if isinstance(g.get(name), int | float) and not isinstance(g[name], bool):
                g[name] *= ratio
    sched = state.get("scheduler")
    if not isinstance(sched, dict):
        return
    for name in SCHEDULER_RATES:
        if isinstance(sched.get(name), list):
            sched[name] = [float(v) * ratio for v in sched[name]]
        elif isinstance(sched.get(name), int | float) and not isinstance(sched[name], bool):
            sched[name] = float(sched[name]) * ratio
