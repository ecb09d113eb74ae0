"""The job a config describes, built before any file is written: model, data, loss, optimizer.

`setup(cfg)` validates the config, seeds every generator, resolves device and dtype and
instantiates the four config groups; a failure is one `GradrunnerError` naming the group. What only
the built job can tell (the learning rates, the schedule through the run, the eval data against the model, the weights
file) is checked before it returns (`gradrunner.run.preflight`).

Example::

    job = setup(cfg)          # cfg composed from gradrunner.conf
    job.model(next(job.batches)[0])
"""

from __future__ import annotations

import inspect
import logging
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from gradrunner.capturing.taps import glob_reach, resolve_taps
from gradrunner.config.choices import DTYPES
from gradrunner.config.schema import validate
from gradrunner.data import Batch, as_batches
from gradrunner.errors import GradrunnerError, did_you_mean, not_allowed, one_paragraph
from gradrunner.run import evaluation, preflight
from gradrunner.run.param_groups import decay_groups

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
_CONF_DIR = Path(__file__).parent.parent / "conf"
log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator and torch (every device).

    Example::

        seed_everything(0); a = torch.rand(1); seed_everything(0); assert torch.equal(a, torch.rand(1))
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(spec: str) -> torch.device:
    """The torch device for `device=`: `auto` is cuda, then mps, then cpu; an unavailable one is an error.

    Example::

        resolve_device("auto")   # device(type='cpu') on a machine without GPU
        resolve_device("cuda")   # GradrunnerError there, listing what is available
    """
    mps = getattr(torch.backends, "mps", None)
    has_mps = bool(mps is not None and mps.is_available())
    available = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())] + (["mps"] if has_mps else [])
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if f"cuda:{device.index}" not in available:
            raise GradrunnerError(
                f"device={spec!r} is not available on this machine (torch {torch.__version__} sees "
                f"{torch.cuda.device_count()} CUDA device(s)); available: {', '.join(available)}. "
                "Use device=auto or device=cpu."
            )
    elif device.type == "mps" and not has_mps:
        raise GradrunnerError(
            f"device='mps' is not available on this machine; available: {', '.join(available)}. Use device=auto."
        )
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for `dtype=` (validated names only: float32, float64, bfloat16, float16).

    Example::

        resolve_dtype("float64")   # torch.float64
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise not_allowed("dtype", name, DTYPES) from None


def _options(group: str) -> str:
    names = sorted(p.stem for p in (_CONF_DIR / group).glob("*.yaml"))
    return ", ".join(names) or "none"


def build(cfg: DictConfig, group: str) -> Any:
    """Instantiate `cfg[group]`; a failure is a GradrunnerError naming the group and its `_target_`.

    Example::

        model = build(cfg, "model")       # e.g. gradrunner.models.MLP(in_features=8, ...)
    """
    node = cfg[group]
    target = node.get("_target_", "<no _target_>")
    check_booleans(node, group)
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, GradrunnerError):
            raise e.__cause__ from None
        detail = one_paragraph(e).replace(f" full_key: {group}", "").rstrip(".")
        if ", set env var HYDRA_FULL_ERROR" in detail:  # "Error locating target": the cause says why
            cause = one_paragraph(str(e.__cause__))
            detail = f"{detail.split(', set env var')[0]} ({type(e.__cause__).__name__}: {cause})"
        partial = group != "optimizer" or node.get("_partial_", False)
        hint = "" if partial else " (optimizer options need `_partial_: true`)"
        raise GradrunnerError(
            f"could not build {group} from _target_={target!r}: {detail}. Check the {group}.* keys{hint}, "
            f"or pick another option with {group}=<option> (built-in: {_options(group)})."
        ) from e


def check_booleans(node: Any, path: str) -> None:
    """Refuse a value other than true or false for a parameter that a `_target_` in `node` (at any depth) types `bool`.

    Example::

        check_booleans(OmegaConf.create({"_target_": "gradrunner.data.Digits", "shuffle": "flase"}), "data")
        # GradrunnerError: data.shuffle='flase' is not allowed; allowed: false, true. Did you mean 'false'? ...

    The constructors take what they are given, and a string is true whatever it says (`data.shuffle=flase`
    shuffled, `data.nan=no` planted NaN): every parameter annotated `bool` of every target `build` instantiates
    (gradrunner's data sources, losses and models, torch's `nn.ReLU(inplace)` or `SGD(nesterov)`) is checked
    here, before it is built. A node that cannot be resolved or located is left to `instantiate`, which says why.
    """
    try:
        plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except Exception:  # a broken interpolation: instantiate names it
        return
    _check_booleans(plain, path)


