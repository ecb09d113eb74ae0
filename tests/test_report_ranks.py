"""The report and the analysis helpers of a DDP run (a row per rank and step): every number checked against
pandas on the run's own Parquet files. One torchrun (2 gloo ranks, 3 steps) per module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import check_ok
from rank_launch import gradrunner_torchrun
from report_tables import tables_after

from gradrunner.analysis import grad_flow, histograms_over_steps, load, noise_scale, tap_summary, update_ratios

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

pytestmark = pytest.mark.slow  # one torchrun of 3 steps, about 10 s


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`torchrun --nproc_per_node=2 -m gradrunner +experiment=mlp steps=3` with per-example norms,
    histograms and full values."""
    cwd = tmp_path_factory.mktemp("ddp_report")
    check_ok(gradrunner_torchrun(cwd, "+experiment=mlp", "steps=3", "device=cpu", "capture.per_example=true",
                                 "capture.histogram=true", "capture.values=full", "hydra.run.dir=run"))  # fmt: skip
    return cwd / "run"


@pytest.fixture(scope="module")
def page(run: Path) -> str:
    from gradrunner.report import write_report

    return write_report(run).read_text(encoding="utf-8")


def _parquet(run: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    grads = pd.read_parquet(run / "grads.parquet")
    steps = pd.read_parquet(run / "steps.parquet")
    assert sorted(grads["rank"].unique()) == [0, 1] and sorted(steps["rank"].unique()) == [0, 1]
    return grads, steps


def test_the_runs_section_and_the_answer_count_steps_once_and_say_rank_0s_loss(run: Path, page: str) -> None:
    _, steps = _parquet(run)
    rank0 = steps[steps["rank"] == 0].sort_values("step")
    runs = tables_after(page, "Runs")
    assert runs["steps run"].tolist() == [3]
    assert runs["captured steps"].tolist() == [3]
    assert float(runs["last loss"].iloc[0]) == pytest.approx(rank0["loss"].iloc[-1], rel=1e-5)
    answer = page.split('<p class="answer">', 1)[1].split("</p>", 1)[0]
    first, last = rank0["loss"].iloc[0], rank0["loss"].iloc[-1]
    assert f"loss {first:.4g} → {last:.4g} over 3 steps" in answer.lower()


def test_the_per_tap_summary_has_a_row_per_tap_and_rank_with_that_ranks_steps(run: Path, page: str) -> None:
    grads, _ = _parquet(run)
    table = tables_after(page, "Per-tap summary")
    assert len(table) == grads[["tap", "rank"]].drop_duplicates().shape[0] == 22
    for (tap, rank), rows in grads.sort_values("step").groupby(["tap", "rank"]):
        shown = table[(table["tap"] == tap) & (table["rank"] == rank)]
        assert len(shown) == 1, (tap, rank)
        assert shown["steps"].iloc[0] == 3
        assert shown["first"].iloc[0] == pytest.approx(rows["norm"].iloc[0], rel=1e-3)
        assert shown["last"].iloc[0] == pytest.approx(rows["norm"].iloc[-1], rel=1e-3)
        assert shown["max"].iloc[0] == pytest.approx(rows["norm"].max(), rel=1e-3)
    summary = tap_summary(load(run))  # the helper itself: first and last of one rank each
    for (tap, rank), rows in grads.sort_values("step").groupby(["tap", "rank"]):
        row = summary[(summary["tap"] == tap) & (summary["rank"] == rank)].iloc[0]
        assert (row["steps"], row["first"], row["last"]) == (3, rows["norm"].iloc[0], rows["norm"].iloc[-1])


def test_the_update_ratio_table_names_each_rows_rank(run: Path, page: str) -> None:
    grads, _ = _parquet(run)
    table = tables_after(page, "Update-to-weight ratio")
    last = grads[grads["update_ratio"].notna() & (grads["step"] == grads["step"].max())]
    assert len(table) == len(last) == 8
    for r in last.itertuples():
        shown = table[(table["tap"] == r.tap) & (table["rank"] == r.rank)]
        assert len(shown) == 1 and shown["update_ratio"].iloc[0] == pytest.approx(r.update_ratio, rel=1e-3)
    ratios = update_ratios(load(run))
    assert "rank" in ratios.columns and len(ratios) == grads["update_ratio"].notna().sum()


def test_the_histogram_table_has_every_rank_at_the_last_step(run: Path, page: str) -> None:
    grads, _ = _parquet(run)
    table = tables_after(page, "Gradient histograms over steps")
    last = grads[grads["step"] == grads["step"].max()]
    assert len(table) == len(last) == 22
    for r in last.itertuples():
        counts = np.asarray(r.hist_counts)
        shown = table[(table["tap"] == r.tap) & (table["rank"] == r.rank)]
        assert len(shown) == 1
        assert shown["zero share"].iloc[0] == pytest.approx(counts[0] / counts.sum(), rel=1e-3, abs=1e-9)
    df = load(run, columns=["run_id", "step", "tap", "call", "rank", "hist_counts"])
    for rank in (0, 1):
        h = histograms_over_steps(df, "fc1:output", rank=rank)
        expected = grads[(grads["tap"] == "fc1:output") & (grads["rank"] == rank)].sort_values("step")
        assert h.index.tolist() == [0, 1, 2]
        assert (h.to_numpy() == np.stack(expected["hist_counts"].to_numpy())).all()


def test_the_noise_scale_section_is_there_with_both_ranks_rows(run: Path, page: str) -> None:
    grads, _ = _parquet(run)
    table = tables_after(page, "Gradient noise scale")
    step = grads["step"].max()
    params = grads[grads["update_norm"].notna() & (grads["step"] == step)]
    for tap, rows in params.groupby("tap"):
        sq = np.concatenate([np.square(np.asarray(v)) for v in rows.sort_values("rank")["per_example_norm"]])
        b, s = sq.size, sq.sum()
        n = float(rows.loc[rows["rank"] == 0, "norm"].iloc[0]) ** 2
        g2, trace = (b * n - b * s) / (b - 1), (b * s - n) / (1 - 1 / b)
        shown = table[table["tap"] == tap]
        assert len(shown) == 1 and b == 2 * len(rows["per_example_norm"].iloc[0])
        assert shown["b_simple"].iloc[0] == pytest.approx(trace / g2, rel=1e-3)
    assert len(noise_scale(load(run))) > 0


def test_grad_flow_and_drawn_values_keep_the_ranks_apart(run: Path) -> None:
    from gradrunner.report.records import drawn_values

    grads, _ = _parquet(run)
    flow = grad_flow(load(run), steps=[2])
    assert len(flow) == 22 and sorted(flow["rank"].unique()) == [0, 1]
    values = drawn_values(run, load(run))
    assert values is not None
    assert not values.duplicated(["step", "tap", "call", "rank"]).any()
    merged = values.merge(grads[["step", "tap", "call", "rank", "values"]], on=["step", "tap", "call", "rank"])
    assert len(merged) == len(values) == 2 * 22
    assert all(np.array_equal(a, b) for a, b in zip(merged["values_x"], merged["values_y"], strict=True))


def test_the_last_word_counts_each_tap_once_over_its_ranks(run: Path) -> None:
    from gradrunner.analysis.health import health

    grads, steps = _parquet(run)
    h = health(run)
    assert h.taps == grads[["tap", "call"]].drop_duplicates().shape[0] == 11
    assert h.steps == 3 and h.loss_last == pytest.approx(steps.loc[(steps["rank"] == 0) & (steps["step"] == 2), "loss"].iloc[0])


def test_compare_counts_a_loss_per_step_and_rank(run: Path) -> None:
    from gradrunner.analysis.compare import compare_runs

    _, steps = _parquet(run)
    said = compare_runs(run, run).summary()
    pairs, distinct = len(steps[["step", "rank"]].drop_duplicates()), steps["step"].nunique()
    assert f"and {pairs} (step, rank) losses ({distinct} steps on 2 ranks) within" in said, said
