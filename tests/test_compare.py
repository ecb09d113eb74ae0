"""`python -m gradrunner.compare RUN_A RUN_B`: runs of one config agree, a changed learning rate differs from step 1.

Real runs of the runner (`train`), compared in-process through `main` and `compare_runs`; the command runs once
in a subprocess. Bad input is exit 2 with one paragraph.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import cli_env, compose_cfg

from gradrunner.analysis import load
from gradrunner.analysis.compare import ATOL, RTOL, agrees, compare_runs, relative
from gradrunner.compare import main
from gradrunner.run.loop import train

MLP = ("+experiment=mlp", "steps=3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    configs = {
        "a": MLP,
        "b": MLP,
        "lr": (*MLP, "optimizer.lr=0.05"),
        "fewer_taps": (*MLP, "taps=[fc1:output,head:weight]"),
        "other_taps": (*MLP, "taps=[fc1:bias]"),
        "nan_1": ("loss=nan_after", "steps=3"),
        "nan_2": ("loss=nan_after", "steps=3"),
    }
    for name, overrides in configs.items():
        train(compose_cfg(*overrides), out_dir=root / name)
    return {name: root / name for name in configs}


def run_main(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_two_runs_of_one_config_agree_bit_for_bit(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    c = compare_runs(runs["a"], runs["b"])
    assert c.agree and c.missing.empty
    assert c.records == len(load(runs["a"])) > 0
    assert set(c.values["stat"]) >= {"norm", "std", "abs_max", "nan_count", "loss", "value_norm"}
    assert (c.values["rel"] == 0).all()  # the same seed, the same machine: identical records
    code, out, err = run_main(capsys, runs["a"], runs["b"])
    assert code == 0 and out.startswith(f"agree: {c.records} records and 3 steps' loss") and err == ""


def test_a_different_learning_rate_first_differs_at_step_1(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    c = compare_runs(runs["a"], runs["lr"])
    assert not c.agree and c.missing.empty
    assert not c.values[c.values["step"] == 0]["differs"].any()  # step 0: the same weights, the same gradients
    first = c.first()
    assert first is not None and first["step"] == 1
    code, out, _ = run_main(capsys, runs["a"], runs["lr"])
    assert code == 1
    lines = out.splitlines()
    assert lines[1].startswith("first difference: step 1, loss: ")
    # the first tap to move, with both runs' values as the records hold them
    tap_line = lines[2]
    assert tap_line.startswith("first tap difference: step 1, tap ")
    tap, stat = tap_line.split(", tap ")[1].split(", ")[0], tap_line.split(", ")[2].split(":")[0]
    rec = {k: load(runs[k]).set_index(["step", "tap"]).loc[(1, tap), stat] for k in ("a", "lr")}
    assert f"{stat}: {rec['a']:.6g} vs {rec['lr']:.6g} (rel {abs(rec['a'] - rec['lr']) / abs(rec['a']):.2g})" in tap_line
    assert "worst taps (largest relative difference):" in out


def test_the_relative_error_by_tap_and_step_is_a_heat_map(runs: dict[str, Path]) -> None:
    c = compare_runs(runs["a"], runs["lr"])
    heat = c.rel_error()
    assert list(heat.columns) == [0, 1, 2]
    assert list(heat.index) == list(dict.fromkeys(load(runs["a"])["tap"]))  # taps in the records' order
    assert (heat[0] == 0).all() and (heat[1] > RTOL).any()
    norm = c.values[(c.values["tap"] == "fc1:weight") & (c.values["step"] == 2)]
    assert heat.loc["fc1:weight", 2] == norm["rel"].max()


def test_tolerances_decide(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    worst = compare_runs(runs["a"], runs["lr"]).values
    loose = worst["rel"].replace(np.inf, np.nan).max() * 2
    assert compare_runs(runs["a"], runs["lr"], rtol=loose, atol=1.0).agree
    assert run_main(capsys, runs["a"], runs["lr"], "--rtol", loose, "--atol", 1)[0] == 0


def test_a_tap_or_a_step_only_one_run_has_is_a_difference(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    c = compare_runs(runs["a"], runs["fewer_taps"])
    assert not c.agree and not c.values["differs"].any()  # the taps both have agree
    only_a = set(c.missing[c.missing["only_in"] == "a"]["tap"])
    assert only_a == set(load(runs["a"])["tap"]) - {"fc1:output", "head:weight"}
    code, out, _ = run_main(capsys, runs["a"], runs["fewer_taps"])
    assert code == 1
    assert "first difference: step 0, tap relu1:output: the record is only in run A" in out
    assert "only in run A: tap fc2:output, steps 0-2 (3)" in out
    reverse = compare_runs(runs["fewer_taps"], runs["a"])
    assert set(reverse.missing["only_in"]) == {"b"}


def test_the_taps_only_one_run_has_are_told_in_run_as_tap_order(runs: dict[str, Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The 'only in run A' lines follow run A's tap order, as the first difference does: the first one shown is it."""
    grads = pd.read_parquet(runs["a"] / "grads.parquet")
    order = [t for t in dict.fromkeys(grads["tap"]) if t not in ("fc1:output", "head:weight")]
    _, out, _ = run_main(capsys, runs["a"], runs["fewer_taps"])
    told = [line.split("tap ")[1].split(",")[0] for line in out.splitlines() if line.startswith("only in run A: tap")]
    assert told == order[: len(told)] and len(told) == 6
    assert f"first difference: step 0, tap {order[0]}: the record is only in run A" in out


