"""The report of a large sweep (issue 25): aggregated over runs, every PNG at most a page, numbers that agree with `load()`.

The sweep is synthetic, written by the real writers without a model: 30 jobs, `optimizer.lr` (3 values) x
`train.batch` (2) x `seed` (5), gradient norms and losses planted as functions of the three, and a NaN from
step 3 in two runs. The medians the report draws and tabulates are checked against a pandas groupby of
`load()`'s output.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

from matplotlib.figure import Figure

from gradrunner.analysis import load, run_columns
from gradrunner.analysis.aggregate import AGGREGATE_ABOVE, sweep_layout
from gradrunner.capturing.stats import Collector
from gradrunner.records.columns import TapKey
from gradrunner.records.writer import RecordWriter, StepsWriter
from gradrunner.report import write as report_module
from gradrunner.report.plots import PAGE_INCHES
from gradrunner.report.write import DPI, write_report

LRS = (0.1, 0.01, 0.001)
BATCHES = (8, 16)
SEEDS = range(5)
STEPS = 4
TAPS = [TapKey("fc1", "output", 0), TapKey("relu1", "output", 0), TapKey("fc2", "output", 0),
        TapKey("head", "output", 0), TapKey("fc1", "weight", 0)]  # fmt: skip
#: Runs whose fc1:output gradient holds a NaN from step 3 on: (lr, batch, seed).
NAN_RUNS = {(0.001, 16, 4), (0.1, 8, 0)}
MAX_PX = (round(PAGE_INCHES[0] * DPI), round(PAGE_INCHES[1] * DPI))


def planted_norm(tap: int, step: int, lr: float, batch: int, seed: int) -> float:
    return (tap + 1) * lr * (1 + batch / 8) * (1 + 0.1 * seed) * (step + 1) ** (0.5 + seed % 3)


def gradient(norm: float, nan: bool) -> torch.Tensor:
    ramp = torch.arange(1, 5, dtype=torch.float64)
    grad = (ramp * norm / ramp.norm()).float()
    if nan:
        grad[0] = float("nan")
    return grad


def write_job(job: Path, lr: float, batch: int, seed: int, taps: list[TapKey] = TAPS) -> None:
    consts = {"run_id": f"run-{job.name}", "experiment": "scale", "strategy": "hook", "device": "cpu",
              "dtype": "float32"}  # fmt: skip
    with (
        RecordWriter(job, constants=consts, metadata={}) as grads,
        StepsWriter(job, constants=consts, metadata={}) as steps,
    ):
        for step in range(STEPS):
            col = Collector(values="none")
            for i, key in enumerate(taps):
                nan = i == 0 and step >= 3 and (lr, batch, seed) in NAN_RUNS
                col.add(key, gradient(planted_norm(i, step, lr, batch, seed), nan))
            loss = (1 + lr * 10) * (1 + 0.05 * seed) / (step + 1)
            grads.write_step(step, col.finish(torch.tensor(loss)))
            steps.write(step, True, loss, 0.01, 0.001, 1 << 20)
    (job / ".hydra").mkdir()
    overrides = ["+experiment=scale", f"optimizer.lr={lr}", f"train.batch={batch}", f"seed={seed}"]
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def jobs() -> Iterator[tuple[float, int, int]]:
    for lr in LRS:
        for batch in BATCHES:
            for seed in SEEDS:
                yield lr, batch, seed


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scale") / "sweep"
    for num, (lr, batch, seed) in enumerate(jobs()):
        write_job(root / str(num), lr, batch, seed)
    return root


@pytest.fixture(scope="module")
def written(sweep: Path) -> dict[str, Any]:
    """The report of the sweep, with every figure it saved (by name)."""
    figures: dict[str, Figure] = {}
    original = report_module.figure_section

    def keep(out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str:
        figures[name] = fig
        return original(out_dir, name, title, fig, note)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_module, "figure_section", keep)
        page = write_report(sweep)
    return {"page": page, "html": page.read_text(encoding="utf-8"), "figures": figures}


class Tables(HTMLParser):
    """Each table of a page as a DataFrame of strings, under the heading (h2) before it."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[pd.DataFrame]] = {}
        self._heading: str | None = None
        self._in: str | None = None
        self._rows: list[list[str]] = []
        self._cell: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("h2", "th", "td"):
            self._in, self._cell = tag, []
        elif tag == "tr":
            self._rows.append([])
        elif tag == "table":
            self._rows = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2":
            self._heading = "".join(self._cell)
        elif tag in ("th", "td"):
            self._rows[-1].append("".join(self._cell))
        elif tag == "table":
            head, *body = self._rows
            self.tables.setdefault(self._heading or "", []).append(pd.DataFrame(body, columns=head))
        self._in = None if tag in ("h2", "th", "td") else self._in

    def handle_data(self, data: str) -> None:
        if self._in:
            self._cell.append(data)


