"""The report's figures say each thing once and legibly (issue 36 items 7, 19).

- no two titles of the gradient-flow figure overlap, however long the run's name (gpt2_pretrain's did);
- a sweep over capture strategies that agree draws the update ratios once, not once per strategy;
- under gradient accumulation the per-tap table counts steps (not micro-batches), and the norms over
  the steps have one point per step.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from conftest import compose_cfg

from gradrunner.analysis import load
from gradrunner.run.job import run

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from gradrunner.report import write as report_module  # noqa: E402
from gradrunner.report.plots import plot_grad_flow  # noqa: E402
from gradrunner.report.write import write_report  # noqa: E402


def _titles_overlap(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of the figure's titles (its own and each panel's) whose drawn boxes intersect."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [t for t in [fig._suptitle, *(ax.title for ax in fig.axes)] if t is not None and t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, x), (b, y) in itertools.combinations(boxes, 2) if x.overlaps(y)]


def _figures(root: Path) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}
    original = report_module.figure_section

    def keep(out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str:
        figures[name] = fig
        return original(out_dir, name, title, fig, note)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_module, "figure_section", keep)
        write_report(root)
    return figures


def test_flow_titles_never_overlap_however_long_the_run_name(tmp_path: Path) -> None:
    cfg = compose_cfg("+experiment=mlp", "steps=2", "taps=[fc1:output,head:output,fc1:weight,head:weight]", "device=cpu")
    cfg.experiment = "a_pretty_long_experiment_name_like_gpt2_pretrain"  # a group too: set, not overridden
    run(cfg, out_dir=tmp_path)
    fig = plot_grad_flow(load(tmp_path))
    assert _titles_overlap(fig) == []
    assert fig._suptitle.get_text() == "Gradient flow (norm per tap): a_pretty_long_experiment_name_like_gpt2_pretrain · hook"
    assert [ax.get_title() for ax in fig.axes] == ["outputs, inputs and locals", "weights and biases"]


@pytest.fixture(scope="module")
def strategies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("strategies")
    for i, strategy in enumerate(("retain_grad", "hook", "autograd_grad")):
        cfg = compose_cfg("+experiment=mlp", "steps=3", f"capture.strategy={strategy}", "train.accumulate=2",
                          "taps=[fc1:output,fc1:weight,head:weight]", "device=cpu")  # fmt: skip
        run(cfg, out_dir=root / str(i))
    return {"root": root, "figures": _figures(root), "html": (root / "report.html").read_text()}


def test_update_ratios_of_agreeing_strategies_are_drawn_once(strategies: dict[str, Any]) -> None:
    fig = strategies["figures"]["update_ratios"]
    assert len(fig.axes) == 1  # not a panel per strategy: the strategies agree, as the page says
    assert "Identical for the strategies retain_grad, hook, autograd_grad" in strategies["html"]
    (ax,) = fig.axes
    assert sorted(line.get_label() for line in ax.get_lines()) == ["1e-3 guide", "fc1:weight", "head:weight"]


def test_accumulated_steps_count_once_in_the_report(strategies: dict[str, Any]) -> None:
    df = load(strategies["root"] / "0")
    assert (df[df.tap == "fc1:output"].groupby("step").size() == 2).all()  # two micro-batch records a step
    norms = strategies["figures"]["norms"]
    (ax,) = norms.axes[:1]
    (line,) = [x for x in ax.get_lines() if x.get_label() == "fc1:output"]
    assert list(line.get_xdata()) == [0, 1, 2]  # one point per step
    html = strategies["html"]
    summary = html[html.index("Per-tap summary") :]
    row = summary[summary.index("<td>fc1:output</td>") :].split("</tr>")[0]
    assert "<td>3</td>" in row and "<td>6</td>" not in row  # steps: 3, not 6
