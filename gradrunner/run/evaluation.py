"""Evaluation during training (`train.eval_every`): the loss on a fixed held-out set, the same batches every time.

| function | what it does |
| --- | --- |
| `held_out_seed(seed)` | the seed of the default held-out set: `seed + HELD_OUT_SEED_OFFSET` |
| `eval_source(cfg, train_source)` | `EvalSource`: `eval_data`, the data's `held_out(seed)`, or the data itself |
| `fixed_batches(source, n, seed, ...)` | the set: the source's first `n` batches (one pass at most), drawn once, torch's RNG left as it was |
| `evaluate(job, cap, autocast)` | the mean loss over the set, in eval mode, without grad or capture |

As Lightning's and the HF Trainer's validation loops do, every evaluation of a run sees the same
batches (drawn once, before step 0), so `eval_loss` moves only when the model does. The set is the
first `train.eval_batches` batches, one pass at most (`fixed_batches`), of

1. `eval_data`, when the config gives one;
2. else new examples of the training data's task: the data source's `held_out(held_out_seed(seed))`
   (`data=synthetic`: other inputs and noise, the same teacher; `data=tokens`: other token ids);
3. else the training data itself, rebuilt with every `seed` key of its node (`data.seed`, a wrapped
   source's `data.inner.seed`) set to `held_out_seed(seed)`, and drawn under torch's RNG seeded so: a
   WARNING names the keys set (or says there were none: then the batches are training's own, unless
   the source draws from torch's RNG) and that these may be training examples (`data=tensors`: the
   literal batch; `data=digits`: the training images, in another order).

Example::

    held = eval_source(cfg, data).source               # e.g. Synthetic(...).held_out(1000000)
    job.eval_set = fixed_batches(held, 2, held_out_seed(0), torch.device("cpu"), torch.float32)
    evaluate(job, cap, torch.autocast("cpu", enabled=False))   # 0.9832 (the same on an unchanged model)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from gradrunner.capturing.untouched import evaluating
from gradrunner.data import Batch, DataSource, as_batches
from gradrunner.data.batches import call

if TYPE_CHECKING:
    from gradrunner.capturing.session import Capture
    from gradrunner.run.build import Job

log = logging.getLogger(__name__)

#: The default held-out set is drawn from `seed + HELD_OUT_SEED_OFFSET` (far from the seeds a sweep uses).
HELD_OUT_SEED_OFFSET = 1_000_000


def held_out_seed(seed: int) -> int:
    """The seed of the default held-out set of a run seeded `seed`.

    Example::

        held_out_seed(0)     # 1000000
    """
    return int(seed) + HELD_OUT_SEED_OFFSET


class EvalSource(NamedTuple):
    """Where a run's evaluation set comes from: a built `source`, or a config `node` to build as `group`."""

    source: object | None
    group: str
    node: DictConfig | None
    what: str


def eval_source(cfg: DictConfig, train_source: object) -> EvalSource:
    """Where a run's evaluation set comes from (the rules in this module's docstring).

    Example::

        eval_source(cfg, Synthetic(seed=0)).what   # 'held-out examples of data (data.held_out(seed=1000000))'

    A node is returned resolved (`${seed}` needs the whole config) for the caller to build: `run.build`
    owns building and its error messages.
    """
    seed = held_out_seed(int(cfg.seed))
    given = cfg.get("eval_data")
    if isinstance(given, DictConfig) and "_target_" in given:
        return EvalSource(None, "eval_data", _resolved(given), "eval_data")
    held_out = getattr(train_source, "held_out", None)
    if callable(held_out):
        return EvalSource(held_out(seed), "data", None, f"held-out examples of data (data.held_out(seed={seed}))")
    node = _resolved(cfg.data)
    keys = _reseed(node, seed)
    why = f"its held_out is {held_out!r}" if hasattr(train_source, "held_out") else "no held_out(seed) method"
    how = f"rebuilt with {', '.join(f'{k}={seed}' for k in keys)}" if keys else "as configured (no seed key to change)"
    log.warning(
        "train.eval_every: data %s offers no held-out examples (%s), so eval_loss is measured on the first %d "
        "batch(es) of the training data %s, which training may also see%s. Set eval_data to a held-out source to "
        "measure generalisation.", cfg.data.get("_target_"), why, int(cfg.train.eval_batches), how,
        "" if keys else f" (the very batches it starts with, unless the source draws from torch's generator, "
        f"seeded {seed} for the draw)",
    )  # fmt: skip
    return EvalSource(None, "data", node, f"the training data, {how}")


