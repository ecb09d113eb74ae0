"""The summary that ends every run: loss first/last, NaN/Inf, vanishing/exploding taps, taps never with a gradient.

Each claim is checked against a reference worked out here: the plant (a loss that turns NaN at a known
step, a ReLU dead from the start, traced with plain torch) or the records read with pandas.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from awkward import dead_relu_mlp
from conftest import compose_cfg
from planted import planted_sweep

from gradrunner.analysis import health
from gradrunner.data.sources import Synthetic
from gradrunner.errors import GradrunnerError
from gradrunner.run.loop import train

HEALTH = "gradrunner.analysis.health"
#: The run-time warnings (nothing captured, ...) come from here, the summary from `HEALTH`.
WATCH = "gradrunner.run.watch"


def summary_of(caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    """The level and lines of the one "run summary" message logged."""
    (record,) = [r for r in caplog.records if r.name == HEALTH and r.getMessage().startswith("run summary:")]
    head, *lines = record.getMessage().split("\n  ")
    assert head == "run summary:"
    return record.levelno, lines


def test_a_healthy_run_says_so_with_its_loss_and_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=6"), out_dir=tmp_path)
    level, lines = summary_of(caplog)
    loss = pd.read_parquet(tmp_path / "steps.parquet")["loss"].tolist()
    # the experiment's taps fc*:output, relu*:output, head:output, *:weight over the MLP's modules
    modules = [n for n, _ in dead_relu_mlp().named_modules() if n]
    taps = sum(fnmatch.fnmatchcase(m, p) for m in modules for p in ("fc*", "relu*", "head")) + sum(
        1 for m in modules if m.startswith(("fc", "head"))
    )
    assert taps == 11
    assert level == logging.INFO
    assert lines == [
        f"records: {tmp_path} (grads.parquet, steps.parquet; read the dir with gradrunner.analysis.load, "
        "a file with pandas.read_parquet)",
        f"loss: {loss[0]:.6g} at the first step, {loss[-1]:.6g} at the last (6 steps)",
        f"healthy: no NaN/Inf, no diverging loss; none of the {taps} taps vanishing, exploding or without gradient",
    ]


def test_a_run_that_turns_nan_names_the_step_and_the_first_tap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the loss is NaN from its 6th call (step 5) on; fc1 is the first module to fire in the forward pass
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=8", "loss=nan_after", "loss.after=5"), out_dir=tmp_path)
    level, lines = summary_of(caplog)
    first = pd.read_parquet(tmp_path / "steps.parquet")["loss"].iloc[0]
    assert level == logging.WARNING
    assert lines[1] == f"loss: {first:.6g} at the first step, nan at the last (8 steps)"
    assert lines[2] == "NaN/Inf: the loss from step 5; gradients from step 5, first in fc1:output"
    # then the spike detector's lines (issue 35); NaN norms are neither vanishing nor exploding
    assert [line.split(" (")[0] for line in lines[3:]] == ["loss NaN/Inf at step 5", "grad_norm NaN/Inf at step 5"]


def _dead_upstream() -> list[str]:
    """With plain torch: the taps of the experiment whose gradient is exactly 0 when relu2 is dead."""
    model = dead_relu_mlp()
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[name] = out

        return hook

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(keep(name))
    model(torch.randn(16, 8)).sub(torch.randn(16, 1)).pow(2).mean().backward()
    dead = [f"{n}:output" for n, t in outputs.items() if t.grad is not None and not t.grad.any()]
    dead += [f"{n}:weight" for n, m in model.named_modules() if hasattr(m, "weight") and not m.weight.grad.any()]
    return dead


def test_a_dead_relu_run_names_the_vanishing_taps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = _dead_upstream()
    assert dead == ["fc1:output", "relu1:output", "fc2:output", "fc1:weight", "fc2:weight", "fc3:weight"]
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=3", "model=dead_relu"), out_dir=tmp_path)
    level, lines = summary_of(caplog)
    assert level == logging.WARNING
    assert lines[2:] == [
        "vanishing (norm below 1e-06 at the last captured step): 6 of 11 taps: "
        + ", ".join(f"{t} (from step 0)" for t in dead)
    ]


def test_planted_records_list_every_kind_of_trouble(tmp_path: Path) -> None:
    # planted.py: fc1 vanishes from step 2, head NaN from step 2, fc2:weight explodes at step 3, unused never fires
    job = planted_sweep(tmp_path) / "0"
    h = health.health(job)
    assert (h.steps, h.taps) == (4, 7)
    assert h.first_nonfinite == (2, "head:output")
    assert h.vanishing == {"fc1:output": 2}
    assert h.exploding == {"fc2:weight": 3}
    assert list(h.without_grad) == ["unused:output"]
    assert not h.healthy
    lines = h.lines()
    assert "exploding (norm above 1000): 1 of 7 taps: fc2:weight (from step 3)" in lines
    assert lines[-1].startswith("never had a gradient: 1 of 7 taps: unused:output (")


@pytest.mark.parametrize(("overrides", "start"), [(["taps=[]"], "taps=[]: this run captures no gradient"),
                                                   (["steps=0"], "steps=0: this run takes no step")])  # fmt: skip
def test_a_run_that_captures_nothing_warns_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, overrides: list[str], start: str
) -> None:
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=2", *overrides), out_dir=tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.name in (WATCH, HEALTH) and r.levelno == logging.WARNING]
    assert warnings[0].startswith(start), warnings
    assert any("no tap was captured" in w or "no step completed" in w for w in warnings), warnings


def test_taps_left_empty_with_an_edit_does_not_say_the_records_stay_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`taps=[]` with `edits`: the edited tap gets rows (README "Edits"), so no warning says grads.parquet has none."""
    with caplog.at_level(logging.INFO):
        path = train(compose_cfg("+experiment=mlp", "steps=2", "taps=[]", 'edits=[{tap:"relu2:output",scale:0.5}]'),
                     out_dir=tmp_path)  # fmt: skip
    assert list(pd.read_parquet(path)["tap"]) == ["relu2:output"] * 2
    said = [r.getMessage() for r in caplog.records if r.name == WATCH]
    assert not [m for m in said if "captures no gradient" in m], said


