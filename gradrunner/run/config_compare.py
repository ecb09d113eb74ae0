"""Whether two job configs give the same records: the keys that change none, the keys added since, the diff.

The run dir's books (`run.books`, which re-exports these), checkpoints and branches compare configs by it.

Example::

    config_diff({"steps": 2, "resume": False}, {"steps": 3, "resume": True})   # ['steps: 2 -> 3']
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

#: Config keys (dotted) that do not change the records: a rerun may differ in them and still resume or be
#: skipped as complete (how often a checkpoint is written changes no record).
NEUTRAL_KEYS = ("resume", "report", "train.checkpoint_every")
#: Config keys added after records were first written, with the value that means "as before": a run
#: recorded without the key matches a config that has it at this value (its records are the same).
ADDED_KEYS: dict[str, Any] = {"capture.per_example": False, "capture.histogram": False}
# The training options (issue 20) at their defaults train as before they existed.
ADDED_KEYS.update({"train.clip_grad_norm": None, "train.clip_grad_value": None, "train.autocast": "off",
                   "train.accumulate": 1, "train.checkpoint_every": 0, "train.eval_every": 0,
                   "train.eval_batches": 1, "eval_data": None})  # fmt: skip
# Gradient edits (issue 22): none edits nothing.
ADDED_KEYS["edits"] = []
# Spike replay and branching (issue 35): off, and no branch, record as before.
ADDED_KEYS.update({"anomaly.replay": 0, "train.branch_from": None, "train.branch_reset_moments": False})
# Spike detection (issue 35) writes anomalies.parquet beside the records and changes none of them; the
# parallelism keys (issue 34) at their defaults are DDP, as before they existed.
ADDED_KEYS.update({"anomaly.enabled": True, "anomaly.z": 6.0, "anomaly.window": 128, "anomaly.warmup": 20,
                   "train.parallel": "ddp", "train.shard": None, "train.shard_size": None, "train.tp": 1})  # fmt: skip


def config_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved job config as plain containers, without the `hydra` node.

    Example::

        config_dict(cfg)["capture"]["strategy"]   # 'hook'
    """
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict), data
    return {str(k): v for k, v in data.items() if k != "hydra"}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every leaf that differs, the keys of `NEUTRAL_KEYS` left out.

    Example::

        config_diff({"steps": 2, "resume": False}, {"steps": 3, "resume": True})   # ['steps: 2 -> 3']

    A key of `ADDED_KEYS` missing on one side counts as its as-before value (records written before
    the key existed match a config that leaves it at that value).
    """
    a, b = _flatten(old), _flatten(new)
    missing = object()
    keys = [k for k in sorted(set(a) | set(b)) if not neutral(k)]
    return [
        f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
        for k in keys
        if not _same(a.get(k, missing), b.get(k, missing)) and not _added_as_before(k, a, b)
    ]


def neutral(key: str) -> bool:
    """Whether the dotted config key `key` is (or lies below) one of `NEUTRAL_KEYS`."""
    return any(key == n or key.startswith(f"{n}.") for n in NEUTRAL_KEYS)


def _same(x: object, y: object) -> bool:
    """Equal leaves, a NaN equal to a NaN (`data.scale=nan` is the same config twice, not a changed key)."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)


def _added_as_before(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """`key` is one of `ADDED_KEYS`, unset on one side and at its as-before value on the other."""
    if key not in ADDED_KEYS:
        return False
    values = [d[key] for d in (old, new) if key in d]
    return len(values) == 1 and values[0] == ADDED_KEYS[key]
