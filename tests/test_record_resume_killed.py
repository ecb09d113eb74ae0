"""`record(..., resume=True)` after a session that was killed outright (SIGKILL, a preempted node).

A killed session's record files have no footer; the steps it closed are in its live segments
(`.live/<run id>/`, every `live_every` steps). A resume continues those, refuses a resume at a step
after the last one kept (the steps between would be missing without a word), and refuses a resume at
a step after 0 where nothing at all was kept. Each killed session is a subprocess that SIGKILLs itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import child_python, cli_env
from torch import nn

import gradrunner
from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError

STEPS = 12


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]


def train(run: str, start: int = 0, checkpoint: str | None = None, save_at: int = -1, kill_at: int = -1,
          live_every: int = 2, fail_at: int = -1, **options: object) -> None:  # fmt: skip
    """Steps `start`.. of the run (from `checkpoint` when given); `save_at`: the state before that step saved to
    `checkpoint`; `kill_at`: SIGKILL this process after that step closed; `fail_at`: raise there instead."""
    torch.set_num_threads(1)
    model, opt = _model()
    if checkpoint is not None and start:
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    data = _data()
    with gradrunner.record(model, ["*:output", "0:weight"], run, live_every=live_every, **options) as rec:
        rec.start_at(start)
        for s in range(start, STEPS):
            if s == save_at:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, str(checkpoint))
            x, y = data[s]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702  # fmt: skip
            rec.step(loss)
            if s == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if s == fail_at:
                raise RuntimeError(f"the training fails after step {s}")


def _killed(run: Path, checkpoint: Path | None, kill_at: int, live_every: int, **options: object) -> None:
    """The session in a process of its own, killed by SIGKILL after step `kill_at` (it waits for that process)."""
    given = "".join(f", {k}={v!r}" for k, v in options.items())
    code = (f"import test_record_resume_killed as t; t.train({str(run)!r}, checkpoint={checkpoint and str(checkpoint)!r}, "
            f"kill_at={kill_at}, live_every={live_every}{given})")  # fmt: skip
    done = subprocess.run([child_python(), "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    skip = {"run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"}
    cols = [c for c in a.columns if c not in skip]
    key = [c for c in ("step", "tap", "call") if c in a.columns]
    pd.testing.assert_frame_equal(a[cols].sort_values(key).reset_index(drop=True),
                                  b[cols].sort_values(key).reset_index(drop=True))  # fmt: skip


def test_a_killed_sessions_closed_steps_are_continued_and_a_gap_is_refused(tmp_path: Path) -> None:
    """Killed after step 6 with segments every 2 steps (steps 0..5 closed in them): a resume at step 7 is refused
    naming step 6 (before: steps 7..11 only, marked complete); one from the checkpoint before step 6 gives the
    uninterrupted run's records, steps 0..11."""
    whole, run, ckpt = tmp_path / "whole", tmp_path / "run", tmp_path / "ckpt.pt"
    train(str(whole))
    _killed(run, ckpt, kill_at=6, live_every=2, save_at=6)
    assert not (run / "grads.parquet").exists()  # no footer: only the segments hold the closed steps
    with pytest.raises(GradrunnerError, match=r"end at step 5 but training resumes at step 7: the records of steps "
                                              r"6\.\.6 would be missing"):  # fmt: skip
        train(str(run), start=7, checkpoint=str(ckpt), resume=True)
    assert not (run / "done.json").exists()
    assert sorted(load(run, table="steps").step) == list(range(6))  # the killed session's closed steps, kept
    train(str(run), start=6, checkpoint=str(ckpt), resume=True)
    assert (run / "done.json").is_file() and not (run / ".live").exists()
    assert sorted(load(run, table="steps").step) == list(range(STEPS))
    _same(load(whole), load(run))
    _same(load(whole, table="steps"), load(run, table="steps"))


