"""The options of `record()` and of the Lightning/HF callbacks: their names and checks, in one place.

`check_options(...)` checks every value `record()` takes before anything is opened or written;
`check_callback_options(who, options)` checks a callback's keyword options in its constructor (a typo
or a bad value is one `GradrunnerError` paragraph there, not when training starts).

Example::

    check_callback_options("GradientCapture", {"histogramm": True})
    # GradrunnerError: GradientCapture(histogramm=True) is no option of the callback; ... Did you mean 'histogram'?
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from gradrunner.config.choices import NONFINITE_MODES, STRATEGY_NAMES, VALUES_MODES
from gradrunner.config.edits import parse_edits
from gradrunner.errors import GradrunnerError, did_you_mean, not_allowed, whole_number
from gradrunner.run.engine import detector_for

#: The options a callback takes as keywords (besides `taps`, `dir`, `every`, `strategy`): `record`'s, less
#: what the callback itself gives the recorder (the model's loss scaler, DDP, the experiment's name).
CALLBACK_OPTIONS = ("values", "sample_size", "seed", "per_example", "histogram", "on_nonfinite", "update_norms",
                    "live_every", "log_to", "edits", "resume", "overwrite", "anomaly")  # fmt: skip
_FLAGS = ("per_example", "histogram", "update_norms", "resume", "overwrite")


def check_options(
    *, strategy: str = "hook", every: int = 1, values: str = "none", sample_size: int = 64, seed: int = 0,
    on_nonfinite: str = "record", log_to: str | None = None, scaler: Any = None, live_every: int = 10,
    edits: Any = None, anomaly: Any = True, **flags: Any,
) -> None:  # fmt: skip
    """Every option of `record` and the callbacks, checked before anything is opened; `flags`: the booleans.

    Example::

        check_options(every=0)     # GradrunnerError: every=0 is not allowed; it must be a whole number of at least 1 ...
    """
    if strategy not in STRATEGY_NAMES:
        raise not_allowed("strategy", strategy, STRATEGY_NAMES)
    if values not in VALUES_MODES:
        raise not_allowed("values", values, VALUES_MODES)
    if on_nonfinite not in NONFINITE_MODES:
        raise not_allowed("on_nonfinite", on_nonfinite, NONFINITE_MODES)
    if log_to not in (None, "tensorboard"):
        raise not_allowed("log_to", log_to, ("tensorboard",), hint=" Leave it out to write the records only.")
    for name, v, low in (("every", every, 1), ("sample_size", sample_size, 1), ("live_every", live_every, 0),
                         ("seed", seed, None)):  # fmt: skip
        whole_number(name, v, low)
    for name, v in flags.items():
        assert name in _FLAGS, name
        if not isinstance(v, bool):
            raise GradrunnerError(f"{name}={v!r} is not allowed; it must be True or False.")
    if flags.get("resume") and flags.get("overwrite"):
        raise GradrunnerError(
            "resume=True and overwrite=True together are not allowed: resume=True continues the records of an "
            "interrupted run in the dir, overwrite=True deletes them and starts again; pass one of them."
        )
    parse_edits(edits)  # the runner's `edits` rule: a list of {tap: <spec>, <operation>: <value>}
    detector_for(anomaly)  # the spike detector's: True, False or {z, window, warmup} (config.anomaly_settings)
    if scaler is not None and not (callable(getattr(scaler, "is_enabled", None)) and callable(getattr(scaler, "scale", None))):  # fmt: skip
        raise GradrunnerError(
            f"scaler={scaler!r} is not a loss scaler; pass the torch.amp.GradScaler whose scale multiplies the loss "
            "(or loss_scale=<a callable giving the scale>)."
        )


def check_callback_options(who: str, strategy: str, every: int, options: dict[str, Any]) -> None:
    """A callback's options, checked in its constructor: an unknown name or a bad value is one paragraph.

    Example::

        check_callback_options("GradientCapture", "hook", 10, {"histogram": True})   # fine
    """
    if strategy == "autograd_grad":
        raise GradrunnerError(
            f"{who}(strategy='autograd_grad') is not possible: autograd_grad computes the "
            "gradients with its own torch.autograd.grad call, which would bypass the framework's own "
            "loss.backward() (its precision plugin and loss scaler, DDP's reducer, accelerate). Use strategy "
            "'hook' (the default) or 'retain_grad': they read the same gradients around the framework's backward."
        )
    for name, value in options.items():
        if name not in CALLBACK_OPTIONS:
            raise GradrunnerError(
                f"{who}({name}={value!r}): {name!r} is no option of the callback; it takes taps, dir, every, "
                f"strategy and {', '.join(CALLBACK_OPTIONS)}.{did_you_mean(name, CALLBACK_OPTIONS)}"
            )
    flags = {k: v for k, v in options.items() if k in _FLAGS}
    rest = {k: v for k, v in options.items() if k not in _FLAGS}
    check_options(strategy=strategy, every=every, **rest, **flags)


def check_extra(extra: dict[str, Any] | None) -> None:
    """`rec.step(extra=...)` takes only the training columns of `steps.parquet`, and values they hold: a misspelled key
    is no silent loss, and a value no column takes is refused before the step writes anything (no torn step).

    Example::

        check_extra({"lr": 0.1})      # fine; {"lrr": 0.1} is one paragraph naming the allowed keys
    """
    from gradrunner.records.schema import TRAIN_STEP_COLUMNS

    for key, value in (extra or {}).items():
        if key not in TRAIN_STEP_COLUMNS:
            raise GradrunnerError(
                f"rec.step(extra=...) has the key {key!r}, which is no column of steps.parquet; allowed: "
                f"{', '.join(TRAIN_STEP_COLUMNS)}.{did_you_mean(key, TRAIN_STEP_COLUMNS)}"
            )
        if key == "lrs":  # one rate per parameter group
            ok = isinstance(value, (list, tuple)) or (isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 1)
            ok = ok and all(map(_scalar, value))
        else:
            ok = _scalar(value)
        if value is not None and not ok:
            kind = "a list of numbers (or one-element tensors)" if key == "lrs" else "a number or a one-element tensor"
            raise GradrunnerError(
                f"rec.step(extra={{{key!r}: {value!r}}}) is not allowed; {key} must be {kind}, or None, e.g. "
                "extra={'lr': optimizer.param_groups[0]['lr'], 'eval_loss': val_loss}. Nothing of the step was written."
            )


def _scalar(value: object) -> bool:
    """A value a numeric or boolean column of `steps.parquet` takes: a number (numpy's too) or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, (numbers.Real, np.bool_)) or (isinstance(value, np.ndarray) and value.ndim == 0)