def _check_booleans(node: Any, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_booleans(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if not str(key).startswith("_"):
            _check_booleans(value, f"{path}.{key}")
    target = node.get("_target_")
    try:
        params = inspect.signature(_quiet_get_object(target)).parameters if isinstance(target, str) else {}
    except Exception:  # no such target, or no signature to read: nothing to check here
        return
    for name, param in params.items():
        value = node.get(name)
        if name in node and param.annotation in (bool, "bool") and not isinstance(value, bool):
            said = "; a string counts as true whatever it says" if isinstance(value, str) else ""
            raise not_allowed(f"{path}.{name}", value, ["false", "true"], f" ({target} takes a boolean there{said}.)")


def _quiet_get_object(target: str) -> Any:
    """`hydra.utils.get_object(target)`, without the ERROR lines it logs for a target that does not import:
    `instantiate` is told the same and `build` says it in one paragraph."""
    hydra_log = logging.getLogger("hydra.utils")
    was = hydra_log.disabled
    hydra_log.disabled = True
    try:
        return get_object(target)
    finally:
        hydra_log.disabled = was


def _optimizer_hint(node: DictConfig, error: Exception) -> str:
    """What to fix when the optimizer cannot be built: a misspelled keyword (with the accepted ones), or `_partial_`."""
    if not isinstance(error, TypeError):
        return ""
    if not node.get("_partial_", False):
        return "; optimizer options need `_partial_: true`"
    bad = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    try:
        accepted = [p for p in inspect.signature(get_class(str(node._target_))).parameters if p not in ("self", "params")]
    except Exception:  # not a class we can inspect: the error says enough
        return ""
    if bad is None:
        return f"; {node._target_} accepts {', '.join(accepted)}"
    return (f"; {node._target_} has no {bad.group(1)!r}, it accepts: {', '.join(accepted)}."
            f"{did_you_mean(bad.group(1), accepted, prefix='optimizer.')} Fix the override or the optimizer file")  # fmt: skip


@dataclass
class Job:
    """Everything the step loop needs, built from the config before any file is written."""

    model: nn.Module
    batches: Iterator[Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer
    device: torch.device
    dtype: torch.dtype
    #: `scheduler` group, built over `optimizer`; None without one.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    #: `train.eval_every`: the fixed evaluation set (`run.evaluation`), the same batches every time; None without.
    eval_set: list[Batch] | None = None


def setup(cfg: DictConfig, check_taps: bool = True) -> Job:
    """Validate `cfg`, seed, and build model, data, loss and optimizer on the configured device and dtype.

    Example::

        job = setup(cfg); job.model(next(job.batches)[0])

    `check_taps=False` (the tap explorer, which lists the model's taps whatever the config's reach) builds
    the job without resolving `cfg.taps` against the model.
    """
    validate(cfg)
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    seed_everything(cfg.seed)
    init_from = OmegaConf.select(cfg, "model.init_from", default=None)
    model = build(_without(cfg, "model", "init_from"), "model")
    if not isinstance(model, nn.Module):
        raise GradrunnerError(f"model {cfg.model._target_!r} built a {type(model).__name__}, not a torch.nn.Module")
    if init_from is not None:
        load_weights(model, str(init_from))
    model.to(device=device, dtype=dtype)
    # Taps checked against the model now: a typo is answered before data, loss and optimizer are
    # built (the first optimizer imports torch._dynamo, about a second).
    specs = OmegaConf.to_container(cfg.taps, resolve=True)
    if check_taps:
        resolve_taps(model, specs)  # type: ignore[arg-type]
        for reach in glob_reach(model, specs):  # type: ignore[arg-type]  # how far each glob reached, depth by depth
            log.info("taps: %s", reach)
    source = build(cfg, "data")
    batches = as_batches(source, device, dtype, cfg.get("forward_kwargs"))
    loss_fn = build(cfg, "loss")
    if isinstance(loss_fn, nn.Module):
        loss_fn.to(device=device)
    make_optimizer = build(_without(cfg, "optimizer", "no_decay"), "optimizer")
    no_decay = OmegaConf.select(cfg, "optimizer.no_decay", default=None)
    params = decay_groups(model, list(no_decay)) if no_decay else model.parameters()  # run/param_groups.py
    try:
        optimizer = make_optimizer(params)
    except (TypeError, ValueError) as e:
        hint = _optimizer_hint(cfg.optimizer, e)
        raise GradrunnerError(
            f"could not build optimizer {cfg.optimizer._target_!r} over the model's parameters: {e}. "
            f"Check the optimizer.* keys{hint}."
        ) from e
    preflight.check_rates(optimizer, str(cfg.optimizer._target_))
    preflight.check_step(optimizer, str(cfg.optimizer._target_))
    scheduler = None
    if cfg.get("scheduler") and "_target_" in cfg.scheduler:
        make_scheduler = build(cfg, "scheduler")
        try:
            scheduler = make_scheduler(optimizer)
        except (TypeError, ValueError, KeyError) as e:
            raise GradrunnerError(
                f"could not build scheduler {cfg.scheduler._target_!r} over the optimizer: {one_paragraph(e)}. "
                f"Check the scheduler.* keys, or pick another option with scheduler=<option> (built-in: "
                f"{_options('scheduler')})."
            ) from e
        preflight.check_schedule(make_scheduler, optimizer, scheduler, int(cfg.steps), str(cfg.scheduler._target_))
    eval_set = _eval_set(cfg, source, device, dtype) if int(cfg.train.eval_every) > 0 else None
    job = Job(model, batches, loss_fn, optimizer, device, dtype, scheduler, eval_set)
    preflight.check_eval_data(job, str(cfg.model._target_), str(cfg.loss._target_))
    return job


def _eval_set(cfg: DictConfig, source: object, device: torch.device, dtype: torch.dtype) -> list[Batch]:
    """The fixed evaluation set of `train.eval_every` (`gradrunner.run.evaluation` says which batches)."""
    src = evaluation.eval_source(cfg, source)
    held = src.source if src.source is not None else build(OmegaConf.create({src.group: src.node}), src.group)
    n, seed = int(cfg.train.eval_batches), evaluation.held_out_seed(int(cfg.seed))
    batches = evaluation.fixed_batches(held, n, seed, device, dtype, cfg.get("forward_kwargs"))
    log.info("evaluation every %d steps on a fixed set of %d batch(es): %s", int(cfg.train.eval_every), len(batches),
             src.what)  # fmt: skip
    return batches


def _without(cfg: DictConfig, group: str, key: str) -> DictConfig:
    """`cfg` with `group.key` removed: a runner's key (`model.init_from`, `optimizer.no_decay`), not a constructor argument."""
    if key not in cfg[group]:
        return cfg
    node = OmegaConf.to_container(cfg[group], resolve=True)  # resolved here: its ${...} need the whole config
    assert isinstance(node, dict), node
    node.pop(key)
    return OmegaConf.create({group: node})


def load_weights(model: nn.Module, path: str) -> None:
    """Load a local state_dict (`torch.load(weights_only=True)`) or safetensors file into `model`, strictly.

    Example::

        load_weights(model, "trained.pt")   # GradrunnerError naming missing/unexpected keys on a mismatch
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise GradrunnerError(f"model.init_from={path!r}: no such file. Give the path of a local state_dict (.pt) or "
                              "safetensors file.")  # fmt: skip
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except ImportError:
        raise GradrunnerError(f"model.init_from={path!r} is a safetensors file, but safetensors is not installed: "
                              "pip install safetensors, or save a state_dict with torch.save.") from None  # fmt: skip
    except Exception as e:
        raise GradrunnerError(
            f"model.init_from={path!r} could not be read as a state_dict: {one_paragraph(e)}. Only tensors are "
            "loaded (torch.load(weights_only=True)); save the model with torch.save(model.state_dict(), path)."
        ) from e
    if not isinstance(state, dict):
        raise GradrunnerError(f"model.init_from={path!r} holds a {type(state).__name__}, not a state_dict; save it "
                              "with torch.save(model.state_dict(), path).")  # fmt: skip
    own = model.state_dict()
    preflight.check_weights(state, own, path)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" (and {len(keys) - 8} more)" if len(keys) > 8 else "") if keys else "none"

        raise GradrunnerError(
            f"model.init_from={path!r} does not fit model {type(model).__name__}: missing keys: {few(missing)}; "
            f"unexpected keys: {few(unexpected)}; shape mismatches: {few(shapes)}. Give the file saved from the same "
            "model config, or change model.* to match it."
        )
    model.load_state_dict(state)
