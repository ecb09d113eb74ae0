"""The run dir's `gradrunner.log` keeps the run's last word whatever level the user set to quiet the console.

Before, `logging.getLogger("gradrunner").setLevel(logging.CRITICAL)` (or the runner's
`+hydra.job_logging.loggers.gradrunner.level=CRITICAL`) left `gradrunner.log` empty: the logger's level gated
the file as well as the console. The reference is the loop's own losses (`steps.parquet`, the script's values).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import gradrunner_in_process
from torch import nn

import gradrunner
from gradrunner.run.session_log import LOG_FILE

HEALTH = "gradrunner.analysis.health"


def _loss_line(text: str) -> tuple[float, float, int]:
    m = re.search(r"loss: (\S+) at the first step, (\S+) at the last \((\d+) steps\)", text)
    assert m, text
    return float(m[1]), float(m[2]), int(m[3])


@contextlib.contextmanager
def _gradrunner_level(level: int) -> Iterator[None]:
    """The `gradrunner` logger at `level` while open, then as it was (conftest leaves a logger a test made as it is)."""
    logger = logging.getLogger("gradrunner")
    was = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(was)


@pytest.mark.parametrize("level", [logging.CRITICAL, logging.WARNING])
def test_a_quieted_gradrunner_logger_quiets_the_console_not_the_record_sessions_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    """The file holds the summary with the loop's losses; the console handlers see what the level lets through, once
    (a NaN loss makes the summary a warning: shown at WARNING, not at CRITICAL)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    losses = []
    with _gradrunner_level(level), gradrunner.record(model, ["0:output"], tmp_path / "run") as rec:
        for s in range(3):
            loss = model(torch.randn(5, 3)).pow(2).mean() * (float("nan") if s == 2 else 1.0)
            loss.backward()
            rec.step(loss)
            losses.append(float(loss.detach()))
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert text.count("run summary:") == 1, text
    first, last, n = _loss_line(text)
    assert (first, n) == (pytest.approx(losses[0], rel=1e-5), 3) and "NaN/Inf: the loss from step 2" in text
    shown = [r for r in caplog.records if r.name.startswith("gradrunner")]
    assert all(r.levelno >= level for r in shown), [(r.name, r.levelname) for r in shown]
    summaries = [r for r in shown if r.name == HEALTH and r.getMessage().startswith("run summary:")]
    assert len(summaries) == (1 if level == logging.WARNING else 0)


def test_a_quieted_gradrunner_logger_quiets_the_console_not_the_runners_log(tmp_path: Path) -> None:
    with _gradrunner_level(logging.NOTSET):  # the logger made before: the in-process run puts its level back
        out = gradrunner_in_process(tmp_path, "+experiment=cosine", "steps=2", "hydra.run.dir=r",
                                    "+hydra.job_logging.loggers.gradrunner.level=CRITICAL")  # fmt: skip
    assert out.returncode == 0, out.stderr
    loss = pd.read_parquet(tmp_path / "r" / "steps.parquet")["loss"].tolist()
    text = (tmp_path / "r" / LOG_FILE).read_text()
    assert text.count("run summary:") == 1 and "[INFO]" in text, text
    first, last, n = _loss_line(text)
    assert (first, last, n) == (pytest.approx(loss[0], rel=1e-5), pytest.approx(loss[-1], rel=1e-5), 2)
    assert "[INFO]" not in out.stderr and "run summary" not in out.stderr, out.stderr
