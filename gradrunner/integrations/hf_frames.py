"""Which `transformers.Trainer` loop a frame belongs to: the `train()` running now, or the one an error left.

Example::

    training(trainer.state)          # True inside a callback that train() called: its loop is a caller's frame
    trainer_error(trainer.state)     # in the `except` around train(): the error that ended it

`GradientCaptureCallback` (`integrations/hf.py`) tells with these a callback's forward of the model while
`train()` runs from the user's forward after a `train()` that raised (the Trainer has no event for it).
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType, TracebackType
from typing import Any

TrainerState = Any  # transformers' TrainerState: only its identity is compared


def trainer_error(state: TrainerState) -> BaseException | None:
    """The error that ended the `train()` whose state is `state`, where it can be seen: the one being handled (a
    `close()` or a forward of the model in the `except` or `finally` around `train()`) or the process's last
    uncaught one (at exit, a notebook's last error); its traceback passes through that Trainer's `train()`."""
    seen = (sys.exc_info()[1], getattr(sys, "last_exc", None), getattr(sys, "last_value", None))
    return next((e for e in seen if isinstance(e, BaseException) and _raised_in(e.__traceback__, state)), None)


def _raised_in(tb: TracebackType | None, state: TrainerState) -> bool:
    """Whether the traceback `tb` passes through the training loop of the Trainer whose state is `state`."""
    while tb is not None:
        if _loop_of(tb.tb_frame, state):  # a frame the error left: its locals are kept as they were
            return True
        tb = tb.tb_next
    return False


def training(state: TrainerState) -> bool:
    """Whether the training loop of the Trainer whose state is `state` is running in this thread (a caller's frame)."""
    frame = inspect.currentframe()
    while frame is not None and not _loop_of(frame, state):
        frame = frame.f_back
    return frame is not None


def _loop_of(frame: FrameType, state: TrainerState) -> bool:
    """Whether `frame` is the `train()` (or its training loop) of the Trainer whose state is `state`."""
    code = frame.f_code.co_name
    return code in ("train", "_inner_training_loop") and getattr(frame.f_locals.get("self"), "state", None) is state
