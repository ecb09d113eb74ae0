"""The spike detector's rule against a plain reference, its degenerate cases, first movers, the last word, and `anomalies.parquet`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from planted import STEPS, planted_step, write_planted_job

from gradrunner.analysis import load
from gradrunner.analysis.anomalies import Anomaly, Detector, check_settings
from gradrunner.analysis.anomaly_signals import TAP_COLUMNS, read_anomalies, run_signals, save_anomalies, step_signals
from gradrunner.analysis.anomaly_summary import first_mover, summary_lines
from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records import rundir
from gradrunner.records.anomalies import ANOMALIES_FILE, ANOMALIES_SCHEMA, write_anomalies


def reference(series: list[dict[str, float]], z: float, window: int, warmup: int, floor: float = 1e-3) -> list[tuple]:
    """The rule written plainly: per signal a list of accepted values (ln of them for a norm signal), np.mean /
    np.std of its last `window`; a run of consecutive flags writes its first `warmup`, and `warmup` finite
    flagged values in a row become the window."""
    accepted: dict[str, list[float]] = {}
    runs: dict[str, list[float]] = {}
    streak: dict[str, int] = {}
    out = []
    for step, values in enumerate(series):
        for name, x in values.items():
            log = name == "grad_norm" or name.count(":") >= 2
            if log and math.isfinite(x) and x <= 0:
                continue  # no logarithm: not observed
            y = (math.log(x) if x > 0 else math.nan) if log else x
            kept = accepted.setdefault(name, [])
            last = np.array(kept[-window:])
            scale = float(np.abs(last).max()) if len(last) else 1.0  # values near 1e200: no square overflows
            mean = scale * float((last / scale).mean()) if len(last) else math.nan
            std = (
                max(scale * float((last / scale).std()), floor * (1.0 if log else abs(mean))) if len(last) else math.nan
            )
            score = (
                math.inf if not math.isfinite(y) else (y - mean) / std if std > 0 else (math.inf if y > mean else 0.0)
            )
            if not math.isfinite(y) or (len(kept) >= warmup and score > z):
                streak[name] = streak.get(name, 0) + 1
                run = runs.setdefault(name, [])
                run[:] = [*run, y] if math.isfinite(y) else []
                if streak[name] <= warmup:
                    out.append((step, name, x, mean, std, score))
                if len(run) >= warmup:
                    accepted[name] = run[-warmup:]
                    streak[name], runs[name] = 0, []
            else:
                kept.append(y)
                streak[name], runs[name] = 0, []
    return out


def feed(det: Detector, series: list[dict[str, float]]) -> list[Anomaly]:
    for step, values in enumerate(series):
        det.observe(step, values)
    return det.anomalies


def assert_same(got: list[Anomaly], want: list[tuple], rel: float = 1e-9) -> None:
    assert [(a.step, a.signal) for a in got] == [(w[0], w[1]) for w in want]
    for a, (_, _, x, mean, std, score) in zip(got, want, strict=True):
        assert a.value == x or (math.isnan(a.value) and math.isnan(x))
        for g, w in ((a.mean, mean), (a.std, std), (a.z, score)):
            assert g == pytest.approx(w, rel=rel, nan_ok=True), (a, w)


def test_matches_the_plain_rule_over_long_noisy_series_with_spikes_drift_and_huge_values() -> None:
    # Four signals over 3,000 steps with a window of 16 (the ring wraps, sums are recomputed often):
    # noise, a steady decay with planted spikes, values near 1e200 (squares overflow), a level shift.
    rng = np.random.default_rng(0)
    n = 3000
    noise = rng.normal(1.0, 0.1, n)
    decay = 10 * np.exp(-np.arange(n) / 300) + rng.normal(0, 1e-3, n)
    decay[[500, 501, 1700]] *= [50, 40, 1e6]
    huge = 1e200 * rng.normal(5.0, 0.5, n)
    huge[900] *= 30
    shift = np.where(np.arange(n) < 1500, 1e6, 1.0) + rng.normal(0, 1e-2, n)
    # A norm (log scale): jumps x1.3 now and then (a few sigma of its log), x1e3 at 2200, 0 at 100 (not
    # observed), and a level shift up x50 from 2500 on (with the NaN probes between them, the run of flags
    # never holds 4 finite values in a row: its first 4 flags are written, steps 2500 and 2501, and no more).
    norm = np.exp(rng.normal(0, 0.1, n)) * np.where(np.arange(n) < 2500, 1.0, 50.0)
    norm[::97] *= 1.3
    norm[2200] *= 1e3
    norm[100] = 0.0
    series = [{"noise": noise[i], "decay": decay[i], "huge": huge[i], "shift": shift[i], "t:output:norm": norm[i]}
              for i in range(n)]  # fmt: skip
    series[7]["noise"] = math.nan
    series[2]["noise"] = 1e8  # accepted in warm-up; when it leaves the window, the running sums must not keep it
    del series[40]["decay"]  # absent on a step: not observed
    # Before each step, a NaN of every signal: flagged with its window's mean and std, and not added, so the
    # windows are compared with the reference's at every step, not only where a value is flagged.
    probed = [d for values in series for d in ({k: math.nan for k in values}, values)]
    want = reference(probed, 6.0, 16, 4)
    got = feed(Detector(z=6.0, window=16, warmup=4), probed)
    assert_same(got, want)
    flagged = {(a.step // 2, a.signal) for a in got if a.step % 2}
    shifted = {(2500, "t:output:norm"), (2501, "t:output:norm")}
    assert flagged == {(7, "noise"), (500, "decay"), (501, "decay"), (1700, "decay"), (900, "huge"),
                       (2200, "t:output:norm")} | shifted  # fmt: skip
    assert {a.space for a in got if a.signal == "t:output:norm"} == {"log"} and {a.space for a in got[:4]} == {"linear"}
    assert [a.through for a in got if a.signal == "t:output:norm" and a.step >= 5000] == [None, None, None, 2 * n - 1]
    assert all(math.isfinite(a.std) for a in got[8:] if a.signal == "huge")  # no overflow: std near 5e199


def test_a_run_of_flags_writes_its_first_warmup_values_then_the_held_level_becomes_the_window() -> None:
    det = Detector(z=6.0, window=32, warmup=5)
    rng = np.random.default_rng(4)
    feed(det, [{"loss": math.nan if i >= 50 else 1 + rng.normal(0, 0.01),
                "grad_norm": (100.0 if i >= 40 else 1.0) * math.exp(rng.normal(0, 0.05))} for i in range(80)])  # fmt: skip
    norm = [a for a in det.anomalies if a.signal == "grad_norm"]
    assert [(a.step, a.streak, a.space) for a in norm] == [(s, s - 39, "log") for s in range(40, 45)]
    assert norm[-1].through == 44  # then its new level: steps 45.. are quiet
    assert det.observe(80, {"grad_norm": 100.0}) == [] and det.observe(81, {"grad_norm": 1e4}) != []
    nan = [a for a in det.anomalies if a.signal == "loss"]
    assert [a.step for a in nan] == list(range(50, 55)) and nan[-1].through == 79  # a NaN loss for 30 steps: 5 rows


def test_nan_and_inf_are_flagged_in_warm_up_with_z_inf_and_never_enter_the_window() -> None:
    det = Detector(z=6.0, window=8, warmup=5)
    [a] = det.observe(0, {"loss": math.nan})
    assert (a.step, a.signal, a.z) == (0, "loss", math.inf) and math.isnan(a.value) and math.isnan(a.mean)
    assert [a.z for a in det.observe(1, {"loss": math.inf, "grad_norm": -math.inf})] == [math.inf, math.inf]
    for step, x in enumerate([1.0, 2.0, 3.0], start=2):
        assert det.observe(step, {"loss": x}) == []
    # The window holds 1, 2, 3 only: the next value is judged against their mean and std.
    [b] = det.observe(5, {"loss": math.nan})
    assert (b.mean, b.std) == pytest.approx((2.0, np.std([1.0, 2.0, 3.0])))


def test_a_flagged_value_does_not_enter_the_window() -> None:
    det = Detector(z=6.0, window=128, warmup=20)
    base = [1.0 + 0.01 * math.sin(i) for i in range(40)]
    feed(det, [{"loss": x} for x in base])
    first = det.observe(40, {"loss": 5.0})
    second = det.observe(41, {"loss": 5.0})  # judged against the same window: 5.0 was not added
    assert len(first) == len(second) == 1
    assert (second[0].mean, second[0].std) == (first[0].mean, first[0].std)
    assert first[0].mean == pytest.approx(np.mean(base)) and first[0].std == pytest.approx(np.std(base))


def test_a_constant_signal_ignores_float_noise_but_flags_a_real_move() -> None:
    det = Detector()
    feed(det, [{"loss": 0.25} for _ in range(50)])  # std 0: floored at 1e-3 * 0.25
    assert det.observe(50, {"loss": 0.25 * (1 + 1e-7)}) == []  # float32 rounding of a converged loss
    assert det.observe(51, {"loss": 0.25 * (1 + 5e-3)}) == []  # 5 floored sigma
    [a] = det.observe(52, {"loss": 0.26})
    window = np.array([0.25] * 50 + [0.25 * (1 + 1e-7), 0.25 * (1 + 5e-3)])
    assert np.std(window) < 1e-3 * window.mean()  # the floor decides
    assert (a.mean, a.std, a.z) == pytest.approx(
        (window.mean(), 1e-3 * window.mean(), (0.26 / window.mean() - 1) * 1e3)
    )
    zero = Detector()
    feed(zero, [{"dead": 0.0} for _ in range(30)])
    [b] = zero.observe(30, {"dead": 1e-30})  # a linear window of exact zeros has no floor: z = inf
    assert (b.mean, b.std, b.z) == (0.0, 0.0, math.inf)


def test_only_upward_moves_are_spikes_and_a_steady_decay_never_alarms() -> None:
    rng = np.random.default_rng(1)
    loss = 3 * np.exp(-np.arange(2000) / 100) + 0.01 + rng.normal(0, 1e-4, 2000)  # steeply down, then flat
    det = Detector()
    assert feed(det, [{"loss": x} for x in loss]) == []
    assert det.observe(2000, {"loss": loss[-1] / 10}) == []  # a sudden drop: learning, not a spike
    assert [a.step for a in det.observe(2001, {"loss": loss[-1] * 3})] == [2001]


def test_warm_up_counts_accepted_values_of_each_signal() -> None:
    det = Detector(z=6.0, window=128, warmup=20)
    feed(det, [{"loss": 1.0 + 0.001 * (i % 3)} for i in range(19)])
    assert det.observe(19, {"loss": 100.0}) == []  # 19 values so far: still warming up, and 100 is accepted
    flagged = det.observe(20, {"loss": 1e6, "fc1:output:norm": 1e6})
    assert [a.signal for a in flagged] == ["loss"]  # a new signal warms up on its own
    assert flagged[0].mean == pytest.approx((sum(1.0 + 0.001 * (i % 3) for i in range(19)) + 100.0) / 20)


def test_state_dict_restores_a_detector_that_then_judges_as_the_original() -> None:
    rng = np.random.default_rng(2)
    series = [{"loss": rng.normal(1, 0.1), f"t{i % 3}:output:norm": rng.normal(2, 0.2)} for i in range(400)]
    series[300]["loss"] = 50.0
    whole = feed(Detector(window=32), series)
    first = Detector(window=32)
    feed(first, series[:200])
    again = Detector(window=32)
    again.load_state_dict(first.state_dict())
    for step, values in enumerate(series[200:], start=200):
        again.observe(step, values)
    assert again.anomalies == whole and any(a.step == 300 for a in whole)


def test_first_mover_is_the_earliest_tap_in_the_window_then_the_larger_z_then_forward_order() -> None:
    a = [Anomaly(3, "fc1:output:norm", 9.0, 1.0, 0.1, 80.0), Anomaly(95, "fc2:output:norm", 9.0, 1.0, 0.1, 7.0),
         Anomaly(95, ":h:norm", 9.0, 1.0, 0.1, 70.0), Anomaly(98, "fc1:weight:update_ratio", 9.0, 1.0, 0.1, 1e3),
         Anomaly(100, "loss", 9.0, 1.0, 0.1, 1e4)]  # fmt: skip
    assert first_mover(a, 100, window=10) == (":h", ":h:norm", 95, 5, 70.0)
    assert first_mover(a, 100, window=97).tap == "fc1:output"  # step 3 is in a window of 97 steps
    assert first_mover(a, 100, window=1) is None  # nothing flagged in steps 99..100 but the loss
    tie = [Anomaly(7, "b:output:norm", 9.0, 1.0, 0.1, 5.0), Anomaly(7, "a:output:norm", 9.0, 1.0, 0.1, 5.0)]
    assert first_mover(tie, 7, 5, order=["b:output", "a:output"]).tap == "b:output"
    assert first_mover(tie, 7, 5).tap == "a:output"  # no order: by name


def test_summary_lines_name_each_spike_its_z_and_the_first_tap_to_move() -> None:
    det = Detector(window=64)
    rng = np.random.default_rng(3)
    for step in range(120):
        values = {"loss": 1 + rng.normal(0, 0.01), "grad_norm": 2 + rng.normal(0, 0.02),
                  "fc1:output:norm": 0.5 + rng.normal(0, 0.005), "fc2:output:norm": 0.5 + rng.normal(0, 0.005)}  # fmt: skip
        if step >= 98:
            values["fc2:output:norm"] = 5.0  # moves first, and stays up
        if step in (100, 101):
            values["loss"] = math.inf if step == 101 else 300.0
        det.observe(step, values)
    lines = summary_lines(det.anomalies, det.window, det.taps())
    assert len(lines) == 2, lines
    m = re.fullmatch(r"loss spike at step 100 \(z = (\d(?:\.\d)?)e(\d+); flagged through step 101, 2 steps; "
                     r"NaN/Inf from step 101\); first to move: fc2:output \(lead 2 steps\)", lines[0])  # fmt: skip
    assert m is not None, lines[0]
    z = next(a.z for a in det.anomalies if a.signal == "loss")
    assert float(f"{m[1]}e{m[2]}") == pytest.approx(z, rel=0.05) and z > 1e4
    # fc2 stays up: its values from step 102 to 117 (a run of flags writes 20 rows, 98..117, then it is the new level)
    assert re.fullmatch(r"16 tap anomalies with no loss or grad_norm spike after them \(first: fc2:output:norm at "
                        r"step 102, z = [\d.e]+\)", lines[1]), lines[1]  # fmt: skip
    assert summary_lines([], 128) == []


@pytest.mark.parametrize(("z", "window", "warmup", "bad"), [(0.0, 128, 20, "anomaly.z=0.0"), (math.inf, 128, 20, "anomaly.z=inf"),
                         (6.0, 1, 1, "anomaly.window=1"), (6.0, 10, 20, "anomaly.warmup=20")])  # fmt: skip
def test_bad_settings_are_one_paragraph_naming_the_value(z: float, window: int, warmup: int, bad: str) -> None:
    with pytest.raises(GradrunnerError, match="^" + bad.replace(".", r"\.") + " is not allowed"):
        check_settings(z, window, warmup)


def test_online_signals_from_step_records_equal_the_offline_ones_from_the_written_records(tmp_path: Path) -> None:
    # The planted job: `:h` fires twice (its norm is the root sum of squares), `unused` never gets a
    # gradient (absent), head has a NaN from step 2 (NaN), fc2:weight explodes at step 3.
    write_planted_job(tmp_path, "hook", values="none")
    online = []
    for step in range(STEPS):
        col = Collector(values="none")
        for key, grad in planted_step("hook", step):
            col.add(key, grad)
        online.append((step, step_signals(1.0 / (step + 1), None, [col.finish(torch.tensor(1.0 / (step + 1)))])))
    steps = rundir.read_verified(tmp_path / "steps.parquet", None)
    offline = list(run_signals(load(tmp_path, columns=TAP_COLUMNS), steps))
    assert [s for s, _ in offline] == list(range(STEPS))
    for (s1, on), (s2, off) in zip(online, offline, strict=True):
        assert s1 == s2 and list(on) == list(off)
        assert np.allclose(list(on.values()), list(off.values()), rtol=1e-6, equal_nan=True)
    assert list(online[0][1]) == ["loss", "fc1:output:norm", ":h:norm", "fc2:output:norm", "head:output:norm",
                                  "fc2:weight:norm"]  # fmt: skip
    assert online[0][1][":h:norm"] == pytest.approx(math.sqrt(2.0), rel=1e-6)
    assert math.isnan(online[2][1]["head:output:norm"])
    assert step_signals(0.5, math.inf, [], skipped=True) == {"loss": 0.5}  # a step the GradScaler skipped


def test_anomalies_parquet_round_trips_with_its_schema_and_the_run_id(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")  # run id "run-<dir name>"
    run_id = f"run-{tmp_path.name}"
    det = Detector(window=8, warmup=2)
    feed(det, [{"loss": 1.0, "fc1:output:norm": 1.0}, {"loss": 1.0, "fc1:output:norm": 1.0},
               {"loss": 1.0, "fc1:output:norm": 9.0}, {"loss": 9.0, "fc1:output:norm": 9.0}])  # fmt: skip
    path = save_anomalies(tmp_path, det, run_id)
    assert pq.read_schema(path).remove_metadata() == ANOMALIES_SCHEMA
    df = read_anomalies(tmp_path)
    assert df[["step", "signal"]].values.tolist() == [[2, "fc1:output:norm"], [3, "loss"], [3, "fc1:output:norm"]]
    assert df.first_tap.isna().tolist() == [True, False, True] and df.first_tap[1] == "fc1:output"
    assert df.lead.isna().tolist() == [True, False, True] and df.lead[1] == 1
    assert set(df.run_id) == {run_id} and df.z.tolist()[1] == pytest.approx(8 / 1e-3)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temp file, none left


def test_an_anomalies_file_of_another_run_or_damaged_is_refused_in_one_paragraph(tmp_path: Path) -> None:
    write_planted_job(tmp_path, "hook", values="none")
    write_anomalies(tmp_path, [], run_id="some-other-run")  # no rows: the metadata still says whose it is
    with pytest.raises(GradrunnerError, match="written for run some-other-run, not for run run-") as e:
        read_anomalies(tmp_path)
    assert "\n" not in str(e.value) and "detect_run" in str(e.value)
    write_anomalies(tmp_path, [{"step": 1, "signal": "loss", "value": 2.0, "mean": 1.0, "std": 0.1, "z": 10.0}],
                    run_id="some-other-run")  # fmt: skip
    with pytest.raises(GradrunnerError, match="holds rows of run.s. some-other-run"):
        read_anomalies(tmp_path)
    data = bytearray((tmp_path / ANOMALIES_FILE).read_bytes())
    data[len(data) // 3] ^= 0xFF
    (tmp_path / ANOMALIES_FILE).write_bytes(bytes(data))
    with pytest.raises(GradrunnerError, match="cannot read .*anomalies.parquet"):
        read_anomalies(tmp_path)
    (tmp_path / ANOMALIES_FILE).unlink()
    with pytest.raises(GradrunnerError, match="no anomalies.parquet in"):
        read_anomalies(tmp_path)


def test_a_completed_runs_marker_decides_the_run_id_and_pins_the_anomalies_file(tmp_path: Path) -> None:
    # done.json's run id is the run's (not the steps file's); a file it pins (rows, footer) must be that file.
    write_planted_job(tmp_path, "hook", values="none")
    row = {"step": 3, "signal": "loss", "value": 2.0, "mean": 1.0, "std": 0.1, "z": 10.0, "first_tap": None}
    write_anomalies(tmp_path, [row], run_id="run-done")
    names = ["grads.parquet", "steps.parquet", ANOMALIES_FILE]
    marker = {"status": "completed", "run_id": "run-done", "files": names,
              "rows": {ANOMALIES_FILE: 1}, "footers": {ANOMALIES_FILE: rundir.footer_digest(tmp_path / ANOMALIES_FILE)}}  # fmt: skip
    (tmp_path / rundir.DONE).write_text(json.dumps(marker))
    assert read_anomalies(tmp_path).step.tolist() == [3]
    write_anomalies(tmp_path, [row, row], run_id="run-done")  # the same run, but not the file done.json pinned
    with pytest.raises(GradrunnerError, match="is not the file done.json recorded"):
        read_anomalies(tmp_path)


def test_the_last_word_names_every_spike() -> None:
    """CONTRACT: the run's last word names each spike. With more than 5 it named the first 5, then "... and N more"."""
    planted = [30, 50, 70, 90, 110, 130, 150]  # seven isolated loss spikes on a flat, noisy loss
    rng = np.random.default_rng(0)
    det = Detector(z=6.0, window=16, warmup=8)
    for step in range(170):
        det.observe(step, {"loss": 1.0 + 0.01 * rng.standard_normal() + (5.0 if step in planted else 0.0)})
    lines = summary_lines(det.anomalies, det.window, det.taps())
    named = [int(m.group(1)) for line in lines if (m := re.match(r"loss spike at step (\d+) ", line))]
    assert named == planted and len(lines) == len(planted) and not any("more spike" in line for line in lines)


