"""The config schema (dataclasses registered in Hydra's ConfigStore) and `validate(cfg)` for its values.

The schema makes a misspelled top-level or `capture.*` key an error at compose time; `validate`
checks what types cannot: strategy names, the device grammar, dtypes, values modes and ranges.

Example::

    from gradrunner.config.schema import validate
    validate(cfg)   # raises GradrunnerError("capture.strategy='hooks' is not ... allowed: ...")
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# The allowed values live in choices.py (one source; re-exported here for `from gradrunner.config.schema import DTYPES`).
from gradrunner.config.anomaly_settings import check_settings
from gradrunner.config.choices import (
    DEVICES,
    DTYPES,
    NONFINITE_MODES,
    SEED_MAX,
    STEPS_MAX,
    STRATEGY_NAMES,
    VALUES_MODES,
)
from gradrunner.config.edits import parse_edits
from gradrunner.config.replay import check_branch, validate_replay
from gradrunner.config.scheduler_checks import validate_scheduler
from gradrunner.errors import GradrunnerError, not_allowed

#: Name of the schema in the ConfigStore; `conf/config.yaml` lists it first in its defaults.
SCHEMA_NAME = "gradrunner_schema"
_DEVICE_RE = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")


@dataclass
class CaptureConfig:
    """`capture.*`: how gradients are captured and what is kept of them."""

    # Capture strategy, a key of gradrunner.capturing.strategies.STRATEGIES: retain_grad, hook, autograd_grad.
    strategy: str = "hook"
    # What is kept besides statistics: none, full (every element), sample (sample_size fixed positions).
    values: str = "none"
    # Capture on every N-th optimisation step (steps 0, N, 2N, ...).
    every: int = 1
    # Number of element positions kept per tap when values=sample.
    sample_size: int = 64
    # A non-finite loss or captured gradient: record (NaN/Inf counts in the records, go on) or stop the run there.
    on_nonfinite: str = "record"
    # Add `per_example_norm` (one gradient norm per batch row; taps other than parameters) to the records.
    per_example: bool = False
    # Add `hist_counts` (counts of |g| in fixed log-spaced bins, edges in the file metadata) to the records.
    histogram: bool = False


@dataclass
class TrainConfig:
    """`train.*`: how each optimisation step is taken (see gradrunner.run.loop.train_step)."""

    # Clip the total gradient norm (over all parameters) to this value, as torch.nn.utils.clip_grad_norm_; null: off.
    clip_grad_norm: float | None = None
    # Clamp every gradient element to [-v, v], as torch.nn.utils.clip_grad_value_; null: off.
    clip_grad_value: float | None = None
    # torch.autocast around forward and loss: bf16, fp16 (with a torch.amp.GradScaler) or off.
    autocast: str = "off"
    # Micro-batches per optimisation step (gradient accumulation); each micro-batch's loss is divided by it.
    accumulate: int = 1
    # Save a checkpoint in the job dir every K optimisation steps (0: never); resume=true continues from it.
    checkpoint_every: int = 0
    # Evaluate the loss on eval_data (or the training data) every K steps (0: never), without capture.
    eval_every: int = 0
    # Batches per evaluation.
    eval_batches: int = 1
    # Start from another run's kept checkpoint, "<run dir>:<step>" (docs/autopsy.md): its model, optimizer,
    # scheduler, data position and generators before <step>, this config from there on; null: from step 0.
    branch_from: str | None = None
    # With branch_from: drop the optimizer's per-parameter state (Adam's moments and step count) at the branch.
    branch_reset_moments: bool = False
    # Under torchrun: ddp (whole model per rank), fsdp2 (fully_shard over all ranks) or hsdp (replicate x shard).
    parallel: str = "ddp"
    # fsdp2/hsdp: globs of the module paths sharded as units (then the root); null: each child holding parameters.
    shard: list[str] | None = None
    # hsdp: processes per shard group (the mesh's second dim); null: the smallest factor leaving 2+ replicas.
    shard_size: int | None = None
    # Tensor-parallel degree: only 1 (no model has a tensor-parallel plan in the runner yet; docs/scale-out.md).
    tp: int = 1


@dataclass
class AnomalyConfig:
    """`anomaly.*`: loss-spike detection and what is done about a spike (README "Spike detection")."""

    # Spike detection on every step (anomalies.parquet, the last word); false: off.
    enabled: bool = True
    # A value beyond z standard deviations of its signal's window is a spike (norms: on a log scale).
    z: float = 6.0
    # Values per signal the mean and std are taken over.
    window: int = 128
    # Values of a signal before it is judged (at most the window); NaN/Inf are flagged from the start.
    warmup: int = 20
    # After the run, re-run the K steps before each flagged loss spike (and the spike's step) from the last
    # checkpoint at or before them, with capture.values=full, into <run dir>/replay/step<S>/ (0: off; needs
    # train.checkpoint_every; keeps the checkpoints that needs; docs/autopsy.md).
    replay: int = 0


@dataclass
class Config:
    """The top level of the composed config (the `hydra` node is added by Hydra itself)."""

    # Instantiable torch.nn.Module (`_target_` + kwargs); config group `model`.
    model: Any = MISSING
    # Instantiable data source yielding (inputs, targets) batches; config group `data`.
    data: Any = MISSING
    # Extra keyword arguments of every forward call, e.g. {output_attentions: true}.
    forward_kwargs: dict[str, Any] = field(default_factory=dict)
    # Instantiable callable (output, target) -> scalar tensor; config group `loss`.
    loss: Any = MISSING
    # Instantiable optimizer with `_partial_: true`, called with model.parameters(); group `optimizer`.
    optimizer: Any = MISSING
    # Capture settings; config group `capture`.
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    # Learning-rate scheduler with `_partial_: true`, called with the optimizer; group `scheduler` (none: no _target_).
    scheduler: Any = None
    # How each optimisation step is taken: clipping, autocast, accumulation, checkpoints, evaluation.
    train: TrainConfig = field(default_factory=TrainConfig)
    # Instantiable data source for evaluation (train.eval_every); null: the training data's source, reseeded.
    eval_data: Any = None
    # Name written to the records' `experiment` column; each experiment file sets its own.
    experiment: str = "default"
    # Number of optimisation steps.
    steps: int = 100
    # Seeds torch, numpy and random (data options interpolate it as `${seed}`).
    seed: int = 0
    # auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.
    device: str = "auto"
    # Dtype of the model and the floating-point inputs: float32, float64, bfloat16, float16.
    dtype: str = "float32"
    # Tap specs: "<module path>:<name>" strings or {module: ..., name: ...} mappings.
    taps: list[Any] = field(default_factory=list)
    # A single run into a dir that already holds records: false refuses; true skips a completed run
    # (done.json) and re-runs an incomplete one (from its last checkpoint with train.checkpoint_every,
    # else from step 0). A sweep always resumes (docs/scale-out.md).
    resume: bool = False
    # Write the report (python -m gradrunner.report) when the run ends; a sweep writes one for the sweep dir.
    report: bool = False
    # Loss-spike detection and replay; config group `anomaly`.
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    # Gradient edits: {tap: <spec>, <operation>: <value>} entries (scale, clip_norm, clip_value, mask,
    # dropout, noise_std), applied on every step in config order (gradrunner/capturing/edits.py).
    edits: list[Any] = field(default_factory=list)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent; done on import of this module).

    Example::

        register_configs()   # then `defaults: [gradrunner_schema, _self_, ...]` in config.yaml
    """
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


