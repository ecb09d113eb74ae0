"""Issue 18's nine findings: patterns where capture changed the computation or the gradients, each checked
against the uncaptured run (bit for bit) and a reference written here in plain torch.

Each test failed on main 815a200 (before the fix) and passes after it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import pytest
import torch
from conftest import class_forwards, leftover_hooks
from torch import nn
from torch.nn.utils import parametrize

from gradrunner import capture
from gradrunner.capturing.grad_context import GRAPH_FREED, TRANSFORMED
from gradrunner.errors import GradrunnerError


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_as_uncaptured(
    model: nn.Module, run: Callable[[], torch.Tensor], taps: list[str], strategy: str, **kw: object
) -> tuple[torch.Tensor, object]:
    """Run once bare, once captured: loss and every parameter's .grad must be bit-identical; returns (loss, cap)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    own = leftover_hooks(model)  # the model's own hooks and instance forwards stay; nothing of ours is added
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    bare = run()
    bare.backward()
    want = _grads(model)
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    with capture(model, taps, strategy=strategy, **kw) as cap:  # type: ignore[arg-type]
        torch.manual_seed(1)
        loss = run()
        cap.backward(loss)
    assert torch.equal(loss, bare)
    got = _grads(model)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w))
    assert leftover_hooks(model) == own
    return loss, cap


# -- 1. retain_grad broke writes through views ---------------------------------------------------------
class Jitter(nn.Module):
    """Gaussian-process style jitter written through a view of the kernel matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K = self.fc(x)
        d = K.diagonal()
        d.add_(0.5)
        return K


@pytest.mark.parametrize("taps", [[":K"], ["fc:output"], [":K", "fc:output", "fc:weight"]])
def test_writes_through_views_reach_the_base(strategy: str, taps: list[str]) -> None:
    model = Jitter()
    x = torch.randn(4, 4, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).pow(2).sum(), taps, strategy)
    K = model.fc(x).detach()
    K.diagonal().add_(0.5)
    grad_K = 2 * K  # the jitter is a constant: the gradient into K before it equals the one after
    want = {":d": grad_K.diagonal(), ":K": grad_K, "fc:output": grad_K, "fc:weight": grad_K.T @ x}
    for tap in taps:
        torch.testing.assert_close(cap.grads[tap], want[tap], rtol=1e-12, atol=1e-12)  # type: ignore[attr-defined]


def test_a_tapped_view_changed_in_place_says_why_it_has_no_gradient(strategy: str) -> None:
    # Autograd never computes the gradient of the view's value before the in-place write (its node leaves the
    # graph): every strategy records that, and the computation is unchanged.
    model = Jitter()
    x = torch.randn(4, 4, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).pow(2).sum(), [":d", ":K"], strategy)
    assert cap.grads[":d"] is None  # type: ignore[attr-defined]
    assert "changed in place" in {k.tap: r for k, r in cap.reasons().items()}[":d"]  # type: ignore[attr-defined]
    assert cap.grads[":K"] is not None  # type: ignore[attr-defined]


# -- 2. a local tap discarded an instance-level forward ------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.tanh()


def _monkeypatched(m: Block) -> None:
    m.forward = types.MethodType(lambda self, x: Block.forward(self, x) * 4, m)  # type: ignore[method-assign]


def _closure(m: Block) -> None:
    orig = m.forward
    m.forward = lambda x: orig(x) * 4  # type: ignore[method-assign]


def _accelerate_style(m: Block) -> None:
    def new_forward(module: Block, x: torch.Tensor) -> torch.Tensor:
        return module._old_forward(x) * 4  # type: ignore[operator]

    m._old_forward = m.forward  # type: ignore[assignment]
    m.forward = functools.update_wrapper(functools.partial(new_forward, m), m._old_forward)  # type: ignore[method-assign]


@pytest.mark.parametrize("wrap", [_monkeypatched, _closure, _accelerate_style])
def test_instance_forward_is_kept_and_restored(strategy: str, wrap: Callable[[Block], None]) -> None:
    outer = nn.Sequential(Block(), Block())
    wrap(outer[0])  # type: ignore[arg-type]
    before = dict(outer[0].__dict__)
    forwards = class_forwards(outer)
    x = torch.randn(2, 3, dtype=torch.float64)
    loss, cap = same_as_uncaptured(outer, lambda: outer(x).sum(), ["0:h", "1:h"], strategy)
    with torch.no_grad():
        h0 = outer[0].fc(x)
        out0 = h0.tanh() * 4
        h1 = outer[1].fc(out0)
    g1 = 1 - h1.tanh() ** 2
    g0 = 4 * (g1 @ outer[1].fc.weight) * (1 - h0.tanh() ** 2)
    torch.testing.assert_close(cap.grads["1:h"], g1, rtol=1e-12, atol=1e-12)  # type: ignore[attr-defined]
    torch.testing.assert_close(cap.grads["0:h"], g0, rtol=1e-12, atol=1e-12)  # type: ignore[attr-defined]
    assert all(outer[0].__dict__.get(k) is v for k, v in before.items() if k in ("forward", "_old_forward"))
    assert all(cls.forward is fwd for cls, fwd in forwards.items())
    assert "forward" not in outer[1].__dict__


# -- 3. the model's own tensor hooks on a tapped tensor -------------------------------------------------
class Reversal(nn.Module):
    """Gradient scaling inside the model (a domain-adversarial reversal, scaled by -3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: -3 * g)
        return self.b(h)