def tables(text: str) -> dict[str, list[pd.DataFrame]]:
    parser = Tables()
    parser.feed(text)
    return parser.tables


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# --- what is aggregated, and how it is said ----------------------------------------------------------


def test_the_layout_colours_by_the_fewest_values_facets_by_the_next_and_aggregates_over_seed(sweep: Path) -> None:
    df = load(sweep)
    assert set(run_columns(df)) == {"optimizer.lr", "train.batch", "seed"}
    layout = sweep_layout(df)
    assert (layout.hue, layout.facet, layout.over, layout.runs) == ("train.batch", "optimizer.lr", ("seed",), 30)


def test_the_page_says_what_was_aggregated_and_draws_no_panel_per_run(written: dict[str, Any]) -> None:
    said = ("30 runs aggregated over seed: median and 10%-90% band, a line per train.batch, "
            "a column of panels per optimizer.lr.")  # fmt: skip
    assert 30 > AGGREGATE_ABOVE
    assert said in written["html"].split("</p>")[0]  # the first paragraph says it
    norms = written["figures"]["norms"]
    assert len(norms.axes) == len(TAPS) * len(LRS)  # a panel per tap and lr, whatever the number of seeds
    assert {len(ax.get_lines()) for ax in norms.axes} == {len(BATCHES)}  # a line per batch
    assert {ax.get_title() for ax in norms.axes} >= {"fc1:output, optimizer.lr=0.1", "fc1:weight, optimizer.lr=0.001"}
    assert len(written["figures"]["loss"].axes) == len(LRS)  # the loss (no grad_norm recorded) per lr


def test_every_png_is_at_most_a_page(written: dict[str, Any]) -> None:
    pngs = sorted(written["page"].parent.glob("report-*.png"))
    assert {p.name for p in pngs} >= {"report-loss.png", "report-norms.png", "report-grad_flow.png"}
    for png in pngs:
        width, height = png_size(png.read_bytes())
        assert width <= MAX_PX[0] and height <= MAX_PX[1], (png.name, width, height)


# --- the numbers agree with load() ------------------------------------------------------------------


def test_the_drawn_medians_and_bands_are_those_of_load(sweep: Path, written: dict[str, Any]) -> None:
    df = load(sweep)
    with_grad = df[df["has_grad"]]
    g = with_grad.groupby(["optimizer.lr", "train.batch", "tap", "step"])["norm"]
    median, lo, hi = g.median(), g.quantile(0.1), g.quantile(0.9)
    checked = 0
    for ax in written["figures"]["norms"].axes:
        tap, lr = ax.get_title().split(", optimizer.lr=")
        for line in ax.get_lines():
            batch = int(line.get_label())
            steps = line.get_xdata().astype(int)  # type: ignore[union-attr]
            expected = median.loc[(float(lr), batch, tap)].reindex(steps).to_numpy()
            np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)  # type: ignore[arg-type]
            checked += 1
    assert checked == len(TAPS) * len(LRS) * len(BATCHES)
    # the band of one panel: fill_between's polygon runs along lo, then back along hi
    ax = next(a for a in written["figures"]["norms"].axes if a.get_title() == "relu1:output, optimizer.lr=0.01")
    band = ax.collections[0].get_paths()[0].vertices
    first = {round(float(x)): y for x, y in band[1 : STEPS + 1]}
    np.testing.assert_allclose(
        [first[s] for s in range(STEPS)], lo.loc[(0.01, 8, "relu1:output")].to_numpy(), rtol=1e-12
    )
    assert (hi.loc[(0.01, 8, "relu1:output")] > lo.loc[(0.01, 8, "relu1:output")]).all()  # seeds differ: a real band
    # the planted values, for one point: the median over 5 seeds is seed 2's (norms grow with the seed at step 0)
    np.testing.assert_allclose(median.loc[(0.1, 16, "head:output", 0)], planted_norm(3, 0, 0.1, 16, 2), rtol=1e-6)