def test_a_resume_after_steps_of_which_nothing_was_kept_is_refused(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Killed after step 6 before any segment (every 10 steps): nothing closed was kept, so a resume at step 7 is
    refused (before: steps 7..11 marked complete); without resume=True the records begin at step 7, as said."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    _killed(run, ckpt, kill_at=6, live_every=10, save_at=6)
    with pytest.raises(GradrunnerError, match=r"holds no records to continue, but training resumes at step 7: the "
                                              r"records of steps 0\.\.6 would be missing"):  # fmt: skip
        train(str(run), start=7, checkpoint=str(ckpt), resume=True)
    assert not (run / "done.json").exists() and not (run / "grads.parquet").exists()
    with caplog.at_level(logging.WARNING, logger="gradrunner"):
        train(str(tmp_path / "fresh"), start=7)
    assert sorted(load(tmp_path / "fresh", table="steps").step) == list(range(7, STEPS))
    assert "begin at step 7, where training starts (rec.start_at): steps 0..6 are not recorded there" in caplog.text


@pytest.mark.parametrize("live_every", [10, 2])
def test_a_resumed_session_killed_leaves_the_earlier_records_readable_and_resumable(tmp_path: Path,
                                                                                   live_every: int) -> None:  # fmt: skip
    """A session failed after step 4 (steps 0..4 closed); a resumed one was killed after step 7. Before, the
    earlier records lay only in the hidden .resumed-* copies: load() found no grads.parquet, load(live=True)
    waited for a dead job, a plain record() named a done.json that was not there. Now load reads them (with a
    warning saying what they are), a refusal names them, and resume=True continues them, or the killed session's
    segments (every 2 steps: the carried steps and steps 5, 6)."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="fails after step 4"):
        train(str(run), fail_at=4)
    before, before_steps = load(run), load(run, table="steps")
    _killed(run, None, kill_at=7, live_every=live_every, start=5, resume=True)
    if live_every == 10:  # no segment: the earlier records are all there is
        for live in (False, True):
            with pytest.warns(UserWarning, match=r"has no grads.parquet: read \.resumed-grads\.parquet"):
                _same(before, load(run, live=live))
    with pytest.raises(GradrunnerError, match=r"already holds records \(\.resumed-grads\.parquet, ") as e:
        train(str(run))
    assert "done.json" not in str(e.value)
    kept = 5 if live_every == 10 else 7
    train(str(run), start=kept, resume=True)
    assert (run / "done.json").is_file() and not any(p.name.startswith(".resumed-") for p in run.iterdir())
    assert sorted(load(run, table="steps").step) == list(range(STEPS))
    _same(before, load(run).query("step < 5"))
    _same(before_steps, load(run, table="steps").query("step < 5"))


def fit(run: str, checkpoints: str, kill_at: int = -1, ckpt_path: str | None = None) -> None:
    """A Lightning fit of 12 steps, checkpointed every 3 (`last.ckpt`), SIGKILLed when `global_step` reaches
    `kill_at` (the records of steps 0..kill_at-1 closed; segments every 2 steps)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from gradrunner.integrations.lightning import GradientCapture

    torch.set_num_threads(1)

    class Reg(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()[0]

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class KillAt(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = zip(*_data()[:6], strict=True)  # epochs of 6 steps, unshuffled: a restarted epoch meets the same batches
    data = torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y))
    callbacks = [GradientCapture(taps=["net.*:output"], dir=run, resume=True, live_every=2),
                 ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=3, save_top_k=-1, save_last=True), KillAt()]  # fmt: skip
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=True, callbacks=callbacks)  # fmt: skip
    trainer.fit(Reg(), torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)


def test_a_lightning_fit_killed_and_resumed_from_last_ckpt_records_every_step(tmp_path: Path) -> None:
    """Killed at global step 7 (segments hold steps 0..5), resumed with fit(ckpt_path=last.ckpt) at step 6: the run
    dir holds the uninterrupted fit's steps 0..11 (before: steps 6..11 only, marked complete)."""
    pytest.importorskip("lightning")
    run, ckdir = tmp_path / "run", tmp_path / "ck"
    fit(str(tmp_path / "whole"), str(tmp_path / "ck_whole"))
    code = f"import test_record_resume_killed as t; t.fit({str(run)!r}, {str(ckdir)!r}, kill_at=7)"
    done = subprocess.run([child_python(), "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    fit(str(run), str(ckdir), ckpt_path=str(ckdir / "last.ckpt"))
    assert (run / "done.json").is_file()
    assert sorted(load(run, table="steps").step) == list(range(STEPS))
    _same(load(tmp_path / "whole"), load(run))
