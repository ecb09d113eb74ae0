"""The report of a run that recorded no loss (`rec.step()` without one): no empty figure, no 'nan', the words
the last word uses. Checked against the run's own steps.parquet (pyarrow: a null loss, not a NaN one)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from report_tables import tables_after
from torch import nn

from gradrunner import record

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")


def _run(out: Path, grad_norm: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, ["*:output"], out) as rec:
        for i in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step(extra={"grad_norm": 1.0 + i} if grad_norm else None)


def _answer(page: str) -> str:
    return page.split('<p class="answer">', 1)[1].split("</p>", 1)[0]


@pytest.mark.parametrize("grad_norm", [False, True], ids=["nothing to draw", "grad_norm only"])
def test_a_run_without_a_loss_is_reported_as_such(tmp_path: Path, grad_norm: bool) -> None:
    from gradrunner.report import write_report

    out = tmp_path / "run"
    _run(out, grad_norm)
    loss = pq.read_table(out / "steps.parquet").column("loss")
    assert len(loss) == loss.null_count == 3  # the reference: three steps, none with a loss
    page = write_report(out).read_text(encoding="utf-8")
    assert _answer(page).startswith("Loss not recorded over 3 steps;")
    runs = tables_after(page, "Runs")
    assert runs["last loss"].tolist() == ["loss not recorded"] and runs["steps run"].tolist() == [3]
    assert "loss nan" not in _answer(page).lower() and "→ nan" not in _answer(page)
    assert (out / "report-loss.png").exists() is grad_norm  # the grad norm is drawn; nothing is not
    if not grad_norm:
        assert "<p>Loss not recorded: every step's loss is null in steps.parquet" in page
    assert "loss: not recorded" in (out / "gradrunner.log").read_text(encoding="utf-8")  # the last word's words


@pytest.mark.parametrize("grad_norm", [False, True], ids=["nothing to draw", "grad_norm only"])
def test_an_aggregated_sweep_without_a_loss_is_reported_as_such(tmp_path: Path, grad_norm: bool) -> None:
    """More than AGGREGATE_ABOVE runs, none with a loss: the report raised StopIteration (nothing to draw), or said
    "median loss nan → nan; last loss NaN/Inf in 9 runs" and named every run as NaN/Inf (found 2026-11-27): a null
    loss is not a NaN one."""
    from gradrunner.analysis.aggregate import AGGREGATE_ABOVE
    from gradrunner.report import write_report

    sweep = tmp_path / "sweep"
    for job in range(AGGREGATE_ABOVE + 1):
        _run(sweep / str(job), grad_norm)
    assert all(pq.read_table(f).column("loss").null_count == 3 for f in sweep.glob("*/steps.parquet"))
    page = write_report(sweep).read_text(encoding="utf-8")
    assert "Loss not recorded over 9 runs;" in _answer(page) and "nan →" not in _answer(page).lower()
    assert "last loss NaN/Inf" not in _answer(page)
    assert "Runs with NaN/Inf" not in page
    assert tables_after(page, "Runs")["runs with NaN/Inf loss"].tolist() == [0]
    assert (sweep / "report-loss.png").exists() is grad_norm
    if not grad_norm:
        assert "<p>Loss not recorded: every step's loss is null in steps.parquet" in page