def test_a_taps_gradient_is_after_the_models_own_hooks(strategy: str) -> None:
    model = Reversal()
    x = torch.randn(5, 4, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).sum(), ["a:output", ":h", "b:input"], strategy)
    # what autograd delivers to h.grad: the gradient from b, through the model's hook
    want = -3 * torch.ones(5, 2, dtype=torch.float64) @ model.b.weight.detach()
    for tap in ("a:output", ":h", "b:input"):
        torch.testing.assert_close(cap.grads[tap], want, rtol=1e-12, atol=1e-12)  # type: ignore[attr-defined]


def test_a_parameters_gradient_is_after_its_own_hooks(strategy: str) -> None:
    model = nn.Linear(3, 1).double()
    model.weight.register_hook(lambda g: g.clamp(-0.1, 0.1))
    x = torch.randn(4, 3, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).sum(), [":weight"], strategy)
    torch.testing.assert_close(cap.grads[":weight"], x.sum(0, keepdim=True).clamp(-0.1, 0.1))  # type: ignore[attr-defined]


# -- 4. autograd_grad skipped post-accumulate-grad hooks -------------------------------------------------
def test_post_accumulate_grad_hooks_fire_as_in_backward(strategy: str) -> None:
    def build() -> tuple[nn.Module, list[str]]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        seen: list[str] = []
        names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():  # optimizer-in-backward: each parameter steps as its gradient lands
            opt = torch.optim.SGD([p], lr=0.1)

            def step(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
                seen.append(names[id(param)])
                opt.step()
                opt.zero_grad()

            p.register_post_accumulate_grad_hook(step)
        return model, seen

    x = torch.randn(6, 3, dtype=torch.float64)
    bare, bare_seen = build()
    bare(x).pow(2).sum().backward()
    model, seen = build()
    with capture(model, ["0:output", "2:weight"], strategy=strategy) as cap:
        cap.backward(model(x).pow(2).sum())
    assert sorted(seen) == sorted(bare_seen) == sorted(n for n, _ in model.named_parameters())
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p, q)


# -- 5. two backwards per forward -----------------------------------------------------------------------
def test_each_backward_of_one_forward_is_captured(strategy: str) -> None:
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with capture(model, [":output", ":weight"], strategy=strategy, keep_grads=True) as cap:
        out = model(x)
        cap.backward(out.sum(), retain_graph=True)
        first, first_index = cap.grads[":output"], cap.backward_index
        w1 = model.weight.grad.clone()  # type: ignore[union-attr]
        cap.backward(out.pow(2).sum())
        recs = cap.records()
        second, second_index = cap.grads[":output"], cap.backward_index
    assert (first_index, second_index) == (0, 1)
    torch.testing.assert_close(first, torch.ones_like(out))
    torch.testing.assert_close(second, 2 * out.detach())
    torch.testing.assert_close(cap.grads[":weight"], 2 * out.detach().T @ x)
    torch.testing.assert_close(model.weight.grad, w1 + 2 * out.detach().T @ x)  # .grad accumulates, as in torch
    # The records cover both backwards: the output once per backward, the weight once for both (its .grad)
    assert [(k.tap, m) for k, m in zip(recs.keys, recs.micro_step, strict=True)] == [
        (":output", 0), (":output", 1), (":weight", None)]  # fmt: skip
    assert list(recs.has_grad) == [True, True, True]
    norms = recs.stats["norm"]
    assert norms[0] == pytest.approx(float(out.numel()) ** 0.5) and norms[1] == pytest.approx(float(2 * out.detach().norm()))
    assert norms[2] == pytest.approx(float(model.weight.grad.norm()))


