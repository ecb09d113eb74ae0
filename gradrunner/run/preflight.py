"""Checks of the built job before step 0: what only the built scheduler, model, data and weights can tell.

`config.schema.validate` checks values by name and range; some mistakes show only once things are built,
and then only steps or minutes into the run, after records were written. `run.build.setup` calls these
before it returns, so each is one `GradrunnerError` (one paragraph, exit 2) with nothing written:

    check_rates(optimizer, target)                             -- every param group's learning rate finite and >= 0
    check_step(optimizer, target)                              -- the optimizer's step() runs without arguments
    check_schedule(make, optimizer, scheduler, steps, target)  -- the scheduler stepped through the run on a stand-in
    check_eval_data(job, model_name, loss_name)                -- the model and loss on the first eval batch
    check_weights(state, path)                                 -- `model.init_from` holds tensors, floats for floats

Example::

    scheduler = make(optimizer)
    check_schedule(make, optimizer, scheduler, steps=100, target="torch.optim.lr_scheduler.OneCycleLR")
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gradrunner.capturing.untouched import evaluating
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.run.guards import forward_loss

if TYPE_CHECKING:
    from gradrunner.run.build import Job

#: Scheduler steps simulated before step 0 (the run's own count when smaller): enough for every schedule
#: whose shape depends on the step count, at a few milliseconds; `schema.validate_scheduler` checks
#: OneCycleLR's total against any `steps`.
SIMULATED_STEPS = 10_000
#: What to pick instead of a scheduler that cannot be stepped by the step count alone.
_BUILT_IN = "scheduler=cosine, onecycle, linear_warmup or warmup_cosine, or any scheduler whose step() takes no argument"


def _stand_in(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer's class over one scalar per param group, with the groups' settings and initial rates."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "lr": g.get("initial_lr", g["lr"]),
               "params": [torch.zeros(1, requires_grad=True)]} for g in optimizer.param_groups]  # fmt: skip
    for g in groups:
        g.pop("initial_lr", None)
    try:
        return type(optimizer)(groups)  # type: ignore[call-arg]  # every subclass takes its params first
    except Exception:  # an optimizer that cannot be built this way: the run itself will tell
        return None


def check_schedule(
    make: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer, scheduler: Any, steps: int,
    target: str,
) -> None:  # fmt: skip
    """Refuse a scheduler the runner cannot step through `steps` optimisation steps with sane learning rates.

    Example::

        check_schedule(make, optimizer, make(optimizer), steps=5, target="torch.optim.lr_scheduler.OneCycleLR")

    The runner calls `scheduler.step()` once after each optimisation step: a scheduler that needs a
    metric (`ReduceLROnPlateau`) is refused; any other is built again over a stand-in optimizer (the
    same class and param groups, one scalar each) and stepped `min(steps, SIMULATED_STEPS)` times:
    an exception, or a learning rate that is negative or not finite at any step, is refused naming the
    step and the rate.
    """
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise GradrunnerError(
            f"scheduler {target!r} needs a metric at each step (step(metrics)), but the runner steps its scheduler "
            f"once per optimisation step without one; nothing was run. Pick {_BUILT_IN}."
        )
    shadow = _stand_in(optimizer)
    if shadow is None:
        return
    step = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stand_in = make(shadow)
            for step in range(min(steps, SIMULATED_STEPS)):  # the rates of each step, then its scheduler.step()
                check_rates(shadow, target, scheduler=True, step=step)
                shadow.step()
                stand_in.step()
    except GradrunnerError:
        raise
    except Exception as e:
        raise GradrunnerError(
            f"scheduler {target!r} fails at step {step} of steps={steps}: {type(e).__name__}: {one_paragraph(e)}. "
            "It was stepped through the run before step 0 (nothing was run); check the scheduler.* keys against "
            "steps (a schedule must last the whole run), or pick another option with scheduler=<option>."
        ) from None


def check_rates(optimizer: torch.optim.Optimizer, target: str, *, scheduler: bool = False, step: int = 0) -> None:
    """Refuse a learning rate that is negative or not finite in any param group: the one rule for learning rates.

    Example::

        check_rates(torch.optim.SGD(model.parameters(), lr=float("nan")), "torch.optim.SGD")
        # GradrunnerError: optimizer.lr=nan is not allowed; a learning rate must be a finite number >= 0 ...

    `run.build.setup` calls it on the built optimizer (`target`: its `_target_`), with or without a
    scheduler (SGD takes NaN and Adam takes inf without a word); `check_schedule` calls it on each step
    of the schedule (`scheduler=True`, `target`: the scheduler's `_target_`), naming the step.
    """
    for i, group in enumerate(optimizer.param_groups):
        lr = float(group["lr"])
        if math.isfinite(lr) and lr >= 0:
            continue
        if scheduler:
            raise GradrunnerError(
                f"scheduler {target!r} gives param group {i} the learning rate {lr!r} at step {step}; a learning "
                "rate must be a finite number >= 0, so nothing was run. Check the scheduler.* keys (rates such as "
                "max_lr, eta_min, factors, warm-up and total steps) and optimizer.lr."
            )
        raise GradrunnerError(
            f"optimizer.lr={lr!r} is not allowed; a learning rate must be a finite number >= 0 ({target} has "
            f"{lr!r} in param group {i} of {len(optimizer.param_groups)}), so nothing was run. Fix it on the command "
            "line, e.g. optimizer.lr=0.001, or in your optimizer file."
        )


def check_step(optimizer: torch.optim.Optimizer, target: str) -> None:
    """Refuse an optimizer whose `step()` needs an argument: the runner calls `optimizer.step()` with none.

    Example::

        check_step(torch.optim.LBFGS(model.parameters()), "torch.optim.LBFGS")
        # GradrunnerError: optimizer 'torch.optim.LBFGS' needs step(closure) ...

    `torch.optim.LBFGS` (and any optimizer like it) re-evaluates the loss through a closure it is given;
    the runner's step is one forward and backward of its own, then `optimizer.step()`.
    """
    try:
        params = list(inspect.signature(type(optimizer).step).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # a step() whose signature cannot be read: the run itself will tell
        return
    needed = [p.name for p in params if p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
    if not needed:
        return
    what = "a closure that re-evaluates the loss" if needed == ["closure"] else "arguments"
    raise GradrunnerError(
        f"optimizer {target!r} needs step({', '.join(needed)}): {what}, but the runner calls optimizer.step() "
        "with none, once per step after its own forward and backward; nothing was run. Pick an optimizer whose "
        "step() takes no argument (optimizer=sgd, adam or adamw, or another torch.optim class), or record "
        f"{type(optimizer).__name__} in your own loop with gradrunner.record() or with the Lightning callback "
        "(one record step per optimizer step, its closure's last evaluation)."
    )


def check_eval_data(job: Job, model_name: str, loss_name: str) -> None:
    """Refuse eval data the model or the loss cannot take: checked on the fixed eval set's first batch.

    Example::

        check_eval_data(job, "gradrunner.models.MLP", "torch.nn.MSELoss")   # GradrunnerError: eval_data ... (32x5 and 8x32)

    The batch runs through the model and the loss as evaluation runs it (eval mode, no grad), with the
    random number generators' state and each module's train/eval mode (`evaluating`) put back afterwards,
    so training is unchanged. Skipped for a
    model with uninitialised lazy parameters (the first forward would initialise them).
    """
    if not job.eval_set:
        return
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in job.model.parameters()):
        return
    devices = [job.device.index or 0] if job.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x, y = job.eval_set[0]
        try:
            with evaluating(job.model), torch.no_grad():
                forward_loss(job.model, job.loss_fn, x, y, 0, model_name=model_name, loss_name=loss_name)
        except GradrunnerError as e:
            why = str(e).replace("step 0 failed in", "it failed in").replace("step 0: ", "")
            raise GradrunnerError(
                f"eval_data does not fit the model (its first batch was checked before step 0; nothing was run): "
                f"{why} Fix eval_data.* (or data.*, whose stream evaluation reads without eval_data)."
            ) from None


def check_weights(state: Mapping[str, Any], own: Mapping[str, torch.Tensor], path: str) -> None:
    """Refuse a `model.init_from` file whose entries are not tensors, or integer tensors for floating-point ones.

    Example::

        check_weights(torch.load(f, weights_only=True), model.state_dict(), f)

    `load_state_dict` would copy integers into floating-point weights without a word: a file of step
    counters or token ids is not weights.
    """
    not_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    integers = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and k in own
                      and own[k].is_floating_point() and not (v.is_floating_point() or v.is_complex()))  # fmt: skip
    if not (not_tensors or integers):
        return
    bad = not_tensors or integers
    what = (f"{type(state[bad[0]]).__name__} values, not tensors" if not_tensors
            else f"{state[bad[0]].dtype} tensors for floating-point weights")  # fmt: skip
    raise GradrunnerError(
        f"model.init_from={path!r} holds {what} ({', '.join(bad[:8])}{' and more' if len(bad) > 8 else ''}): not a "
        "model's weights, so nothing was run. Save the weights with torch.save(model.state_dict(), path)."
    )