def test_nan_equals_nan(runs: dict[str, Path]) -> None:
    c = compare_runs(runs["nan_1"], runs["nan_2"])
    assert c.values["a"].isna().any() and c.agree  # NaN gradients from step 1 on, in both
    np.testing.assert_array_equal(agrees(np.array([np.nan, np.inf, 1.0, 0.0]), np.array([np.nan, np.inf, np.nan, 1e-9]),
                                         RTOL, ATOL), [True, True, False, True])  # fmt: skip
    np.testing.assert_allclose(relative(np.array([0.0123, 0.0, np.nan, 2.0]), np.array([0.0456, 1.0, np.nan, 2.0])),
                               [0.0333 / 0.0123, np.inf, 0.0, 0.0])  # fmt: skip


def test_an_infinity_agrees_only_with_the_same_infinity() -> None:
    # numpy's isclose (run A the reference: isclose(b, a) scales by |a|) is the independent reference: it
    # treats infinities apart; |inf - b| <= rtol * |inf| alone would call inf close to every b
    grid = np.array([np.inf, -np.inf, np.nan, 0.0, 1.0, 1.0 + 1e-9, -1.0, 2.4e30, 3.4e38, 1e308])
    a, b = np.meshgrid(grid, grid, indexing="ij")
    for rtol, atol in ((RTOL, ATOL), (1e-3, 0.0), (1.0, 1.0), (0.0, 0.0)):
        np.testing.assert_array_equal(agrees(a, b, rtol, atol), np.isclose(b, a, rtol=rtol, atol=atol, equal_nan=True))
    np.testing.assert_array_equal(agrees(np.array([np.inf, np.inf, -np.inf, np.inf]), np.array([1.0, -np.inf, 5.0, np.inf]),
                                         RTOL, ATOL), [False, False, False, True])  # fmt: skip


def _with_step_value(run: Path, root: Path, step: int, stat: str, value: float) -> Path:
    """A copy of `run` whose steps table holds `value` as `stat` at `step` (a run whose grad_norm overflowed there)."""
    out = root / f"{stat}_{value}"
    shutil.copytree(run, out)
    f = out / "steps.parquet"
    t = pq.read_table(f)
    col = t.column(stat).to_numpy().copy()
    col[t.column("step").to_numpy() == step] = value
    field = t.schema.field(stat)
    pq.write_table(t.set_column(t.schema.get_field_index(stat), field, pa.array(col, field.type)), f)
    return out


