"""`noise_scale`: McCandlish et al.'s estimates from recorded norms, against per-example gradients and a known noise.

Records are built as the capture writes them for parameter taps: `norm` the `.grad` norm,
`per_example_norm` each row's share (from `PerExampleNorms`), `update_norm` set.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from gradrunner.analysis.noise import WHOLE_MODEL, NoiseScaleWarning, noise_scale
from gradrunner.capturing.per_example import PerExampleNorms
from gradrunner.errors import GradrunnerError


def records(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], reduction: str = "mean"
) -> pd.DataFrame:
    """One step per batch: each parameter's record (norm of .grad, per-example norms), as the capture writes them."""
    params = [(f"{mn}:{pn}", m, p) for mn, m in model.named_modules() for pn, p in m.named_parameters(recurse=False)]
    out = []
    with PerExampleNorms(model, params) as pex:
        for step, (x, y) in enumerate(batches):
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
            norms = pex.norms()
            for name, _, p in params:
                pen = norms[name]
                assert pen is not None, pex.reasons()[name]
                out.append({"run_id": "r", "step": step, "tap": name, "name": name.split(":")[1], "norm": float(p.grad.norm()),
                            "per_example_norm": pen.tolist(), "update_norm": 1.0, "has_grad": True, "rank": 0,
                            "value_norm": float(p.detach().norm()), "numel": p.numel()})  # fmt: skip
    return pd.DataFrame(out)


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, P): each example's own gradient (its loss alone, not divided by B), every parameter flattened."""
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    return torch.stack(rows)


def test_against_estimates_from_per_example_gradients() -> None:
    """g2 = |mean g|^2 - tr(S)/B and trace_sigma = tr(S) (S: the unbiased sample covariance of the g_i), whole model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    batches = [(torch.randn(6, 3), torch.randn(6, 2)) for _ in range(3)]
    ns = noise_scale(records(model, batches))
    for step, (x, y) in enumerate(batches):
        g = per_example_grads(model, x, y) / y.shape[1]  # mse mean also divides by the output width
        b = g.shape[0]
        trace = float(((g - g.mean(0)) ** 2).sum() / (b - 1))
        g2 = float(g.mean(0).square().sum()) - trace / b
        row = ns[(ns.step == step) & (ns.tap == WHOLE_MODEL)].iloc[0]
        assert row.rows == b
        assert row.trace_sigma == pytest.approx(trace, rel=1e-6)
        assert row.g2 == pytest.approx(g2, rel=1e-5, abs=1e-7 * trace)
        assert row.b_simple == pytest.approx(trace / g2, rel=1e-4)
    one = ns[(ns.step == 0) & (ns.tap == "2:weight")].iloc[0]  # a single tap: its own block of the gradient
    x, y = batches[0]
    g = (per_example_grads(model, x, y) / y.shape[1])[:, 3 * 4 + 4 : 3 * 4 + 4 + 8]
    assert one.trace_sigma == pytest.approx(float(((g - g.mean(0)) ** 2).sum() / 5), rel=1e-6)


class SummedCells(nn.Module):
    """An RNN cell's pattern, W_x x + b_x + W_h h + b_h: the two biases always get equal gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(2, 4), nn.Linear(4, 2)

    def forward(self, xz: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(xz[:, :3]) + self.b(xz[:, 3:])))  # type: ignore[no-any-return]


def test_distinct_parameters_with_equal_gradients_both_count_in_the_whole_model() -> None:
    """a.bias and b.bias have the same N, S and B every step; the whole model's row dropped one as if tied (found
    2026-11-27). Their values differ: both count, and "*" is the estimate from every parameter's per-example gradient."""
    torch.manual_seed(5)
    model = SummedCells()
    batches = [(torch.randn(6, 5), torch.randn(6, 2)) for _ in range(2)]
    frame = records(model, batches)
    ns = noise_scale(frame)
    for step, (x, y) in enumerate(batches):
        g = per_example_grads(model, x, y) / y.shape[1]
        trace = float(((g - g.mean(0)) ** 2).sum() / (g.shape[0] - 1))
        row = ns[(ns.step == step) & (ns.tap == WHOLE_MODEL)].iloc[0]
        assert row.trace_sigma == pytest.approx(trace, rel=1e-6)
        taps = ns[(ns.step == step) & (ns.tap != WHOLE_MODEL)]
        assert row.trace_sigma == pytest.approx(taps.trace_sigma.sum(), rel=1e-9)  # disjoint parameters add