register_configs()


#: The one "not allowed" message (errors.not_allowed), under the name this module's validators call.
_allowed = not_allowed


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GradrunnerError(
            f"{name}={value!r} is not allowed; {name} must be an integer >= {minimum}."
            f" Fix it on the command line, e.g. {name}={max(minimum, 1)}, or in your config file."
        )




def _check_at_most(name: str, value: int, maximum: int, why: str) -> None:
    if value > maximum:
        raise GradrunnerError(
            f"{name}={value} is not allowed; {name} must be an integer from 0 to {maximum} ({why})."
            f" Fix it on the command line, e.g. {name}={min(maximum, 10)}, or in your config file."
        )


def _check_keys(prefix: str, node: DictConfig, allowed: list[str]) -> None:
    for key in node:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            maybe = f" Did you mean {prefix}{close[0]}?" if close else ""
            raise GradrunnerError(
                f"unknown config key {prefix}{key!s}.{maybe} Allowed keys: "
                f"{', '.join(prefix + a for a in allowed if a != 'hydra')}."
            )


def validate(cfg: DictConfig) -> None:
    """Check the composed config's values; raise `GradrunnerError` naming the bad value and what is allowed.

    Example::

        cfg = compose("config", overrides=["capture.strategy=hooks"])
        validate(cfg)   # GradrunnerError: capture.strategy='hooks' is not allowed; allowed: ...
    """
    # `+key=value` on the command line adds keys even past the schema: refuse them here.
    _check_keys("", cfg, [f.name for f in fields(Config)] + ["hydra"])
    _check_keys("capture.", cfg.capture, [f.name for f in fields(CaptureConfig)])
    for group in ("model", "data", "loss", "optimizer"):
        node = OmegaConf.select(cfg, group, throw_on_missing=False)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise GradrunnerError(
                f"{group} has no _target_ (got {OmegaConf.to_container(node) if OmegaConf.is_config(node) else node!r});"
                f" pick an option with {group}=<option> or give {group}._target_=<importable.Class>."
            )
    # choices.STRATEGY_NAMES, not the capture registry: config sits below capture (a test holds them equal)
    if cfg.capture.strategy not in STRATEGY_NAMES:
        raise _allowed("capture.strategy", cfg.capture.strategy, STRATEGY_NAMES)
    if cfg.capture["values"] not in VALUES_MODES:
        raise _allowed("capture.values", cfg.capture["values"], VALUES_MODES)
    if cfg.capture.get("on_nonfinite", "record") not in NONFINITE_MODES:
        raise _allowed("capture.on_nonfinite", cfg.capture.on_nonfinite, NONFINITE_MODES)
    if not isinstance(cfg.device, str) or not _DEVICE_RE.fullmatch(cfg.device):
        raise _allowed("device", cfg.device, DEVICES, " (N is a GPU index, e.g. cuda:0.)")
    if cfg.dtype not in DTYPES:
        raise _allowed("dtype", cfg.dtype, DTYPES)
    _check_int("steps", cfg.steps, 0)
    _check_int("seed", cfg.seed, 0)
    _check_at_most("steps", cfg.steps, STEPS_MAX, "a larger number would run for ever")
    _check_at_most("seed", cfg.seed, SEED_MAX, "numpy's seeds are 32-bit")
    _check_int("capture.every", cfg.capture.every, 1)
    _check_int("capture.sample_size", cfg.capture.sample_size, 1)
    for flag in ("per_example", "histogram"):
        if not isinstance(cfg.capture.get(flag, False), bool):
            raise _allowed(f"capture.{flag}", cfg.capture[flag], ["false", "true"])
    validate_train(cfg)
    validate_anomaly(cfg)
    _check_int("anomaly.replay", OmegaConf.select(cfg, "anomaly.replay", default=0), 0)
    validate_replay(cfg)
    validate_edits(cfg)
    if not OmegaConf.is_list(cfg.taps):
        raise GradrunnerError(
            f"taps={cfg.taps!r} must be a list of tap specs, e.g. taps='[fc1:output,\"relu*:output\"]'."
        )


