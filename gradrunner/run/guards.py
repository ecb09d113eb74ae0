"""What can go wrong inside a run, turned into one-paragraph `GradrunnerError`s that name the way out.

| guard | catches |
| --- | --- |
| `next_batch` | a data source that runs out, raises, or yields something other than an (inputs, targets) pair |
| `forward_loss` | a forward() or a loss that raises (told as the targets' shapes only when torch's error is about shapes or dtypes), targets an elementwise loss would broadcast against the output, a loss that is not a scalar or does not require grad |
| `backward` | a backward pass that raises (a model's in-place op on a tensor autograd saved) |
| `optimizer_step` | an optimizer step that raises (float16/bfloat16 overflow of a huge learning rate) |
| `check_finite` | `capture.on_nonfinite=stop`: a non-finite loss or captured gradient ends the run (`NonFinite`) |
| `check_writable` | an output directory that cannot be written, before step 0 |
| `write_errors` | an `OSError` while the records are written or closed (a full disk, a read-only dir); any other `OSError` (the caller's own) goes on as it is |
| `sigterm_as_interrupt` | SIGTERM or SIGHUP ends the run like Ctrl-C (`Terminated`; defined in `run.signals`, re-exported) |

Example::

    x, y = next_batch(job.batches, step, source="gradrunner.data.Synthetic")
    loss = forward_loss(job.model, job.loss_fn, x, y, step, model="gradrunner.models.MLP", loss="torch.nn.MSELoss")
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradrunner.data import call
from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.losses import ELEMENTWISE, output_hint
from gradrunner.records.columns import RECORD_FILES, StepRecords, is_temp_of
from gradrunner.run.signals import Terminated as Terminated  # re-exported: the loop and the CLI import it here
from gradrunner.run.signals import sigterm_as_interrupt as sigterm_as_interrupt


def describe(value: object) -> str:
    """A short description of a model output, batch or loss, for messages.

    Example::

        describe(torch.zeros(2, 3))        # '(2, 3) float32'
        describe({"logits": t, "aux": t})  # "a dict with keys 'logits', 'aux'"
    """
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(repr(k) for k in value)}"
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"a namedtuple {type(value).__name__}({', '.join(value._fields)})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"a dataclass {type(value).__name__}({', '.join(f.name for f in dataclasses.fields(value))})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(describe(v) for v in value[:3])})"
    return f"a {type(value).__name__}"


def next_batch(batches: Iterator[Any], step: int, source: str) -> tuple[Any, Any]:
    """The batch of `step`; a data source that runs out, raises or yields a non-pair is a GradrunnerError."""
    try:
        item = next(batches)
    except GradrunnerError:
        raise
    except StopIteration:
        raise GradrunnerError(
            f"data: {source} ran out of batches at step {step}{' (it yielded none)' if step == 0 else ''}; "
            "a data option must yield an (inputs, targets) batch for every step. Give it more data, make its "
            "batches() endless (as the built-in options are), or lower steps."
        ) from None
    except Exception as e:
        raise GradrunnerError(
            f"data: {source} raised {type(e).__name__}: {one_paragraph(e)} while making the batch of step {step}. "
            "Check the data.* keys and the data source's code; HYDRA_FULL_ERROR=1 shows the traceback."
        ) from e
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise GradrunnerError(
            f"data: {source} yielded {describe(item)} at step {step}, not an (inputs, targets) pair; make the "
            "data option yield (inputs, targets) tuples."
        )
    return item[0], item[1]


def forward_loss(
    model: Callable[..., Any], loss_fn: Callable[[Any, Any], Any], x: Any, y: Any, step: int, *, model_name: str,
    loss_name: str,
) -> torch.Tensor:  # fmt: skip
    """`loss_fn(model(x), y)` (`model(**x)` for a dict of keyword arguments), failures of either explained."""
    try:
        out = call(model, x)  # model(x), model(**x) for a dict, with the config's forward_kwargs
    except GradrunnerError:
        raise
    except Exception as e:
        raise GradrunnerError(
            f"step {step} failed in the model's forward(): {model_name} raised {type(e).__name__}: {one_paragraph(e)}, "
            f"on inputs {describe(x)}. Check the model (its forward() and the model.* keys) and that the data "
            "fits it (data.* shapes); HYDRA_FULL_ERROR=1 shows the traceback."
        ) from e
    try:
        with _broadcast_warnings(watch=step == 0) as warned:
            loss = loss_fn(out, y)
    except GradrunnerError:
        raise
    except Exception as e:
        if isinstance(out, torch.Tensor) and not _SHAPE_ERROR.search(str(e)):  # not about what it was given
            raise GradrunnerError(
                f"step {step} failed in the loss: {loss_name} raised {type(e).__name__}: {one_paragraph(e)} (given "
                f"the model's output, {describe(out)}, and targets {describe(y)}). Check the loss (loss._target_ and "
                "its loss.* keys); HYDRA_FULL_ERROR=1 shows the traceback."
            ) from e
        hint = (
            "check data.* target shapes against the model's output (classification losses need int64 labels)"
            if isinstance(out, torch.Tensor) else
            "give it a loss that takes what the model returns (loss._target_=<your loss>), or make the model "
            "return a tensor"
        )  # fmt: skip
        if not isinstance(out, torch.Tensor) and output_hint(out):
            hint = f"{output_hint(out)}; or {hint}"
        raise GradrunnerError(
            f"step {step} failed in the loss: {loss_name} cannot take the model's output, {describe(out)}, with "
            f"targets {describe(y)}: {type(e).__name__}: {one_paragraph(e)}. To fix it, {hint}."
        ) from e
    _check_targets(loss_fn, out, x, y, step, loss_name, warned)
    _check_loss(loss, step, loss_name)
    return loss


#: What torch's errors say when a loss cannot take its output or targets (their sizes, shapes, dimensions or dtypes):
#: only such an error is told as the shapes' (with their fix); any other a loss raises is named as it is.
_SHAPE_ERROR = re.compile(
    r"size|shape|dimension|dtype|scalar type|out of bounds|batch.?size|broadcast|must match|cannot be multiplied"
    r"|\btarget|can.?t be cast|expected .*\b(?:long|float|double|half|int|bool|tensor|input)",
    re.IGNORECASE,
)
#: How torch's warning starts when `mse_loss`, `l1_loss`, `smooth_l1_loss` or `huber_loss` is about to broadcast.
_TORCH_BROADCASTS = "Using a target size"


@contextlib.contextmanager
def _broadcast_warnings(watch: bool) -> Iterator[list[str]]:
    """The messages of torch's "Using a target size ..." warnings raised inside (only when `watch`: the first step).

    Any other warning raised inside is passed on as it came.
    """
    found: list[str] = []
    if not watch:
        yield found
        return
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        for w in caught:
            if issubclass(w.category, UserWarning) and str(w.message).startswith(_TORCH_BROADCASTS):
                found.append(str(w.message))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _check_targets(
    loss_fn: object, out: object, x: object, y: object, step: int, loss_name: str, warned: list[str]
) -> None:  # fmt: skip
    """Refuse targets of another shape than the output for an elementwise loss (`losses.ELEMENTWISE`, or one torch warned
    about at the first step): torch broadcasts them (targets (32,) against (32, 1): a (32, 32) loss) and the loss is wrong.
    """
    if not (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor)) or out.shape == y.shape:
        return
    if not (isinstance(loss_fn, ELEMENTWISE) or warned):
        return
    try:
        to = f" to {tuple(torch.broadcast_shapes(out.shape, y.shape))}"
    except RuntimeError:
        to = ""
    why = (f"the loss compares them element by element: torch would broadcast them{to} and the loss would be wrong"
           if isinstance(loss_fn, ELEMENTWISE) else
           f"torch warned that it would broadcast them{to}, so the loss would be wrong")  # fmt: skip
    rows = ""
    if out.dim() and y.dim() and out.shape[0] != y.shape[0]:
        inputs = f" (from {_rows(x.shape[0])} of inputs)" if isinstance(x, torch.Tensor) and x.dim() else ""
        rows = f" The output has {_rows(out.shape[0])}{inputs} but the targets have {_rows(y.shape[0])}."
    raise GradrunnerError(
        f"step {step} failed in the loss: {loss_name} cannot take the model's output, {describe(out)}, with targets "
        f"{describe(y)}: their shapes differ and {why}.{rows} To fix it, check data.* target shapes against the "
        f"model's output (targets of shape {tuple(out.shape)}: data.target_shape, data.targets, model.out_features), "
        "or give a loss that takes these shapes (loss._target_=<your loss>)."
    )


def _rows(count: int) -> str:
    return f"{count} row{'' if count == 1 else 's'}"


def backward(run_backward: Callable[[torch.Tensor], None], loss: torch.Tensor, step: int) -> None:
    """`run_backward(loss)`, with a failure explained (it is nearly always the model's in-place ops)."""
    try:
        run_backward(loss)
    except GradrunnerError:
        raise
    except Exception as e:
        raise GradrunnerError(
            f"step {step} failed in backward: {type(e).__name__}: {one_paragraph(e)}. This usually comes from the model: "
            "an in-place operation on a tensor autograd saved for backward (x += ..., x.mul_(...), "
            "inplace=True), or a custom autograd.Function; check the model's forward(). HYDRA_FULL_ERROR=1 shows "
            "the traceback."
        ) from e


def optimizer_step(optimizer: torch.optim.Optimizer, step: int, scaler: torch.amp.GradScaler | None = None) -> None:
    """`optimizer.step()`, with a failure (float16 overflow of a huge learning rate, ...) explained.

    Example::

        optimizer_step(job.optimizer, step)   # GradrunnerError: step 0 failed in the optimizer step: ...

    It runs before the step's rows are written, so the records kept end with the step before.
    """
    try:
        if scaler is not None:
            scaler.step(optimizer)  # skips the step when the unscaled gradients hold inf/NaN
        else:
            optimizer.step()
    except GradrunnerError:
        raise
    except RuntimeError as e:
        kept = f"the records of steps 0-{step - 1} are kept" if step else "no step completed, so no records are kept"
        raise GradrunnerError(
            f"step {step} failed in the optimizer step ({type(optimizer).__name__}): {one_paragraph(e)}. With "
            "float16/bfloat16 this is usually an update too large for the dtype: lower optimizer.lr, or run in "
            f"dtype=float32; {kept}."
        ) from e


def _check_loss(loss: object, step: int, loss_name: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise GradrunnerError(
            f"step {step}: the loss {loss_name} returned {describe(loss)}, not a scalar tensor; use a reducing "
            "loss (reduction='mean' or 'sum')"
        )
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise GradrunnerError(
            f"step {step}: the loss {loss_name} does not require grad, so there is nothing to backpropagate: no "
            "parameter that requires grad took part in it (are all parameters frozen, or is the model's output "
            "detached or computed under torch.no_grad()?). Unfreeze a parameter or check the model's forward()."
        )


class NonFinite(GradrunnerError):
    """`capture.on_nonfinite=stop` (or `on_nonfinite="stop"`) ended the run: the step and what was not finite.

    `who` names the API the user set it in: None for the runner's config, else `record()` or a callback's
    `GradientCapture(...)`; the message names the setting as that API spells it.
    """

    def __init__(self, step: int, problem: str, directory: Path | None = None, who: str | None = None) -> None:
        super().__init__(step, problem)
        self.step, self.problem, self.directory, self.who = step, problem, directory, who

    def _setting(self, mode: str) -> str:
        """`on_nonfinite` set to `mode`, as the user's API spells it."""
        if self.who is None:
            return f"capture.on_nonfinite={mode}"
        return f"{self.who.partition('(')[0]}(..., on_nonfinite={mode!r})"

    def __str__(self) -> str:
        where = f" in {self.directory}" if self.directory is not None else ""
        lower = "Lower optimizer.lr" if self.who is None else "Lower the learning rate"
        return (
            f"{self._setting('stop')}: stopped at step {self.step}, where {self.problem}. The records written so "
            f"far (through step {self.step}) are kept{where}. {lower}, or look in the records for the first tap "
            f"that went non-finite, or set {self._setting('record')} to record every step and go on."
        )


def nonfinite(loss: float | None, records: StepRecords | None) -> str | None:
    """What is not finite in a step (its loss, the taps with NaN/Inf gradient elements), or None (loss None: unknown)."""
    taps: list[str] = []
    if records is not None and len(records):
        bad = (np.asarray(records.counts["nan_count"]) + np.asarray(records.counts["inf_count"])) > 0
        taps = list(dict.fromkeys(records.keys[i].tap for i in np.flatnonzero(bad)))
    parts = [f"the loss is {loss}"] if loss is not None and not math.isfinite(loss) else []
    if taps:
        parts.append(f"{len(taps)} tap(s) have NaN or Inf gradient elements (first: {', '.join(taps[:3])})")
    return " and ".join(parts) or None


def check_finite(
    mode: str, step: int, loss: float | None, records: StepRecords | None, directory: Path | None = None,
    who: str | None = None,
) -> None:  # fmt: skip
    """Raise `NonFinite` (naming the run dir `directory`, and the setting as `who` spells it) when `mode` is `stop`
    and the step's loss or a captured gradient is not finite."""
    if mode == "stop":
        problem = nonfinite(loss, records)
        if problem is not None:
            raise NonFinite(step, problem, directory, who)


_WHERE = "hydra.run.dir=<dir> on the command line, out_dir= in train()"


def check_writable(directory: Path, where: str = _WHERE) -> None:
    """Fail before step 0 if records cannot be written in `directory` (which may not exist yet).

    Example::

        check_writable(Path("/proc/runs"))  # GradrunnerError: cannot write records in /proc/runs: ...
    """
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        os.rmdir(tempfile.mkdtemp(prefix=".gradrunner-probe-", dir=existing))
    except OSError as e:
        raise GradrunnerError(
            f"cannot write records in {directory}: {one_paragraph(e)}. Nothing was run; choose another output "
            f"directory ({where})."
        ) from None


@contextlib.contextmanager
def write_errors(directory: Path) -> Iterator[None]:
    """Turn an `OSError` from writing or closing the records (disk full, quota) into a GradrunnerError."""
    try:
        yield
    except BrokenPipeError:
        raise  # stdout/stderr closed under us: not about the records
    except CheckpointNotWritten as e:
        kept = e.held()
        resume = (f"then run again with resume=true: it goes on from {kept}" if kept else
                  "then run again (no checkpoint was kept: from step 0)")  # fmt: skip
        raise GradrunnerError(
            f"could not write the mid-run checkpoint after step {e.step} in {directory}: {one_paragraph(e.error)}. "
            f"{_left_behind(directory)} To go on, free some disk space (or make the dir writable), {resume}."
        ) from e
    except OSError as e:
        if not _from_writing(e):
            raise  # the caller's own (a data file a record() block opens): not about the records
        raise GradrunnerError(
            f"could not write the records in {directory}: {one_paragraph(e)}. {_left_behind(directory)} To go on, free some "
            f"disk space (or make the dir writable) or choose another output directory ({_WHERE}), then run again."
        ) from e


#: The modules whose `OSError` is the records' (or their exports') not being written.
_WRITERS = ("gradrunner.records.", "gradrunner.export.", "gradrunner.run.writers")


def _from_writing(error: BaseException) -> bool:
    """Whether `error` was raised while gradrunner wrote or closed something: a frame of its writers on its way up."""
    tb = error.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_WRITERS):
            return True
        tb = tb.tb_next
    return False


class CheckpointNotWritten(OSError):
    """The disk refused the mid-run checkpoint after `step` (`checkpoint_write_errors`); `write_errors` says so once the
    records are closed, with what is on disk then and the checkpoint that `resume=true` goes on from (`held()`)."""

    def __init__(self, error: OSError, step: int, held: Callable[[], str | None]) -> None:
        super().__init__(error.errno, error.strerror, error.filename)
        self.error, self.step, self.held = error, step, held


@contextlib.contextmanager
def checkpoint_write_errors(step: int, held: Callable[[], str | None]) -> Iterator[None]:
    """An `OSError` writing the mid-run checkpoint after `step` as a `CheckpointNotWritten`."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        raise CheckpointNotWritten(e, step, held) from e


def side_file_error(directory: Path, name: str, e: OSError) -> GradrunnerError:
    """A file written beside the records (`anomalies.parquet`) the disk refused: one paragraph that names it, and
    what is on disk (the records are closed by then: never called "the records could not be written")."""
    return GradrunnerError(
        f"could not write {name} in {directory}: {one_paragraph(e)}. {_left_behind(directory)} To go on, free some "
        f"disk space (or make the dir writable) or choose another output directory ({_WHERE}), then run again."
    )


def _left_behind(directory: Path) -> str:
    """What a failed write left in `directory`, as found on disk (never what was meant to happen)."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        return f"What is left in the dir cannot be listed ({one_paragraph(e)})."
    kept = sorted(n for n in names if n in RECORD_FILES)
    temps = sorted(n for n in names if any(is_temp_of(n, r) for r in RECORD_FILES))
    said = f"Kept: {', '.join(kept)} (complete files)." if kept else "No records were kept."
    if temps:
        said += f" The temp file(s) {', '.join(temps)} could not be removed: delete them by hand."
    else:
        said += " No half-written file is left."
    return said