def test_b_simple_does_not_depend_on_the_loss_reduction() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2))
    batches = [(torch.randn(5, 3), torch.randn(5, 2))]
    mean, total = noise_scale(records(model, batches, "mean")), noise_scale(records(model, batches, "sum"))
    # float32 gradients; g2 is a difference of near-equal sums at B = 5, hence 1e-4
    np.testing.assert_allclose(total["b_simple"], mean["b_simple"], rtol=1e-4)
    np.testing.assert_allclose(total["g2"], mean["g2"] * 10**2, rtol=1e-4)  # sum of B x 2 outputs = 10 x the mean


def test_linear_regression_with_known_noise() -> None:
    """y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2), loss (x.w - y)^2 / 2 at w = w* + delta:

    g_i = (x_i.delta - eps_i) x_i, so G = delta and Sigma = (|delta|^2 + s^2) I + delta delta^T:
    tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2, |G|^2 = |delta|^2. Averaged over 400 steps of 64
    examples (25,600 draws), the unbiased estimates agree within 6% (g2: spread 1.8% over 20 seeds)
    and 3% (trace_sigma: 0.9%); the last b_simple_ema (beta 0.99) within 10% (2.3%). The seed is fixed.
    """
    torch.manual_seed(2)
    d, s, steps, b = 5, 1.0, 400, 64
    model = nn.Linear(d, 1, bias=False)
    w_star = torch.randn(1, d)
    delta = torch.randn(1, d)
    delta = delta / delta.norm()
    with torch.no_grad():
        model.weight.copy_(w_star + delta)
    batches = []
    for _ in range(steps):
        x = torch.randn(b, d)
        batches.append((x, x @ w_star.T + s * torch.randn(b, 1)))
    frame = records(model, batches)  # mse_loss mean = (1/B) sum (x.w - y)^2: twice the loss above, same b_simple
    ns = noise_scale(frame, ema=0.99)
    tap = ns[ns.tap == ":weight"]
    assert len(tap) == steps
    g2_true, trace_true = 1.0 * 4, (d * (1 + s**2) + 1) * 4  # the factor 2 of mse on both: 4 on squares
    assert tap["g2"].mean() == pytest.approx(g2_true, rel=0.06)
    assert tap["trace_sigma"].mean() == pytest.approx(trace_true, rel=0.03)
    assert tap["b_simple_ema"].iloc[-1] == pytest.approx(trace_true / g2_true, rel=0.10)


def test_ema_is_the_ratio_of_the_two_smoothed_estimates() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 1))
    ns = noise_scale(records(model, [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(5)]), ema=0.5)
    tap = ns[ns.tap == "0:weight"].sort_values("step")
    num = den = 0.0
    for t, g, got in zip(tap.trace_sigma, tap.g2, tap.b_simple_ema, strict=True):
        num, den = 0.5 * num + 0.5 * t, 0.5 * den + 0.5 * g
        assert got == pytest.approx(num / den)


def test_missing_per_example_norms_name_the_tap_and_the_option() -> None:
    torch.manual_seed(4)
    frame = records(nn.Sequential(nn.Linear(2, 1)), [(torch.randn(3, 2), torch.randn(3, 1))])
    with pytest.raises(GradrunnerError, match=r"capture\.per_example=true"):
        noise_scale(frame.drop(columns=["per_example_norm"]))
    frame.loc[frame.tap == "0:bias", "per_example_norm"] = None
    with pytest.raises(GradrunnerError, match=r"'0:bias' \(steps 0\).*capture\.per_example=true"):
        noise_scale(frame, taps=["0:weight", "0:bias"])  # named: an error
    with pytest.warns(NoiseScaleWarning, match=r"leaves out '0:bias' \(steps 0\)"):
        left_out = noise_scale(frame)  # chosen by default: left out, said
    named = noise_scale(frame, taps=["0:weight"])
    assert set(named.tap) == {"0:weight", WHOLE_MODEL}
    pd.testing.assert_frame_equal(left_out, named)
    frame["per_example_norm"] = None
    with pytest.raises(GradrunnerError, match=r"capture\.per_example=true"):
        noise_scale(frame)  # no tap has them: an error
    with pytest.raises(GradrunnerError, match=r"ema=1.5"):
        noise_scale(frame, ema=1.5)


