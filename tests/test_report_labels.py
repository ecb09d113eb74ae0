"""Tap names with `$` (a ModuleDict key is any string): the report draws them as written, never as mathtext,
which would draw `$x^2$` as maths and raise on what it cannot parse (`$\\nope$`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import recorded
from report_tables import tables_after
from torch import nn

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

KEYS = ["$x^2$", "$\\nope$", "a$b"]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({k: nn.Linear(4, 4) for k in KEYS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        return x


def test_tap_names_with_dollars_are_drawn_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.text import Text

    from gradrunner.report import write as report

    torch.manual_seed(0)
    out = recorded(Blocks(), ["blocks.*:output", "blocks.*:weight"], tmp_path / "run")
    figures = []
    real = report.figure_section
    monkeypatch.setattr(report, "figure_section", lambda d, n, t, fig, *a: figures.append(fig) or real(d, n, t, fig, *a))
    page = report.write_report(out).read_text(encoding="utf-8")
    taps = pd.read_parquet(out / "grads.parquet")["tap"].unique().tolist()
    assert sorted(tables_after(page, "Per-tap summary")["tap"]) == sorted(taps)
    assert {f"blocks.{k}:output" for k in KEYS} <= set(taps)
    assert figures
    for fig in figures:  # every text, tick labels included (made when the figure was saved)
        texts = [t for t in fig.findobj(Text) if "$" in t.get_text()]
        assert all(not t.get_parse_math() for t in texts)
    assert any("$x^2$" in t.get_text() for fig in figures for t in fig.findobj(Text))


def test_log_axes_tick_labels_are_plain_numbers_of_their_ticks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With mathtext off for the tap names, matplotlib's log tick labels ($\\mathdefault{10^{-1}}$) were drawn as
    written on every log axis (found 2026-11-27): each label must be the tick's value as a plain number."""
    from gradrunner.report import write as report

    torch.manual_seed(0)
    out = recorded(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), ["*:output", "*:weight"], tmp_path / "r")
    figures = []
    real = report.figure_section
    monkeypatch.setattr(report, "figure_section", lambda d, n, t, fig, *a: figures.append(fig) or real(d, n, t, fig, *a))
    report.write_report(out)
    labelled = 0
    for fig in figures:
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                if axis.get_scale() != "log":
                    continue
                for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                    text = tick.label1.get_text()
                    if text and tick.label1.get_visible():
                        assert "$" not in text and float(text) == pytest.approx(tick.get_loc(), rel=5e-3), text
                        labelled += 1
    assert labelled > 5
