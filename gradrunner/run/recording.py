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
(`micro_step` 0, 1, ...); parameter taps one record per step (`micro_step` null), the gradient
accumulated in `.grad` over the step's backwards since it was last reset (`zero_grad` between two
backwards: `ParamTaps.begin_backward`): the one the optimiser uses, before clipping (held by the
capture, so clipping or `zero_grad` before `rec.step` does not change it).
The Lightning and HF callbacks (`gradrunner.integrations`) drive this same `Recorder`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf
from torch import nn

from gradrunner.capturing.open_sessions import refuse_beside_open
from gradrunner.capturing.taps import TapSpec, tap_shapes
from gradrunner.errors import GradrunnerError
from gradrunner.records import rundir
from gradrunner.run import books, record_books
from gradrunner.run.distributed import joined_group
from gradrunner.run.engine import LIVE_EVERY, RunFiles, StepEngine, StepResult
from gradrunner.run.record_options import check_callback_options, check_extra, check_options
from gradrunner.run.session_log import how_it_ended, session_log

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
    (the sample positions, and the draws of `dropout` and `noise_std` edits, as the runner's `seed`).
    `update_norms=True` adds the parameter taps' `update_norm` and `update_ratio`: the change over the step's
    optimizer steps, all of them (each tapped parameter copied after each captured step's first backward).
    `scaler=` (a `torch.amp.GradScaler`) makes the records hold the true gradients and loss of a loss
    multiplied by its scale (`loss_scale=`, a callable giving the scale, does the same for another
    loss scaler). `live_every` (default 10; 0: off) writes the completed steps as closed segments
    every so many steps, which `load(run_dir, live=True)` reads while the job runs;
    `log_to="tensorboard"` also logs each captured step's statistics to `<run_dir>/tensorboard` as
    it is written (the export's tags; no extra device sync). `dist` (a `run.distributed.Distributed`)
    records every rank's rows in rank 0's run dir (left out under an initialised process group of several
    processes, e.g. a user's own FSDP2 or DDP loop under torchrun: joined here, every rank calling
    `record` with the same `run_dir`); a `DistributedDataParallel` model has its parameter
    taps read after DDP's all-reduce (`params_synced`: the same for a wrapper `record` is not given, as
    the callbacks use it). `edits` are the runner's gradient edits (`[{"tap": ..., "scale": 0.5}]`).
    `anomaly` (default True: on) is the spike detector: False turns it off, a dict of `z`, `window`,
    `warmup` sets it (as `anomaly.*` in the config); `anomalies.parquet` and the spikes' lines (logged as
    a warning) come at the close of the block, however it ends.

    A run dir that holds records is refused (one paragraph) unless `overwrite=True` (delete them, record
    from step 0) or `resume=True` (continue an interrupted session's records: `run.record_books`; the
    rows before `start_at(step)` are kept). Every option is checked here, before anything is written. A
    `Recorder` is entered once (a second `with rec:` is refused: its run_id and steps are the first entry's).
    When the block ends (also by an error) the runner's last word, the health summary, is logged on
    the console and into `<run_dir>/gradrunner.log` (`run.session_log`).
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
        edits: Sequence[Any] | None = None,
        resume: bool = False,
        overwrite: bool = False,
        anomaly: bool | Mapping[str, Any] = True,
    ) -> None:
        check_options(strategy=strategy, every=every, values=values, sample_size=sample_size, seed=seed,
                      on_nonfinite=on_nonfinite, log_to=log_to, scaler=scaler, live_every=live_every, edits=edits,
                      per_example=per_example, histogram=histogram, update_norms=update_norms, resume=resume,
                      overwrite=overwrite, anomaly=anomaly)  # fmt: skip
        dist = joined_group() if dist is None else dist
        self.model, self.directory = model, Path(run_dir).resolve()
        self.taps = [taps] if isinstance(taps, (str, dict)) else list(taps)
        self.strategy, self.dist = strategy, dist
        self.run_id = dist.run_id if dist is not None and dist.run_id else uuid.uuid4().hex
        self.config = OmegaConf.create({
            "experiment": experiment, "source": "gradrunner.record", "seed": int(seed), "taps": self.taps,
            "capture": {"strategy": strategy, "values": values, "sample_size": int(sample_size), "every": int(every),
                        "per_example": bool(per_example), "histogram": bool(histogram), "on_nonfinite": on_nonfinite,
                        "update_norms": bool(update_norms)},
            "edits": [dict(e) for e in edits or []],
        })  # fmt: skip
        self.resume, self.overwrite = resume, overwrite
        #: who the messages name (`record()`, or the callback that drives this recorder)
        self.who = "record()"
        self._kept: record_books.Kept | None = None
        self._start: int | None = None  # a `start_at` before the block opened: it wins over the kept records' next step
        self._start_backwards: int | None = None  # ... and the backwards it gave
        self._log: Any = None
        self.engine = StepEngine(model, self.taps, strategy=strategy, every=every, values=values,
                                 sample_size=sample_size, seed=seed, per_example=per_example, histogram=histogram,
                                 on_nonfinite=on_nonfinite, update_norms=update_norms, scaler=scaler,
                                 loss_scale=loss_scale, dist=dist, live_every=live_every, log_to=log_to,
                                 params_synced=params_synced, edits=list(edits or []), anomaly=anomaly)  # fmt: skip
        self.capture = self.engine.capture
        self._stack = contextlib.ExitStack()
        #: the run dir's lock, held from before the dir is looked at until after `done.json` (or the last word of a
        #: session that did not complete): released last, by `_release`, never by `_stack`
        self._lock: books.RunLock | None = None
        self._open = False
        self._warned_loss = False
        self._unclosed_ends = False  # `end_within_step`: the backwards no step closed are no misuse at the end

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
        self._refuse_entered()  # outside the try: an open block's stack, lock and log are the first entry's
        try:
            self._enter()
        except BaseException:
            try:
                self._stack.close()
                if self._log is not None:
                    self._log.__exit__(None, None, None)
                    self._log = None
            finally:
                self._release()
            raise
        self._open = True
        return self

    def _refuse_entered(self) -> None:
        """A second entry, after the block or inside it, before anything is looked at or let go of."""
        if self.engine.files is not None:  # the run dir's records (and an open block) stay as they are
            raise GradrunnerError(
                f"this {self.who} into {str(self.directory)!r} was entered before: a session is entered once (its "
                "run_id and step numbers are its first entry's); call record(...) again for another session, with "
                "resume=True to continue its records"
            )

    def _enter(self) -> None:
        from gradrunner.records.writer import run_metadata  # pyarrow: imported once writing starts

        self.capture.label = f"{self.who} into {str(self.directory)!r} (strategy={self.strategy!r})"
        refuse_beside_open(self.capture)  # before the run dir is looked at
        # rank 0 keeps the books; every rank numbers its steps from where they resume (the kept records' next step)
        next_step = self._open_books() if self.dist is None else self.dist.from_main(self._open_books)
        self.engine.who = self.who  # a callback renamed it after construction; `on_nonfinite="stop"` names it
        device, dtype = self.engine.device, self.engine.dtype
        constants = {"run_id": self.run_id, "experiment": str(self.config.experiment), "strategy": self.strategy,
                     "device": str(device), "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
        c = self.config.capture
        files = RunFiles(self.directory, constants, run_metadata(OmegaConf.to_yaml(self.config), seed=int(self.config.seed)),
                         per_example=bool(c.per_example), histogram=bool(c.histogram))  # fmt: skip
        self.engine.open(self._stack, files)
        if self._start is not None and self._kept is not None:
            self.engine.start_at(self._start, self._start_backwards)
        elif next_step is not None:  # by default, the step after the last one recorded
            self.engine.start_at(next_step)

    def _open_books(self) -> int | None:
        """Rank 0: the run dir's lock, its records kept or refused, the session's log; the step a resume starts at."""
        from gradrunner.run.guards import check_writable

        check_writable(self.directory, where="the run_dir argument")
        self._lock = books.RunLock(self.directory, self.run_id)
        self._lock.__enter__()
        try:
            self._kept = record_books.prepare(self.directory, self.config, resume=self.resume, overwrite=self.overwrite,
                                              who=self.who, last_run=self._lock.previous.get("run_id"),
                                              taps=tap_shapes(self.capture.model, self.capture.taps, not self.capture.sharded))  # fmt: skip
            if self._start is not None:
                self._first_start(self._start)
        except books.Refused:
            self._lock.leave_no_trace()
            raise
        self._log = session_log(self.directory)
        self._log.__enter__()
        return None if self._kept is None else self._kept.next_step

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._open = False
        pending = 0 if self._unclosed_ends else self.engine.pending_backwards
        closing: BaseException | None = None  # the files failed to close (a full disk): the error says what is left
        try:
            if self._kept is not None and self.main and exc_type is None:
                self._carry(self.engine.step)  # a resumed session that closed no step keeps the earlier records
            self._stack.__exit__(exc_type, exc, tb)  # type: ignore[arg-type]
        except BaseException as e:
            closing = e
            raise
        finally:
            self._stack = contextlib.ExitStack()
            try:
                if self.main and self._log is not None:
                    self._end(exc_type, pending, closing, exc)
            finally:
                self._release()  # after done.json: no other session may take the dir between the files and the marker

    def _release(self) -> None:
        """Let go of the run dir's lock (once): the session's books are written, or it never got to write any."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(None, None, None)

    def _end(
        self, exc_type: type[BaseException] | None, pending: int, closing: BaseException | None = None,
        exc: BaseException | None = None,
    ) -> None:  # fmt: skip
        """The books after the files closed, then the last word (as a runner job's: console and run dir's log).

        `closing`: the error closing the files raised (it propagates, saying what was kept): the dir is not
        marked complete, and no summary is read from records that were not written.
        """
        from gradrunner.analysis import health

        assert self._log is not None
        if closing is not None:
            try:
                restored = self._kept is not None and self._kept.settle()  # a resume's kept records stay or go back
                log.warning("the records of %s could not be written (%s); it is not marked complete%s",
                            self.directory, str(closing).split(". ")[0],
                            "; the earlier session's records are put back as they were" if restored else "")  # fmt: skip
            finally:
                self._log.__exit__(None, None, None)
                self._log = None
            return
        try:
            restored = self._kept is not None and self._kept.settle()
            if restored and exc_type is not None:
                assert self._kept is not None
                log.warning("%s before its first step; the records of steps 0..%d are kept in %s (not "
                            "marked complete; %s with resume=True continues them)", how_it_ended(exc_type, exc),
                            self._kept.next_step - 1, self.directory, self.who)  # fmt: skip
            elif exc_type is None and pending:
                log.warning(
                    "%d backward(s) were captured after the last rec.step() but no step closed them: their records "
                    "were not written and %s is not marked complete. Call rec.step() after each optimiser step.",
                    pending, self.directory,
                )  # fmt: skip
            elif exc_type is None:
                self._mark_complete()
            elif self.engine.steps_written:
                log.warning("%s; the records of %d completed step(s) are kept in %s (not marked complete; %s with "
                            "resume=True continues them)", how_it_ended(exc_type, exc), self.engine.steps_written,
                            self.directory, self.who)  # fmt: skip
            else:
                log.warning("%s before its first step; no records were kept in %s", how_it_ended(exc_type, exc),
                            self.directory)  # fmt: skip
            health.try_last_word(self.directory)  # also after a normal end: the same summary, never an error
        finally:
            self._log.__exit__(None, None, None)
            self._log = None

    def _carry(self, start: int) -> None:
        """A resumed session: the kept rows of the steps before `start` go into this session's writers (once)."""
        if self._kept is None or self._kept.carried or not self.main:
            return
        real = [getattr(w, "writer", w) for w in (self.engine.grads, self.engine.steps)]
        before = real[1].steps_written
        record_books.carry(self._kept, start, real[0], real[1], self.run_id)
        self.engine.steps_written += real[1].steps_written - before

    def _mark_complete(self) -> None:
        files = [n for n in rundir.RECORD_NAMES if (self.directory / n).is_file()]
        world = 1 if self.dist is None else self.dist.world_size
        assert self._lock is not None, "done.json is written with the session's own lock held"
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
        or null where there were none. `extra` holds the step's training columns of `steps.parquet` (`grad_norm`, `lr`,
        `eval_loss`, ...: numbers or one-element tensors, `lrs` a list); another key or value: refused, nothing written.
        """
        self._check_open("step")
        check_extra(extra)
        self._carry(self.engine.step)
        if loss is None and self.engine.pending_backwards and not self.engine.has_loss and not self._warned_loss:
            self._warned_loss = True
            if self.who == "record()":
                log.warning("rec.step() got no loss and saw no rec.backward(loss): the steps' loss is null; pass the "
                            "loss, rec.step(loss), when you call loss.backward() yourself")  # fmt: skip
            else:  # a callback: the framework's loss was not where the callback reads it
                log.warning("%s saw no loss of the step: the steps' loss is null (the gradients are recorded as "
                            "ever); the README's section on this framework says where the loss is read", self.who)  # fmt: skip
        return self.engine.end_step(loss, **(extra or {}))

    def end_within_step(self, framework: str) -> int:
        """`framework` ended training normally inside a step (an accumulation window no optimiser step closed): its
        backwards are not written, an INFO line says so, and the run is complete. Returns how many.

        Example::

            rec.end_within_step("the Trainer")     # then leave the block: done.json
        """
        self._unclosed_ends, dropped = True, self.engine.pending_backwards
        if dropped:
            log.info("%s ended inside step %d's accumulation window, which no optimiser step closed: its %d captured "
                     "micro-batch(es) are not written (a step is one optimiser step); the run is complete with the "
                     "steps before it", framework, self.step_index, dropped)  # fmt: skip
        return dropped

    def start_at(self, step: int, backwards: int | None = None) -> None:
        """Number the next step `step` (a resumed run's first); capture is on for its forward when it is captured.

        Under `resume=True` the kept records of the steps before `step` stay, those from `step` on are
        recorded again (a training resumed from a checkpoint before the last recorded step). Seeded edits
        (`dropout`, `noise_std`) draw on as the uninterrupted run did from its backward `backwards` (the
        backwards before `step`; by default `step`, one per step; a callback: the framework's, as its resume counts them).
        Refused (one paragraph): a step that is no whole number of at least 0; under `resume=True` a step after the
        last one kept, or after 0 with nothing kept (those steps' records would be missing).
        """
        self.engine.start_at(step, backwards)  # a step that is no whole number of at least 0: refused there
        if self._open:
            self._first_start(self.engine.step)
            self._carry(self.engine.step)
        else:
            self._start, self._start_backwards = self.engine.step, backwards

    def _first_start(self, step: int) -> None:
        """Where a session with nothing kept begins: a resume after the steps it has no records of is refused."""
        if self.main and self._kept is None and not self.engine.steps_written:
            record_books.check_fresh_start(self.directory, step, resume=self.resume, who=self.who)

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise GradrunnerError(f"rec.{what}() was called outside the `with record(...) as rec:` block; call it "
                                  "inside the block (the run dir's writers are open only there).")  # fmt: skip


#: `record(model, taps, run_dir, ...)`: the documented spelling of `Recorder(...)`.
record = Recorder


class CallbackOptions:
    """What every framework callback takes: the taps, the run dir, how often, the strategy and `record`'s options.

    Example::

        class MyCallback(CallbackOptions, FrameworkCallback): ...
        MyCallback(taps=["fc1:output"], dir="runs/a", every=10, histogram=True)

    Every option is checked here, in the constructor (`record_options.check_callback_options`): a typo
    or a bad value is one paragraph before training starts. `strategy="autograd_grad"` is refused: it
    computes the gradients with an engine call of its own, which would bypass the framework's
    `loss.backward()` (precision plugins, DDP's reducer, accelerate); `hook` and `retain_grad` read the
    same gradients around the framework's own backward.
    """

    def __init__(
        self, taps: list[TapSpec] | TapSpec, dir: str | os.PathLike[str], every: int = 1, strategy: str = "hook",
        **options: Any,
    ) -> None:  # fmt: skip
        check_callback_options(type(self).__name__, strategy, every, options)
        self.taps, self.dir, self.every, self.strategy, self.options = taps, dir, every, strategy, options
        self.recorder: Recorder | None = None

    def _recorder(self, model: nn.Module, accumulate: int = 1, **given: Any) -> Recorder:
        """The session's `Recorder` on `model` (`given`: what the callback knows of the framework's run).

        `accumulate`: the framework's micro-batches per optimiser step (`micro_step` numbers them when over 1).
        """
        rec = Recorder(model, self.taps, self.dir, strategy=self.strategy, every=self.every, experiment=type(model).__name__,
                       **given, **self.options)  # fmt: skip
        rec.who = f"{type(self).__name__}(...)"
        rec.engine.accumulate = accumulate
        return rec