@pytest.mark.parametrize("which", ["a", "b"])
def test_an_infinite_grad_norm_against_a_finite_one_differs(runs: dict[str, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str], which: str) -> None:  # fmt: skip
    inf_run = _with_step_value(runs["a"], tmp_path, 2, "grad_norm", np.inf)
    finite = float(pd.read_parquet(runs["a"] / "steps.parquet").set_index("step").loc[2, "grad_norm"])
    assert np.isfinite(finite) and compare_runs(runs["a"], runs["b"]).agree
    pair = (inf_run, runs["b"]) if which == "a" else (runs["b"], inf_run)
    c = compare_runs(*pair, rtol=1e-3)
    assert not c.agree
    first = c.first()
    assert first is not None and (first["step"], first["stat"]) == (2, "grad_norm")
    code, out, _ = run_main(capsys, *pair, "--rtol", "1e-3")
    a, b = (np.inf, finite) if which == "a" else (finite, np.inf)
    assert code == 1 and f"first difference: step 2, grad_norm: {a:.6g} vs {b:.6g} (rel inf)" in out


@pytest.mark.parametrize("stat", ["grad_norm", "loss"])
def test_a_step_value_one_run_did_not_record_is_named_not_a_difference(runs: dict[str, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       stat: str) -> None:  # fmt: skip
    """A run whose steps table holds no grad_norm (a record() session given none: null on every row) or no loss
    (rec.step() without one), against a run of the same training that has them: compare said "differ", first
    difference "step 0, grad_norm: nan vs 1.009" (found 2026-11-27), a value one run never recorded."""
    unrecorded = _with_step_value(runs["a"], tmp_path, 0, stat, np.nan)
    f = unrecorded / "steps.parquet"
    t = pq.read_table(f)
    field = t.schema.field(stat)
    pq.write_table(t.set_column(t.schema.get_field_index(stat), field, pa.nulls(t.num_rows, field.type)), f)
    for pair, only in (((unrecorded, runs["b"]), "B"), ((runs["b"], unrecorded), "A")):
        c = compare_runs(*pair)
        assert c.agree and f"{stat} recorded in run {only} only: not compared" in c.notes
        assert stat not in set(c.values["stat"])
        code, out, _ = run_main(capsys, *pair)
        assert code == 0 and out.splitlines()[0] == f"note: {stat} recorded in run {only} only: not compared"


def test_the_verdict_names_the_step_value_that_differs(runs: dict[str, Path], tmp_path: Path) -> None:
    """Equal losses, a grad_norm twice as large at step 1: the verdict said "1 of 3 steps' loss" differ (found
    2026-11-27), a loss difference that is not in the files."""
    changed = _with_step_value(runs["a"], tmp_path, 1, "grad_norm", 2 * float(
        pd.read_parquet(runs["a"] / "steps.parquet").set_index("step").loc[1, "grad_norm"]))  # fmt: skip
    verdict = compare_runs(runs["a"], changed).summary().splitlines()[0]
    records = len(load(runs["a"]))
    assert verdict == f"differ beyond rtol=1e-05, atol=1e-08: 0 of {records} records and 1 of 3 steps' grad_norm; 0 only in one run"
    loss = _with_step_value(runs["a"], tmp_path, 1, "loss", 7.0)
    assert "and 1 of 3 steps' loss;" in compare_runs(runs["a"], loss).summary().splitlines()[0]


def _sweep_of(runs: dict[str, Path], root: Path) -> Path:
    for i, name in enumerate(("a", "b")):
        shutil.copytree(runs[name], root / "sweep" / str(i))
    return root / "sweep"


def _truncated(runs: dict[str, Path], root: Path) -> Path:
    shutil.copytree(runs["a"], root / "damaged")
    f = root / "damaged" / "grads.parquet"
    f.write_bytes(f.read_bytes()[:-100])
    return root / "damaged"


def _twice(runs: dict[str, Path], root: Path) -> Path:
    shutil.copytree(runs["a"], root / "twice")
    f = root / "twice" / "grads.parquet"
    t = pq.read_table(f)
    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), f)
    return root / "twice"


