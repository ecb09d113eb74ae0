"""`gradrunner.record(model, taps, run_dir)`: the runner's records from any training loop.

The loop stays the user's; `record` is the run dir's books (the lock, `done.json` when the block
exits normally with every step closed) around the runner's own step engine (`run.engine.StepEngine`:
the same capture session, writers, live segments and step semantics). `analysis.load`,
`python -m gradrunner.report`, DuckDB and polars read the run dir unchanged.

Example::

    from gradrunner import record
    with record(model, ["*:output", "*:weight"], "runs/mine", strategy="hook", every=10) as rec:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()                    # or rec.backward(loss); autograd_grad needs rec.backward
            optimizer.step(); optimizer.zero_grad()
            rec.step(loss)                     # closes the step: its records, one transfer

A step is one optimiser step: several backwards before `rec.step` (gradient accumulation) give the
runner's records (`train.accumulate=N`): activation, input and local taps one record per backward
(`micro_step` 0, 1, ...); parameter taps one record per step (`micro_step` null), the sum of the
gradients that arrived over the step's backwards: the accumulated `.grad` the optimiser uses, before
clipping (held by the capture, so clipping or `zero_grad` before `rec.step` does not change it).
The Lightning and HF callbacks (`gradrunner.integrations`) drive this same `Recorder`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf
from torch import nn

from gradrunner.capturing.taps import TapSpec
from gradrunner.config.choices import NONFINITE_MODES, STRATEGY_NAMES, VALUES_MODES
from gradrunner.errors import GradrunnerError, not_allowed
from gradrunner.records import rundir
from gradrunner.run import books
from gradrunner.run.engine import LIVE_EVERY, RunFiles, StepEngine, StepResult

if TYPE_CHECKING:
    from gradrunner.run.distributed import Distributed

log = logging.getLogger(__name__)

#: The `experiment` column of records written by `record` (the runner writes the config's name).
EXPERIMENT = "record"


class Recorder:
    """The session `record(...)` opens: one run dir, one step engine.

    Example::

        with Recorder(model, ["fc1:output"], "runs/a") as rec:
            loss.backward(); opt.step(); opt.zero_grad(); rec.step(loss)

    Options are `capture.*`'s: `values` (`none`, `full`, `sample` with `sample_size`), `per_example`,
    `histogram`, `on_nonfinite` (`record`, `stop`), plus `every` (capture every N-th step) and `seed`
    (the sample positions). `update_norms=True` adds the parameter taps' `update_norm` and
    `update_ratio` (a copy of each tapped parameter is taken after each captured backward).
    `scaler=` (a `torch.amp.GradScaler`) makes the records hold the true gradients and loss of a loss
    multiplied by its scale (`loss_scale=`, a callable giving the scale, does the same for another
    loss scaler). `live_every` (default 10; 0: off) writes the completed steps as closed segments
    every so many steps, which `load(run_dir, live=True)` reads while the job runs;
    `log_to="tensorboard"` also logs each captured step's statistics to `<run_dir>/tensorboard` as
    it is written (the export's tags; no extra device sync). `dist` (a `run.distributed.Distributed`)
    records every rank's rows in rank 0's run dir; a `DistributedDataParallel` model has its parameter
    taps read after DDP's all-reduce (`params_synced`: the same for a wrapper `record` is not given, as
    the callbacks use it).
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Sequence[TapSpec] | TapSpec,
        run_dir: str | os.PathLike[str],
        *,
        strategy: str = "hook",
        every: int = 1,
        values: str = "none",
        sample_size: int = 64,
        seed: int = 0,
        per_example: bool = False,
        histogram: bool = False,
        on_nonfinite: str = "record",
        experiment: str = EXPERIMENT,
        scaler: Any = None,
        loss_scale: Callable[[], torch.Tensor | float | None] | None = None,
        update_norms: bool = False,
        dist: Distributed | None = None,
        live_every: int = LIVE_EVERY,
        log_to: str | None = None,
        params_synced: Callable[[], bool] | None = None,
    ) -> None:
        _check_options(strategy, every, values, sample_size, on_nonfinite, log_to, scaler)
        self.model, self.directory = model, Path(run_dir).resolve()
        self.taps = [taps] if isinstance(taps, (str, dict)) else list(taps)
        self.strategy, self.dist = strategy, dist
        self.run_id = dist.run_id if dist is not None and dist.run_id else uuid.uuid4().hex
        self.config = OmegaConf.create({
            "experiment": experiment, "source": "gradrunner.record", "seed": int(seed), "taps": self.taps,
            "capture": {"strategy": strategy, "values": values, "sample_size": int(sample_size), "every": int(every),
                        "per_example": bool(per_example), "histogram": bool(histogram), "on_nonfinite": on_nonfinite},
        })  # fmt: skip
        self.engine = StepEngine(model, self.taps, strategy=strategy, every=every, values=values,
                                 sample_size=sample_size, seed=seed, per_example=per_example, histogram=histogram,
                                 on_nonfinite=on_nonfinite, update_norms=update_norms, scaler=scaler,
                                 loss_scale=loss_scale, dist=dist, live_every=live_every, log_to=log_to,
                                 params_synced=params_synced)  # fmt: skip
        self.capture = self.engine.capture
        self._stack = contextlib.ExitStack()
        self._open = False
        self._warned_loss = False

    @property
    def main(self) -> bool:
        """Whether this process keeps the books (always, outside DDP; rank 0 under it)."""
        return self.engine.main

    @property
    def step_index(self) -> int:
        """The number of the step in progress (from 0)."""
        return self.engine.step

    @property
    def captured(self) -> bool:
        """Whether the current step is captured (`step_index % every == 0`)."""
        return self.engine.captured

    # -- opening and closing -------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        try:
            self._enter()
        except BaseException:
            self._stack.close()
            raise
        self._open = True
        return self

    def _enter(self) -> None:
        from gradrunner.records.writer import run_metadata  # pyarrow: imported once writing starts
        from gradrunner.run.guards import check_writable

        if self.main:
            check_writable(self.directory, where="the run_dir argument")
            lock = self._stack.enter_context(books.RunLock(self.directory, self.run_id))
            try:
                books.prepare(self.directory, self.config, resume=False)  # records are never overwritten
            except books.Refused:
                lock.leave_no_trace()
                raise
        device, dtype = self.engine.device, _dtype_of(self.model)
        constants = {"run_id": self.run_id, "experiment": str(self.config.experiment), "strategy": self.strategy,
                     "device": str(device), "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
        c = self.config.capture
        files = RunFiles(self.directory, constants, run_metadata(OmegaConf.to_yaml(self.config), seed=int(self.config.seed)),
                         per_example=bool(c.per_example), histogram=bool(c.histogram))  # fmt: skip
        self.engine.open(self._stack, files)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._open = False
        pending = self.engine.pending_backwards
        try:
            self._stack.__exit__(exc_type, exc, tb)  # type: ignore[arg-type]
        finally:
            self._stack = contextlib.ExitStack()
        if exc_type is None and self.main:
            if pending:
                log.warning(
                    "%d backward(s) were captured after the last rec.step() but no step closed them: their records "
                    "were not written and %s is not marked complete. Call rec.step() after each optimiser step.",
                    pending, self.directory,
                )  # fmt: skip
            else:
                self._mark_complete()
        elif exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            log.warning("interrupted; the records of %d completed step(s) are kept in %s", self.engine.steps_written,
                        self.directory)  # fmt: skip

    def _mark_complete(self) -> None:
        files = [n for n in rundir.RECORD_NAMES if (self.directory / n).is_file()]
        world = 1 if self.dist is None else self.dist.world_size
        with books.RunLock(self.directory, self.run_id):
            books.mark_complete(self.directory, self.config, files=files, run_id=self.run_id, world_size=world,
                                 overrides=[])  # fmt: skip

    # -- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the strategy's way; `loss` counts into the step's loss.

        Example::

            rec.backward(loss_fn(model(x), y))   # then optimizer.step(), rec.step()

        Every parameter's `.grad` is filled as by `loss.backward()`. Under `hook` and `retain_grad` a
        plain `loss.backward()` gives the same records (then pass the loss to `rec.step(loss)`);
        `autograd_grad` needs this call.
        """
        self._check_open("backward")
        self.engine.backward(loss, retain_graph=retain_graph)

    def step(self, loss: torch.Tensor | float | None = None, *, extra: dict[str, Any] | None = None) -> StepResult:
        """Close the step: on a captured step its records (one device-to-host transfer), and its `steps` row.

        Example::

            rec.step(loss)          # after optimizer.step()

        `loss` is the step's loss (a tensor rides in the step's transfer); without it, the sum of the
        losses given to `backward` since the last step (the mean, for a loss divided for accumulation),
        or null where there were none. `extra` holds further `steps.parquet` values of the training
        step's columns (`grad_norm`, `lr`, ...); any other key is refused.
        """
        self._check_open("step")
        _check_extra(extra)
        if loss is None and self.engine.pending_backwards and not self.engine.has_loss and not self._warned_loss:
            self._warned_loss = True
            log.warning("rec.step() got no loss and saw no rec.backward(loss): the steps' loss is null; pass the "
                        "loss, rec.step(loss), when you call loss.backward() yourself")  # fmt: skip
        return self.engine.end_step(loss, **(extra or {}))

    def start_at(self, step: int) -> None:
        """Number the next step `step` (a resumed run's first); capture is on for its forward when it is captured."""
        self.engine.start_at(step)

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise GradrunnerError(
                f"rec.{what}() was called outside the `with record(...) as rec:` block; call it inside the block "
                "(the run dir's writers are open only there)."
            )


#: `record(model, taps, run_dir, ...)`: the documented spelling of `Recorder(...)`.
record = Recorder


def _check_extra(extra: dict[str, Any] | None) -> None:
    """`rec.step(extra=...)` takes only the training columns of `steps.parquet`: a misspelled key is no silent loss."""
    from gradrunner.errors import did_you_mean
    from gradrunner.records.schema import TRAIN_STEP_COLUMNS

    for key in extra or {}:
        if key not in TRAIN_STEP_COLUMNS:
            raise GradrunnerError(
                f"rec.step(extra=...) has the key {key!r}, which is no column of steps.parquet; allowed: "
                f"{', '.join(TRAIN_STEP_COLUMNS)}.{did_you_mean(key, TRAIN_STEP_COLUMNS)}"
            )


class CallbackOptions:
    """What every framework callback takes: the taps, the run dir, how often, the strategy and `record`'s options.

    Example::

        class MyCallback(CallbackOptions, FrameworkCallback): ...
        MyCallback(taps=["fc1:output"], dir="runs/a", every=10, histogram=True)

    `strategy="autograd_grad"` is refused: it computes the gradients with an engine call of its own,
    which would bypass the framework's `loss.backward()` (precision plugins, DDP's reducer, accelerate);
    `hook` and `retain_grad` read the same gradients around the framework's own backward.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        if strategy == "autograd_grad":
            raise GradrunnerError(
                f"{type(self).__name__}(strategy='autograd_grad') is not possible: autograd_grad computes the "
                "gradients with its own torch.autograd.grad call, which would bypass the framework's own "
                "loss.backward() (its precision plugin and loss scaler, DDP's reducer, accelerate). Use strategy "
                "'hook' (the default) or 'retain_grad': they read the same gradients around the framework's backward."
            )
        _check_options(strategy, every, options.get("values", "none"), options.get("sample_size", 64),
                       options.get("on_nonfinite", "record"), options.get("log_to"), None)  # fmt: skip
        self.taps, self.dir, self.every, self.strategy, self.options = taps, dir, every, strategy, options
        self.recorder: Recorder | None = None


def _check_options(
    strategy: str, every: int, values: str, sample_size: int, on_nonfinite: str, log_to: str | None, scaler: Any
) -> None:
    """Every option of `record` and the callbacks, checked in one place before anything is opened."""
    if strategy not in STRATEGY_NAMES:
        raise not_allowed("strategy", strategy, STRATEGY_NAMES)
    if values not in VALUES_MODES:
        raise not_allowed("values", values, VALUES_MODES)
    if on_nonfinite not in NONFINITE_MODES:
        raise not_allowed("on_nonfinite", on_nonfinite, NONFINITE_MODES)
    if log_to not in (None, "tensorboard"):
        raise not_allowed("log_to", log_to, ("tensorboard",), hint=" Leave it out to write the records only.")
    for name, v in (("every", every), ("sample_size", sample_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GradrunnerError(f"{name}={v!r} is not allowed; it must be a whole number of at least 1 (e.g. {name}=10).")
    if scaler is not None and not (callable(getattr(scaler, "is_enabled", None)) and callable(getattr(scaler, "scale", None))):
        raise GradrunnerError(
            f"scaler={scaler!r} is not a loss scaler; pass the torch.amp.GradScaler whose scale multiplies the loss "
            "(or loss_scale=<a callable giving the scale>)."
        )


def _dtype_of(model: nn.Module) -> torch.dtype:
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None else torch.get_default_dtype()