def _reseed(node: DictConfig, seed: int, path: str = "data") -> list[str]:
    """Every `seed` key of `node` and of the nodes inside it (a wrapped source's `inner.seed`) set to `seed`;
    their dotted names."""
    keys: list[str] = []
    for key in [str(k) for k in node.keys()]:
        value = node[key]
        if isinstance(value, DictConfig):
            keys += _reseed(value, seed, f"{path}.{key}")
        elif key == "seed":
            node[key] = seed
            keys.append(f"{path}.seed")
    return keys


def _resolved(node: DictConfig) -> DictConfig:
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict), plain
    return OmegaConf.create(plain)


def fixed_batches(
    source: object, n: int, seed: int, device: torch.device, dtype: torch.dtype, forward_kwargs: Any = None
) -> list[Batch]:
    """The first `n` batches of `source` on `device`, one pass at most: the evaluation set, drawn once.

    Example::

        fixed_batches(Synthetic(seed=0).held_out(1_000_000), 2, 1_000_000, torch.device("cpu"), torch.float32)

    Drawn under torch's (and numpy's, Python's) RNG seeded with `seed`, then restored: a shuffling
    `DataLoader` gives the same set on every run of the config, and training's random draws are the
    same with evaluation on or off. A finite iterable (a list, a `DataLoader`) is read once, not cycled,
    and a source with `len()` (every built-in one: batches per epoch, `Tokens`' `num_batches`, `Tensors`'
    one batch) gives one epoch at most: a batch is never counted twice in `eval_loss`. Fewer than `n`
    batches is a WARNING.
    """
    if isinstance(source, DataSource) and isinstance(source, Sized):
        n_max = min(n, len(source))
    else:
        n_max = n
    with _seeded(seed, device):
        batches = list(itertools.islice(as_batches(source, device, dtype, forward_kwargs, once=True), n_max))
    if len(batches) < n:
        log.warning(
            "train.eval_batches=%d, but the evaluation data (%s) holds %d batch(es) in one pass; eval_loss is the "
            "mean over those %d, each counted once. Lower train.eval_batches, or give eval_data more batches.",
            n, type(source).__name__, len(batches), len(batches),
        )  # fmt: skip
    return batches


def evaluate(job: Job, cap: Capture | None, autocast: contextlib.AbstractContextManager[Any]) -> float | None:
    """Mean loss over `job.eval_set` (each batch's loss, averaged), in eval mode, without grad or capture.

    Example::

        eval_loss = evaluate(job, cap, torch.autocast("cpu", enabled=False))   # None without an eval set

    `autocast` is the training step's (`train.autocast`). Each module's train/eval mode (a block the
    model keeps in eval mode stays so: `evaluating`), the capture's `enabled` and torch's RNG are as they
    were afterwards.
    """
    if job.eval_set is None:
        return None
    enabled = cap.enabled if cap is not None else False
    if cap is not None:
        cap.enabled = False
    try:
        with evaluating(job.model), _rng_kept(job.device), torch.no_grad(), autocast:
            total = torch.zeros((), dtype=torch.float64, device=job.device)
            for x, y in job.eval_set:
                total += job.loss_fn(call(job.model, x), y).double()
        return float(total) / len(job.eval_set)
    finally:
        if cap is not None:
            cap.enabled = enabled
            cap.reset()


@contextlib.contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """torch's (CPU and `device`'s), numpy's and Python's random states restored on exit."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    random.setstate(py)
    np.random.set_state(np_state)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """`_rng_kept`, every generator seeded with `seed` inside."""
    with _rng_kept(device):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        yield
