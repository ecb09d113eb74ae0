"""A `torch.autograd.grad(..., create_graph=True)` of the user's inside a step is part of a loss, not a backward.

Gradient penalties (WGAN-GP, R1), a PINN's derivatives of its output by its input, a MAML inner step and
a force computed in `forward()` call `torch.autograd.grad` through the tapped model before the step's own
backward. Those calls fill no `.grad`; the step's records are the gradients of the backward that does
(`loss.backward()`, `cap.backward(loss)`, a framework's). Each test compares every tap's gradient with a
reference taken without gradrunner (`torch.autograd.grad` of the step's loss by each call's tapped
tensor, kept by plain forward hooks) and the parameters' `.grad` with the uncaptured run, bit for bit.
Before this was handled, every strategy recorded the inner call as a micro-step of its own (its gradient
of `out.sum()`, not of the loss), `per_example_norm` of the parameters was null ("two backward passes"),
and `autograd_grad` refused the step with a message saying the user had run `loss.backward()`. Without
`create_graph` (a saliency map, an attack's step) the call is a backward like `loss.backward()`: recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.func import functional_call

from gradrunner import capture, record
from gradrunner.capturing import torch_compat

Step = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # the step's loss, inner autograd.grad calls included


def _critic() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def wgan_gp(critic: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A WGAN-GP critic loss: real and fake scores, and the penalty on the gradient at interpolates."""
    real, fake = x[:4], x[4:] * 0.5 + 0.1
    alpha = torch.linspace(0.1, 0.9, 4, dtype=x.dtype, device=x.device).unsqueeze(1)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (g,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def _pinn() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1))