def test_a_sweep_ends_with_one_line_per_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sweep = planted_sweep(tmp_path)
    jobs = [(str(i), [f"capture.strategy={s}"]) for i, s in enumerate(("retain_grad", "hook", "autograd_grad"))]
    with caplog.at_level(logging.INFO):
        assert not health.sweep_word(sweep, jobs)
    (record,) = [r for r in caplog.records if r.name == HEALTH]
    loss = pd.read_parquet(sweep / "0" / "steps.parquet")["loss"]
    head, *lines = record.getMessage().split("\n  ")
    assert record.levelno == logging.WARNING and head == f"sweep summary ({sweep}):"
    trouble = (f"loss {loss.iloc[0]:.4g} -> {loss.iloc[-1]:.4g}; NaN/Inf from step 2 (head:output), "
               "1 of 7 taps vanishing, 1 of 7 taps exploding, 1 of 7 taps without gradient")  # fmt: skip
    assert lines == [f"job {j} ({o[0]}): {trouble}" for j, o in jobs]


def test_a_sweeps_failed_job_has_its_line_in_job_order_and_makes_the_summary_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found 2026-11-27: the summary listed the completed jobs only, at INFO ("healthy"), after a job failed."""
    for job in ("0", "10"):
        train(compose_cfg("+experiment=mlp", "steps=2"), out_dir=tmp_path / job)
    jobs = [("0", ["optimizer.lr=0.1"]), ("10", ["optimizer.lr=0.2"])]
    with caplog.at_level(logging.INFO):
        assert health.sweep_word(tmp_path, jobs)  # both healthy, none failed
        assert not health.sweep_word(tmp_path, jobs, [("2", ["optimizer.lr=-1"], "Invalid learning rate: -1.")])
    first, second = [r for r in caplog.records if r.name == HEALTH]
    assert first.levelno == logging.INFO and second.levelno == logging.WARNING
    lines = second.getMessage().split("\n  ")[1:]
    assert [line.split(" (")[0] for line in lines] == ["job 0", "job 2", "job 10"]
    assert lines[1] == "job 2 (optimizer.lr=-1): failed (Invalid learning rate: -1)"
    assert lines[0].endswith("; healthy") and lines[2].endswith("; healthy")


def test_a_diverging_gpt2_says_so_in_the_last_word(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=gpt2", "optimizer.lr=10", "steps=20", "device=cpu"), out_dir=tmp_path)
    level, lines = summary_of(caplog)
    loss = pd.read_parquet(tmp_path / "steps.parquet")["loss"]
    start, end = float(loss.iloc[:3].min()), float(loss.iloc[-3:].median())  # a tenth of 20 steps, at least 3
    assert end > 100 * start  # the plant: lr=10 blows the loss up
    assert level == logging.WARNING
    assert lines[2] == (f"loss diverging: {end:.6g} at the end (the median of the last 3 finite steps) against "
                        f"{start:.6g} at the start (the lowest of the first 3): x{end / start:.3g}")  # fmt: skip


class FlipAfter:
    """A LambdaLR multiplier: 1 for the first `after` steps, then -1 (a negative learning rate)."""

    def __init__(self, after: int) -> None:
        self.after = after

    def __call__(self, step: int) -> float:
        return 1.0 if step < self.after else -1.0


def test_a_negative_learning_rate_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # A config's schedule that turns negative is refused before step 0 (issue 38 item 14, tests/test_preflight.py);
    # the last word must still name one that reaches a run past that check (a scheduler of the user's own making).
    from gradrunner.run import preflight

    monkeypatch.setattr(preflight, "check_schedule", lambda *args, **kwargs: None)
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=30", "optimizer.lr=0.05", "scheduler=warmup_cosine",
                          "scheduler.lr_lambda._target_=test_last_word.FlipAfter", "~scheduler.lr_lambda.warmup_steps",
                          "~scheduler.lr_lambda.total_steps", "~scheduler.lr_lambda.min_ratio",
                          "+scheduler.lr_lambda.after=3"), out_dir=tmp_path)  # fmt: skip
    level, lines = summary_of(caplog)
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert steps["lr"].tolist() == [0.05] * 3 + [-0.05] * 27
    assert level == logging.WARNING
    assert "negative learning rate from step 3 (lr -0.05): the optimiser climbs the loss" in lines
    h = health.health(tmp_path)
    assert h.negative_lr == (3, -0.05) and not h.healthy
    finite = steps["loss"][np.isfinite(steps["loss"])]
    start, end = float(finite.iloc[:3].min()), float(finite.iloc[-3:].median())
    assert end > 2 * start and h.loss_diverging == pytest.approx((start, end))  # climbing the loss diverges


def _zero_upstream_of(edited: str) -> list[str]:
    """With plain torch: the experiment's taps whose gradient is exactly 0 when `edited`'s output gradient is zeroed."""
    torch.manual_seed(0)
    model = dead_relu_mlp(dead=1)
    with torch.no_grad():
        model.fc1.bias.zero_()  # alive again: only the edit zeroes anything
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
            out.retain_grad()
            outputs[name] = out
            if name == edited:
                out.register_hook(torch.zeros_like)

        return hook

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(keep(name))
    model(torch.randn(16, 8)).sub(torch.randn(16, 1)).pow(2).mean().backward()
    zero = [f"{n}:output" for n, t in outputs.items() if n != edited and t.grad is not None and not t.grad.any()]
    zero += [f"{n}:weight" for n, m in model.named_modules() if hasattr(m, "weight") and not m.weight.grad.any()]
    return zero


def test_taps_an_edit_zeroes_are_not_vanishing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    zero = _zero_upstream_of("relu2")
    assert zero == ["fc1:output", "relu1:output", "fc2:output", "fc1:weight", "fc2:weight"]
    with caplog.at_level(logging.INFO):
        train(compose_cfg("+experiment=mlp", "steps=4", 'edits=[{tap: "relu2:output", scale: 0.0}]'), out_dir=tmp_path)
    h = health.health(tmp_path)
    assert h.vanishing == {} and h.zeroing_edits == ["relu2:output"]
    assert h.zeroed_by_edit == dict.fromkeys(zero, 0)
    level, lines = summary_of(caplog)
    assert ("zero by an edit (the edit on relu2:output leaves a zero gradient; taps upstream get none), not vanishing: "
            "5 of 11 taps: " + ", ".join(f"{t} (from step 0)" for t in zero)) in lines  # fmt: skip
    assert (level == logging.INFO) == h.healthy and h.loss_diverging is None


@pytest.mark.parametrize("losses, diverging", [
    ([3.1, 0.91], False), ([0.9, 3.1], False), ([1.0, 1.0, 9.0, 9.0, 9.0], False),  # under 6 steps: not judged
    ([1.0, 1.1, 1.2, 1.5, 1.9, 1.9], False), ([1.0, 1.0, 1.0, 9.0, 9.0, 9.0], True), ([2.0, 1.0, 3.0, 1.0, 9.0, 2.5], True),
])
def test_short_runs_judge_the_loss_by_windows_that_do_not_overlap(
    tmp_path: Path, losses: list[float], diverging: bool
) -> None:
    """A falling 2-step run (3.1 -> 0.91) was called diverging: its start and end windows both held both steps.
    Each window is at least 3 steps (one batch's noise is not a trend), so runs under 6 steps are not judged."""
    pd.DataFrame({"step": range(len(losses)), "loss": losses}).to_parquet(tmp_path / "steps.parquet")
    h = health.health(tmp_path)
    assert (h.loss_diverging is not None) == diverging
    if diverging:
        k = 3
        assert h.loss_diverging == (min(losses[:k]), float(np.median(losses[-k:])))
        assert f"the median of the last {k} finite steps" in "\n".join(h.lines())


def test_the_last_word_of_a_torchrun_job_counts_steps_once_and_reads_rank_0s_loss(tmp_path: Path) -> None:
    """steps.parquet under torchrun holds a row per step and rank: 3 steps on 2 ranks read "6 steps" and rank 1's
    last loss before (found 2026-11-27 on a DDP and an FSDP2 record())."""
    rows = [{"step": s, "rank": r, "loss": 1.0 + s + 10 * r, "lr": 0.1} for s in range(3) for r in (1, 0)]
    pd.DataFrame(rows).to_parquet(tmp_path / "steps.parquet")
    h = health.health(tmp_path)
    assert (h.steps, h.loss_first, h.loss_last) == (3, 1.0, 3.0)
    assert "loss: 1 at the first step, 3 at the last (3 steps)" in str(h)


class CutAt(Synthetic):
    """The experiment's data, ended in the batch of step `at`: Ctrl-C (KeyboardInterrupt) or a failing data source."""

    at, how = 45, "interrupt"

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[Any]:
        for i, b in enumerate(super().batches(device, dtype)):
            if i == CutAt.at:
                raise KeyboardInterrupt if CutAt.how == "interrupt" else RuntimeError("injected failure")
            yield b


@pytest.mark.parametrize("how", ["interrupt", "raise"])
def test_an_interrupted_or_failed_run_says_its_loss_diverged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A runner job that diverged and was then interrupted (or whose data raised) said only how it ended: its last
    word, which record() gives after an error, was missing. Reference: the rule applied with pandas to the kept rows."""
    monkeypatch.setattr(CutAt, "how", how)
    cfg = compose_cfg("+experiment=mlp", "steps=50", "model.depth=6", "optimizer.lr=1",
                      "data._target_=test_last_word.CutAt")  # fmt: skip
    with caplog.at_level(logging.INFO), pytest.raises(KeyboardInterrupt if how == "interrupt" else GradrunnerError):
        train(cfg, out_dir=tmp_path)
    loss = pd.read_parquet(tmp_path / "steps.parquet").sort_values("step")["loss"].to_numpy()
    assert len(loss) == 45 and np.isfinite(loss).all()  # the steps before the cut, kept
    k = len(loss) // 10
    start, end = float(loss[:k].min()), float(np.median(loss[-k:]))
    assert end > 2 * start  # the plant: lr=1 on a six-layer MLP diverges
    level, lines = summary_of(caplog)
    assert level == logging.WARNING
    assert lines[0].startswith(f"records: {tmp_path} (grads.parquet, steps.parquet; ")
    assert lines[1].endswith("(45 steps)")
    assert lines[2] == (f"loss diverging: {end:.6g} at the end (the median of the last {k} finite steps) against "
                        f"{start:.6g} at the start (the lowest of the first {k}): x{end / start:.3g}")  # fmt: skip
    spikes = health.health(tmp_path).spikes  # the spikes the detector flagged: in the summary, said once
    assert set(spikes) <= set(lines)
    assert not [r for r in caplog.records if r.getMessage().startswith("spikes (anomalies.parquet):")]


def test_an_expert_given_no_tokens_is_not_vanishing(tmp_path: Path) -> None:
    """An expert called on a (0, d) tensor (no token routed to it) has a gradient of no elements: has_grad true,
    numel 0, norm 0. Its 0 was judged as a norm and the last word called it vanishing (found 2026-11-27); it has no
    value to judge: not vanishing, not without gradient, while a tap whose norm really is tiny still is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gradrunner.analysis.summaries import tap_summary
    from gradrunner.records.columns import GRADS_FILE

    rows = [(s, tap, n, norm) for s in range(3) for tap, n, norm in
            (("experts.0:output", 8, 1.0), ("experts.1:output", 8, 1e-12), ("experts.2:output", 0 if s else 8, 0.0 if s else 1.0))]  # fmt: skip
    table = pa.table({"step": [r[0] for r in rows], "tap": [r[1] for r in rows], "call": [0] * len(rows),
                      "numel": [r[2] for r in rows], "norm": [r[3] for r in rows], "has_grad": [True] * len(rows),
                      "nan_count": [0] * len(rows), "inf_count": [0] * len(rows)})  # fmt: skip
    pq.write_table(table, tmp_path / GRADS_FILE)
    h = health.health(tmp_path)
    assert h.vanishing == {"experts.1:output": 0} and h.without_grad == {} and h.taps == 3
    s = tap_summary(table.to_pandas()).set_index("tap")
    assert s.loc["experts.2:output", "steps"] == 3 and s.loc["experts.2:output", "last"] == 1.0
    assert not s.loc["experts.2:output", "vanishing"] and pd.isna(s.loc["experts.2:output", "first_vanishing_step"])
