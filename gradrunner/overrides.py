"""Command-line overrides checked against the schema before Hydra composes the config.

Hydra refuses a misspelled key (`capture.stratgy=hook`, `stepz=3`) with a multi-line message that
does not say what is allowed. `misspelled_key(argv)` finds such a key first, so the CLI can say in
one paragraph which key is wrong, which keys exist and what was probably meant.

Example::

    misspelled_key(["+experiment=mlp", "capture.stratgy=hook"])
    # "capture.stratgy is not a config key; capture.* keys: strategy, values, every, ... Did you mean 'capture.strategy'?"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from gradrunner.config import CaptureConfig, Config, TrainConfig
from gradrunner.errors import closest, did_you_mean

#: Config groups: a key under them belongs to the chosen option (model.depth, data.batch_size, ...).
GROUPS = ("model", "data", "loss", "optimizer", "experiment", "hydra", "scheduler", "eval_data")
#: Hydra's command-line flags that take a value (`--config-dir my_conf`): the value is not an override.
_FLAGS_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c",
                     "--package", "-p", "--info", "-i", "--experimental-rerun")  # fmt: skip


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def parse(argv: Sequence[str]) -> list[Override]:
    """The overrides in `argv` as Hydra parses them; flags (`-m`, `--config-dir X`) and unparsable ones skipped.

    Example::

        [o.key_or_group for o in parse(["-m", "+experiment=mlp", "steps=1,2"])]   # ['experiment', 'steps']
    """
    parser, out, skip = OverridesParser.create(), [], False
    for arg in argv:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _FLAGS_WITH_VALUE
            continue
        try:
            out.extend(parser.parse_overrides([arg]))
        except HydraException:
            continue  # Hydra itself reports a malformed override, in its own words
    return out


def misspelled_key(argv: Sequence[str]) -> str | None:
    """The message for the first override whose key the schema does not have, or None.

    Only plain `key=value` overrides of top-level and `capture.*` keys are checked: `+key=...`
    adds keys on purpose, and keys inside the other groups depend on the option chosen.
    """
    top, capture = _fields(Config), _fields(CaptureConfig)
    for override in parse(argv):
        if override.type != OverrideType.CHANGE or override.package is not None:
            continue
        key, arg = override.key_or_group, override.input_line
        if "/" in key:  # group choices such as hydra/launcher=joblib
            continue
        head, _, rest = key.partition(".")
        if head == "train" and rest not in _fields(TrainConfig):
            train = _fields(TrainConfig)
            hint = did_you_mean(rest, train, prefix="train.")
            return f"{key} is not a config key; train.* keys: {', '.join(train)}.{hint} Fix the override {arg!r}."
        if head == "train":
            continue
        if head in GROUPS or (head == "capture" and (not rest or rest in capture)) or (not rest and head in top):
            continue
        if head == "capture":
            hint = did_you_mean(rest, capture, prefix="capture.")
            return f"{key} is not a config key; capture.* keys: {', '.join(capture)}.{hint} Fix the override {arg!r}."
        if head in top:  # a scalar key given a sub-key, e.g. steps.max=3
            return f"{key} is not a config key: {head} is a single value ({head}=...). Fix the override {arg!r}."
        close = closest(head, [*top, *GROUPS])
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"{key} is not a config key; top-level keys: {', '.join(top)}.{hint} Fix the override {arg!r}."
    return None


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's override list, in job order, for a sweep run by Hydra's basic sweeper; else None.

    Example::

        sweep_jobs(cfg)   # [['capture.strategy=hook', 'seed=0'], ['capture.strategy=hook', 'seed=1'], ...]

    Other sweepers (Optuna, Ax, ...) choose their jobs as they go: None.
    """
    sweeper = OmegaConf.select(config, "hydra.sweeper._target_", default="")
    if not str(sweeper).endswith("BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # Hydra's own expansion rules

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
