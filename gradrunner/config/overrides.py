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
import functools
from collections.abc import Sequence
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException

from gradrunner.config.schema import AnomalyConfig, CaptureConfig, Config, TrainConfig
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
    out: list[Override] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _FLAGS_WITH_VALUE
            continue
        out.extend(_parse_one(arg))
    return out


@functools.lru_cache(maxsize=256)
def _parse_one(arg: str) -> tuple[Override, ...]:
    """One override as Hydra parses it, () if Hydra would refuse it; cached: each check of the command line
    parses the same arguments, and `seed=0,1,...,9999` costs Hydra's parser about a second each time."""
    try:
        return tuple(OverridesParser.create().parse_overrides([arg]))
    except HydraException:
        return ()  # Hydra itself reports a malformed override, in its own words


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
        if head == "anomaly" and rest and rest not in _fields(AnomalyConfig):
            keys = _fields(AnomalyConfig)
            hint = did_you_mean(rest, keys, prefix="anomaly.")
            return f"{key} is not a config key; anomaly.* keys: {', '.join(keys)}.{hint} Fix the override {arg!r}."
        if head == "anomaly":
            continue
        if head in GROUPS or (head == "capture" and (not rest or rest in capture)) or (not rest and head in top):
            continue
        if head == "edits":  # edits.0.scale=...: a list entry's value (validate_edits checks it)
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


#: The package's own config dir: one subdirectory per config group, one YAML file per option.
_PACKAGE_CONF = Path(__file__).resolve().parent.parent / "conf"


def _search_dirs(argv: Sequence[str]) -> list[Path] | None:
    """Config dirs the command line adds (`--config-dir`, `hydra.searchpath=[file://...]`), after the package's.

    None when a search path entry is not a plain directory (`pkg://...` of another package): its
    options cannot be listed here, so group choices are left to Hydra.
    """
    dirs = [_PACKAGE_CONF]
    for i, arg in enumerate(argv):
        for flag in ("--config-dir", "-cd"):
            if arg == flag and i + 1 < len(argv):
                dirs.append(Path(argv[i + 1]))
            elif arg.startswith(f"{flag}="):
                dirs.append(Path(arg.split("=", 1)[1]))
    for override in parse(argv):
        if override.key_or_group != "hydra.searchpath":
            continue
        value = override.value()
        for entry in value if isinstance(value, list) else [value]:
            entry = str(entry)
            if entry.startswith("file://"):
                dirs.append(Path(entry[len("file://") :]))
            elif entry.startswith("pkg://gradrunner.conf"):
                continue
            else:
                return None
    return dirs


def _options(group: str, dirs: Sequence[Path]) -> list[str]:
    """Every option of `group` found in `dirs` (`<dir>/<group>/<option>.yaml`, nested options as `a/b`)."""
    found: set[str] = set()
    for d in dirs:
        base = d / group
        if base.is_dir():
            found.update(str(f.relative_to(base).with_suffix("")) for f in base.rglob("*.yaml"))
    from hydra.core.config_store import ConfigStore  # options registered in Python count too

    try:
        found.update(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group))
    except OSError:  # no such group in the store
        pass
    return sorted(found)


def group_mistake(argv: Sequence[str]) -> str | None:
    """The message for the first config-group override that names no option of the group, or None.

    Example::

        group_mistake(["model=mpl"])
        # "model=mpl: the config group model has no option 'mpl'; its options: cnn, cosine, ... Did you mean 'mlp'?"

    Hydra answers `model=mpl` with a dozen lines, and `model=null` or `loss=[1,2]` with a traceback.
    Groups and options are the subdirectories and YAML files of the package's `conf/` and of the
    dirs the command line adds; with a search path this cannot list (another package), only values
    that are not option names (null, numbers, nested lists) are refused.
    """
    dirs = _search_dirs(argv)
    groups = {p.name for d in (dirs or [_PACKAGE_CONF]) if d.is_dir() for p in d.iterdir()
              if p.is_dir() and not p.name.startswith(("_", "."))}  # fmt: skip
    for override in parse(argv):
        group = override.key_or_group
        if group not in groups or override.package is not None or override.type == OverrideType.DEL:
            continue
        prefix = "+" if override.type == OverrideType.ADD else "++" if override.type == OverrideType.FORCE_ADD else ""
        options = _options(group, dirs or [_PACKAGE_CONF])
        listed = ", ".join(options) if options else "(none found)"
        for value in _choices(override):
            if not isinstance(value, str) or not value:
                return (f"{override.input_line}: {group} is a config group, so its value names one of its options; its options: "
                        f"{listed}. Fix the override, e.g. {prefix}{group}={options[0] if options else '<option>'}.")  # fmt: skip
            if dirs is not None and value not in options:
                hint = did_you_mean(value, options)
                return (f"{override.input_line}: the config group {group} has no option {value!r}; its options: "
                        f"{listed}.{hint} Add your own with --config-dir <dir> holding {group}/{value}.yaml.")  # fmt: skip
    return None


def _choices(override: Override) -> list[object]:
    """The option(s) an override selects: each value of a sweep, each element of a list, or the value."""
    if override.is_sweep_override():
        try:
            return list(override.sweep_string_iterator())
        except Exception:  # a range or interval sweep over a group: not option names
            return [None]
    value = override.value()
    return list(value) if isinstance(value, list) else [value]