def test_a_step_without_per_example_norms_is_left_out_not_the_run() -> None:
    """Per-example norms null at some steps only (a diverging run: the rows' squared norms overflowed float32 while
    `norm` is finite): noise_scale raised "turn them on with capture.per_example=true", which was on, and returned
    nothing for the other steps (found 2026-11-27). Those steps' rows of the tap are left out, said once; the
    other steps' estimates are those of the records without them; "*" of a step missing a tap is NaN."""
    torch.manual_seed(7)
    frame = records(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)), [(torch.randn(4, 2), torch.randn(4, 1))
                                                                               for _ in range(4)])  # fmt: skip
    every = frame.step == 2
    one = (frame.step == 3) & (frame.tap == "0:weight")
    frame.loc[every | one, "per_example_norm"] = None
    reference = noise_scale(frame[~every & ~one]).set_index(["step", "tap"])
    for taps in (None, ["0:weight", "0:bias", "2:weight", "2:bias"]):
        with pytest.warns(NoiseScaleWarning, match=r"'0:weight' \(steps 2-3\).*'2:weight' \(steps 2\)"):
            ns = noise_scale(frame, taps=taps).set_index(["step", "tap"])
        assert 2 not in ns.index.get_level_values("step")
        assert ns.loc[(3, WHOLE_MODEL), ["g2", "trace_sigma", "b_simple"]].isna().all()  # never the other taps alone
        same = [k for k in ns.index if k != (3, WHOLE_MODEL)]
        assert sorted(same) == sorted(k for k in reference.index if k != (3, WHOLE_MODEL))
        pd.testing.assert_frame_equal(ns.loc[same], reference.loc[same])
    ranks = pd.concat([frame.assign(per_example_norm=[p if p is None else p[:2] for p in frame.per_example_norm], rank=0),
                       frame.assign(per_example_norm=[p if p is None else p[2:] for p in frame.per_example_norm], rank=1)])  # fmt: skip
    ranks.loc[(ranks.step == 1) & (ranks.tap == "2:bias") & (ranks["rank"] == 1), "per_example_norm"] = None
    with pytest.warns(NoiseScaleWarning, match=r"'2:bias' \(steps 1-2\)"):
        split = noise_scale(ranks).set_index(["step", "tap"])  # a step's tap without rank 1's rows: not half a batch
    assert (1, "2:bias") not in split.index and split.loc[(1, WHOLE_MODEL), ["g2", "trace_sigma"]].isna().all()
    pd.testing.assert_frame_equal(
        split.loc[[(0, "2:bias"), (0, WHOLE_MODEL)]], ns.loc[[(0, "2:bias"), (0, WHOLE_MODEL)]]
    )


def test_a_nan_tap_makes_the_whole_model_row_nan() -> None:
    """A step whose gradients are NaN: the taps' estimates are NaN, and so is "*" (it read 0 and 0, found 2026-11-27,
    pandas' sum skipping NaN); a step with one NaN tap pools nothing either, never the other taps alone."""
    torch.manual_seed(6)
    frame = records(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)), [(torch.randn(4, 2), torch.randn(4, 1))
                                                                               for _ in range(3)])  # fmt: skip
    nan = [float("nan")] * 4
    all_nan = frame.step == 1
    frame.loc[all_nan, "norm"] = float("nan")
    frame.loc[all_nan, "per_example_norm"] = pd.Series([nan] * int(all_nan.sum()), index=frame.index[all_nan])
    one = (frame.step == 2) & (frame.tap == "0:weight")
    frame.loc[one, "norm"] = float("nan")
    frame.loc[one, "per_example_norm"] = pd.Series([nan], index=frame.index[one])
    ns = noise_scale(frame).set_index(["step", "tap"])
    assert ns.loc[(1, "0:weight"), ["g2", "trace_sigma"]].isna().all()
    for step in (1, 2):
        assert ns.loc[(step, WHOLE_MODEL), ["g2", "trace_sigma", "b_simple"]].isna().all(), step
    assert np.isfinite(ns.loc[(0, WHOLE_MODEL), ["g2", "trace_sigma"]].to_numpy(dtype=np.float64)).all()


def test_ranks_pool_their_rows() -> None:
    """Two ranks' records of one step are one batch: the same estimates as one rank holding all rows."""
    torch.manual_seed(5)
    frame = records(nn.Sequential(nn.Linear(2, 1)), [(torch.randn(6, 2), torch.randn(6, 1))])
    split = pd.concat([frame.assign(per_example_norm=[p[:2] for p in frame.per_example_norm], rank=0),
                       frame.assign(per_example_norm=[p[2:] for p in frame.per_example_norm], rank=1)])  # fmt: skip
    pd.testing.assert_frame_equal(noise_scale(split), noise_scale(frame))