@pytest.mark.parametrize(
    ("make", "args", "says"),
    [
        (lambda runs, root: root / "nothing", (), "is not a run dir (it does not exist)"),
        (lambda runs, root: runs["a"] / "grads.parquet", (), "is not a run dir (a file)"),
        (_sweep_of, (), "is not a run dir (no grads.parquet in it; its subdirs 0, 1 hold runs: pass one of them)"),
        (lambda runs, root: runs["a"].parent, (), "its subdirs a, b, lr, nan_1 and 3 more hold runs: pass one of them"),
        (lambda runs, root: root, (), "is not a run dir (no grads.parquet in it)"),
        (_truncated, (), "do not verify"),
        (_twice, (), "holds 1 records twice"),
        (lambda runs, root: runs["other_taps"], (), "no tap in common"),
        (lambda runs, root: runs["b"], ("--rtol", "-1"), "rtol='-1' is not a tolerance"),
        (lambda runs, root: runs["b"], ("--atol", "nan"), "atol='nan' is not a tolerance"),
        (lambda runs, root: runs["b"], ("--rtol", "1e-5x"), "rtol='1e-5x' is not a tolerance"),
    ],
    ids=["missing", "file", "sweep", "runs_side_by_side", "empty", "truncated", "duplicated", "disjoint_taps", "negative", "nan", "not_a_number"],
)
def test_bad_input_is_one_paragraph_and_exit_2(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               make: object, args: tuple[str, ...], says: str) -> None:  # fmt: skip
    other = make(runs, tmp_path)  # type: ignore[operator]
    code, out, err = run_main(capsys, runs["a"], other, *args)
    assert code == 2 and out == ""
    assert err.startswith("gradrunner.compare: error: ") and err.count("\n") == 1 and says in err, err
    assert "Traceback" not in err


def test_the_command_runs_as_a_module(runs: dict[str, Path]) -> None:
    cmd = [sys.executable, "-m", "gradrunner.compare", str(runs["a"]), str(runs["lr"])]
    result = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "first difference: step 1" in result.stdout and result.stderr == ""


def test_a_verdict_piped_into_head_ends_without_a_traceback(runs: dict[str, Path]) -> None:
    """`python -m gradrunner.compare A B | head -1`: the reader is gone before the verdict is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "gradrunner.compare", str(runs["a"]), str(runs["lr"])],
                                env=cli_env(), stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 1  # the verdict's status still: they differ


def test_the_analysis_side_imports_no_torch() -> None:
    code = "import sys, gradrunner.compare, gradrunner.analysis.compare; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_a_comparison_frame_holds_both_values(runs: dict[str, Path]) -> None:
    c = compare_runs(runs["a"], runs["lr"])
    a, b = load(runs["a"]), load(runs["lr"])
    got = c.values[c.values["stat"] == "norm"].set_index(["step", "tap"])
    for frame, col in ((a, "a"), (b, "b")):
        want = frame.set_index(["step", "tap"])["norm"]
        pd.testing.assert_series_equal(got[col].sort_index(), want.sort_index(), check_names=False)


def _recorded_pair(tmp_path: Path, options_b: dict[str, object] | None = None, swap_b: bool = False,
                   rows_b: int = 2, **options: object) -> tuple[Path, Path]:  # fmt: skip
    """Two record() runs of one tiny model and data: run B's batches have their rows swapped (`swap_b`), or `rows_b`
    rows; `options_b` replaces `options` for run B."""
    import torch
    from torch import nn

    import gradrunner

    dirs = (tmp_path / "a", tmp_path / "b")
    for d, swap, rows, opts in ((dirs[0], False, 2, options), (dirs[1], swap_b, rows_b, options_b or options)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        batches = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(1))[:, :rows]
        with gradrunner.record(model, ["0:output", "2:weight"], d, strategy="hook", **opts) as rec:  # type: ignore[arg-type]
            for batch in batches:
                loss = model(batch.flip(0) if swap else batch).pow(2).mean()
                loss.backward()
                model.zero_grad()
                rec.step(loss)
    return dirs


def _largest_difference(a: pd.DataFrame, b: pd.DataFrame, column: str) -> float:
    """The largest |a - b| over the elements of `column`, record by record (the reference: numpy on the files)."""
    return max(float(np.max(np.abs(np.asarray(x, float) - np.asarray(y, float)), initial=0.0))
               for x, y in zip(a[column], b[column], strict=True) if x is not None)  # fmt: skip


def test_recorded_elements_are_compared_element_by_element(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run B sees each batch's rows swapped: every statistic is order-free (equal up to rounding), the elements are
    not. compare said "agree" (exit 0) for them (found 2026-11-27)."""
    run_a, run_b = _recorded_pair(tmp_path, swap_b=True, values="full", per_example=True)
    a, b = pd.read_parquet(run_a / "grads.parquet"), pd.read_parquet(run_b / "grads.parquet")
    assert _largest_difference(a, b, "values") > 1e-3 and _largest_difference(a, b, "per_example_norm") > 1e-3
    c = compare_runs(run_a, run_b)
    assert not c.agree
    bad = c.values[c.values["differs"]]
    assert set(bad["stat"].str.split("[").str[0]) == {"values", "per_example_norm"}  # the statistics agree
    for column in ("values", "per_example_norm"):  # per record: numpy's isclose (run A the reference) decides
        rows = c.values[c.values["stat"].str.startswith(column + "[")].set_index(["step", "tap"])
        for x, y, step, tap in zip(a[column], b[column], a["step"], a["tap"], strict=True):
            row = rows.loc[(step, tap)]
            i = int(row["stat"].split("[")[1].rstrip("]"))  # the element named holds both runs' values
            assert (row["a"], row["b"]) == pytest.approx((float(x[i]), float(y[i])))
            assert row["differs"] == (not np.isclose(y, x, rtol=RTOL, atol=ATOL).all())
    code, out, _ = run_main(capsys, run_a, run_b)
    assert code == 1 and out.startswith("differ beyond rtol=1e-05, atol=1e-08: ")
    assert "first difference: step 0, tap 0:output, " in out and ("values[" in out or "per_example_norm[" in out)


