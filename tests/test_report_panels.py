"""What a reader sees in the report's panels of a steps sweep: every job drawn with its own steps (integer
ticks), legends beside the axes with short tap names, and the per-element columns read for the rows drawn only.

References: planted DataFrames (their values written here), and for the real sweep the records read back
with plain pyarrow/numpy.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import check_ok, gradrunner_in_process
from report_tables import tables_after

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

from matplotlib.axes import Axes

from gradrunner.report.plots import plot_norms
from gradrunner.report.plots_optional import plot_update_ratios


def visible_ticks(ax: Axes, axis: str = "x") -> list[float]:
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    ticks = ax.get_xticks() if axis == "x" else ax.get_yticks()
    return [float(t) for t in ticks if lo - 1e-9 <= t <= hi + 1e-9]


def test_update_ratios_of_a_steps_sweep_draw_every_job_with_its_own_whole_steps() -> None:
    rows = [{"run_id": run, "experiment": "mlp", "override.steps": n, "step": s, "tap": tap, "call": 0,
             "update_norm": 1.0, "value_norm": 1.0, "update_ratio": ratio * (s + 1)}
            for run, n in (("a", 2), ("b", 5)) for s in range(n)
            for tap, ratio in (("fc1:weight", 1e-3), ("head:weight", 1e-2))]  # fmt: skip
    fig = plot_update_ratios(pd.DataFrame(rows))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["override.steps=2", "override.steps=5"]
    for ax, n in zip(axes, (2, 5), strict=True):
        fc1, head, guide = ax.get_lines()
        assert list(fc1.get_xdata()) == list(range(n)) and list(head.get_xdata()) == list(range(n))
        np.testing.assert_allclose(fc1.get_ydata(), [1e-3 * (s + 1) for s in range(n)])
        assert guide.get_ydata()[0] == 1e-3
        ticks = visible_ticks(ax)
        assert ticks and all(t == int(t) for t in ticks), ticks  # no half steps
        assert set(range(n)) <= {int(t) for t in ticks}
    fig.draw_without_rendering()
    for ax in axes:  # the legend sits right of the axes: it covers no line
        assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1


def _24_layers(steps: int = 3) -> pd.DataFrame:
    taps = [f"model.layers.{i}.mlp:output" for i in range(24)]
    return pd.DataFrame([{"run_id": "r", "experiment": "llama", "strategy": "hook", "step": s, "tap": t, "call": 0,
                          "norm": (1.0 + i) * (s + 1), "has_grad": True}
                         for s in range(steps) for i, t in enumerate(taps)])  # fmt: skip


def test_the_norms_legend_sits_beside_the_lines_with_short_tap_names() -> None:
    fig = plot_norms(_24_layers(), heatmap=False)
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [f"{i}.mlp:output" for i in range(24)]
    assert legend.get_title().get_text() == "after 'model.layers.'"
    np.testing.assert_allclose(ax.get_lines()[23].get_ydata(), [24.0, 48.0, 72.0])
    fig.draw_without_rendering()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # outside the axes: covers no data


def test_the_norms_heatmap_labels_taps_without_their_common_prefix() -> None:
    fig = plot_norms(_24_layers(), heatmap=True)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{i}.mlp:output" for i in range(24)]
    assert ax.get_ylabel() == "tap (after 'model.layers.')"


@pytest.fixture(scope="module")
def steps_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`-m +experiment=mlp steps=2,5` with histograms and per-example norms (a real Hydra multirun, in-process)."""
    root = tmp_path_factory.mktemp("steps_sweep")
    sweep = root / "sweep"
    check_ok(gradrunner_in_process(root, "-m", "+experiment=mlp", "steps=2,5", "capture.histogram=true",
                                   "capture.per_example=true", "report=false", f"hydra.sweep.dir={sweep}"))  # fmt: skip
    return sweep