def test_from_a_recorded_gpt2_run_against_per_example_gradients(tmp_path: Path) -> None:
    """record(per_example=True) of a tiny random-init GPT-2 (every parameter tapped, lm_head tied to wte: counted
    once in "*"), 2 SGD steps; each step's whole-model estimates against per-example gradients of a twin in lockstep."""
    from per_example_reference import gpt2

    from gradrunner import record
    from gradrunner.analysis import load

    torch.manual_seed(6)
    model = gpt2()
    twin = copy.deepcopy(model)
    taps = [f"{mn}:{pn}" for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)]
    assert "lm_head:weight" in taps and "transformer.wte:weight" in taps
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    batches = [torch.randint(0, 40, (5, 6)) for _ in range(2)]
    pos = torch.arange(6).expand(5, 6)

    def lm(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=ids, position_ids=pos[: ids.shape[0]]).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))

    want = []
    with record(model, taps, tmp_path / "run", per_example=True, update_norms=True) as rec:
        for ids in batches:
            rows = []
            for i in range(ids.shape[0]):  # each example's own gradient (its mean over tokens), every parameter once
                twin.zero_grad(set_to_none=True)
                lm(twin, ids[i : i + 1]).backward()
                rows.append(torch.cat([p.grad.reshape(-1) for p in twin.parameters()]).double())
            g = torch.stack(rows)
            trace = float(((g - g.mean(0)) ** 2).sum() / (g.shape[0] - 1))
            want.append((float(g.mean(0).square().sum()) - trace / g.shape[0], trace))
            twin.zero_grad(set_to_none=True)
            lm(twin, ids).backward()
            opts[1].step()
            loss = lm(model, ids)
            loss.backward()
            opts[0].step()
            opts[0].zero_grad(set_to_none=True)
            rec.step(loss)
    ns = noise_scale(load(tmp_path / "run"))
    whole = ns[ns.tap == WHOLE_MODEL].sort_values("step")
    assert len(whole) == 2 and (whole.rows == 5).all()
    for (g2, trace), (_, row) in zip(want, whole.iterrows(), strict=True):
        assert row.trace_sigma == pytest.approx(trace, rel=1e-4)
        assert row.g2 == pytest.approx(g2, rel=1e-3, abs=1e-4 * trace)
        assert row.b_simple == pytest.approx(trace / g2, rel=1e-3)


def test_the_run_report_draws_the_noise_scale_per_layer(tmp_path: Path) -> None:
    """A runner job with capture.per_example=true: the report's noise-scale section, its table noise_scale's last step."""
    pytest.importorskip("matplotlib")
    from conftest import compose_cfg
    from report_tables import tables_after

    from gradrunner.analysis import load
    from gradrunner.report import write_report
    from gradrunner.run.loop import train

    train(compose_cfg("+experiment=mlp", "steps=4", "capture.per_example=true", "report=false"), out_dir=tmp_path)
    page = write_report(tmp_path).read_text()
    assert ">Gradient noise scale</h2>" in page and (tmp_path / "report-noise_scale.png").is_file()
    table = tables_after(page, "Gradient noise scale")
    want = noise_scale(load(tmp_path), ema=0.9)
    want = want[want.step == want.step.max()]
    assert sorted(table.tap) == sorted(want.tap) and WHOLE_MODEL in set(table.tap) and len(want) >= 4
    for _, row in want.iterrows():
        got = table[table.tap == row.tap].iloc[0]
        assert got.b_simple_ema == pytest.approx(row.b_simple_ema, rel=1e-3)


def test_a_tap_that_is_not_a_parameter_is_refused_when_named() -> None:
    """`taps=["0:output"]` (an activation: its row norms add up to its norm, so g2 = 0 and b_simple ~ 1e17) was taken as
    a parameter tap and pooled into "*" (found 2026-11-27). The noise scale is over parameter gradients only: a
    module's output or input, a `local.` variable, or a tap without the `update_norm` the parameter taps of these
    records have, is refused by name; the default selection is the parameter taps alone."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    frame = records(model, [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)])
    params = sorted(set(frame.tap))
    acts = []
    for step, part in frame.groupby("step"):  # an activation's record: its rows' norms, and its norm, of dim 0's rows
        grad = torch.randn(4, 3, dtype=torch.float64)
        for tap in ("0:output", "1:input.0", ":local.h", ":h"):
            acts.append({"run_id": "r", "step": step, "tap": tap, "name": tap.split(":")[1], "norm": float(grad.norm()),
                         "per_example_norm": grad.norm(dim=1).tolist(), "update_norm": None, "has_grad": True,
                         "rank": 0, "value_norm": 1.0, "numel": 12})  # fmt: skip
    frame = pd.concat([frame, pd.DataFrame(acts)], ignore_index=True)
    reference = noise_scale(frame[frame.tap.isin(params)])
    pd.testing.assert_frame_equal(noise_scale(frame), reference)  # by default: the parameter taps only
    for tap, why in (
        ("0:output", "output"),
        ("1:input.0", "input"),
        (":local.h", "local variable"),
        (":h", "update_norm"),
    ):
        with pytest.raises(GradrunnerError, match=rf"'{re.escape(tap)}' \(.*{why}.*parameter taps.*'0:bias'"):
            noise_scale(frame, taps=[*params, tap])
    without_updates = frame.assign(update_norm=None)
    with pytest.raises(GradrunnerError, match=r"'0:output' \(a module's output"):
        noise_scale(without_updates, taps=["0:output"])
    pd.testing.assert_frame_equal(noise_scale(without_updates, taps=params), reference)