def pinn(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A heat equation's residual u_t - u_xx, with u's derivatives by its input (two inner autograd.grad)."""
    x = x.clone().requires_grad_(True)
    u = net(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    return ((du[:, 1] - d2u[:, 0]) ** 2).mean() + (u**2).mean()


def maml(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One MAML inner step by `torch.autograd.grad` of the parameters, the query loss through the fast weights."""
    support, query = x[:4], x[4:]
    inner = (net(support) ** 2).mean()
    names = [n for n, _ in net.named_parameters()]
    grads = torch.autograd.grad(inner, list(net.parameters()), create_graph=True)
    fast = {n: p - 0.1 * g for n, p, g in zip(names, net.parameters(), grads, strict=True)}
    return ((functional_call(net, fast, (query,)) - 1) ** 2).mean()


class Forces(nn.Module):
    """A force field: `forward()` returns -dE/dx of an energy network (a `torch.autograd.grad` inside the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(3, 10), nn.SiLU(), nn.Linear(10, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        (force,) = torch.autograd.grad(-self.energy(x).sum(), x, create_graph=True)
        return force


def forces(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ((model(x) - 0.5) ** 2).mean()


CASES: dict[str, tuple[Callable[[], nn.Module], Step, list[str], tuple[int, ...]]] = {
    "wgan_gp": (_critic, wgan_gp, ["0:output", "1:output", "4:output", "0:weight", "4:bias"], (8, 6)),
    "pinn": (_pinn, pinn, ["0:output", "1:output", "3:output", "4:output", "2:weight"], (10, 2)),
    "maml": (_pinn, maml, ["0:output", "3:output", "0:weight", "4:bias"], (8, 2)),
    "forces": (Forces, forces, ["energy.0:output", "energy.1:output", "energy.0:weight"], (6, 3)),
}


def _reference(model: nn.Module, step: Step, x: torch.Tensor, taps: list[str]) -> dict[str, list[torch.Tensor | None]]:
    """Each activation tap's gradient per call, `torch.autograd.grad` of the step's loss, plain forward hooks."""
    outputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    for tap in taps:
        path, name = tap.split(":")
        if name == "output":
            mod = model.get_submodule(path)
            handles.append(mod.register_forward_hook(lambda m, a, out, tap=tap: outputs.setdefault(tap, []).append(out)))
    try:
        loss = step(model, x)
    finally:
        for h in handles:
            h.remove()
    flat = [t for calls in outputs.values() for t in calls]
    grads = iter(torch.autograd.grad(loss, flat, allow_unused=True))
    return {tap: [next(grads) for _ in calls] for tap, calls in outputs.items()}


def _run(case: str, strategy: str | None, own: bool, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor | None], object]:
    make, step, taps, shape = CASES[case]
    torch.manual_seed(0)
    model = make().double().to(device)
    x = torch.randn(*shape, dtype=torch.float64).to(device)
    if strategy is None:
        loss = step(model, x)
        loss.backward()
        return loss, _grads(model), _reference(model, step, x, taps)
    with capture(model, taps, strategy=strategy) as cap:
        loss = step(model, x)
        cap.backward(loss) if own else loss.backward()
        recs = cap.records(loss)
        grads = {t: cap.grads.calls(t) for t in taps if not t.endswith(("weight", "bias"))}
    return loss, _grads(model), (grads, recs)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])  # CUDA: hooks on the engine's device thread
@pytest.mark.parametrize("own", [True, False], ids=["cap.backward", "loss.backward"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_users_autograd_grad_calls_are_not_recorded_and_change_nothing(
    strategy: str, case: str, own: bool, device: str
) -> None:
    if strategy == "autograd_grad" and not own:
        pytest.skip("autograd_grad takes the step's backward from cap.backward (a loss.backward() is refused)")
    bare_loss, bare_grads, ref = _run(case, None, own, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of an unclosed step or a second backward
        loss, grads, (got, recs) = _run(case, strategy, own, device)  # type: ignore[misc]
    assert torch.equal(loss, bare_loss)
    for g, want in zip(grads, bare_grads, strict=True):
        assert (g is None and want is None) or (g is not None and want is not None and torch.equal(g, want))
    assert isinstance(ref, dict)
    for tap, calls in ref.items():
        assert len(got[tap]) == len(calls), tap
        for c, (g, r) in enumerate(zip(got[tap], calls, strict=True)):
            assert (g is None) == (r is None), (tap, c)
            if r is not None:
                torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12, msg=f"{tap} call {c}")
    # one backward: no micro-step numbers, each (tap, call) once, and the parameters' rows are their .grad's
    assert recs.micro_step is None or all(m is None for m in recs.micro_step)
    keys = [(k.tap, k.call) for k in recs.keys]
    assert len(keys) == len(set(keys))
    _, _, taps, _ = CASES[case]
    named = dict(_model_params(case))
    for i, k in enumerate(recs.keys):
        if k.tap in named:
            want = bare_grads[named[k.tap]].norm().item()  # type: ignore[union-attr]
            assert recs.row(i)["norm"] == pytest.approx(want, rel=1e-6), k.tap


def _model_params(case: str) -> list[tuple[str, int]]:
    return [(n[::-1].replace(".", ":", 1)[::-1], i) for i, (n, _) in enumerate(CASES[case][0]().named_parameters())]


# -- without create_graph: a torch.autograd.grad of the user's is a backward of its own -------------------------
def _fgsm_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, attack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_adv, loss): the attack's gradient by `torch.autograd.grad` through the tapped model, or x_adv given."""
    if attack:
        probe = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(nn.functional.cross_entropy(model(probe), y), probe)
        x = (x + 0.1 * gx.sign()).detach()
    return x, nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("per_example", [False, True], ids=["plain", "per_example"])
def test_an_attack_step_is_recorded_as_a_backward_of_its_own_and_leaves_the_training_rows_as_they_are(
    strategy: str, per_example: bool
) -> None:
    """An FGSM step by `torch.autograd.grad` (no create_graph) inside the training step: its rows are micro-step 0
    (the attack's gradients, as a saliency map's would be), the training backward's are micro-step 1 and equal
    those of the same step without the attack, `per_example_norm` of the parameters (shares of `.grad`) too."""
    if strategy == "autograd_grad":
        pytest.skip("autograd_grad refuses a backward it did not run (tests/test_engine.py)")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    taps = ["0:output", "2:output", "0:weight", "2:bias"]
    x_adv, _ = _fgsm_step(model, x, y, attack=True)  # the adversarial batch, computed outside any capture
    runs = []
    for attack in (True, False):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        with capture(model, taps, strategy=strategy, per_example=per_example) as cap:
            xa, loss = _fgsm_step(model, x if attack else x_adv, y, attack)
            assert torch.equal(xa, x_adv)
            cap.backward(loss)
            recs = cap.records(loss)
        runs.append({(recs.keys[i].tap, recs.keys[i].call, recs.row(i)["micro_step"]): recs.row(i) for i in range(len(recs))})
    with_attack, without = runs
    probe = x.clone().requires_grad_(True)  # the attack's own gradient at 2:output, without gradrunner
    model.load_state_dict(state)
    kept: list[torch.Tensor] = []
    handle = model[2].register_forward_hook(lambda m, a, out: kept.append(out))
    (g_attack,) = torch.autograd.grad(nn.functional.cross_entropy(model(probe), y), kept)
    handle.remove()
    assert with_attack[("2:output", 0, 0)]["norm"] == pytest.approx(float(g_attack.norm()), rel=1e-12)
    for (tap, call, micro), row in without.items():
        ours = with_attack[(tap, call, 1) if tap.endswith("output") else (tap, call, None)]
        assert ours["norm"] == row["norm"] and ours["has_grad"], tap
        if per_example:
            assert ours["per_example_norm"] is not None, tap
            np.testing.assert_array_equal(ours["per_example_norm"], row["per_example_norm"])


def test_a_saliency_map_by_autograd_grad_on_a_frozen_model_is_recorded(strategy: str) -> None:
    """Interpretability's own use: `torch.autograd.grad(score, x)` (as Captum's Saliency does) is the backward."""
    if strategy == "autograd_grad":
        pytest.skip("autograd_grad refuses a backward it did not run (tests/test_engine.py)")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).requires_grad_(False)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    kept: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, out: kept.append(out))
    (want,) = torch.autograd.grad(model(x)[:, 3].sum(), kept)
    handle.remove()
    with capture(model, ["0:output"], strategy=strategy) as cap:
        (saliency,) = torch.autograd.grad(model(x)[:, 3].sum(), x)
        got = cap.grads["0:output"]
    assert got is not None
    torch.testing.assert_close(got, want)


