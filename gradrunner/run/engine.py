"""The step engine: the one object behind the runner's `train_step`, `gradrunner.record` and both callbacks.

It owns what every way of training shares: the capture session over the model (the strategy's way
around the caller's backward), the run's writers (`run.writers.open_writers`: one process, or rank 0 writing
every rank's rows under DDP), live segments and the live TensorBoard log, which steps are captured
(`every`), the loss-scale inversion of a GradScaler, the step's loss summed on the device, update
norms, peak memory, and writing a step's rows: grads rows and the steps row together or not at all.

Example::

    engine = StepEngine(model, ["fc1:output", "fc1:weight"], every=10)   # taps resolved here
    with contextlib.ExitStack() as stack:
        engine.open(stack, RunFiles(run_dir, constants, meta))
        for x, y in loader:
            engine.begin_step()
            engine.backward(loss_fn(model(x), y))    # or loss.backward() under hook / retain_grad
            optimizer.step(); optimizer.zero_grad()
            result = engine.end_step()               # result.records, result.loss, result.row
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradrunner.analysis.anomalies import Detector
from gradrunner.capturing.session import Capture, ParamSnapshot
from gradrunner.capturing.taps import TapSpec
from gradrunner.capturing.torch_compat import scale_tensor
from gradrunner.config.anomaly_settings import WARMUP, WINDOW, Z
from gradrunner.errors import GradrunnerError, as_whole
from gradrunner.records.anomalies import ANOMALIES_FILE
from gradrunner.records.columns import StepRecords
from gradrunner.run import distributed
from gradrunner.run.guards import check_finite, side_file_error, write_errors
from gradrunner.run.signals import ending_signals_as_interrupt
from gradrunner.run.writers import RunFiles, open_writers

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gradrunner.run.distributed import Distributed, GatheredWriter

__all__ = ["LIVE_EVERY", "RunFiles", "StepEngine", "StepResult", "open_writers", "peak_memory_bytes"]

log = logging.getLogger(__name__)

#: How often (in steps) completed steps are written as closed segments that `load(dir, live=True)` reads.
LIVE_EVERY = 10


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA allocator's peak on a GPU, else the process's peak RSS.

    Example::

        peak_memory_bytes(torch.device("cpu"))   # e.g. 412_000_000
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


#: The keys of an `anomaly` mapping: the detector's settings (the runner's `anomaly.*` adds `replay`).
DETECTOR_KEYS = ("enabled", "z", "window", "warmup")


def detector_for(anomaly: bool | Mapping[str, Any] | None, replay: bool = False) -> Detector | None:
    """The spike detector an `anomaly` option asks for: True (the defaults), a mapping of `enabled`, `z`,
    `window`, `warmup` (`record()`'s and the callbacks'), or False/None (off). Bad settings: one paragraph.

    Example::

        detector_for({"z": 8, "window": 64})      # Detector(z=8, window=64, warmup=20)

    `replay`: the mapping is the runner's `anomaly.*` config, whose `replay` the runner acts on after the run;
    `record()` and the callbacks have no replay, and a `replay` key there is refused.
    """
    if anomaly is None or anomaly is False:
        return None
    if anomaly is True:
        return Detector()
    allowed = (*DETECTOR_KEYS, "replay") if replay else DETECTOR_KEYS
    example = "anomaly={'enabled': True, 'z': 6, 'window': 128, 'warmup': 20}"
    if not hasattr(anomaly, "get"):
        raise GradrunnerError(f"anomaly={anomaly!r} is not allowed; pass True (the defaults), False (off) or a "
                              f"dict of {', '.join(DETECTOR_KEYS)}, e.g. {example}")  # fmt: skip
    unknown = [str(k) for k in anomaly if k not in allowed]
    if unknown:
        why = (" (replay re-runs a spike's steps from the runner's kept checkpoints: the runner's anomaly.replay; "
               "record() and the callbacks have none)" if "replay" in unknown else "")  # fmt: skip
        raise GradrunnerError(f"anomaly has the unknown key(s) {', '.join(unknown)}{why}; allowed: "
                              f"{', '.join(allowed)}, e.g. {example}")  # fmt: skip
    enabled = anomaly.get("enabled", True)
    if not isinstance(enabled, bool):
        raise GradrunnerError(f"anomaly enabled={enabled!r} is not allowed; it must be True or False (a bool), e.g. "
                              f"{example}")  # fmt: skip
    if not enabled:
        return None
    return Detector(anomaly.get("z", Z), anomaly.get("window", WINDOW), anomaly.get("warmup", WARMUP))


@dataclass
class StepResult:
    """What a step left: its number, loss, records (captured steps) and its `steps.parquet` row's values.

    The host values a per-step observer needs (issue 35's spike detector takes `loss`, `row["grad_norm"]`
    and `records`).
    """

    step: int
    captured: bool
    loss: float | None
    records: StepRecords | None
    row: dict[str, Any] = field(default_factory=dict)


class StepEngine:
    """One run's steps: capture, accumulation, loss scaling, update norms, peak memory, the writers.

    Options are `capture.*`'s (`strategy`, `values`, `sample_size`, `seed`, `per_example`, `histogram`,
    `edits`) plus `every` (capture every N-th step), `on_nonfinite` (`record`, `stop`), `update_norms`
    (copy the tapped parameters after each captured step's first backward, before any optimizer step of
    the step: `update_norm`, `update_ratio`, the step's whole change),
    `scaler` (a `torch.amp.GradScaler`: records hold the true gradients and loss) or `loss_scale` (a
    callable giving the scale), `dist` (DDP: rank 0 writes every rank's rows), `live_every`
    (segments for `load(dir, live=True)`; 0: none), `log_to="tensorboard"` and `optimizer` (its
    learning rates go into `lr`/`lrs`), `anomaly` (the spike detector: `detector_for`; on by default:
    `anomalies.parquet` and the spikes' last word at the close, on every path). A `DistributedDataParallel` model is tapped inside, its parameter
    taps read after DDP's all-reduce; `params_synced` says the same for a wrapper the engine is not given
    (a framework's: whether the backward that just ended synchronised the gradients).
    """

    def __init__(
        self, model: nn.Module, taps: Sequence[TapSpec] | TapSpec, *, every: int = 1,
        on_nonfinite: str = "record", update_norms: bool = False, scaler: Any = None,
        loss_scale: Callable[[], torch.Tensor | float | None] | None = None, dist: Distributed | None = None,
        live_every: int = LIVE_EVERY, log_to: str | None = None, optimizer: torch.optim.Optimizer | None = None,
        params_synced: Callable[[], bool] | None = None, anomaly: bool | Mapping[str, Any] | None = True,
        **capture_options: Any,
    ) -> None:  # fmt: skip
        inner, synced = distributed.capture_target(model)
        synced = params_synced or synced  # a framework's DDP wrapper, which the model given does not show
        self.files: RunFiles | None = None
        self.dist, self.every = dist, int(every)
        self.on_nonfinite, self.update_norms, self.optimizer = on_nonfinite, update_norms, optimizer
        #: who the messages name: None for the runner (its config keys), else `record()` or a callback's class
        self.who: str | None = None
        self.live_every, self.log_to = live_every, log_to
        self.device, self.dtype = _device_of(inner), _dtype_of(inner)  # where the model's parameters are, and in what
        #: The spike detector (`anomaly`), fed each step's host values on the main rank; None: off.
        # the runner's `anomaly.*` may hold `replay`; record() and the callbacks checked theirs without it (record_options)
        self.detector = detector_for(anomaly, replay=True) if self.main else None
        #: Whether the driver's last word says the spikes (the runner's health summary, at every end): not logged here.
        self._observed, self._resumed = 0, False  # a resumed run's detector is rebuilt from its records at the end
        if scaler is not None:
            loss_scale = lambda: scale_tensor(scaler, self.device)  # noqa: E731 (read as each backward begins)
        self.capture = Capture(inner, taps, keep_grads=False, loss_scale=loss_scale, params_synced=synced,
                               **capture_options)  # fmt: skip
        self.capture.backward_ended = self._backward_ended
        #: the backwards each step holds (the runner's `train.accumulate`, a framework's accumulation): `accumulate`
        self._accumulate = 1
        #: the run's backwards before this session's first (a resumed run), and those this session ran
        self._backwards_before, self._backwards = 0, 0
        self.grads: Any = None
        self.steps: Any = None
        self.step = 0
        self.steps_written = 0
        self._t0 = time.perf_counter()
        self._loss: torch.Tensor | None = None
        self._since: torch.Tensor | None = None  # the losses counted since the last backward ended
        self._before: ParamSnapshot | None = None
        self._segments: Any = None
        self._live_log: Any = None
        self._all_ranks: GatheredWriter | None = None

    @property
    def main(self) -> bool:
        """Whether this process writes the files (always, outside DDP; rank 0 under it)."""
        return self.dist is None or self.dist.is_main

    @property
    def captured(self) -> bool:
        """Whether the current step is captured (`step % every == 0`)."""
        return self.step % self.every == 0

    @property
    def run_id(self) -> str:
        """The run's id (once `open` has the run's files)."""
        assert self.files is not None
        return self.files.run_id

    @property
    def has_loss(self) -> bool:
        """Whether the step in progress has a loss counted (`backward`, `add_loss`)."""
        return self._loss is not None

    @property
    def step_loss(self) -> torch.Tensor | None:
        """The step's loss counted so far (`backward`, `add_loss`; unscaled, on the device), None without any."""
        return self._loss

    def forget_loss(self) -> None:
        """What was counted is not the step's loss (a framework backpropagated another): the row's loss is null."""
        self._loss = self._since = None

    @property
    def accumulate(self) -> int:
        """The backwards a step holds (1; the runner's `train.accumulate`, a framework's accumulation): `micro_step`
        numbers them when over 1, and a resumed session's seeded edits draw on from `step * accumulate`."""
        return self._accumulate

    @accumulate.setter
    def accumulate(self, n: int) -> None:
        self._accumulate = int(n)
        self.capture.accumulating = self._accumulate > 1

    @property
    def backwards_run(self) -> int:
        """The run's backwards so far, captured or not (a resumed run's before this session included): the number
        the next backward has in the seeds of `dropout` and `noise_std` edits."""
        return self._backwards_before + self._backwards

    @property
    def pending_backwards(self) -> int:
        """Captured backwards since the last step closed: more than 0 at the end means a step was never closed."""
        return self.capture.pending_backwards

    # -- opening ---------------------------------------------------------------------------------
    def open(self, stack: contextlib.ExitStack, files: RunFiles) -> None:
        """Open the capture, the run's writers (`files`), live segments and log on `stack` (closed in reverse).

        SIGTERM and SIGHUP end the run like Ctrl-C while it is open; an OSError writing the records
        (a full disk) is one GradrunnerError paragraph.
        """
        self.files = files
        stack.enter_context(self.capture)
        stack.enter_context(ending_signals_as_interrupt())  # before the writers: they close on SIGTERM too
        stack.enter_context(write_errors(files.directory))
        # Closed segments of the completed steps, readable while the run goes; removed once the files are closed.
        stack.callback(lambda: self._segments is not None and self._segments.close())
        if self.detector is not None:  # after the writers close (a resumed run's detector is rebuilt from them)
            stack.push(self._close_anomalies)
        self.grads, self.steps = open_writers(stack, files, self.dist)
        # DDP: rank 0 has every rank's steps row each step; the detector takes their mean loss from it
        self._all_ranks = self.steps if isinstance(self.steps, distributed.GatheredWriter) else None
        real = {t: getattr(w, "writer", w) for t, w in (("grads", self.grads), ("steps", self.steps))}
        if self.live_every and self.main and all(w is not None for w in real.values()):
            from gradrunner.records.segments import Segments

            self._segments = Segments(files.directory, files.run_id, real, every=self.live_every)
        if self.log_to == "tensorboard" and self.main:
            from gradrunner.export.tensorboard import LIVE_DIR, LiveTensorBoard

            self._live_log = stack.enter_context(contextlib.closing(LiveTensorBoard(files.directory / LIVE_DIR)))
        self.start_at(self.step)

    def tee(self, wrap: Callable[[Any], Any]) -> None:
        """Write through `wrap(writer)` from now on (the runner's checkpoint segments)."""
        self.grads, self.steps = wrap(self.grads), wrap(self.steps)

    # -- a step ------------------------------------------------------------------------------------
    def start_at(self, step: int, backwards: int | None = None) -> None:
        """Number the next step `step` (a resumed run's first); capture is on for its forwards when it is captured.

        Before this session's first backward it is where the run resumes: the seeded edits (`dropout`,
        `noise_std`) draw on as the uninterrupted run did, from its backward `backwards` (the run's backwards
        before `step`; default `step * accumulate`). Later it only renumbers the step. A step (or backwards) that is
        not a whole number of at least 0 is one paragraph, before anything changes.
        """
        self.step = _whole(step, "step", "the optimisation step training resumes at, from 0")
        if backwards is not None:
            backwards = _whole(backwards, "backwards", "the run's backwards before that step")
        if not self._backwards:
            self._backwards_before = self.step * self._accumulate if backwards is None else backwards
            self.capture.start_backwards_at(self._backwards_before)
        self.capture.enabled = self.captured
        self._t0 = time.perf_counter()

    def begin_step(self) -> None:
        """The step's work begins now (its `step_time_s` is counted from here)."""
        self.capture.enabled = self.captured
        self._t0 = time.perf_counter()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward from `loss` the capture strategy's way; the step's loss sums `loss` (unscaled) on the device.

        Example::

            engine.backward(scaler.scale(loss / n))     # one micro-batch of n
        """
        self.add_loss(loss)
        self.capture.backward(loss, retain_graph=retain_graph)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Count `loss` (a backpropagated loss, scaled by the GradScaler if there is one) into the step's loss."""
        part = loss.detach().sum(dtype=torch.promote_types(loss.dtype, torch.float32))  # a float64 loss stays float64
        scale = self.capture.loss_scale() if self.capture.loss_scale is not None else None
        if scale is not None:
            part = part / torch.as_tensor(scale).to(device=part.device, dtype=part.dtype)
        self._loss = part if self._loss is None else self._loss + part.to(self._loss.device)
        self._since = part if self._since is None else self._since + part.to(self._since.device)

    def _backward_ended(self, captured: bool) -> None:
        self._backwards += 1
        if self.capture.restarted:  # a closure evaluated again inside optimizer.step() (LBFGS): the step's loss is its loss  # fmt: skip
            self._loss = self._since
        self._since = None
        if captured and self.update_norms and self._before is None:
            # the step's first backward: before any of its optimizer steps (a GAN's generator steps before the
            # discriminator's backward, LBFGS between its closure's backwards); update_norm: the step's whole change
            self._before = self.capture.snapshot_params()

    def settle(self) -> None:
        """The step's backwards are done: reduce its parameter gradients now (before clipping, the optimiser)."""
        if self.captured:
            self.capture.settle()

    def end_step(
        self, loss: torch.Tensor | float | None = None, *, grad_norm: torch.Tensor | float | None = None,
        clipped: torch.Tensor | bool | None = None, **train: Any,
    ) -> StepResult:  # fmt: skip
        """Close the step: its records (captured steps: one transfer), its `steps.parquet` row, both written together.

        `loss` defaults to the sum of the backpropagated losses (`backward`, `add_loss`; from the backward that
        started the step again, `Capture.restarted`: LBFGS's last closure evaluation); `train` holds the
        other training columns (`lr`, `lrs`, `loss_scale`, `skipped`, `eval_loss`, ...). Any of them may be a
        device tensor (`lrs`' elements too): they ride in one transfer with the loss, taken before anything is written.
        """
        from gradrunner.records.critical import deferred_signals

        step, captured = self.step, self.captured and self.capture.pending_backwards > 0
        loss = self._loss if loss is None else loss
        host = self._host({**train, "loss": loss, "grad_norm": grad_norm, "clipped": clipped})
        loss_value = host.pop("loss", None)
        recs, capture_time = None, None
        t1 = time.perf_counter()
        if captured:
            recs = self.capture.records(None, self._before)
            recs.loss = loss_value  # every row of the step carries the step's loss
        else:  # as `records()` does: a forward of this step that no backward used (skipped) is not the next step's
            self.capture.reset()
        row: dict[str, Any] = host
        if self.optimizer is not None and "lr" not in row:
            row["lrs"] = [float(g["lr"]) for g in self.optimizer.param_groups]
            row["lr"] = row["lrs"][0]
        with deferred_signals():  # a step's rows go into both tables, or into neither
            if recs is not None:
                self.grads.write_step(step, recs)
                capture_time = time.perf_counter() - t1
            self.steps.write(step, captured, loss_value, time.perf_counter() - self._t0, capture_time,
                             peak_memory_bytes(self.device), **row)  # fmt: skip
            if self._segments is not None:
                self._segments.step_done()
        if self._live_log is not None and recs is not None:
            self._live_log.write(step, recs, loss_value)  # host values the writer just took: no device sync
        self.steps_written += 1
        self._loss, self._since, self._before = None, None, None
        self.start_at(step + 1)
        if self.detector is not None:  # host values already here: no device sync of its own
            self._observe(step, loss_value, row, recs)
        check_finite(self.on_nonfinite, step, loss_value, recs, self.files.directory if self.files else None, self.who)
        return StepResult(step, captured, loss_value, recs, row)

    def _observe(self, step: int, loss: float | None, row: dict[str, Any], recs: StepRecords | None) -> None:
        from gradrunner.analysis.anomaly_signals import rank_mean, step_signals

        assert self.detector is not None
        if self._all_ranks is not None:  # DDP: the ranks' mean loss (`steps.write(step, captured, loss, ...)`)
            loss = rank_mean([args[2] for args, _ in self._all_ranks.last])
        grad_norm = row.get("grad_norm")
        values = step_signals(loss, None if grad_norm is None else float(grad_norm), [recs] if recs is not None else (),
                              skipped=row.get("skipped") is True)  # fmt: skip
        self._resumed = self._resumed or (self._observed == 0 and step > 0)  # steps before it: not seen here
        self.detector.observe(step, values)
        self._observed += 1

    def _close_anomalies(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        """At the close, on every path: `anomalies.parquet` in the run dir (the last word, `health`, then says the
        spikes it holds: the runner's and `record()`'s, so the callbacks' too)."""
        from gradrunner.analysis.anomaly_signals import finish_anomalies

        assert self.detector is not None and self.files is not None
        if not self._observed:  # no step completed: no records are kept, and no anomalies file
            return False
        try:
            finish_anomalies(self.files.directory, self.detector, self.run_id, rebuild=self._resumed)
        except Exception as e:
            if exc is None and isinstance(e, OSError):
                raise side_file_error(self.files.directory, ANOMALIES_FILE, e) from e
            if exc is None:
                raise
            log.warning("the spike detector's anomalies.parquet was not written (%s)", e)
            return False
        return False

    def _host(self, values: dict[str, Any]) -> dict[str, Any]:
        """The step's row values on the host, those not None, before anything of the step is written: the device
        tensors among them (`lrs`' elements too) in one transfer; `clipped` and `skipped` bools, the others floats."""
        lrs = None if values.get("lrs") is None else list(values["lrs"])
        items = [(k, v) for k, v in values.items() if v is not None and k != "lrs"] + [("lrs", v) for v in lrs or []]
        on_device = [i for i, (_, v) in enumerate(items) if isinstance(v, torch.Tensor)]
        if on_device:
            wide = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
            first = items[on_device[0]][1].device
            got = torch.stack([items[i][1].detach().reshape(()).to(first, wide) for i in on_device]).tolist()
            items = [(k, got[on_device.index(i)] if i in on_device else v) for i, (k, v) in enumerate(items)]
        host: dict[str, Any] = {k: bool(v) if k in ("clipped", "skipped") else float(v) for k, v in items if k != "lrs"}
        if lrs is not None:
            host["lrs"] = [float(v) for k, v in items if k == "lrs"]
        return host


def _whole(value: object, name: str, meaning: str) -> int:
    """`value` of `start_at(name=...)` as an int: a whole number of at least 0 (a bool, 2.5 or -1 is refused)."""
    number = as_whole(value)  # ints, numpy ints, 0-d integer tensors
    if number is None or number < 0:
        raise GradrunnerError(
            f"start_at({name}={value!r}) is not allowed; {name} must be a whole number of at least 0 ({meaning}), "
            "e.g. rec.start_at(7) where training resumes at step 7."
        )
    return number


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _dtype_of(model: nn.Module) -> torch.dtype:
    p = next(iter(model.parameters()), None)
    return p.dtype if p is not None else torch.get_default_dtype()
