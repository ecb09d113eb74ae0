"""gradrunner.report.plots and gradrunner.report.write: figures checked through matplotlib's objects, the page
through its HTML (and headless Chromium where installed). The commands (`python -m gradrunner.report`,
`python -m gradrunner -m ...`) run inside the test's process (`conftest.python_m`), except two real
subprocesses: the report command's end-to-end smoke, and the report without matplotlib (an import-time case)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import check_ok, gradrunner_in_process, python_m
from planted import STRATEGIES, planted_sweep, write_planted_job

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")

from matplotlib.image import AxesImage

from gradrunner.analysis import compare_strategies, forward_order, load, strategy_costs
from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import TapKey
from gradrunner.records.writer import RecordWriter
from gradrunner.report.plots import (
    plot_grad_flow,
    plot_norms,
    plot_strategy_agreement,
    plot_strategy_cost,
    plot_value_distributions,
)
from gradrunner.report.write import REPORT_NAME, _summary_table, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    return planted_sweep(tmp_path / "sweep")


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The planted sweep and its report, written once (`write_report(sweep_dir)`) for the tests that only read it."""
    sweep = planted_sweep(tmp_path_factory.mktemp("report") / "sweep")
    return sweep, write_report(sweep)


def tick_labels(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


# --- figures ------------------------------------------------------------------------------------


def test_grad_flow_figure_one_panel_per_strategy_one_line_per_step(sweep_dir: Path) -> None:
    df = load(sweep_dir, values=True)
    fig = plot_grad_flow(df, steps=[0, 3])
    # a row per strategy; outputs and locals in one column, weights in the other: no line joins them
    assert [ax.get_title() for ax in fig.axes] == ["outputs, inputs and locals", "weights and biases"] + [""] * 4
    assert [ax.get_ylabel() for ax in fig.axes[::2]] == [f"strategy={s}\nnorm" for s in STRATEGIES]
    for ax, taps in zip(fig.axes, [6, 1] * 3, strict=True):
        assert ax.get_yscale() == "log"
        assert [line.get_label() for line in ax.get_lines()] == ["step 0", "step 3"]
        assert list(ax.get_lines()[0].get_xdata()) == list(range(taps))
    labels = forward_order(df).label.tolist()
    assert tick_labels(fig.axes[-2]) + tick_labels(fig.axes[-1]) == [x for x in labels if x != "fc2:weight"] + ["fc2:weight"]
    fc1_step3 = fig.axes[0].get_lines()[1].get_ydata()[0]
    assert fc1_step3 == pytest.approx(1e-10)


def test_grad_flow_marks_zero_gradients_on_the_bottom_edge(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook")
    df = load(tmp_path)
    df.loc[(df.tap == "fc2:output") & (df.step == 1), "norm"] = 0.0
    ax, weights = plot_grad_flow(df, steps=[1]).axes
    assert ax.get_title() == "outputs, inputs and locals"  # the run is named in the figure title (no overlap)
    line, zeros = ax.get_lines()
    assert zeros.get_label() == "exactly 0" and list(zeros.get_xdata()) == [2] and list(zeros.get_ydata()) == [0.03]
    legend = weights.get_legend()  # the last column's, outside the axes: it covers no point
    assert [t.get_text() for t in legend.get_texts()] == ["step 1"] and legend.get_bbox_to_anchor().x0 > 0


def test_norms_figure_draws_a_line_per_tap(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook")
    df = load(tmp_path)
    fig = plot_norms(df)
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == forward_order(df).label.tolist()
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "step"
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.1, 1e-4, 1e-7, 1e-10])


def write_many_taps(job_dir: Path, taps: int, steps: int = 3) -> None:
    consts = dict(run_id="many", experiment="wide", strategy="hook", device="cpu", dtype="float32")
    with RecordWriter(job_dir, constants=consts, metadata={}) as w:
        for step in range(steps):
            col = Collector()
            for i in range(taps):
                col.add(TapKey(f"layer{i}", "output", 0), torch.full((3,), 10.0**-i))
            w.write_step(step, col.finish())


def test_norms_figure_is_a_heatmap_above_twelve_taps(tmp_path: Path) -> None:
    write_many_taps(tmp_path / "few", 12)
    write_many_taps(tmp_path / "many", 13)
    assert not plot_norms(load(tmp_path / "few")).axes[0].get_images()
    fig = plot_norms(load(tmp_path / "many"))
    (image,) = fig.axes[0].get_images()
    assert isinstance(image, AxesImage) and image.get_array().shape == (13, 3)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [f"layer{i}:output" for i in range(13)]
    assert image.get_array()[5, 0] == pytest.approx(-5 + 0.5 * 0.47712, abs=1e-3)  # log10(1e-5 * sqrt(3))
    assert fig.axes[1].get_ylabel().startswith("log10 norm")  # the colorbar


def test_heatmap_marks_zero_nan_and_missing_gradients(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook")
    df = load(tmp_path)
    df.loc[(df.tap == "fc2:output") & (df.step == 1), "norm"] = 0.0
    image = plot_norms(df, heatmap=True).axes[0].get_images()[0]
    cells, (lo, hi) = image.get_array(), image.get_clim()
    labels = forward_order(df).label.tolist()
    assert cells[labels.index("fc2:output"), 1] < lo  # exactly 0: below the colour scale (black)
    assert cells[labels.index("head:output"), 2] > hi  # NaN: above it (red)
    assert cells.mask[labels.index("unused:output")].all()  # no gradient: blank
    assert lo == pytest.approx(-10) and hi == pytest.approx(4)  # 1e-10 (fc1, step 3) .. 1e4 (fc2:weight)


def test_agreement_figure_labels_exact_agreement_and_the_planted_difference(sweep_dir: Path) -> None:
    fig = plot_strategy_agreement(compare_strategies(load(sweep_dir, values=True)))
    by_stat, by_tap = fig.axes
    assert tick_labels(by_stat) == ["norm", "mean", "std", "min", "max", "abs_max", "zero_frac", "values"]
    stat_texts = [t.get_text() for t in by_stat.texts]
    assert stat_texts[6] == "0" and stat_texts[0] == "1.0e-03"
    tap_texts = dict(zip(tick_labels(by_tap), [t.get_text() for t in by_tap.texts], strict=True))
    assert tap_texts == {label: "1.0e-03" if label == "fc2:output" else "0" for label in tap_texts}
    assert by_stat.get_yscale() == "log"


def test_cost_figure_shows_time_and_memory_per_strategy(sweep_dir: Path) -> None:
    fig = plot_strategy_cost(strategy_costs(load(sweep_dir, table="steps")))
    time_ax, memory_ax = fig.axes
    assert tick_labels(time_ax) == list(STRATEGIES)
    step_bars = time_ax.containers[0]
    assert [b.get_height() for b in step_bars] == pytest.approx([10.0, 20.0, 30.0])  # ms
    assert [b.get_height() for b in memory_ax.containers[0]] == pytest.approx([100.0, 200.0, 300.0])  # MiB
    assert memory_ax.get_ylabel() == "peak memory (MiB)" and time_ax.get_ylabel() == "time (ms)"


def test_value_distributions_panel_per_tap_line_per_step(sweep_dir: Path) -> None:
    df = load(sweep_dir, values=True)
    fig = plot_value_distributions(df, steps=[0, 1])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == forward_order(df).label.tolist()
    assert len(visible[0].patches) == 2  # one step histogram per step
    assert fig.get_suptitle() == "Gradient values (strategy=retain_grad)"


def test_value_distributions_say_when_taps_are_left_out(sweep_dir: Path) -> None:
    df = load(sweep_dir / "0", values=True)
    fig = plot_value_distributions(df, max_taps=3)
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == forward_order(df).label.tolist()[:3]
    assert fig.get_suptitle() == "Gradient values (planted · retain_grad; the first 3 of 7 taps (max_taps=))"


def test_value_distributions_need_values(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    with pytest.raises(GradrunnerError, match="needs captured values"):
        plot_value_distributions(load(tmp_path))


# --- the page -----------------------------------------------------------------------------------


class PageParts(HTMLParser):
    """The parts of a page the tests look at: images, tables, headings, every outside reference."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[bytes] = []
        self.tables = 0
        self.headings: list[str] = []
        self.outside: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            src = a.get("src") or ""
            assert src.startswith("data:image/png;base64,"), src[:40]
            self.images.append(base64.b64decode(src.split(",", 1)[1]))
        self.tables += tag == "table"
        self._in_h2 = tag == "h2"
        for key in ("src", "href"):
            value = a.get(key) or ""
            if value and not value.startswith(("data:", "#")):
                self.outside.append(value)

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.headings.append(data)
            self._in_h2 = False


def parse(page: Path) -> PageParts:
    parts = PageParts()
    parts.feed(page.read_text(encoding="utf-8"))
    return parts


@pytest.mark.slow
def test_report_of_a_sweep_embeds_every_figure_and_table(sweep_report: tuple[Path, Path]) -> None:
    sweep_dir, page = sweep_report
    assert page == sweep_dir / REPORT_NAME
    parts = parse(page)
    assert parts.headings == [
        "Findings", "Loss over the steps", "Runs", "Per-tap summary", "Gradient flow", "Gradient norm over the steps",
        "Do the strategies agree?", "Strategy agreement", "What each strategy costs", "Strategy cost",
        "Gradient values",
    ]  # fmt: skip
    assert parts.tables == 4 and parts.outside == []
    pngs = sorted(sweep_dir.glob("report-*.png"))
    assert [p.name for p in pngs] == [
        f"report-{n}.png" for n in ["agreement", "cost", "grad_flow", "loss", "norms", "values"]
    ]
    assert all(img.startswith(PNG_SIGNATURE) for img in parts.images)
    assert sorted(parts.images) == sorted(p.read_bytes() for p in pngs)


def test_report_findings_name_the_planted_problems(sweep_report: tuple[Path, Path]) -> None:
    text = sweep_report[1].read_text()
    # a headline, then the taps grouped by kind; the same in every strategy, so no strategy named
    assert ('<p class="headline"><b>1 tap NaN or Inf</b> (from step 2) · <b>1 tap vanishing</b> (from step 2) · '
            "<b>1 tap exploding</b> (from step 3).</p>") in text  # fmt: skip
    assert "<h3>NaN or Inf</h3>\n<ul class=\"findings\">\n<li>from step 2: <code>head:output</code></li>" in text
    assert "<li>norm below 1e-06 at the last step; since step 2: <code>fc1:output</code></li>" in text
    assert "<li>norm above 1000 from step 3: <code>fc2:weight</code></li>" in text
    assert text.count("<li>") == 3 and "they differ" in text
    # one summary table, strategies side by side; the planted disagreement (fc2:output in hook) marked
    assert text.count("<th>last (retain_grad)</th>") == 1 and text.count('<td class="bad">differ</td>') == 1
    row = text[text.index("<td>fc2:output</td>") :].split("</tr>")[0]
    assert '<td class="bad">differ</td>' in row


def test_report_shows_the_true_last_loss_and_one_table_when_the_strategies_agree(tmp_path: Path) -> None:
    # the planted disagreement is in `hook` only: these two strategies agree on every record
    for i, strategy in enumerate(["retain_grad", "autograd_grad"]):
        write_planted_job(tmp_path / str(i), strategy, "none", [f"capture.strategy={strategy}"])
    steps = tmp_path / "0" / "steps.parquet"
    table = pq.read_table(steps)
    losses = table["loss"].to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("loss"), "loss",
                                    pa.array([*losses[:-1], float("nan")])), steps)  # fmt: skip
    text = write_report(tmp_path).read_text()
    runs = text[text.index('id="runs"') : text.index('id="per-tap-summary"')]
    assert runs.count("<td>NaN</td>") == 1 and runs.count(f"<td>{losses[-1]:.6g}</td>") == 1  # job 0: NaN
    summary = text[text.index('id="per-tap-summary"') : text.index('id="gradient-flow"')]
    assert "Identical for the strategies retain_grad, autograd_grad." in summary
    assert summary.count("<td>fc1:output</td>") == 1 and "differ" not in summary and "<th>strategy</th>" not in summary


def test_report_of_one_run_has_no_strategy_sections(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    parts = parse(write_report(tmp_path / "grads.parquet"))  # a file: the report goes next to it
    assert parts.headings == ["Findings", "Loss over the steps", "Runs", "Per-tap summary", "Gradient flow",
                              "Gradient norm over the steps"]  # fmt: skip
    assert len(parts.images) == 3 and (tmp_path / REPORT_NAME).is_file()


def run_report(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}import runpy, sys; sys.argv = ['gradrunner.report', *{list(args)!r}]; " \
           "runpy.run_module('gradrunner.report', run_name='__main__')"  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_command_prints_the_page_path(sweep_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "gradrunner.report", str(sweep_dir)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip  # the end-to-end smoke
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sweep_dir / REPORT_NAME)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_command_bad_path_is_one_paragraph_and_status_2(tmp_path: Path, make: str) -> None:
    path = tmp_path / "nope" if make == "missing" else tmp_path
    out = python_m(tmp_path, "gradrunner.report", str(path))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("gradrunner.report: error: ") and out.stderr.count("\n") == 1
    assert str(path) in out.stderr and "Traceback" not in out.stderr


def test_command_without_matplotlib_says_how_to_install_it(sweep_dir: Path) -> None:
    out = run_report(str(sweep_dir), prelude="import sys; sys.modules['matplotlib'] = None; ")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pip install 'gradrunner[report]'" in out.stderr
    assert not (sweep_dir / REPORT_NAME).exists()


# --- headless Chromium --------------------------------------------------------------------------


def chromium_problems(page: Path, timeout: float = 60.0) -> list[str]:
    """Load `page` in headless Chromium, driven over the DevTools pipe; return what went wrong.

    Collects console errors and warnings, uncaught exceptions, failed loads (`Log.entryAdded`) and
    images that did not decode: `--enable-logging` alone shows console messages but not the last two.
    """
    to_chrome, from_chrome = os.pipe(), os.pipe()
    # Chromium reads commands on fd 3 and writes answers on fd 4: move both ends out of the way first.
    ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_chrome[0], from_chrome[1])]
    os.close(to_chrome[0])
    os.close(from_chrome[1])

    def child_fds() -> None:
        os.dup2(ends[0], 3)
        os.dup2(ends[1], 4)

    with tempfile.TemporaryDirectory() as profile:
        chrome = subprocess.Popen(
            [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=child_fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for fd in ends:
            os.close(fd)
        try:
            events, broken = _drive(to_chrome[1], from_chrome[0], page, time.monotonic() + timeout)
        finally:
            os.close(to_chrome[1])
            os.close(from_chrome[0])
            try:
                chrome.wait(timeout=15)
            except subprocess.TimeoutExpired:
                chrome.kill()
                chrome.wait()
    return [f"image not decoded: {b}" for b in broken] + [p for e in events if (p := _problem(e))]


def _drive(out_fd: int, in_fd: int, page: Path, deadline: float) -> tuple[list[dict[str, Any]], list[str]]:
    events: list[dict[str, Any]] = []
    buffer = b""
    ids = iter(range(1, 1 << 30))

    def receive() -> dict[str, Any]:
        nonlocal buffer
        while b"\0" not in buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(in_fd, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            buffer += chunk
        raw, buffer = buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        if "method" in message:
            events.append(message)
        return message

    def send(method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        request_id = next(ids)
        message = {"id": request_id, "method": method, "params": params or {}}
        os.write(out_fd, json.dumps(message | ({"sessionId": session} if session else {})).encode() + b"\0")
        while (answer := receive()).get("id") != request_id:
            pass
        assert "error" not in answer, (method, answer["error"])
        return dict(answer.get("result", {}))

    target = send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page"):
        send(f"{domain}.enable", session=session)
    send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
    while not any(e["method"] == "Page.loadEventFired" for e in events):
        receive()
    check = "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt)"
    broken = send("Runtime.evaluate", {"expression": check, "returnByValue": True}, session=session)
    send("Browser.close")
    return events, list(broken["result"]["value"])


def _problem(event: dict[str, Any]) -> str | None:
    method, p = event["method"], event.get("params", {})
    if method == "Runtime.exceptionThrown":
        return f"exception: {p['exceptionDetails'].get('text')}"
    if method == "Runtime.consoleAPICalled" and p["type"] in ("error", "warning", "assert"):
        return f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}"
    if method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
        return f"log {p['entry']['level']}: {p['entry']['text']} {p['entry'].get('url', '')}"
    return None


#: Set by `.ci/run`, which installs Chromium in the background while the tests run: a file that appears once
#: that install has ended, however it ended.
CHROMIUM_PENDING = "GRADRUNNER_CI_CHROMIUM_DONE"


def chromium() -> str | None:
    """Chromium's path, or None; where `.ci/run` is still installing it, once that install has ended (at most the
    install's own time-outs)."""
    pending = os.environ.get(CHROMIUM_PENDING)
    if shutil.which("chromium") is None and pending:
        deadline = time.monotonic() + 420  # .ci/run gives apt-get update and install 180 s each
        while not Path(pending).exists() and time.monotonic() < deadline:
            time.sleep(0.5)  # waiting for the installer's marker, not for time to pass
    return shutil.which("chromium")


@pytest.fixture
def needs_chromium() -> None:
    if chromium() is None:
        pytest.skip("chromium not installed (Debian: apt-get install chromium)")


@pytest.mark.usefixtures("needs_chromium")
def test_chromium_check_catches_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text('<img alt="broken" src="data:image/png;base64,AAAA"><img alt="gone" src="gone.png">'
                   '<script>console.error("boom"); nope();</script>')  # fmt: skip
    problems = chromium_problems(bad)
    assert {p.split(":")[0] for p in problems} == {"image not decoded", "log error", "console.error", "exception"}


@pytest.mark.slow
@pytest.mark.usefixtures("needs_chromium")
def test_page_renders_in_chromium_without_errors(sweep_report: tuple[Path, Path]) -> None:
    assert chromium_problems(sweep_report[1]) == []


# --- end to end: real sweeps --------------------------------------------------------------------



@pytest.mark.slow
@pytest.mark.parametrize(
    ("experiment", "extra"), [("mlp", []), ("transformer", ["capture.values=sample", "capture.sample_size=8"])]
)
def test_report_on_a_real_three_strategy_sweep(tmp_path: Path, experiment: str, extra: list[str]) -> None:
    sweep = tmp_path / "sweep"
    run = gradrunner_in_process(tmp_path, "-m", f"+experiment={experiment}", "steps=3",
                                "capture.strategy=retain_grad,hook,autograd_grad", f"hydra.sweep.dir={sweep}", *extra)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = python_m(tmp_path, "gradrunner.report", str(sweep))
    assert out.returncode == 0, out.stderr
    page = Path(out.stdout.strip())
    assert page == sweep / REPORT_NAME
    parts = parse(page)
    updates = experiment == "mlp"  # it taps *:weight: the update-ratio panel and its table (issue 15)
    assert parts.tables == 4 + updates and parts.outside == [] and len(parts.images) == 4 + bool(extra) + updates
    assert ("update_ratio" in page.read_text()) == updates
    assert all(img.startswith(PNG_SIGNATURE) for img in parts.images)
    assert "identical records" in page.read_text()  # the contract: all three give the same gradients
    df = load(sweep)
    flow = plot_grad_flow(df)
    columns = 2 if experiment == "mlp" else 1  # mlp taps *:weight too: weights get their own column
    assert [ax.get_ylabel() for ax in flow.axes[::columns]] == [f"strategy={s}\nnorm" for s in STRATEGIES]
    assert [line.get_label() for line in flow.axes[0].get_lines()] == ["step 0", "step 1", "step 2"]
    ticks = [label for ax in flow.axes[-columns:] for label in tick_labels(ax)]
    assert sorted(ticks) == sorted(forward_order(df).label)
    if chromium():
        assert chromium_problems(page) == []


@pytest.mark.slow
def test_report_and_every_helper_on_a_sweep_over_steps(tmp_path: Path) -> None:
    """`-m +experiment=mlp steps=5,10` then the report: the swept `steps` never clashes with a column."""
    from gradrunner.analysis import grad_flow, tap_summary

    sweep = tmp_path / "sweep"
    check_ok(gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "steps=5,10", f"hydra.sweep.dir={sweep}"))
    out = python_m(tmp_path, "gradrunner.report", str(sweep))
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == sweep / REPORT_NAME
    df = load(sweep)
    assert df.groupby("job")["override.steps"].first().tolist() == [5, 10]
    assert df.groupby("job").step.max().tolist() == [4, 9]
    summary = tap_summary(df)
    assert summary.groupby("override.steps")["steps"].max().to_dict() == {5: 5, 10: 10}
    assert set(grad_flow(df)["override.steps"]) == {5, 10}
    assert len(strategy_costs(load(sweep, table="steps"))) == 2


def test_the_strategy_table_tells_an_infinity_from_a_finite_norm() -> None:
    # per tap: the two strategies' `max` (the rest equal); numpy's isclose at 1e-6 is the reference
    maxes = {"fc1:weight": (np.inf, 2.4e30), "fc2:weight": (np.inf, -np.inf), "fc3:weight": (np.inf, np.inf),
             "head:weight": (1.0, 1.0 + 1e-9)}  # fmt: skip
    rows = [{"strategy": s, "tap": tap, "call": 0, "steps": 3, "first": 1.0, "last": 1.0, "max": m[i],
             "first_nonfinite_step": np.nan, "first_vanishing_step": np.nan, "first_exploding_step": np.nan}
            for tap, m in maxes.items() for i, s in enumerate(["hook", "retain_grad"])]  # fmt: skip
    html = _summary_table(pd.DataFrame(rows))
    for tap, (a, b) in maxes.items():
        (row,) = [r for r in html.split("<tr>") if f"<td>{tap}</td>" in r]
        differs = not np.isclose(a, b, rtol=1e-6, atol=0.0)
        assert ('<td class="bad">differ</td>' in row) is differs, (tap, row)
    assert differs is False and html.count('<td class="bad">differ</td>') == 2
