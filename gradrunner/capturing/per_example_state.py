"""What `PerExampleNorms` holds while a step runs: its micro-batches, its parameters, their holders and calls.

Example::

    t = Tracked(param, ["fc1:weight"])      # one parameter object, under every name it is tapped by
    t.reset()                               # a new step: its shares, expected calls and check start again
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.per_example_check import Projection
from gradrunner.capturing.per_example_layers import Call
from gradrunner.capturing.per_example_math import Form

#: Why a parameter's per-example norms are None in a step whose backwards its `.grad` was reset between.
RESET = (
    "its .grad was reset (zero_grad) between the step's backwards: the rows of those before are in no .grad, "
    "and per-example shares are not kept across a reset"
)


@dataclass
class Micro:
    """One backward's micro-batch: the batch sizes of its fired calls (`batch`: of its model call), whether a
    backward that fills `.grad` reached it (a forward never backwarded, a metric's, has no rows), where a
    row-mixing module was called last."""

    rows: set[int] = field(default_factory=set)
    batch: int = 0
    backward: bool = False
    mix_clock: int = -1
    mix_name: str = ""


@dataclass
class Tracked:
    """One parameter object: its names, its holders, and this step's shares and check."""

    param: nn.Parameter
    names: list[str]
    reason: str | None = None
    check: Projection | None = None
    step_reason: str | None = None
    expected: dict[int, int] = field(default_factory=dict)
    pending: dict[int, list[Form]] = field(default_factory=dict)
    sq: dict[int, torch.Tensor] = field(default_factory=dict)
    first_clock: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.step_reason = None
        self.expected, self.pending, self.sq, self.first_clock = {}, {}, {}, {}
        if self.check is not None:
            self.check.reset()


@dataclass
class Holder:
    module: nn.Module
    path: str
    kind: str
    tracked: list[tuple[Tracked, str]]


@dataclass
class CallRecord:
    holder: Holder
    call: Call | None
    micro: int
    clock: int
    rows: int
    handle: Any = None
    fired: bool = False
