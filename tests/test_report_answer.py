"""What a reader of the report sees first: the answer paragraph, for one run, a strategies sweep and a steps sweep.

References: the planted records' documented properties (tests/planted.py), the steps tables read with pandas,
and for the real runs the records themselves compared with plain pandas.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from conftest import compose_cfg
from planted import planted_sweep, write_planted_job

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

from gradrunner.analysis import load
from gradrunner.report.plots import plot_grad_flow, short_labels
from gradrunner.report.write import write_report
from gradrunner.run.loop import train


def first_paragraph(page: Path) -> str:
    """The text of the page's first paragraph (the answer), lines joined by " | "."""
    text = page.read_text()
    body = text[text.index("</h1>") :]
    p = re.search(r"<p[^>]*>(.*?)</p>", body, re.S)
    assert p is not None and 'class="answer"' in body[: p.end()]
    return html.unescape(p.group(1).replace("<br>", " | "))


def losses(job: Path) -> tuple[float, float, int]:
    steps = pd.read_parquet(job / "steps.parquet").sort_values("step")
    return float(steps.loss.iloc[0]), float(steps.loss.iloc[-1]), len(steps)


def test_one_run_leads_with_its_loss_and_where_the_flow_stops(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    first, last, n = losses(tmp_path)
    # planted: fc1:output vanishes from step 2 (the first activation tap, so the flow stops below :h),
    # head:output NaN from step 2, fc2:weight explodes at step 3, unused:output never gets a gradient
    assert first_paragraph(write_report(tmp_path)) == (
        f"Loss {first:.4g} → {last:.4g} over {n} steps; NaN/Inf from step 2 (first in head:output); "
        "gradients vanish below :h from step 2; 1 of 7 taps exploding from step 3; 1 tap never had a gradient."
    )


@pytest.mark.slow
def test_a_strategies_sweep_that_disagrees_leads_with_the_largest_difference(tmp_path: Path) -> None:
    sweep = planted_sweep(tmp_path, values="none")
    answer = first_paragraph(write_report(sweep))
    # planted: hook's fc2:output at step 1 is scaled by 1 + 1e-3: its statistics differ by 1e-3 / (1 + 1e-3)
    assert re.match(rf"The 3 strategies differ: largest relative difference {1e-3 / (1 + 1e-3):.3g}, "
                    r"in \w+ of fc2:output at step 1\. \| Loss ", answer), answer  # fmt: skip


@pytest.fixture(scope="module")
def real_sweeps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A strategies sweep and a steps sweep of the MLP, laid out as Hydra multiruns (job dirs with overrides)."""
    root = tmp_path_factory.mktemp("sweeps")
    jobs = {"strategies": [f"capture.strategy={s}" for s in ("retain_grad", "hook", "autograd_grad")],
            "steps": ["steps=2", "steps=7"]}  # fmt: skip
    for kind, overrides in jobs.items():
        for i, o in enumerate(overrides):
            job = root / kind / str(i)
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "overrides.yaml").write_text(f"- +experiment=mlp\n- {o}\n")
            with pytest.MonkeyPatch.context() as mp:  # the records keep the job's overrides, as under Hydra
                mp.setattr("gradrunner.run.hydra_adapter.task_overrides", lambda o=o: ["+experiment=mlp", o])
                train(compose_cfg("+experiment=mlp", "steps=4", o), out_dir=job)
    return {kind: root / kind for kind in jobs}


@pytest.mark.slow
def test_a_strategies_sweep_that_agrees_says_so_first_and_draws_the_flow_once(real_sweeps: dict[str, Path]) -> None:
    sweep = real_sweeps["strategies"]
    df = load(sweep)
    wide = df.pivot_table(index=["step", "tap", "call"], columns="strategy", values="norm")
    assert (wide.max(axis=1) == wide.min(axis=1)).all()  # plain pandas: the three agree exactly
    first, last, n = losses(sweep / "0")
    page = write_report(sweep)
    assert first_paragraph(page) == (
        f"All 3 strategies agree (largest relative difference 0). | Loss {first:.4g} → {last:.4g} over {n} steps; "
        "no NaN/Inf, no vanishing or exploding gradient."
    )
    text = page.read_text()
    assert "Identical for the strategies retain_grad, hook, autograd_grad: shown once (retain_grad)." in text
    assert "Strategy agreement" not in text and "peak memory (MiB)" in text


@pytest.mark.slow
def test_a_steps_sweep_names_each_job_and_picks_flow_steps_per_job(real_sweeps: dict[str, Path]) -> None:
    sweep = real_sweeps["steps"]
    lines = first_paragraph(write_report(sweep)).split(" | ")
    for job, line in zip(("0", "1"), lines, strict=True):
        first, last, n = losses(sweep / job)
        assert line.startswith(f"override.steps={n}: Loss {first:.4g} → {last:.4g} over {n} steps")
    df = load(sweep)
    fig = plot_grad_flow(df, steps={r: sorted(rows.step.unique()) for r, rows in df.groupby("run_id")})
    per_row = [sorted({ln.get_label() for ln in ax.get_lines()}) for ax in fig.axes[::2]]
    assert per_row == [["step 0", "step 1"], [f"step {s}" for s in range(7)]]


def test_long_tap_names_lose_their_common_prefix() -> None:
    names = [f"model.layers.{i}.mlp:output" for i in range(24)]
    short, prefix = short_labels(names)
    assert prefix == "model.layers." and short[0] == "0.mlp:output" and short[23] == "23.mlp:output"
    assert short_labels(["fc1:output", "fc2:output"]) == (["fc1:output", "fc2:output"], "")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (Debian: apt-get install chromium)")
def test_a_screenshot_of_the_page_shows_the_answer_on_top(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    page = write_report(tmp_path)
    shot = tmp_path / "report.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1280,900", page.as_uri()], capture_output=True, timeout=120, check=True)  # fmt: skip
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[:2] == (900, 1280)
    assert (pixels[:300, :, :3] < 0.5).any()  # text (dark pixels) in the top third: the title and the answer


def test_a_24_layer_flow_labels_taps_without_their_common_prefix() -> None:
    taps = [f"model.layers.{i}.mlp:output" for i in range(24)]
    df = pd.DataFrame([{"run_id": "r", "experiment": "llama", "strategy": "hook", "step": s, "tap": t, "call": 0,
                        "norm": 1.0 + i, "has_grad": True} for s in (0, 1) for i, t in enumerate(taps)])  # fmt: skip
    (ax,) = plot_grad_flow(df, steps=[0, 1]).axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{i}.mlp:output" for i in range(24)]
    assert ax.get_xlabel() == "tap, in forward order (after 'model.layers.')"


def test_the_loss_figure_adds_a_grad_norm_panel_when_the_steps_table_has_it() -> None:
    from gradrunner.report.plots import plot_loss

    steps = pd.DataFrame({"run_id": "r", "step": range(4), "loss": [2.0, 1.0, float("nan"), float("nan")]})
    (ax,) = plot_loss(steps).axes
    assert ax.get_ylabel() == "loss" and ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss", "loss NaN/Inf from step 2"]
    with_norm = plot_loss(steps.assign(grad_norm=[3.0, 2.0, 1.0, 0.5])).axes
    assert [a.get_ylabel() for a in with_norm] == ["loss", "grad norm"]
    assert list(with_norm[1].get_lines()[0].get_ydata()) == [3.0, 2.0, 1.0, 0.5]