#: `train.autocast` values: bfloat16 or float16 autocast around forward and loss, or none.
AUTOCAST_MODES = ("off", "bf16", "fp16")
#: `train.parallel` values (gradrunner.run.parallel): how the ranks of a torchrun job hold the model.
PARALLEL_MODES = ("ddp", "fsdp2", "hsdp")


def _check_positive(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise GradrunnerError(
            f"{name}={value!r} is not allowed; {name} must be a number > 0, or null to turn it off."
            f" Fix it on the command line, e.g. {name}=1.0, or in your config file."
        )


#: What to pick instead of a node without `_target_`, per optional group.
_GROUP_HINTS = {
    "scheduler": "pick an option with scheduler=<option> (none, cosine, onecycle, linear_warmup, warmup_cosine)",
    "eval_data": "pick a data option with eval_data=<option> (the data group's: synthetic, tensors, digits, tokens)",
}


def validate_train(cfg: DictConfig) -> None:
    """Check `train.*`, `scheduler`, `eval_data` and `model.init_from`; raise `GradrunnerError` naming the bad value.

    Example::

        validate_train(compose("config", overrides=["train.autocast=fp8"]))
        # GradrunnerError: train.autocast='fp8' is not allowed; allowed: off, bf16, fp16. ...
    """
    train = cfg.get("train")
    if train is None:
        return
    _check_keys("train.", train, [f.name for f in fields(TrainConfig)])
    _check_positive("train.clip_grad_norm", train.clip_grad_norm)
    _check_positive("train.clip_grad_value", train.clip_grad_value)
    if str(train.autocast) not in AUTOCAST_MODES:
        raise _allowed("train.autocast", train.autocast, AUTOCAST_MODES, ' (In YAML quote it: autocast: "off".)')
    mode = str(train.get("parallel", "ddp"))
    if mode not in PARALLEL_MODES:
        raise _allowed("train.parallel", mode, PARALLEL_MODES, " (fsdp2/hsdp under torchrun: docs/scale-out.md)")
    if train.get("shard_size") is not None:
        _check_int("train.shard_size", train.shard_size, 2)
    if mode != "ddp" and int(os.environ.get("WORLD_SIZE") or 1) < 2:  # a sweep's check says it before any job too
        raise GradrunnerError(
            f"train.parallel={mode} shards the model over several processes, but this job is one process (WORLD_SIZE"
            f" is unset or 1). Start it with torchrun, e.g. `torchrun --standalone --nproc_per_node="
            f"{4 if mode == 'hsdp' else 2} -m gradrunner <your overrides> train.parallel={mode}`, or drop train.parallel"
            " (ddp, the default, runs as one process without torchrun)."
        )
    if train.get("tp", 1) != 1:
        raise GradrunnerError(
            f"train.tp={train.tp} asks for tensor parallel, but model {OmegaConf.select(cfg, 'model._target_')} has no "
            "tensor-parallel plan in gradrunner's runner (none has yet: docs/scale-out.md says why); allowed: 1. Shard it "
            "with train.parallel=fsdp2 under torchrun, or parallelize it in your own loop and use gradrunner.record()."
        )
    _check_int("train.accumulate", train.accumulate, 1)
    _check_int("train.checkpoint_every", train.checkpoint_every, 0)
    _check_int("train.eval_every", train.eval_every, 0)
    _check_int("train.eval_batches", train.eval_batches, 1)
    _check_can_finish(cfg)
    check_branch(train)
    if train.autocast != "off" and cfg.dtype != "float32":
        raise GradrunnerError(
            f"train.autocast={train.autocast} needs dtype=float32 (got dtype={cfg.dtype}): autocast runs a float32"
            " model's eligible ops in lower precision. Set dtype=float32, or train.autocast=off."
        )
    for group in ("scheduler", "eval_data"):
        node = cfg.get(group)
        if node is None or (isinstance(node, DictConfig) and len(node) == 0):
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise GradrunnerError(
                f"{group} has no _target_ (got {OmegaConf.to_container(node) if OmegaConf.is_config(node) else node!r});"
                f" {_GROUP_HINTS[group]} or give {group}._target_=<importable.Class>."
            )
    sched = cfg.get("scheduler")
    if isinstance(sched, DictConfig) and "_target_" in sched and not sched.get("_partial_", False):
        raise GradrunnerError(
            f"scheduler {sched._target_!r} needs `_partial_: true`: the runner calls it with the optimizer."
            " Add scheduler._partial_=true (+scheduler._partial_=true on the command line) or to your scheduler file."
        )
    validate_scheduler(cfg)
    init_from = OmegaConf.select(cfg, "model.init_from", default=None)
    if init_from is not None and not isinstance(init_from, str):
        raise GradrunnerError(
            f"model.init_from={init_from!r} is not allowed; it must be the path of a local state_dict (.pt) or"
            " safetensors file, or null."
        )


def _check_can_finish(cfg: DictConfig) -> None:
    """Micro-batches and evaluation batches a run cannot get through are refused (`STEPS_MAX` of each)."""
    train, steps = cfg.train, max(1, int(cfg.steps))
    if int(train.accumulate) > STEPS_MAX // steps:
        raise GradrunnerError(
            f"train.accumulate={train.accumulate} is not allowed with steps={cfg.steps}: steps x train.accumulate "
            f"micro-batches must be at most {STEPS_MAX} (more would run for ever), so train.accumulate must be an "
            f"integer from 1 to {STEPS_MAX // steps}. Fix it on the command line, e.g. train.accumulate=4."
        )
    evaluations = steps // int(train.eval_every) if int(train.eval_every) else 0
    if evaluations and int(train.eval_batches) > STEPS_MAX // evaluations:
        raise GradrunnerError(
            f"train.eval_batches={train.eval_batches} is not allowed with steps={cfg.steps} and train.eval_every="
            f"{train.eval_every}: the run's {evaluations} evaluation(s) would read more than {STEPS_MAX} batches "
            f"(it would run for ever), so train.eval_batches must be an integer from 1 to "
            f"{STEPS_MAX // evaluations}. Fix it on the command line, e.g. train.eval_batches=4."
        )


def validate_anomaly(cfg: DictConfig) -> None:
    """Check `anomaly.*` (the detector's rule: `config.anomaly_settings.check_settings`).

    Example::

        validate_anomaly(compose("config", overrides=["anomaly.window=10"]))
        # GradrunnerError: anomaly.warmup=20 is not allowed with anomaly.window=10 ...
    """
    node = OmegaConf.select(cfg, "anomaly", default=None) or {"enabled": False}
    if not isinstance(node.get("enabled", True), bool):
        raise _allowed("anomaly.enabled", node["enabled"], ["false", "true"])
    if node["enabled"]:
        check_settings(node["z"], node["window"], node["warmup"])


def validate_edits(cfg: DictConfig) -> None:
    """Check `edits` (a list of `{tap, <one operation>: <value>}`) before anything is built.

    Example::

        validate_edits(compose("config", overrides=['edits=[{tap:"fc1:output",scale:-1}]']))   # fine
    """
    edits = cfg.get("edits")
    parse_edits(OmegaConf.to_container(edits, resolve=True) if OmegaConf.is_config(edits) else edits)


def edit_list(cfg: DictConfig) -> list[Any] | None:
    """`edits` as plain Python values for `capture(..., edits=...)`, None when there are none (validated already)."""
    edits = OmegaConf.to_container(cfg.edits, resolve=True) if cfg.get("edits") else None
    return edits if isinstance(edits, list) else None