def test_the_tables_are_those_of_load(sweep: Path, written: dict[str, Any]) -> None:
    df, steps = load(sweep), load(sweep, table="steps")
    found = tables(written["html"])
    taps = found["Per-tap summary"][0]
    per_run = df[df["has_grad"]].sort_values("step").groupby(["train.batch", "optimizer.lr", "tap", "seed"])["norm"]
    last = per_run.agg(lambda s: s.iloc[-1]).groupby(["train.batch", "optimizer.lr", "tap"]).median()  # NaN stays
    assert len(taps) == len(last) == len(TAPS) * len(LRS) * len(BATCHES)
    shown = taps.set_index(["train.batch", "optimizer.lr", "tap"])
    for (batch, lr, tap), value in last.items():
        assert math.isclose(float(shown.loc[(str(batch), f"{lr:.4g}", tap), "last (median)"]), value, rel_tol=5e-4)
    nan_runs = shown.xs("fc1:output", level="tap")["runs NaN/Inf"].astype(int)
    assert nan_runs.sum() == len(NAN_RUNS) and nan_runs.loc[("16", "0.001")] == 1

    runs = found["Runs"][0].set_index(["train.batch", "optimizer.lr"])
    final = steps[steps["step"] == STEPS - 1].groupby(["train.batch", "optimizer.lr"])["loss"]
    for (batch, lr), value in final.median().items():
        row = runs.loc[(str(batch), f"{lr:.4g}")]
        assert int(row["runs"]) == len(SEEDS)
        assert math.isclose(float(row["last loss (median)"]), value, rel_tol=5e-4)
        assert math.isclose(float(row["last loss (10%)"]), final.quantile(0.1).loc[(batch, lr)], rel_tol=5e-4)
    assert runs["runs with NaN/Inf taps"].astype(int).sum() == len(NAN_RUNS)


def test_the_findings_count_the_runs_instead_of_naming_each(written: dict[str, Any]) -> None:
    findings = written["html"].split('<h2 id="findings">')[1].split("<h2")[0]
    assert "(in 2 of 30 runs)" in findings and "fc1:output" in findings
    assert "seed=" not in findings  # no run named one by one


# --- bounded, whatever the size ----------------------------------------------------------------------


def test_a_small_sweep_keeps_a_panel_per_run_and_its_pngs_fit_a_page(tmp_path: Path) -> None:
    """At the threshold the report still draws a panel per run; 60 taps in each (a tall heatmap) still fit a page."""
    taps = [TapKey(f"layer{i}", "output", 0) for i in range(60)]
    for num in range(AGGREGATE_ABOVE):
        write_job(tmp_path / str(num), 0.1, 8, num, taps)
    text = write_report(tmp_path).read_text(encoding="utf-8")
    assert "runs aggregated" not in text
    assert f"seed={AGGREGATE_ABOVE - 1}" in text  # each run named (its panel title, its row)
    for png in sorted(tmp_path.glob("report-*.png")):
        width, height = png_size(png.read_bytes())
        assert width <= MAX_PX[0] and height <= MAX_PX[1], (png.name, width, height)


def test_a_large_sweep_over_seeds_only_draws_one_line_per_tap(tmp_path: Path) -> None:
    for num in range(AGGREGATE_ABOVE + 1):
        write_job(tmp_path / str(num), 0.1, 8, num)
    layout = sweep_layout(load(tmp_path))
    assert (layout.hue, layout.facet, layout.over) == (None, None, ("seed",))
    text = write_report(tmp_path).read_text(encoding="utf-8")
    assert f"{AGGREGATE_ABOVE + 1} runs aggregated over seed: median and 10%-90% band." in text


def test_a_panel_whose_gradients_are_all_zero_is_drawn_empty_not_a_traceback(tmp_path: Path) -> None:
    """optimizer.lr=0 plants gradient 0 in every run of its column of panels: a log axis with no positive value made
    savefig raise (found 2026-11-27 with an edit-strength sweep, edits.0.scale=0); it stays empty, linear, and the
    other columns keep their log scale."""
    figures: dict[str, Figure] = {}
    original = report_module.figure_section

    def keep(out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str:
        figures[name] = fig
        return original(out_dir, name, title, fig, note)

    for num, (lr, batch, seed) in enumerate((lr, b, s) for lr in (0.0, 0.1, 0.01) for b in BATCHES for s in range(2)):
        write_job(tmp_path / str(num), lr, batch, seed)
    assert (sweep_layout(load(tmp_path)).hue, sweep_layout(load(tmp_path)).facet) == ("train.batch", "optimizer.lr")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_module, "figure_section", keep)
        write_report(tmp_path)
    for name in ("norms", "grad_flow"):
        axes = [ax for ax in figures[name].axes if ax.get_title()]
        zero = [ax for ax in axes if ax.get_title().endswith("optimizer.lr=0.0")]
        assert zero and all(ax.get_yscale() == "linear" for ax in zero), name
        assert all(ax.get_yscale() == "log" for ax in axes if ax not in zero), name
