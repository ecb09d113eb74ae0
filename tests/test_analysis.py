"""gradrunner.analysis helpers on records with planted properties (`tests/planted.py` lists them): the helpers
must report exactly those."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from planted import (
    CAPTURE_TIME,
    PEAK,
    STEP_TIME,
    STEPS,
    STRATEGIES,
    planted_sweep,
    planted_sweep_with_failures,
    write_planted_job,
)

from gradrunner.analysis import (
    compare_strategies,
    flow_steps,
    forward_order,
    grad_flow,
    histograms_over_steps,
    load,
    measure,
    per_example_spread,
    pick_steps,
    run_columns,
    strategy_costs,
    tap_summary,
)
from gradrunner.analysis.reading import IncompleteSweepWarning
from gradrunner.analysis.strategies import strategy_groups
from gradrunner.errors import GradrunnerError


@pytest.fixture
def sweep(tmp_path: Path) -> pd.DataFrame:
    return load(planted_sweep(tmp_path / "sweep"), values=True)


@pytest.fixture
def run(tmp_path: Path) -> pd.DataFrame:
    write_planted_job(tmp_path / "run", "hook")
    return load(tmp_path / "run", values=True)


# --- run_columns, forward_order, pick_steps, measure -------------------------------------------


def test_helpers_name_the_columns_a_frame_read_with_columns_lacks(run: pd.DataFrame) -> None:
    """A frame of `load(dir, columns=[...])` without a column a helper uses gave pandas' KeyError (or an
    AttributeError) half-way (found 2026-11-27); each helper names what is missing, in one paragraph."""
    small = run[["step", "tap", "call", "norm"]]
    cases = [
        (lambda: tap_summary(small), "tap_summary", "'has_grad', 'nan_count', 'inf_count'"),
        (lambda: grad_flow(small), "grad_flow", "'run_id'"),
        (lambda: flow_steps(small), "flow_steps", "'run_id', 'has_grad', 'nan_count', 'inf_count'"),
        (lambda: measure(small, "rms"), "measure 'rms'", "'numel'"),
        (lambda: compare_strategies(small), "compare_strategies", "'strategy'"),
        (lambda: strategy_costs(small), "strategy_costs", "'strategy', 'captured', 'step_time_s'"),
        (lambda: per_example_spread(small.assign(per_example_norm=[[1.0]] * len(small))), "per_example_spread", "'run_id'"),
        (lambda: histograms_over_steps(small.assign(hist_counts=[[1]] * len(small)), "x:output"), "histograms_over_steps",
         "'run_id'"),
    ]  # fmt: skip
    for call, who, named in cases:
        with pytest.raises(GradrunnerError, match=rf"^{who} needs the column\(s\) {named}.* name them in load") as e:
            call()
        assert "\n" not in str(e.value)


def test_run_columns_of_one_run_is_empty(run: pd.DataFrame) -> None:
    assert run_columns(run) == []


def test_run_columns_of_strategy_sweep_is_strategy_alone(sweep: pd.DataFrame) -> None:
    assert "capture.strategy" in sweep.columns
    assert run_columns(sweep) == ["strategy"]  # capture.strategy splits the runs the same way


def test_run_columns_add_other_swept_values_and_run_id_when_ambiguous(tmp_path: Path) -> None:
    for i, (strategy, seed) in enumerate([("hook", 0), ("hook", 1), ("retain_grad", 0)]):
        write_planted_job(tmp_path / "a" / str(i), strategy, "none", [f"capture.strategy={strategy}", f"seed={seed}"])
    assert run_columns(load(tmp_path / "a")) == ["strategy", "seed"]
    for i in range(2):
        write_planted_job(tmp_path / "b" / str(i), "hook", "none", [])
    assert run_columns(load(tmp_path / "b")) == ["run_id"]


def test_forward_order_is_firing_order_with_call_labels(run: pd.DataFrame) -> None:
    order = forward_order(run)
    assert list(zip(order.tap, order.call, strict=True)) == [
        ("fc1:output", 0), (":h", 0), ("fc2:output", 0), (":h", 1), ("head:output", 0),
        ("fc2:weight", 0), ("unused:output", 0),
    ]  # fmt: skip
    assert order.position.tolist() == list(range(7))
    assert order.label.tolist()[:4] == ["fc1:output", ":h [0]", "fc2:output", ":h [1]"]


def test_pick_steps() -> None:
    assert pick_steps(range(100)) == [0, 33, 66, 99]
    assert pick_steps([5, 3, 3, 4]) == [3, 4, 5]
    assert pick_steps(range(10), n=2) == [0, 9]


def test_measures(run: pd.DataFrame) -> None:
    row = run[(run.tap == "fc2:weight") & (run.step == 0)].index[0]
    assert measure(run, "norm")[row] == pytest.approx(1.0)
    assert measure(run, "rms")[row] == pytest.approx(1 / math.sqrt(6))
    assert measure(run, "mean_abs")[row] == pytest.approx(3.5 / math.sqrt(91), rel=1e-6)  # ramp 1..6, norm 1
    assert measure(run, "abs_max")[row] == pytest.approx(6 / math.sqrt(91), rel=1e-6)
    assert measure(run, "rms")[run.tap == "unused:output"].isna().all()


def test_mean_abs_without_values_says_what_to_do(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    with pytest.raises(GradrunnerError, match=r"needs captured values \(capture.values=full or sample, read with load\(..., values=True\)\).*'rms'"):
        measure(load(tmp_path), "mean_abs")
    with pytest.raises(GradrunnerError, match="'nrom' is neither norm, rms, abs_max, mean_abs nor a column"):
        measure(load(tmp_path), "nrom")


# --- tap_summary --------------------------------------------------------------------------------


def test_summary_flags_exactly_the_vanishing_tap(run: pd.DataFrame) -> None:
    s = tap_summary(run)
    assert s.loc[s.vanishing, "tap"].tolist() == ["fc1:output"]
    fc1 = s.set_index("tap").loc["fc1:output"]
    assert fc1.first_vanishing_step == 2  # 1e-7 is the first norm below 1e-6
    assert fc1["first"] == pytest.approx(0.1) and fc1["last"] == pytest.approx(1e-10)
    assert fc1["min"] == pytest.approx(1e-10) and fc1["max"] == pytest.approx(0.1)
    assert fc1["median"] == pytest.approx((1e-4 + 1e-7) / 2)
    assert s.first_vanishing_step.notna().sum() == 1


def test_summary_reports_the_first_nan_step(run: pd.DataFrame) -> None:
    s = tap_summary(run)
    nonfinite = s.dropna(subset="first_nonfinite_step")
    assert list(zip(nonfinite.tap, nonfinite.first_nonfinite_step, strict=True)) == [("head:output", 2)]


def test_summary_flags_exactly_the_exploding_tap(run: pd.DataFrame) -> None:
    s = tap_summary(run)
    assert s.loc[s.exploding, "tap"].tolist() == ["fc2:weight"]
    assert s.set_index("tap").loc["fc2:weight", "first_exploding_step"] == 3


def test_summary_thresholds_are_arguments(run: pd.DataFrame) -> None:
    s = tap_summary(run, vanish_below=1e-3, explode_above=1e5)
    assert s.loc[s.vanishing, "tap"].tolist() == ["fc1:output"]
    assert s.set_index("tap").loc["fc1:output", "first_vanishing_step"] == 1
    assert not s.exploding.any()


def test_summary_rows_in_forward_order_with_calls_and_a_tap_without_gradient(run: pd.DataFrame) -> None:
    s = tap_summary(run)
    assert list(zip(s.tap, s.call, strict=True)) == list(zip(forward_order(run).tap, forward_order(run).call, strict=True))
    unused = s.set_index("tap").loc["unused:output"]
    assert unused.steps == 0 and pd.isna(unused["last"]) and not unused.vanishing and not unused.exploding
    assert s.set_index("tap").loc["fc2:output", "steps"] == STEPS


def test_summary_of_a_sweep_has_one_block_per_strategy(sweep: pd.DataFrame) -> None:
    s = tap_summary(sweep)
    assert s.columns[0] == "strategy" and s.strategy.unique().tolist() == list(STRATEGIES)
    assert s.groupby("strategy", sort=False).size().tolist() == [7, 7, 7]
    assert s.loc[s.vanishing, ["strategy", "tap"]].values.tolist() == [[st, "fc1:output"] for st in STRATEGIES]


# --- grad_flow ----------------------------------------------------------------------------------


def test_grad_flow_taps_in_forward_order_for_the_chosen_steps(run: pd.DataFrame) -> None:
    flow = grad_flow(run, steps=[0, 3], measure_name="rms")
    assert flow.step.unique().tolist() == [0, 3]
    at0 = flow[flow.step == 0]
    assert at0.label.tolist() == forward_order(run).label.tolist()
    assert at0.position.tolist() == list(range(7))
    assert at0.set_index("tap").loc["fc1:output", "rms"] == pytest.approx(0.1 / 2)


def test_grad_flow_names_steps_the_records_do_not_hold(run: pd.DataFrame) -> None:
    """A step no record holds (not captured, or past the run's end) gave an empty table, and an empty figure, with
    nothing said (found 2026-11-27)."""
    steps = sorted(set(run.step))
    with pytest.raises(GradrunnerError, match=rf"^grad_flow: step\(s\) 99 are not in these records \(steps there: "
                       rf"{', '.join(map(str, steps))}\)") as e:  # fmt: skip
        grad_flow(run, steps=[0, 99])
    assert "\n" not in str(e.value)


def test_grad_flow_default_steps_and_sweep_runs_in_record_order(sweep: pd.DataFrame) -> None:
    flow = grad_flow(sweep)
    assert flow.strategy.unique().tolist() == list(STRATEGIES)
    assert flow.step.unique().tolist() == [0, 1, 2, 3]
    assert len(flow) == 3 * 4 * 7


# --- compare_strategies -------------------------------------------------------------------------


def test_compare_finds_exactly_the_planted_difference(sweep: pd.DataFrame) -> None:
    cmp = compare_strategies(sweep)
    differ = cmp[cmp.abs_diff > 0]
    assert set(zip(differ.step, differ.tap, differ.call, strict=True)) == {(1, "fc2:output", 0)}
    assert differ.stat.tolist() == ["norm", "mean", "std", "min", "max", "abs_max", "values"]  # not zero_frac
    norm = differ.set_index("stat").loc["norm"]
    assert norm.rel_diff == pytest.approx(1e-3 / (1 + 1e-3), rel=1e-4)
    assert norm.abs_diff == pytest.approx(1e-3, rel=1e-4)
    assert differ.set_index("stat").loc["values", "rel_diff"] == pytest.approx(1e-3 / (1 + 1e-3), rel=1e-4)
    assert (cmp.strategies == 3).all()


def test_compare_treats_nan_in_every_strategy_as_agreement(sweep: pd.DataFrame) -> None:
    cmp = compare_strategies(sweep)
    head = cmp[(cmp.tap == "head:output") & (cmp.step == 3)].set_index("stat")
    assert head.loc["norm", "abs_diff"] == 0 and head.loc["values", "abs_diff"] == 0


def test_compare_nan_in_one_strategy_only_is_an_infinite_difference(tmp_path: Path) -> None:
    df = load(planted_sweep(tmp_path, values="none"))
    df.loc[(df.strategy == "hook") & (df.tap == "fc1:output") & (df.step == 0), "norm"] = np.nan
    cmp = compare_strategies(df)
    worst = cmp.groupby("stat")["rel_diff"].max()
    assert worst["norm"] == math.inf and "values" not in worst
    inf_rows = cmp[np.isinf(cmp.rel_diff)]
    assert list(zip(inf_rows.step, inf_rows.tap, inf_rows.stat, strict=True)) == [(0, "fc1:output", "norm")]


def test_compare_rows_in_step_then_forward_order(sweep: pd.DataFrame) -> None:
    cmp = compare_strategies(sweep)
    first = cmp[(cmp.step == 0) & (cmp.stat == "norm")]
    assert first.tap.tolist() == forward_order(sweep).tap.tolist()
    assert cmp.stat.unique().tolist() == ["norm", "mean", "std", "min", "max", "abs_max", "zero_frac", "values"]


def test_compare_within_other_swept_values(tmp_path: Path) -> None:
    jobs = [(s, seed) for seed in (0, 1) for s in ("hook", "retain_grad")]
    for i, (strategy, seed) in enumerate(jobs):
        write_planted_job(tmp_path / str(i), strategy, "none", [f"capture.strategy={strategy}", f"seed={seed}"])
    cmp = compare_strategies(load(tmp_path, values=True))
    assert cmp.columns[0] == "seed" and sorted(cmp.seed.unique()) == [0, 1]
    assert (cmp.strategies == 2).all()
    assert set(cmp.loc[cmp.abs_diff > 0, "tap"]) == {"fc2:output"}


def test_compare_refuses_runs_it_cannot_tell_apart(tmp_path: Path) -> None:
    for i in range(2):
        write_planted_job(tmp_path / str(i), "hook", "none", [])
    with pytest.raises(GradrunnerError, match="several runs share strategy"):
        compare_strategies(load(tmp_path))


def test_compare_leaves_out_a_seed_whose_other_strategy_failed(tmp_path: Path) -> None:
    """strategy x seed, (autograd_grad, 1) failed: seed 1 has one strategy, nothing to compare. compare said inf
    (its missing records) and the report "the 2 strategies differ" (found 2026-11-27)."""
    jobs = [("retain_grad", 0, True), ("autograd_grad", 0, True), ("retain_grad", 1, True), ("autograd_grad", 1, False)]
    with pytest.warns(IncompleteSweepWarning, match="job 3 failed"):
        df = load(planted_sweep_with_failures(tmp_path, jobs))
    cmp = compare_strategies(df)
    # planted: retain_grad and autograd_grad write the same records; seed 0 is the only group with both
    assert set(cmp.seed) == {0} and (cmp.strategies == 2).all() and cmp.rel_diff.max() == 0.0
    assert len(cmp) == STEPS * 7 * 7  # every step, (tap, call) and statistic of seed 0
    groups = strategy_groups(df)
    assert groups[["seed", "strategies", "missing"]].values.tolist() == [[0, 2, ""], [1, 1, "autograd_grad"]]
    # a record one strategy's completed run lacks, in a group with both, is still a difference
    lacks = df[~((df.strategy == "autograd_grad") & (df.seed == 0) & (df.tap == "fc1:output") & (df.step == 0))]
    cmp = compare_strategies(lacks)
    inf = cmp[np.isinf(cmp.rel_diff)]
    assert set(zip(inf.seed, inf.step, inf.tap, inf.strategies, strict=True)) == {(0, 0, "fc1:output", 1)}


def test_compare_keeps_a_seed_that_splits_the_runs_as_the_strategy_does(tmp_path: Path) -> None:
    """(hook, 1) and (autograd_grad, 0) failed: `seed` splits the two runs left exactly as `strategy` does, and was
    dropped from the keys, so hook's seed 0 was compared with autograd_grad's seed 1 (found 2026-11-27)."""
    jobs = [("hook", 0, True), ("hook", 1, False), ("autograd_grad", 0, False), ("autograd_grad", 1, True)]
    with pytest.warns(IncompleteSweepWarning):
        df = load(planted_sweep_with_failures(tmp_path, jobs))
    assert run_columns(df) == ["strategy", "seed"]  # capture.strategy repeats strategy; seed is another setting
    cmp = compare_strategies(df)
    assert cmp.empty and list(cmp.columns)[:4] == ["seed", "step", "tap", "call"]
    groups = strategy_groups(df)
    assert groups[["seed", "strategies", "missing"]].values.tolist() == [[0, 1, "autograd_grad"], [1, 1, "hook"]]
    with pytest.warns(IncompleteSweepWarning):
        costs = strategy_costs(load(tmp_path, table="steps"))
    assert costs[["strategy", "seed"]].values.tolist() == [["hook", 0], ["autograd_grad", 1]]


# --- strategy_costs -----------------------------------------------------------------------------


def test_costs_are_medians_over_captured_steps_and_peak_memory(tmp_path: Path) -> None:
    costs = strategy_costs(load(planted_sweep(tmp_path, values="none"), table="steps"))
    assert costs.strategy.tolist() == list(STRATEGIES)
    assert costs.step_time_s.tolist() == pytest.approx([STEP_TIME[s] for s in STRATEGIES])  # warm-up left out
    assert costs.capture_time_s.tolist() == pytest.approx([CAPTURE_TIME[s] for s in STRATEGIES])
    assert costs.peak_memory_bytes.tolist() == [PEAK[s] for s in STRATEGIES]
    assert costs.captured_steps.tolist() == [STEPS] * 3
    assert costs.capture_share.tolist() == pytest.approx([0.1] * 3)


# --- swept keys that share a name with a record or helper column ---------------------------------

SWEPT = ["steps", "seed", "capture.every", "model.depth", "label", "first", "stat"]


@pytest.fixture
def colliding_sweep(tmp_path: Path) -> Path:
    """Six jobs (two per strategy) whose overrides use names the records and the helpers use."""
    for i in range(6):
        strategy = STRATEGIES[i % 3]
        overrides = [f"capture.strategy={strategy}", *(f"{k}={5 + 5 * (i // 3)}" for k in SWEPT)]
        write_planted_job(tmp_path / str(i), strategy, "full", overrides)
    return tmp_path


def test_every_helper_works_on_a_sweep_over_names_the_helpers_use(colliding_sweep: Path) -> None:
    df = load(colliding_sweep, values=True)
    assert {"override.steps", "seed", "capture.every", "model.depth", "override.label", "override.first"} <= set(df)
    assert df.groupby("job")["override.steps"].first().tolist() == [5, 5, 5, 10, 10, 10]
    assert run_columns(df) == ["strategy", "capture.every"]  # the swept keys split the jobs alike: the first
    summary = tap_summary(df)
    assert len(summary) == 6 * len(forward_order(df)) and summary["steps"].max() == STEPS
    flow = grad_flow(df, measure_name="rms")
    assert set(flow["capture.every"]) == {5, 10} and len(flow) == len(df)
    cmp = compare_strategies(df)
    assert set(cmp["capture.every"]) == {5, 10} and (cmp.strategies == 3).all()
    planted = cmp[(cmp.tap == "fc2:output") & (cmp.step == 1) & (cmp.stat == "norm")]
    assert planted.rel_diff.to_numpy() == pytest.approx([1e-3 / (1 + 1e-3)] * 2, rel=1e-4)  # float32 norms
    costs = strategy_costs(load(colliding_sweep, table="steps"))
    assert sorted(costs["capture.every"].tolist()) == [5, 5, 5, 10, 10, 10]
    assert measure(df, "mean_abs").notna().any() and pick_steps(df.step) == list(range(STEPS))


def test_helper_outputs_use_only_reserved_column_names(colliding_sweep: Path) -> None:
    """A new helper column must join RESERVED_COLUMNS, or a swept key of that name would clash with it."""
    from gradrunner.analysis.labels import RESERVED_COLUMNS

    df = load(colliding_sweep, values=True)
    runs = set(run_columns(df))
    outputs = [tap_summary(df), grad_flow(df), grad_flow(df, measure_name="mean_abs"), compare_strategies(df),
               forward_order(df), strategy_costs(load(colliding_sweep, table="steps"))]  # fmt: skip
    for out in outputs:
        assert set(out.columns) - runs <= RESERVED_COLUMNS, set(out.columns) - runs - RESERVED_COLUMNS


def test_flow_steps_stop_at_the_first_nonfinite_step_and_keep_the_largest_change(tmp_path: Path) -> None:
    from gradrunner.analysis import flow_steps

    df = load(planted_sweep(tmp_path))
    assert flow_steps(df) == [0, 1, 2]  # head:output is NaN from step 2: step 3 (all NaN there) is never drawn
    finite = df[df.tap != "head:output"]
    # fc1 falls 1000x every step; at step 3 fc2:weight also jumps 1e4x: the largest change, with the step before
    assert flow_steps(finite, n=3) == [0, 2, 3] and flow_steps(finite) == [0, 1, 2, 3]


def test_the_helpers_take_accumulated_records_as_they_are_written(tmp_path: Path) -> None:
    """Two micro-batches a step, two strategies in one sweep dir: `compare_strategies` said "several runs share
    strategy" (false), `grad_flow`'s and `histograms_over_steps`' rows doubled per step (found 2026-11-27)."""
    import torch
    from torch import nn

    from gradrunner import record
    from gradrunner.analysis import combine_micro_steps, compare_strategies, grad_flow, histograms_over_steps

    for strategy in ("hook", "retain_grad"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        g = torch.Generator().manual_seed(0)
        with record(model, ["*:output", "*:weight"], tmp_path / strategy, strategy=strategy, histogram=True) as rec:
            for _ in range(3):
                for _ in range(2):
                    loss = model(torch.randn(4, 3, generator=g)).pow(2).mean() / 2
                    loss.backward()
                model.zero_grad()
                rec.step(loss)
    df = load(tmp_path)
    cmp = compare_strategies(df)
    assert cmp.rel_diff.max() == 0.0 and set(cmp.micro_step.dropna()) == {0.0, 1.0}
    one = load(tmp_path / "hook")
    flow = grad_flow(one, measure_name="rms")
    assert not flow.duplicated(["step", "label"]).any()
    table = flow.pivot(index="label", columns="step", values="rms")  # the docstring's example
    combined = combine_micro_steps(one)
    want = combined[(combined.tap == "0:output") & (combined.step == 1)].iloc[0]  # the whole batch's gradient
    label = flow[(flow.tap == "0:output") & (flow.step == 1)].label.iloc[0]
    assert table.loc[label, 1] == pytest.approx(want.norm / np.sqrt(want.numel))
    h = histograms_over_steps(one, "0:output")
    assert h.index.tolist() == [0, 1, 2]
    parts = one[(one.tap == "0:output") & (one.step == 1)]
    assert h.loc[1].sum() == sum(int(np.sum(c)) for c in parts.hist_counts) == 2 * 4 * 4
    assert len(combine_micro_steps(one[["step", "tap", "call", "micro_step", "norm"]])) == len(combined)
