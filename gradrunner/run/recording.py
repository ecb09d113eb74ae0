"""`gradrunner.record(model, taps, run_dir)`: the runner's records from any training loop.

The loop stays the user's; `record` opens the same capture session (`capturing.session.Capture`)
and the same writers (`records.writer`) the runner uses, and keeps the run dir's books as a
runner job does: the run-dir lock, `grads.parquet` and `steps.parquet` (closed together, signals
deferred while a step's rows are written, SIGTERM kept like Ctrl-C), `done.json` when the block
exits normally. `analysis.load`, `python -m gradrunner.report`, DuckDB and polars read it unchanged.

Example::

    from gradrunner import record
    with record(model, ["*:output", "*:weight"], "runs/mine", strategy="hook", every=10) as rec:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            rec.backward(loss)                 # the strategy's backward; .grad filled as usual
            optimizer.step(); optimizer.zero_grad()
            rec.step(loss)                     # closes the step: its records, one transfer

A step is one optimiser step: several `rec.backward` calls before `rec.step` (gradient
accumulation) give the runner's records (`gradrunner.run.accumulation`, `train.accumulate=N`):
activation, input and local taps one record per backward (`micro_step` 0, 1, ...); parameter taps
one record per step, on the last backward's rows (`micro_step` null), from the accumulated `.grad`
the optimiser uses (unscaled, before clipping: read after each backward, the latest kept).
The Lightning and HF callbacks (`gradrunner.integrations`) drive this same `Recorder`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf
from torch import nn

from gradrunner.capturing.session import Capture, ParamSnapshot
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.strategies.base import Strategy
from gradrunner.capturing.taps import TapSpec
from gradrunner.config.choices import NONFINITE_MODES, STRATEGY_NAMES, VALUES_MODES
from gradrunner.errors import GradrunnerError, not_allowed
from gradrunner.records import rundir
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, StepRecords
from gradrunner.run import accumulation, books

if TYPE_CHECKING:
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.run.distributed import Distributed, GatheredWriter

log = logging.getLogger(__name__)

#: The `experiment` column of records written by `record` (the runner writes the config's name).
EXPERIMENT = "record"


class Recorder:
    """The session `record(...)` opens: one run dir, one capture, the runner's writers.

    Example::

        with Recorder(model, ["fc1:output"], "runs/a") as rec:
            rec.backward(loss); opt.step(); opt.zero_grad(); rec.step(loss)

    Options are `capture.*`'s: `values` (`none`, `full`, `sample` with `sample_size`), `per_example`,
    `histogram`, `on_nonfinite` (`record`, `stop`), plus `every` (capture every N-th step) and `seed`
    (the sample positions). `live_every` (default 10; 0: off) writes the completed steps as closed
    segments every so many steps, which `load(run_dir, live=True)` reads while the job runs;
    `log_to="tensorboard"` also logs each captured step's statistics to `<run_dir>/tensorboard` as it
    is written (the export's tags; no extra device sync). `loss_scale` (a callable giving the current loss scale, a 0-d tensor or
    None) makes the records hold the true gradients of a loss multiplied by a GradScaler's scale.
    `dist` (a `run.distributed.Distributed`) records every rank's rows in rank 0's run dir.
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
        loss_scale: Callable[[], torch.Tensor | float | None] | None = None,
        dist: Distributed | None = None,
        live_every: int = 10,
        log_to: str | None = None,
        wrap_strategy: Callable[[Strategy], Strategy] | None = None,
    ) -> None:
        _check_options(strategy, every, values, sample_size, on_nonfinite)
        self.model, self.directory = model, Path(run_dir).resolve()
        self.taps = [taps] if isinstance(taps, (str, dict)) else list(taps)
        self.strategy, self.every, self.on_nonfinite = strategy, int(every), on_nonfinite
        self.dist = dist
        self.run_id = dist.run_id if dist is not None and dist.run_id else uuid.uuid4().hex
        self.config = OmegaConf.create({
            "experiment": experiment, "source": "gradrunner.record", "seed": int(seed), "taps": self.taps,
            "capture": {"strategy": strategy, "values": values, "sample_size": int(sample_size), "every": int(every),
                        "per_example": bool(per_example), "histogram": bool(histogram), "on_nonfinite": on_nonfinite},
        })  # fmt: skip
        self.capture = Capture(model, self.taps, strategy, values=values, sample_size=sample_size, seed=seed,
                               keep_grads=False, wrap_strategy=wrap_strategy, per_example=per_example, histogram=histogram)  # fmt: skip
        self.step_index = 0
        self._stack = contextlib.ExitStack()
        self._grads: RecordWriter | GatheredWriter | None = None
        self._steps: StepsWriter | GatheredWriter | None = None
        self._backwards = 0
        #: Records of the step's earlier micro-batches (gradient accumulation), taken before the next backward.
        self._micro: list[StepRecords] = []
        #: The parameter taps' accumulated `.grad` after the latest backward, reduced on the device (accumulation).
        self._accumulated: Collector | None = None
        self._loss_scale = loss_scale
        self._loss_sum: torch.Tensor | None = None
        self._before: ParamSnapshot | None = None
        self._t0 = time.perf_counter()
        self._open = False
        self.live_every = live_every
        self._segments: Any = None
        if log_to not in (None, "tensorboard"):
            raise not_allowed("log_to", log_to, ("tensorboard",), hint=" Leave it out to write the records only.")
        self.log_to = log_to
        self._live_log: Any = None

    @property
    def main(self) -> bool:
        """Whether this process keeps the books (always, outside DDP; rank 0 under it)."""
        return self.dist is None or self.dist.is_main

    @property
    def captured(self) -> bool:
        """Whether the current step is captured (`step_index % every == 0`)."""
        return self.step_index % self.every == 0

    # -- opening and closing -------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        try:
            self._enter()
        except BaseException:
            self._stack.close()
            raise
        self._open = True
        self.start_at(self.step_index)
        return self

    def _enter(self) -> None:
        from gradrunner.records.table_writer import closing_together
        from gradrunner.records.writer import RecordWriter, StepsWriter, run_metadata
        from gradrunner.run.guards import check_writable, write_errors
        from gradrunner.run.signals import ending_signals_as_interrupt

        stack = self._stack
        if self.main:
            check_writable(self.directory, where="the run_dir argument")
            lock = stack.enter_context(books.RunLock(self.directory, self.run_id))
            try:
                books.prepare(self.directory, self.config, resume=False)  # records are never overwritten
            except books.Refused:
                lock.leave_no_trace()
                raise
        stack.enter_context(self.capture)
        stack.enter_context(ending_signals_as_interrupt())  # before the writers: they close on SIGTERM too
        stack.enter_context(write_errors(self.directory))
        constants = {"run_id": self.run_id, "experiment": str(self.config.experiment), "strategy": self.strategy,
                     "device": str(_device_of(self.model)), "dtype": str(_dtype_of(self.model)).removeprefix("torch.")}  # fmt: skip
        meta = run_metadata(OmegaConf.to_yaml(self.config), seed=int(self.config.seed))
        c = self.config.capture
        # Closed segments of the completed steps, readable while the job runs; removed once the files are closed.
        stack.callback(lambda: self._segments is not None and self._segments.close())
        if self.dist is not None:
            from gradrunner.run.distributed import open_writers

            self._grads, self._steps = open_writers(stack, self.dist, self.directory, constants, meta,
                                                    bool(c.per_example), bool(c.histogram))  # fmt: skip
        else:
            grads = RecordWriter(self.directory / GRADS_FILE, constants=constants, metadata=meta,
                                 per_example=bool(c.per_example), histogram=bool(c.histogram))  # fmt: skip
            steps = StepsWriter(self.directory / STEPS_FILE, constants=constants, metadata=meta)
            stack.enter_context(closing_together(grads, steps))
            self._grads, self._steps = grads, steps
        if self.log_to == "tensorboard" and self.main:
            from gradrunner.export.tensorboard import LiveTensorBoard

            self._live_log = stack.enter_context(contextlib.closing(LiveTensorBoard(self.directory / "tensorboard")))
        real = {t: getattr(w, "writer", w) for t, w in (("grads", self._grads), ("steps", self._steps))}
        if self.live_every and self.main and all(w is not None for w in real.values()):
            from gradrunner.records.segments import Segments

            self._segments = Segments(self.directory, self.run_id, real, every=self.live_every)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._open = False
        try:
            self._stack.__exit__(exc_type, exc, tb)  # type: ignore[arg-type]
        finally:
            self._stack = contextlib.ExitStack()
        if exc_type is None and self.main:
            self._mark_complete()
        elif exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            log.warning("interrupted; the records of %d completed step(s) are kept in %s", self.step_index, self.directory)

    def _mark_complete(self) -> None:
        files = [n for n in rundir.RECORD_NAMES if (self.directory / n).is_file()]
        world = 1 if self.dist is None else self.dist.world_size
        with books.RunLock(self.directory, self.run_id):
            books.mark_complete(self.directory, self.config, files=files, run_id=self.run_id, world_size=world,
                                 overrides=[])  # fmt: skip

    # -- the step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the strategy's way on captured steps (plain `loss.backward()` on the others).

        Example::

            rec.backward(loss_fn(model(x), y))   # then optimizer.step(), rec.step(loss)

        Every parameter's `.grad` is filled as by `loss.backward()`; called several times before
        `step` (gradient accumulation), each backward's gradients are captured.
        """
        self._check_open("backward")
        assert self.captured == self.capture.enabled, "step_index changed outside start_at()"
        if self.captured and self._backwards > 0:  # the collector holds one backward's records: take them now
            self._micro.append(self.capture.records())
        part = loss.detach().float()  # the step's loss, if `step` is given none: summed on the device, no sync
        scale = self._loss_scale() if self._loss_scale is not None else None
        # As the runner: the capture multiplies every captured gradient by 1/scale on its device.
        inverse = None if scale is None else torch.as_tensor(scale, device=part.device).detach().double().reciprocal()
        self.capture.grad_scale = inverse
        self.capture.backward(loss, retain_graph=retain_graph)
        self._backwards += 1
        part = part * inverse.to(part.dtype) if inverse is not None else part
        self._loss_sum = part if self._loss_sum is None else self._loss_sum + part
        if self.captured:
            # `.grad` is now the running sum; `rec.step` comes after clipping and `zero_grad`: read it here.
            self._accumulated = accumulation.param_grad_collector(self.capture, inverse)
            self._snapshot()

    def _snapshot(self) -> None:
        # Tapped parameters as they are before the optimiser step: their update norms ride in the step's transfer.
        self._before = self.capture.snapshot_params()

    def step(self, loss: torch.Tensor | float | None = None, *, extra: dict[str, Any] | None = None) -> None:
        """Close the step: on a captured step its records (one device-to-host transfer), and its `steps` row.

        Example::

            rec.step(loss)          # after optimizer.step()

        `loss` is the step's loss (a tensor rides in the records' transfer); without it, the sum of the
        losses given to `backward` since the last step (the mean, for a loss divided for accumulation). `extra` holds further
        `steps.parquet` values of the training step's columns (`grad_norm`, `lr`, ...); any other key is refused.
        """
        from gradrunner.records.critical import deferred_signals
        from gradrunner.run.guards import check_finite

        self._check_open("step")
        _check_extra(extra)
        assert self._grads is not None and self._steps is not None
        step, captured = self.step_index, self.captured and self._backwards > 0
        if loss is None:
            loss = self._loss_sum
        recs: StepRecords | None = None
        micro: list[StepRecords] = []
        capture_time = None
        t1 = time.perf_counter()
        if captured:
            as_tensor = loss if isinstance(loss, torch.Tensor) else None
            recs = self.capture.records(as_tensor.detach() if as_tensor is not None else None, self._before)
            loss_value = float("nan") if recs.loss is None else recs.loss
            if as_tensor is None and loss is not None:
                loss_value = float(loss)
            if self._micro and self._accumulated is not None:  # accumulation: parameter taps once, on the last
                recs = accumulation.replace_param_rows(recs, self._accumulated.finish())
                self._micro = [accumulation.drop_param_rows(r, self.capture) for r in self._micro]
            micro = [*self._micro, recs]
            for r in micro:
                r.loss = loss_value  # every row of the step carries the step's loss
        else:
            loss_value = float("nan") if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        with deferred_signals():  # a step's rows go into both tables, or into neither
            if micro:
                write_micro_batches(self._grads, step, micro, self.capture)
                capture_time = time.perf_counter() - t1
            peak = _peak_memory(self.model)
            write_steps_row(self._steps, step, recs is not None, loss_value, time.perf_counter() - self._t0,
                            capture_time, peak, extra or {})  # fmt: skip
            if self._segments is not None:
                self._segments.step_done()
        if self._live_log is not None:
            for r in micro:
                self._live_log.write(step, r, loss_value)  # host values the writer just took: no device sync
        self._t0 = time.perf_counter()
        self.start_at(self.step_index + 1)
        self._backwards, self._before, self._loss_sum, self._micro, self._accumulated = 0, None, None, [], None
        checks: list[StepRecords | None] = [*micro] or [None]
        for checked in checks:
            check_finite(self.on_nonfinite, step, loss_value, checked)

    def start_at(self, step: int) -> None:
        """Number the next step `step` (a resumed run's first); capture is on for its forward when it is captured."""
        self.step_index = int(step)
        self.capture.enabled = self.captured  # before the step's forward: taps fire only on captured steps

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


def write_steps_row(
    writer: StepsWriter | GatheredWriter, step: int, captured: bool, loss: float, step_time: float,
    capture_time: float | None, peak: int | None, extra: dict[str, Any],
) -> None:  # fmt: skip
    """One `steps.parquet` row through the writer's API, with the training columns in `extra` (`grad_norm`, ...)."""
    writer.write(step, captured, loss, step_time, capture_time, peak, **extra)


class CallbackOptions:
    """What every framework callback takes: the taps, the run dir, how often, the strategy and `record`'s options.

    Example::

        class MyCallback(CallbackOptions, FrameworkCallback): ...
        MyCallback(taps=["fc1:output"], dir="runs/a", every=10, histogram=True)
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        self.taps, self.dir, self.every, self.strategy, self.options = taps, dir, every, strategy, options
        self.recorder: Recorder | None = None


def write_micro_batches(writer: RecordWriter | GatheredWriter, step: int, micro: list[StepRecords], cap: Capture) -> None:
    """A step's records, one `StepRecords` per micro-batch: `micro_step` 0, 1, ... (null for parameter taps)."""
    if len(micro) == 1:
        writer.write_step(step, micro[0])
        return
    for m, r in enumerate(micro):
        writer.write_step(step, r, micro_step=accumulation.micro_steps(r, m, cap))


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A GradScaler's current scale as its 0-d device tensor (no host sync), None when it is off.

    Example::

        record(model, taps, "runs/a", loss_scale=lambda: scaler_scale(scaler))
    """
    if not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # the device tensor behind get_scale(), which would sync
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scaler.get_scale()))


def _check_options(strategy: str, every: int, values: str, sample_size: int, on_nonfinite: str) -> None:
    if strategy not in STRATEGY_NAMES:
        raise not_allowed("strategy", strategy, STRATEGY_NAMES)
    if values not in VALUES_MODES:
        raise not_allowed("values", values, VALUES_MODES)
    if on_nonfinite not in NONFINITE_MODES:
        raise not_allowed("on_nonfinite", on_nonfinite, NONFINITE_MODES)
    for name, v in (("every", every), ("sample_size", sample_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise GradrunnerError(f"{name}={v!r} is not allowed; it must be a whole number of at least 1 (e.g. {name}=10).")


def _first_param(model: nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def _device_of(model: nn.Module) -> torch.device:
    p = _first_param(model)
    return p.device if p is not None else torch.device("cpu")


def _dtype_of(model: nn.Module) -> torch.dtype:
    p = _first_param(model)
    return p.dtype if p is not None else torch.get_default_dtype()


def _peak_memory(model: nn.Module) -> int | None:
    device = _device_of(model)
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None

