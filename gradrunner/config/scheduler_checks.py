"""The `scheduler` node's checks before step 0: rates, step counts and windows by name, OneCycleLR covering `steps`.

`validate_scheduler` is called by `config.schema.validate`; the built scheduler is then stepped through the
run on a stand-in optimizer (`gradrunner.run.preflight`), which catches what no name tells.

Example::

    validate_scheduler(compose("config", overrides=["scheduler=onecycle", "scheduler.max_lr=-1"]))
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gradrunner.config.choices import STEPS_MAX
from gradrunner.errors import GradrunnerError

#: Scheduler keyword arguments checked by name, under whichever scheduler (torch's, the built-in options', a
#: user's) and at any depth (`scheduler.lr_lambda.warmup_steps`): what each allows, as (kind, low, high) with
#: kind "int" (an integer from low to high), "rate" (a number > low, no upper bound) or "range" (a number
#: from low to high). Anything else a scheduler takes is left to it, and to the check before step 0.
_STEP_COUNTS = ("total_steps", "T_max", "T_0", "T_mult", "total_iters", "step_size", "step_size_up",
                "steps_per_epoch", "epochs")  # fmt: skip
SCHEDULER_RANGES: dict[str, tuple[str, float, float]] = {
    **{k: ("rate", 0.0, math.inf) for k in ("max_lr", "base_lr", "gamma", "div_factor", "final_div_factor")},
    **{k: ("range", 0.0, math.inf) for k in ("eta_min", "min_lr")},
    **{k: ("int", 1, STEPS_MAX) for k in _STEP_COUNTS},
    "warmup_steps": ("int", 0, STEPS_MAX),
    **{k: ("range", 0.0, 1.0) for k in ("pct_start", "end_factor", "min_ratio")},
    "start_factor": ("rate", 0.0, 1.0),
}
#: OneCycleLR's alternatives: `total_steps`, or `epochs` and `steps_per_epoch`; the unused ones may be null.
_MAY_BE_NULL = frozenset({"total_steps", "epochs", "steps_per_epoch"})


def _range_text(kind: str, low: float, high: float) -> str:
    if kind == "int":
        return f"an integer from {int(low)} to {int(high)}"
    if kind == "rate":
        return f"a number > {low:g}" + (f" and <= {high:g}" if high != math.inf else "")
    return f"a number from {low:g} to {high:g}" if high != math.inf else f"a number >= {low:g}"


def _in_range(value: object, kind: str, low: float, high: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    if kind == "int":
        return isinstance(value, int) and low <= value <= high
    return (value > low if kind == "rate" else value >= low) and value <= high


#: The fix a refusal suggests, where the range's end is not a good one.
_EXAMPLES: dict[str, object] = {"total_steps": "${steps}", "T_max": "${steps}", "pct_start": 0.3, "start_factor": 0.1,
                                "end_factor": 1.0, "min_ratio": 0.1, "gamma": 0.9, "eta_min": 0.0}  # fmt: skip


def _scheduler_values(node: Any, path: str, name: str = "") -> list[tuple[str, str, Any]]:
    """(path, setting name, value) of every setting below a scheduler node (a list is one value)."""
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _scheduler_values(v, f"{path}.{k}", str(k))]
    return [(path, name, node)]


def validate_scheduler(cfg: DictConfig) -> None:
    """Check the `scheduler` node's rates, steps and windows against their allowed ranges and against `steps`.

    Example::

        validate_scheduler(compose("config", overrides=["scheduler=onecycle", "scheduler.max_lr=-1"]))
        # GradrunnerError: scheduler.max_lr=-1 is not allowed; it must be a number > 0 ...

    Settings are checked by name (`SCHEDULER_RANGES`) whichever scheduler takes them, nested ones too
    (`scheduler.lr_lambda.warmup_steps`): a zero or negative rate, step count or window, null or a
    string where a number belongs, is one paragraph naming the key and its range. OneCycleLR must cover
    every step (`total_steps`, or `epochs` x `steps_per_epoch`, at least `steps`): it fails past them. The
    built scheduler is then stepped through the run on a stand-in optimizer before step 0
    (`gradrunner.run.preflight`), which catches what no name tells.
    """
    node = cfg.get("scheduler")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    settings = OmegaConf.to_container(node, resolve=True)
    assert isinstance(settings, dict)
    for key, name, value in _scheduler_values(settings, "scheduler"):
        kind, low, high = SCHEDULER_RANGES.get(name, ("", 0.0, 0.0))
        # A rate may be a list, one per param group (OneCycleLR's max_lr); a step count may not.
        each = value if isinstance(value, list) and value and kind != "int" else [value]
        if not kind or (value is None and name in _MAY_BE_NULL) or all(_in_range(v, kind, low, high) for v in each):
            continue
        example = _EXAMPLES.get(name, int(max(low, 1)) if kind == "int" else 0.01)
        if example == "${steps}" and not _in_range(cfg.get("steps"), kind, low, high):  # steps=0: ${steps} is refused too
            example = int(max(low, 1))
        raise GradrunnerError(
            f"{key}={'null' if value is None else repr(value)} is not allowed; {key} must be "
            f"{_range_text(kind, low, high)}. Fix it on the "
            f"command line, e.g. {key}={example}, or in your scheduler file."
        )
    if str(settings["_target_"]).rsplit(".", 1)[-1] == "OneCycleLR":
        _check_covers_steps({str(k): v for k, v in settings.items()}, int(cfg.steps))


def _check_covers_steps(settings: dict[str, Any], steps: int) -> None:
    total = settings.get("total_steps")
    epochs, per_epoch = settings.get("epochs"), settings.get("steps_per_epoch")
    covered = total if total is not None else epochs * per_epoch if epochs and per_epoch else None
    if covered is None:
        raise GradrunnerError(
            "scheduler: OneCycleLR needs scheduler.total_steps (or scheduler.epochs and scheduler.steps_per_epoch);"
            " set scheduler.total_steps=${steps}, as scheduler=onecycle does."
        )
    if covered < steps:
        given = f"scheduler.total_steps={total}" if total is not None else (
            f"scheduler.epochs={epochs} x scheduler.steps_per_epoch={per_epoch} = {covered}")  # fmt: skip
        raise GradrunnerError(
            f"{given} is less than steps={steps}: OneCycleLR is stepped once per optimisation step and fails "
            f"past its last one (at step {covered + 1}). Set scheduler.total_steps to at least {steps} "
            "(scheduler.total_steps=${steps}, as scheduler=onecycle does), or lower steps."
        )
