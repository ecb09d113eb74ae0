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
import difflib
from collections.abc import Sequence

from gradrunner.config import CaptureConfig, Config

#: Config groups: a key under them belongs to the chosen option (model.depth, data.batch_size, ...).
GROUPS = ("model", "data", "loss", "optimizer", "experiment", "hydra")


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def misspelled_key(argv: Sequence[str]) -> str | None:
    """The message for the first override whose key the schema does not have, or None.

    Only plain `key=value` overrides of top-level and `capture.*` keys are checked: `+key=...`
    adds keys on purpose, and keys inside the other groups depend on the option chosen.
    """
    top, capture = _fields(Config), _fields(CaptureConfig)
    for arg in argv:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].strip()
        if "/" in key or "@" in key:  # group choices such as hydra/launcher=joblib
            continue
        head, _, rest = key.partition(".")
        if head in GROUPS or (head == "capture" and (not rest or rest in capture)) or (not rest and head in top):
            continue
        if head == "capture":
            close = difflib.get_close_matches(rest, capture, n=1)
            hint = f" Did you mean 'capture.{close[0]}'?" if close else ""
            return f"{key} is not a config key; capture.* keys: {', '.join(capture)}.{hint} Fix the override {arg!r}."
        if head in top:  # a scalar key given a sub-key, e.g. steps.max=3
            return f"{key} is not a config key: {head} is a single value ({head}=...). Fix the override {arg!r}."
        close = difflib.get_close_matches(head, [*top, *GROUPS], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"{key} is not a config key; top-level keys: {', '.join(top)}.{hint} Fix the override {arg!r}."
    return None