# -- record(): three WGAN-GP steps, one row per tap, call and step ------------------------------------------
def test_record_of_a_gradient_penalty_loop_has_one_row_per_tap_call_and_step(strategy: str, tmp_path: Path) -> None:
    torch.manual_seed(1)
    critic = _critic()
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    taps = ["0:output", "4:output", "0:weight"]
    batches = [torch.randn(8, 6) for _ in range(3)]
    with record(critic, taps, str(tmp_path), strategy=strategy) as rec:
        for x in batches:
            loss = wgan_gp(critic, x)
            rec.backward(loss) if strategy == "autograd_grad" else loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = pd.read_parquet(tmp_path / "grads.parquet")
    assert (tmp_path / "done.json").exists()
    # the critic runs three times a step (interpolates, fake, real): three calls of each activation tap
    counts = df.groupby(["step", "tap"]).size().to_dict()
    assert counts == {(s, t): (1 if t == "0:weight" else 3) for s in range(3) for t in taps}
    assert df["micro_step"].isna().all()
    # the interpolates' score takes no part in the loss (only its gradient does): that row alone has none
    missing = df[~df["has_grad"]]
    assert set(zip(missing["tap"], missing["call"], strict=True)) == {("4:output", 0)}
    assert missing["reason"].str.contains("takes no part").all()


def test_fills_grad_tells_the_backwards_apart() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    params = list(net.parameters())
    x = torch.randn(5, 3, requires_grad=True)
    seen: list[bool | None] = []

    def tapped() -> torch.Tensor:
        h = net[0](x)
        h.register_hook(lambda g: seen.append(torch_compat.fills_grad(params)))
        return net[2](net[1](h)).sum()  # type: ignore[no-any-return]

    tapped().backward()
    torch.autograd.grad(tapped(), x, create_graph=True)  # a gradient penalty's, a PINN's
    torch.autograd.grad(tapped(), params)  # a MAML inner step's: the parameters' accumulators captured, not run
    tapped().backward(inputs=[x])  # fills x.grad
    fast = {n: p * 1.0 for n, p in net.named_parameters()}  # the parameters' accumulators are not in this graph
    h = functional_call(net[0], {"weight": fast["0.weight"], "bias": fast["0.bias"]}, (x,))
    h.register_hook(lambda g: seen.append(torch_compat.fills_grad(params)))
    h.sum().backward()  # found by the walk from the node running now
    assert seen == [True, False, False, True, True]
    assert torch_compat.fills_grad(params) is None  # no backward runs