def test_a_backward_after_the_graph_was_freed_says_so(strategy: str) -> None:
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with capture(model, [":output"], strategy=strategy) as cap:
        out = model(x)
        cap.backward(out.sum())
        cap.backward(model.weight.sum())  # no forward since: the tap's graph is gone
        assert cap.reasons()[next(iter(cap.reasons()))] == GRAPH_FREED


# -- 6. sparse gradients ---------------------------------------------------------------------------------
def test_sparse_embedding_gradient_gets_statistics(strategy: str) -> None:
    emb = nn.Embedding(10, 3, sparse=True).double()
    idx = torch.tensor([1, 2, 2, 7])
    with capture(emb, [":weight", ":output"], strategy=strategy, keep_grads=False, values="full") as cap:
        cap.backward(emb(idx).pow(2).sum())
        recs = cap.records()
    dense = torch.zeros(10, 3, dtype=torch.float64)
    dense.index_add_(0, idx, 2 * emb.weight.detach()[idx])
    row = recs.row([k.tap for k in recs.keys].index(":weight"))
    assert row["has_grad"] and row["numel"] == 30
    assert row["norm"] == pytest.approx(float(dense.norm()), rel=1e-12)
    assert row["zero_frac"] == pytest.approx(21 / 30)
    assert row["mean"] == pytest.approx(float(dense.mean()), rel=1e-12)
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse


@pytest.mark.parametrize("rows", [[1, 2, 2, 7], list(range(10))])
def test_sparse_gradient_statistics_never_make_it_dense(strategy: str, rows: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics only (values=none): read from the stored values; the implicit zeros count."""
    emb = nn.Embedding(10, 3, sparse=True).double()
    with torch.no_grad():
        emb.weight.add_(1.0)  # all positive: the minimum over the dense gradient is an implicit 0
    idx = torch.tensor(rows)
    dense = torch.zeros(10, 3, dtype=torch.float64)
    dense.index_add_(0, idx, 2 * emb.weight.detach()[idx])

    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a sparse gradient was made dense")

    with capture(emb, [":weight"], strategy=strategy, keep_grads=False) as cap:
        loss = emb(idx).pow(2).sum()
        monkeypatch.setattr(torch.Tensor, "to_dense", refuse)
        cap.backward(loss)
        recs = cap.records()
    monkeypatch.undo()
    row = recs.row(0)
    assert row["has_grad"] and row["numel"] == 30 and list(row["shape"]) == [10, 3]
    assert row["norm"] == pytest.approx(float(dense.norm()), rel=1e-12)
    assert row["mean"] == pytest.approx(float(dense.mean()), rel=1e-12)
    assert row["std"] == pytest.approx(float(dense.std()), rel=1e-9)
    assert row["min"] == float(dense.min()) and row["max"] == float(dense.max())
    assert row["zero_frac"] == pytest.approx(float((dense == 0).double().mean()))


# -- 7. torch.vmap / torch.func ---------------------------------------------------------------------------
class PerSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(self.inner)(x)


@pytest.mark.parametrize("tap", ["inner:output", "inner:input"])
def test_tap_inside_vmap_is_refused_with_the_true_reason(strategy: str, tap: str) -> None:
    model = PerSample()
    with capture(model, [tap], strategy=strategy), pytest.raises(GradrunnerError, match="torch.func transform"):
        model(torch.randn(4, 3, dtype=torch.float64))


def test_glob_inside_vmap_records_the_true_reason_and_parameters_are_right(strategy: str) -> None:
    model = PerSample()
    x = torch.randn(4, 3, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).sum(), ["*:output", "inner:weight", ":output"], strategy)
    assert cap.reasons()[next(k for k in cap.reasons() if k.tap == "inner:output")] == TRANSFORMED  # type: ignore[attr-defined]
    torch.testing.assert_close(cap.grads["inner:weight"], torch.ones(2, 4, dtype=torch.float64) @ x)  # type: ignore[attr-defined]
    torch.testing.assert_close(cap.grads[":output"], torch.ones(4, 2, dtype=torch.float64))  # type: ignore[attr-defined]


# -- 8. a model that changes its input in place -----------------------------------------------------------
class Centre(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean())
        return self.fc(x)


@pytest.mark.parametrize("tap", [":input", "fc:input"])
def test_in_place_change_of_a_tapped_input(strategy: str, tap: str) -> None:
    model = Centre()
    x0 = torch.randn(3, 4, dtype=torch.float64)
    x = x0.clone()
    _, cap = same_as_uncaptured(model, lambda: model(x.copy_(x0)).pow(2).sum(), [tap], strategy)
    assert torch.equal(x, x0 - x0.mean())  # the caller's tensor was changed, as without capture
    assert not x.requires_grad
    ref = x0.clone().requires_grad_()
    centred = ref - ref.mean()
    if tap == "fc:input":
        centred.retain_grad()
    model.fc(centred).pow(2).sum().backward()
    want = ref.grad if tap == ":input" else centred.grad
    torch.testing.assert_close(cap.grads[tap], want, rtol=1e-12, atol=1e-12)  # type: ignore[attr-defined]


# -- 9. messages and names ----------------------------------------------------------------------------------
def test_parametrized_weight_points_to_the_original() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    parametrize.register_parametrization(model[0], "weight", nn.Identity())
    with pytest.raises(GradrunnerError, match=r"'0\.parametrizations\.weight:original'") as err:
        capture(model, ["0:weight"])
    assert "'0.parametrizations.weight:output'" in str(err.value)


def test_parametrized_weight_taps_the_message_suggests_work(strategy: str) -> None:
    class Sym(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).T

    model = nn.Sequential(nn.Linear(3, 3)).double()
    parametrize.register_parametrization(model[0], "weight", Sym())
    x = torch.randn(5, 3, dtype=torch.float64)
    taps = ["0.parametrizations.weight:original", "0.parametrizations.weight:output"]
    _, cap = same_as_uncaptured(model, lambda: model(x).sum(), taps, strategy)
    g_w = torch.ones(5, 3, dtype=torch.float64).T @ x  # gradient of the computed weight
    torch.testing.assert_close(cap.grads[taps[1]], g_w)  # type: ignore[attr-defined]
    torch.testing.assert_close(cap.grads[taps[0]], g_w.triu() + g_w.tril(-1).T)  # type: ignore[attr-defined]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3).double()

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(hidden_states) * scale


class Encoder(nn.Module):
    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.layer = Layer()
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return self.layer(hidden_states=h) if self.by_keyword else self.layer(h, 3.0)


@pytest.mark.parametrize("by_keyword", [True, False], ids=["keyword", "positional"])
def test_input_name_binds_keyword_or_positional(strategy: str, by_keyword: bool) -> None:
    model = Encoder(by_keyword)
    x = torch.randn(2, 3, dtype=torch.float64)
    _, cap = same_as_uncaptured(model, lambda: model(x).sum(), ["layer:input.hidden_states"], strategy)
    scale = 1.0 if by_keyword else 3.0
    want = scale * torch.ones(2, 3, dtype=torch.float64) @ model.layer.fc.weight.detach()
    torch.testing.assert_close(cap.grads["layer:input.hidden_states"], want)  # type: ignore[attr-defined]


def test_a_new_forward_lets_go_of_the_retained_graph() -> None:
    import gc
    import weakref

    model = nn.Linear(3, 2)
    with capture(model, [":output"], strategy="retain_grad") as cap:
        out = model(torch.randn(4, 3))
        cap.backward(out.sum(), retain_graph=True)
        held = weakref.ref(out)
        del out
        model(torch.randn(4, 3))
        gc.collect()
        assert held() is None
