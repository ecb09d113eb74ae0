"""Learning-rate multipliers for `torch.optim.lr_scheduler.LambdaLR` that the `scheduler` group names.

Example::

    sched = LambdaLR(optimizer, lr_lambda=WarmupCosine(warmup_steps=10, total_steps=100))
"""

from __future__ import annotations

import math


class WarmupCosine:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at the last step (nanoGPT's schedule).

    Example::

        f = WarmupCosine(warmup_steps=2, total_steps=10, min_ratio=0.1)
        [round(f(s), 3) for s in (0, 1, 2, 9)]      # [0.5, 1.0, 1.0, 0.1]

    `f(step)` is the multiplier of the rate step `step` uses (LambdaLR calls it with the number of
    scheduler steps so far): 1.0 at step `warmup_steps`, `min_ratio` at step `total_steps - 1`, the
    last step of a run of `total_steps` steps (and after it). A class, not a closure: LambdaLR's
    `state_dict` keeps its attributes, so a checkpoint restores it.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio = int(warmup_steps), int(total_steps), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)  # the last step is total_steps - 1
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