@pytest.mark.slow  # about 10 s: two short runs and a report with every optional panel
def test_a_steps_sweep_report_draws_every_job_and_reads_only_the_drawn_rows(
    steps_sweep: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradrunner.report import write as report

    loaded: list[Any] = []
    real_load = report.load
    monkeypatch.setattr(report, "load", lambda *a, **k: loaded.append(k.get("columns")) or real_load(*a, **k))
    reads: list[tuple[list[str], Any, int]] = []
    real_read = pq.read_table

    def spy(*a: Any, **k: Any) -> Any:
        table = real_read(*a, **k)
        reads.append((list(k.get("columns") or []), k.get("filters"), table.num_rows))
        return table

    monkeypatch.setattr(pq, "read_table", spy)
    page = report.write_report(steps_sweep).read_text()
    monkeypatch.undo()

    # the records' rows are loaded without the per-element columns
    grads_columns = loaded[0]
    assert grads_columns is not None and not {"values", "hist_counts", "per_example_norm"} & set(grads_columns)
    # hist_counts: read with a filter (the drawn taps, or each job's last step), never every row
    hist = [(f, n) for c, f, n in reads if "hist_counts" in c]
    assert hist and all(f for f, _ in hist)
    files = {n: pq.read_table(steps_sweep / str(i) / "grads.parquet", columns=["step", "tap", "hist_counts"])
             .to_pandas() for i, n in enumerate((2, 5))}  # fmt: skip
    n_taps = files[2]["tap"].nunique()
    assert n_taps > 8  # the MLP's 11 taps: the histogram panels draw 8
    assert sorted(n for _, n in hist) == sorted([8 * 2, n_taps, 8 * 5, n_taps])

    # update ratios: a panel per job (the table: each job's own last step, both jobs)
    ratios = tables_after(page, "Update-to-weight ratio")
    assert ratios.groupby("override.steps")["step"].max().to_dict() == {2: 1, 5: 4}
    # histogram table: every tap at each job's last step; the shares match numpy on the records read back
    table = tables_after(page, "Gradient histograms over steps")
    assert table.groupby("override.steps")["step"].max().to_dict() == {2: 1, 5: 4}
    for n, df in files.items():
        last = df[df["step"] == n - 1].set_index("tap")
        shown = table[table["override.steps"] == n].set_index("tap")
        assert set(shown.index) == set(last.index)
        for tap, row in shown.iterrows():
            counts = np.asarray(last.loc[tap, "hist_counts"], dtype=np.int64)
            np.testing.assert_allclose(row["zero share"], counts[0] / counts.sum(), rtol=1e-3)
    # per-example norms: both jobs in the table
    per_example = tables_after(page, "Per-example gradient norms")
    assert set(per_example["override.steps"]) == {2, 5}
    images = re.findall(r'<img alt="([^"]+)"', page)
    assert {"Update-to-weight ratio", "Gradient histograms over steps", "Per-example gradient norms"} <= {
        html.unescape(i) for i in images
    }


def test_the_norms_of_a_steps_sweep_give_each_job_its_own_whole_steps() -> None:
    rows = [{"run_id": run, "experiment": "mlp", "override.steps": n, "step": s, "tap": tap, "call": 0,
             "norm": 0.5 * (s + 1), "has_grad": True}
            for run, n in (("a", 2), ("b", 5)) for s in range(n) for tap in ("fc1:output", "head:output")]  # fmt: skip
    for heatmap in (False, True):
        fig = plot_norms(pd.DataFrame(rows), heatmap=heatmap)
        axes = [ax for ax in fig.axes if ax.get_title()]  # the panels, not the heatmap colour bars
        assert [ax.get_title() for ax in axes] == ["override.steps=2", "override.steps=5"]
        for ax, n in zip(axes, (2, 5), strict=True):
            lo, hi = sorted(ax.get_xlim())
            assert lo > -1 and n - 1 <= hi < n, (heatmap, ax.get_xlim())  # its own steps, not the longest job's
            ticks = visible_ticks(ax)
            assert ticks and all(t == int(t) for t in ticks), ticks


@pytest.mark.parametrize(
    ("options", "shown"),
    [(("train.clip_grad_norm=0.5", "scheduler=cosine"), True), ((), False)],
    ids=["clipping-and-a-scheduler", "plain-sgd"],
)
def test_a_runs_training_figure_shows_the_clip_threshold_and_lr_where_they_say_something(
    tmp_path: Path, options: tuple[str, ...], shown: bool
) -> None:
    from conftest import compose_cfg

    from gradrunner.report import write as report
    from gradrunner.run.job import run

    out = tmp_path / "run"
    run(compose_cfg("+experiment=mlp", "steps=6", "device=cpu", *options), out_dir=out)
    page = report.write_report(out).read_text(encoding="utf-8")
    assert ("Training: grad norm and learning rate" in page) is shown
    assert (out / "report-training.png").exists() is shown
    if shown:
        steps = pd.read_parquet(out / "steps.parquet")
        assert report.config_value(out, ("train", "clip_grad_norm")) == 0.5  # the dashed line's value
        assert steps["lr"].nunique() == 6 and steps["clipped"].any()  # what the figure draws is in the records


def test_a_training_figure_without_a_known_threshold_does_not_claim_one(tmp_path: Path) -> None:
    """The callbacks clip in the framework's loop (Lightning's gradient_clip_val): `clipped` and `lr` are recorded, the
    threshold is not, and no dashed line is drawn, but the note said "the threshold dashed" (found 2026-11-27)."""
    import torch

    from gradrunner.capturing.stats import Collector
    from gradrunner.records.columns import TapKey
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.report import write as report

    consts = {"run_id": "r1", "experiment": "lightning", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    with RecordWriter(tmp_path, constants=consts, metadata={}) as grads, StepsWriter(tmp_path, constants=consts,
                                                                                     metadata={}) as steps:  # fmt: skip
        for step in range(4):
            col = Collector(values="none")
            col.add(TapKey("fc", "weight", 0), torch.full((4,), 0.2 * (step + 1)))
            grads.write_step(step, col.finish(torch.tensor(1.0)))
            steps.write(step, True, 1.0, 0.01, 0.001, 1 << 20, lr=0.1 / (step + 1), lrs=[0.1 / (step + 1)],
                        grad_norm=0.4 * (step + 1), clipped=step > 0)  # fmt: skip
    assert report.config_value(tmp_path, ("train", "clip_grad_norm")) is None
    page = report.write_report(tmp_path).read_text(encoding="utf-8")
    assert "Training: grad norm and learning rate" in page
    assert "the threshold dashed" not in page and "no threshold drawn" in page


def test_the_update_ratio_table_says_which_step_it_shows_when_the_last_ones_are_nan(tmp_path: Path) -> None:
    """A run whose last captured steps are NaN: the table shows the last step with a ratio, not the last captured one,
    which the note claimed (found 2026-11-27: a diverged run's table read step 61, captured through step 65)."""
    import torch
    from torch import nn

    from gradrunner import record
    from gradrunner.report import write as report

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, ["*:weight"], tmp_path / "r", update_norms=True) as rec:
        for step in range(5):
            x = torch.randn(8, 4)
            x[0, 0] = float("nan") if step >= 3 else x[0, 0]
            loss = nn.functional.mse_loss(model(x), torch.randn(8, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = pd.read_parquet(tmp_path / "r" / "grads.parquet")
    shown = int(df.loc[df["update_ratio"].notna(), "step"].max())
    assert shown < int(df["step"].max())  # the last captured steps have no ratio
    page = report.write_report(tmp_path / "r").read_text(encoding="utf-8")
    assert tables_after(page, "Update-to-weight ratio")["step"].astype(int).tolist() == [shown, shown]
    text = html.unescape(page)
    assert "each run's last step with a ratio" in text and "each run's last captured step" not in text