def _nan_session(run: Path, nan_at: int, steps: int, interrupt_at: int | None = None) -> None:
    """A `record()` session of a Linear whose input has a NaN at step `nan_at` (the parameters put back to finite
    after it), Ctrl-C (KeyboardInterrupt) at step `interrupt_at` if given."""
    import gradrunner

    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with gradrunner.record(m, [":output"], run) as rec:
        for s in range(steps):
            if s == interrupt_at:
                raise KeyboardInterrupt
            x = torch.randn(8, 4)
            x[0, 0] = math.nan if s == nan_at else x[0, 0]
            loss = torch.nn.functional.mse_loss(m(x), torch.zeros(8, 1))
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
            with torch.no_grad():
                for p in m.parameters():
                    p.nan_to_num_(0.0)


def test_a_nan_in_warm_up_scores_inf_as_it_is_flagged(tmp_path: Path) -> None:
    """Detector.score checked warm-up before non-finite: a NaN loss at step 5 (warm-up 20), flagged with z = inf in
    anomalies.parquet, was blank ("not measured") in the report's spike table."""
    from gradrunner.analysis.anomaly_context import z_around

    det = Detector(warmup=20)
    det.observe(0, {"loss": 1.0})
    assert det.score({"loss": math.nan, "grad_norm": math.inf, "other": 2.0}) == {
        "loss": math.inf, "grad_norm": math.inf, "other": pytest.approx(math.nan, nan_ok=True)}  # fmt: skip
    torch.manual_seed(0)
    _nan_session(tmp_path, nan_at=5, steps=30)
    flagged = read_anomalies(tmp_path).query("signal == 'loss' and step == 5")
    assert len(flagged) == 1 and math.isinf(flagged["z"].iloc[0])  # the reference: the detector's own row
    spike, table = z_around(tmp_path)[0]
    assert (spike.signal, spike.step) == ("loss", 5) and math.isinf(table.loc["loss", 5])


def test_another_runs_file_is_refused_naming_where_the_run_id_came_from(tmp_path: Path) -> None:
    """An interrupted run (no done.json) holding another run's anomalies.parquet: refused, but the message said the
    run id it was checked against came from "(done.json)", a file the run dir does not have."""
    import shutil

    from gradrunner.records.anomalies import run_id_source

    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        with pytest.raises(KeyboardInterrupt):
            _nan_session(run, nan_at=3, steps=10, interrupt_at=8)  # Ctrl-C at step 8: no done.json
    shutil.copy(a / ANOMALIES_FILE, b / ANOMALIES_FILE)
    own = pq.read_table(b / "steps.parquet", columns=["run_id"]).column("run_id")[0].as_py()
    other = pq.read_table(a / "steps.parquet", columns=["run_id"]).column("run_id")[0].as_py()
    assert not (b / "done.json").exists() and run_id_source(b) == (own, "steps.parquet")
    with pytest.raises(GradrunnerError) as e:
        read_anomalies(b)
    assert (
        f"anomalies.parquet holds rows of run(s) {other}, not of run {own} (steps.parquet): a file of another run"
        in str(e.value)
    )
    assert "done.json" not in str(e.value)
