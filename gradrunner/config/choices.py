"""The allowed values of the settings that more than one layer checks: one source for each.

Strategy names are the capture registry's keys (`gradrunner.capturing.strategies.STRATEGIES`);
`STRATEGY_NAMES` spells them here so the config can be checked without importing torch, and a test
holds the two equal.

Example::

    from gradrunner.config.choices import DTYPES
    assert "bfloat16" in DTYPES
"""

from __future__ import annotations

#: `capture.strategy`: the registry's names, in the order the docs list them.
STRATEGY_NAMES = ("retain_grad", "hook", "autograd_grad")
#: `dtype`: the model's and the inputs' precision.
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: `device`: `cuda:N` stands for any device index.
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
#: `capture.values`: statistics only, every element, or `capture.sample_size` fixed elements.
VALUES_MODES = ("none", "full", "sample")
#: `capture.on_nonfinite`: record NaN/Inf and go on, or stop the run with its records kept.
NONFINITE_MODES = ("record", "stop")

#: The largest `seed` (numpy seeds with 32 bits) and `steps` (2**31 - 1: about 68 years at one step a second).
SEED_MAX = 2**32 - 1
STEPS_MAX = 2**31 - 1