def test_an_element_column_one_run_lacks_is_named_not_agreed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_a, run_b = _recorded_pair(tmp_path, options_b={"values": "none"}, values="full", per_example=True, histogram=True)
    c = compare_runs(run_a, run_b)
    assert c.agree and "values recorded in run A only (capture.values): not compared" in c.notes
    assert "per_example_norm recorded in run A only (capture.per_example): not compared" in c.notes
    assert not c.values["stat"].str.startswith(("values", "per_example_norm", "hist_counts")).any()
    code, out, _ = run_main(capsys, run_a, run_b)
    assert code == 0 and out.splitlines()[0] == "note: values recorded in run A only (capture.values): not compared"


def test_a_null_per_example_norm_is_unknown_not_an_empty_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run B's last layer is a module of its own computing the same `F.linear`: its weight's per-example norms are
    null there (a layer type they are not computed for), its gradient that of run A. compare said "len(per_example_norm):
    2 vs 0", a difference (exit 1), counting the null as an empty list (found 2026-11-27)."""
    import torch
    from torch import nn

    import gradrunner
    from gradrunner.capturing.per_example_check import PerExampleWarning

    class OwnLinear(nn.Module):
        def __init__(self, lin: nn.Linear) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(lin.weight.detach().clone()), nn.Parameter(lin.bias.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias)

    batches = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(1))
    norms: dict[str, list[float]] = {}
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        if name == "b":
            model[2] = OwnLinear(model[2])
        with pytest.warns(PerExampleWarning) if name == "b" else contextlib.nullcontext():
            with gradrunner.record(model, ["0:weight", "2:weight"], tmp_path / name, per_example=True) as rec:
                for batch in batches:
                    model(batch).pow(2).mean().backward()
                    norms.setdefault(name, []).append(float(model[2].weight.grad.norm()))  # plain torch's
                    model.zero_grad()
                    rec.step()
    b = pd.read_parquet(tmp_path / "b" / "grads.parquet").set_index(["step", "tap"])
    assert b.loc[(0, "2:weight"), "per_example_norm"] is None and b.loc[(0, "0:weight"), "per_example_norm"] is not None
    assert norms["a"] == norms["b"] == pytest.approx(b.xs("2:weight", level="tap")["norm"].tolist(), rel=1e-6)
    c = compare_runs(tmp_path / "a", tmp_path / "b")
    assert c.agree, c.summary()
    assert "per_example_norm is null (unknown) in run B only on 2 record(s), the first at step 0, tap 2:weight: " \
           "those are not compared" in c.notes, c.notes  # fmt: skip
    compared = c.values[c.values["stat"].str.startswith(("per_example_norm", "len(per_example_norm)"))]
    assert sorted(set(compared["tap"])) == ["0:weight"] and len(compared) == 2  # the known ones still are
    code, out, _ = run_main(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and out.startswith("note: per_example_norm is null (unknown) in run B only")


def test_histograms_and_shapes_are_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_a, run_b = _recorded_pair(tmp_path, rows_b=3, histogram=True)  # run B: batches of 3 rows, not 2
    c = compare_runs(run_a, run_b)
    a, b = pd.read_parquet(run_a / "grads.parquet"), pd.read_parquet(run_b / "grads.parquet")
    shape = c.values[c.values["stat"].str.startswith("shape")].set_index(["step", "tap"])
    assert shape.loc[(0, "0:output"), ["stat", "a", "b"]].tolist() == ["shape[0]", 2.0, 3.0]  # 2 x 4 against 3 x 4
    assert not shape.loc[(0, "2:weight"), "differs"]  # the weight's shape is the weight's
    hist = c.values[c.values["stat"].str.startswith("hist_counts")]
    want = [not np.array_equal(x, y) for x, y in zip(a["hist_counts"], b["hist_counts"], strict=True)]
    assert hist["differs"].tolist() == want and any(want)


def test_values_captured_differently_are_named_not_compared(tmp_path: Path) -> None:
    """A sample of 4 positions against every element (a replay of a sampled run): other elements, not a difference."""
    run_a, run_b = _recorded_pair(tmp_path, options_b={"values": "full"}, values="sample", sample_size=4)
    c = compare_runs(run_a, run_b)
    note = "values captured differently (capture.values=sample (4 positions, seed 0) in run A, full in run B): not compared"
    assert c.agree and note in c.notes and not c.values["stat"].str.startswith("values").any()


def test_values_captured_differently_are_named_in_a_run_without_done_json(tmp_path: Path) -> None:
    """A run that stopped (capture.on_nonfinite=stop) or failed has no done.json: its capture.values is read from its
    grads.parquet's config, so its 4 sampled elements are not compared with a replay's 12 (they were: "len(values)
    4.0 vs 12.0", and an identical replay was judged "not exact")."""
    run_a, run_b = _recorded_pair(tmp_path, options_b={"values": "full"}, values="sample", sample_size=4)
    (run_a / "done.json").unlink()
    assert pd.read_parquet(run_a / "grads.parquet")["values"].map(len).eq(4).all()
    c = compare_runs(run_a, run_b)
    note = "values captured differently (capture.values=sample (4 positions, seed 0) in run A, full in run B): not compared"
    assert c.agree and note in c.notes and not c.values["stat"].str.startswith(("values", "len(values)")).any()


def test_counts_are_compared_exactly_whatever_the_tolerance(tmp_path: Path) -> None:
    """One element or one histogram count more is another record: numel and hist_counts agree only when equal
    (with rtol=0.5, 8 elements against 12 were "within the tolerance": |8 - 12| <= 0.5 * 8)."""
    run_a, run_b = _recorded_pair(tmp_path, rows_b=3, histogram=True)  # run B: batches of 3 rows, not 2
    a, b = pd.read_parquet(run_a / "grads.parquet"), pd.read_parquet(run_b / "grads.parquet")
    c = compare_runs(run_a, run_b, rtol=0.5, atol=0.0)
    numel = c.values[c.values["stat"] == "numel"].set_index(["step", "tap"])
    assert numel.loc[(0, "0:output"), ["a", "b", "differs"]].tolist() == [8.0, 12.0, True]
    assert not numel.loc[(0, "2:weight"), "differs"]
    hist = c.values[c.values["stat"].str.startswith("hist_counts")]
    want = [not np.array_equal(x, y) for x, y in zip(a["hist_counts"], b["hist_counts"], strict=True)]
    assert hist["differs"].tolist() == want and any(want)