def test_without_the_engines_answer_every_backward_counts_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback: a torch without `_will_engine_execute_node` records the inner call as a backward (documented)."""
    monkeypatch.setitem(torch_compat.FEATURES, "will_engine_execute_node", False)
    torch.manual_seed(0)
    critic = _critic()
    with capture(critic, ["0:output"], strategy="hook") as cap:
        loss = wgan_gp(critic, torch.randn(8, 6))
        loss.backward()
        recs = cap.records(loss)
    assert recs.micro_step is not None and sorted({m for m in recs.micro_step if m is not None}) == [0, 1]


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.unused = nn.Linear(2, 2)  # never called: "takes no part in the loss" is true of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])
def test_a_step_of_torch_autograd_grad_only_gives_parameter_taps_the_reason_that_nothing_filled_grad(
    strategy: str,
) -> None:
    """Your own `torch.autograd.grad(loss, params)` (then `.grad` set by hand) adds nothing to `.grad`: a parameter
    tap, which records what a backward adds to `.grad`, has no gradient, and says so (it said "takes no part in the
    loss"); a step whose `loss.backward()` reaches the parameter records its gradient as before."""
    from gradrunner.capturing.grad_context import NO_PART, NOT_FILLED

    model, x = _WithUnused(), torch.randn(6, 4)
    taps = ["net.0:weight", "unused:weight", "net.0:output"]
    used = list(model.net.parameters())
    with capture(model, taps, strategy=strategy) as cap:
        loss = model(x).square().mean()
        for p, g in zip(used, torch.autograd.grad(loss, used), strict=True):
            p.grad = g
        by_hand = cap.records(loss)
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        filled = cap.records(loss)
    for recs, want in ((by_hand, [NOT_FILLED, NOT_FILLED, None]), (filled, [None, NO_PART, None])):
        rows = {k.tap: i for i, k in enumerate(recs.keys)}
        assert recs.reason is not None and [recs.reason[rows[t]] for t in taps] == want
    rows = {k.tap: i for i, k in enumerate(filled.keys)}
    assert float(filled.stats["norm"][rows["net.0:weight"]]) == pytest.approx(float(model.net[0].weight.grad.double().norm()))


@pytest.mark.parametrize("strategy", ["hook", "retain_grad", "autograd_grad"])
def test_per_sample_gradients_by_torch_func_inside_a_session_are_not_a_backward_of_the_step(strategy: str) -> None:
    """The user's own per-sample gradients, vmap(grad(functional_call(model, ...))) (Opacus-style clipping, a metric), in a
    step whose parameters are tapped: found 2026-11-27, every strategy raised AttributeError ('NoneType' object has no
    attribute 'next_functions') inside the transform, asking whether its backward fills .grad (a view of a parameter
    records no node there). It fills none: the record is the step's .grad, its per_example_norm the transform's
    per-sample gradients / B."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (xi[None],)) - yi) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))
    want = per_sample(params, x, y)["2.weight"]
    with capture(model, ["2:weight"], strategy=strategy, per_example=True) as cap:
        got = per_sample(params, x, y)["2.weight"]
        loss = ((model(x) - y) ** 2).mean()
        cap.backward(loss)
        recs = cap.records(loss)
    assert torch.equal(got, want) and len(recs) == 1
    row = recs.row(0)
    grad = model[2].weight.grad
    assert grad is not None and row["micro_step"] is None and row["norm"] == pytest.approx(grad.norm().item(), rel=1e-6)
    np.testing.assert_allclose(row["per_example_norm"], (want / 5).flatten(1).norm(dim=1).numpy(), rtol=1e-5)
