"""Where a forward's edges meet capture: the model's own output under your backward, a reentrant checkpoint's
input used outside the block, an evaluation forward between two backwards through one graph.

Each found by a hunt against references taken without gradrunner (plain forward hooks keeping the tensors,
`torch.autograd.grad` of the loss by them) on stock `torch.nn` models and tiny random-init `transformers`
ones; each failed before its fix (2026-11-27):

- `retain_grad` with the user's own `loss.backward()` recorded no gradient for a tap on the model's output
  (the root's forward hook told the session before the root's own output tap fired);
- `checkpoint(use_reentrant=True)`: a tap inside the block on its input, a tensor also used outside (a
  residual; T5's encoder states fed to every checkpointed decoder block), recorded only the block's share;
- an evaluation forward (`no_grad`, `inference_mode`) between two backwards through one retained forward
  made the second backward's taps "module not called in this step";
- the root module itself run inside `checkpoint(use_reentrant=True)` (one layer of a model checkpointing its
  layers captured on its own): its first, no-grad pass was read as an evaluation, nothing was recorded, an edit
  was not applied, and the records said "no forward since the last backward, which freed the graph".
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner import GradrunnerError, capture
from gradrunner.capturing.edits import generator_seed


def _backward(cap: object, loss: torch.Tensor, own: bool, retain_graph: bool = False) -> None:
    if own:
        cap.backward(loss, retain_graph=retain_graph)  # type: ignore[attr-defined]
    else:
        loss.backward(retain_graph=retain_graph)


OWN = pytest.mark.parametrize("own", [True, False], ids=["cap.backward", "loss.backward"])


@OWN
def test_a_tap_on_the_models_own_output_gets_its_gradient(strategy: str, own: bool) -> None:
    if strategy == "autograd_grad" and not own:
        pytest.skip("autograd_grad runs its own backward")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 20, (2, 5))
    kept: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: kept.append(out))
    (want,) = torch.autograd.grad(model(ids).logits.pow(2).mean(), kept)
    handle.remove()
    taps = [":output.logits", "lm_head:output"]
    with capture(model, taps, strategy=strategy) as cap:
        _backward(cap, model(ids).logits.pow(2).mean(), own)
        for tap in taps:
            got = cap.grads[tap]
            assert got is not None, tap
            torch.testing.assert_close(got, want, msg=tap)


class Residual(nn.Module):
    """A checkpointed block whose input is also used outside it (a residual connection)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.stem, self.inner, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        b = self.inner(h) if self.reentrant is None else checkpoint(self.inner, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(self.inner(b)) + h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [True, False], ids=["use_reentrant=True", "use_reentrant=False"])
def test_a_checkpointed_blocks_input_used_outside_it_gets_its_whole_gradient(strategy: str, reentrant: bool) -> None:
    if strategy == "autograd_grad" and reentrant:
        pytest.skip("refused: autograd.grad cannot run through a reentrant checkpoint")
    torch.manual_seed(0)
    x = torch.randn(2, 3, dtype=torch.float64)
    ref = Residual(None).double()
    state = ref.state_dict()
    seen: dict[str, list[torch.Tensor]] = {"in": [], "out": []}

    def keep(_m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["in"].append(args[0])
        seen["out"].append(out)

    ref.inner.register_forward_hook(keep)
    want = torch.autograd.grad(ref(x).pow(2).sum(), seen["in"] + seen["out"])
    model = Residual(reentrant).double()
    model.load_state_dict(state)
    with capture(model, ["inner:input", "inner:output", "stem:output"], strategy=strategy) as cap:
        cap.backward(model(x).pow(2).sum())
    got = cap.grads.calls("inner:input") + cap.grads.calls("inner:output")
    assert len(got) == 4  # the checkpointed call (counted once, in its forward place) and the call after it
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(cap.grads["stem:output"], want[0])


@OWN
@pytest.mark.parametrize("between", ["no_grad", "inference_mode"])
def test_an_evaluation_forward_between_two_backwards_keeps_the_second_ones_taps(
    strategy: str, own: bool, between: str
) -> None:
    if strategy == "autograd_grad" and not own:
        pytest.skip("autograd_grad runs its own backward")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    kept: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, out: kept.append(out))
    out = model(x)
    handle.remove()
    want = [torch.autograd.grad(loss, kept, retain_graph=True)[0] for loss in (out.pow(2).sum(), out[:, 0].sum())]
    context = torch.no_grad if between == "no_grad" else torch.inference_mode
    with capture(model, ["0:output"], strategy=strategy) as cap:
        out = model(x)
        _backward(cap, out.pow(2).sum(), own, retain_graph=True)
        first = cap.grads["0:output"]
        with context():
            model(x)  # an evaluation forward
        _backward(cap, out[:, 0].sum(), own)
        assert cap.backward_index == 1
        second = cap.grads["0:output"]
        recs = cap.records()
    torch.testing.assert_close(first, want[0])
    torch.testing.assert_close(second, want[1])
    rows = [recs.row(i) for i in range(len(recs))]
    assert [(r["micro_step"], r["has_grad"]) for r in rows] == [(0, True), (1, True)]


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["plain", "use_reentrant=True", "use_reentrant=False"])
def test_an_edit_on_a_checkpointed_blocks_input_edits_the_blocks_use_of_it(
    strategy: str, reentrant: bool | None
) -> None:
    """An edit on `inner:input` changes the gradient that flows back through the block's use of its input only (the
    residual's use is not the tap's); tapping the input whole in a reentrant block's first pass must not lose it."""
    if strategy == "autograd_grad" and reentrant:
        pytest.skip("refused: autograd.grad cannot run through a reentrant checkpoint")
    torch.manual_seed(0)
    x = torch.randn(2, 3, dtype=torch.float64)
    by_hand = Residual(None).double()
    state = by_hand.state_dict()
    h = by_hand.stem(x)
    into = h * 1.0  # the block's use of its input, its gradient scaled as the edit scales it
    into.register_hook(lambda g: -2.0 * g)
    b = by_hand.inner(into) * 1.0  # and the second call's (the edit acts on every call of the tap)
    b.register_hook(lambda g: -2.0 * g)
    by_hand.head(torch.tanh(by_hand.inner(b)) + h).pow(2).sum().backward()
    model = Residual(reentrant).double()
    model.load_state_dict(state)
    with capture(model, [], strategy=strategy, edits=[{"tap": "inner:input", "scale": -2.0}]) as cap:
        cap.backward(model(x).pow(2).sum())
    for (name, want), got in zip(by_hand.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


@pytest.mark.parametrize("taps", [["self_attn:input.0"], ["self_attn:input.1", "self_attn:input.0"],
                                  ["self_attn:input.query"]], ids=["query", "key+query", "by_name"])  # fmt: skip
def test_an_input_tap_on_self_attention_over_the_data_batch_is_transparent(strategy: str, taps: list[str]) -> None:
    """`TransformerEncoderLayer` calls `self_attn(x, x, x)` on the raw batch (no grad): the stand-in made for the tap
    went into the tapped slot only, so `query is key` broke (MultiheadAttention's packed in-projection left: other
    roundings in the output, the loss and every parameter gradient) and the tap recorded the query path's share.
    Now the layer runs bit for bit as without capture, and each tap records the gradient through `self_attn`'s use of
    x, all three slots (the reference: one tensor requiring grad put in every slot by a plain pre-hook). From a
    hunt, 2026-11-27."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 8)

    def run(cap: object | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        loss = nn.functional.mse_loss(out, y)
        cap.backward(loss) if cap is not None else loss.backward()  # type: ignore[attr-defined]
        return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}

    plain_out, plain_grads = run(None)
    kept: list[torch.Tensor] = []

    def one_alias(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        alias = args[0].detach().requires_grad_(True)
        kept.append(alias)
        return tuple(alias if a is args[0] else a for a in args), kwargs

    handle = layer.self_attn.register_forward_pre_hook(one_alias, with_kwargs=True)
    (want,) = torch.autograd.grad(nn.functional.mse_loss(layer(x), y), kept)
    handle.remove()
    with capture(layer, taps, strategy=strategy) as cap:
        out, grads = run(cap)
        recs = cap.records()
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    for i in range(len(recs)):
        assert recs.row(i)["norm"] == pytest.approx(float(want.norm()), rel=1e-6), recs.keys[i].tap


class _TwoLocals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        z = h * 2
        return (z**2).sum()


def test_a_second_session_tapping_locals_of_a_rewritten_forward_is_refused_and_the_first_keeps_recording(
    strategy: str,
) -> None:
    torch.manual_seed(0)
    m, x = _TwoLocals(), torch.randn(2, 3)
    h = m.l(x)
    z = h * 2
    ref_h, ref_z = torch.autograd.grad((z**2).sum(), [h, z])  # 8h and 2z, by hand
    with capture(m, [":h"], strategy=strategy) as outer:
        # autograd_grad beside any open session is refused first (capturing/open_sessions.py), before the locals
        refused = r"cannot be opened while" if strategy == "autograd_grad" else r"another open capture session.*\['z'\]"
        with pytest.raises(GradrunnerError, match=refused):
            capture(m, [":z"], strategy=strategy).__enter__()
        assert "forward" in m.__dict__  # the outer session's rewritten forward is still in place
        loss = m(x)
        outer.backward(loss)
        assert torch.allclose(outer.grads[":h"], ref_h)
    assert "forward" not in m.__dict__
    with capture(m, [":z"], strategy=strategy) as later:  # once the first closed, a new session taps them
        loss = m(x)
        later.backward(loss)
        assert torch.allclose(later.grads[":z"], ref_z)


class _Layer(nn.Module):
    """One layer of a model that checkpoints each layer (HF's gradient checkpointing with use_reentrant=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))  # type: ignore[no-any-return]


@OWN
@pytest.mark.parametrize("edited", [False, True], ids=["no_edit", "dropout"])
def test_a_root_run_inside_a_reentrant_checkpoint_records_each_backwards_gradients_once(
    strategy: str, own: bool, edited: bool
) -> None:
    """`capture(layer)` where the parent runs `head(checkpoint(layer, x, use_reentrant=True))`: the root's forward is
    the checkpoint's no-grad first pass, computed again inside backward; its taps are captured there, once per
    backward, and a seeded edit draws that backward's mask; the same checkpoint run under no_grad is an evaluation
    (no call of the step). Reference: the same layer without checkpointing, with
    plain tensor hooks doing the README's dropout (`generator_seed(seed, backward, tap, call)`)."""
    torch.manual_seed(0)
    layer, head = _Layer(), nn.Linear(6, 1)
    ref = _Layer()
    ref.load_state_dict(layer.state_dict())
    xs = [torch.randn(5, 4, requires_grad=True) for _ in range(2)]
    taps, edits = [":input", "a:output", "b:output", "a:weight"], [{"tap": "a:output", "dropout": 0.5}]
    if strategy == "autograd_grad":
        if own:
            with capture(layer, taps, strategy, edits=edits if edited else None) as cap:
                with pytest.raises(GradrunnerError, match=r"use_reentrant=True.*a:output"):
                    checkpoint(layer, xs[0], use_reentrant=True)
        return  # autograd_grad runs its own backward, and refuses a reentrant checkpoint's
    want: list[dict[str, torch.Tensor]] = []
    for step, x in enumerate(xs):
        x_ref, seen = x.detach().requires_grad_(), {}

        def drop(g: torch.Tensor, step: int = step, seen: dict[str, torch.Tensor] = seen) -> torch.Tensor:
            seen["a:output"] = g
            if not edited:
                return g
            gen = torch.Generator().manual_seed(generator_seed(0, step, "a:output", 0))
            return torch.where(torch.rand(g.shape, generator=gen) >= 0.5, g * 2.0, torch.zeros(()))

        a = ref.a(x_ref)
        a.register_hook(drop)
        b = ref.b(torch.tanh(a))
        b.register_hook(functools.partial(seen.__setitem__, "b:output"))
        head(b).sum().backward()
        grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
        want.append({**seen, **grads, ":input": x_ref.grad, "a:weight": grads["a.weight"]})
        ref.zero_grad()
    with capture(layer, taps, strategy, edits=edits if edited else None) as cap:
        for x, w in zip(xs, want, strict=True):
            layer.zero_grad()
            with torch.no_grad():  # an evaluation through the same checkpoint: no call of the step
                checkpoint(layer, x, use_reentrant=True)
            loss = head(checkpoint(layer, x, use_reentrant=True)).sum()
            _backward(cap, loss, own)
            recs = cap.records(loss)
            assert [k.tap for k in recs.keys] == taps  # one row each (firing order): counted once
            assert list(recs.has_grad) == [True] * 4, recs.reason
            for tap in taps:
                assert torch.equal(cap.grads[tap], w[tap]), tap
                assert recs.row(taps.index(tap))["norm"] == pytest.approx(float(w[tap].norm()), rel=1e-6), tap
            for name, param in layer.named_parameters():  # the edit applied once, in this backward's mask
                assert torch.equal(param.grad, w[name]), name


@pytest.mark.parametrize("enabled", [True, False], ids=["captured", "uncaptured"])
def test_a_dropped_forward_before_a_root_run_inside_a_reentrant_checkpoint_keeps_firing_order(
    strategy: str, enabled: bool
) -> None:
    """`capture(layer)` where the parent runs the layer in `checkpoint(..., use_reentrant=True)` twice, the first
    output dropped (a skipped batch): calls are numbered in firing order, as without the checkpoint (call 0 the
    dropped forward, no gradient; call 1 the one the backward used), and a seeded edit draws call 1's mask. Before,
    the dropped forward's checkpoint context, freed, left its address to the next one, which took its call numbers.
    Reference: the layer without checkpointing, plain tensor hooks doing the README's dropout."""
    if strategy == "autograd_grad":
        return  # refuses a reentrant checkpoint (test_a_root_run_inside_a_reentrant_checkpoint_...)
    torch.manual_seed(0)
    layer, head = _Layer(), nn.Linear(6, 1)
    ref = _Layer()
    ref.load_state_dict(layer.state_dict())
    dropped, x = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    arrived: list[torch.Tensor] = []

    def drop(g: torch.Tensor) -> torch.Tensor:
        arrived.append(g)
        gen = torch.Generator().manual_seed(generator_seed(0, 0, "b:output", 1))
        return torch.where(torch.rand(g.shape, generator=gen) >= 0.5, g * 2.0, torch.zeros(()))

    ref(dropped).sum()
    out = ref(x)
    out.register_hook(drop)
    head(out).sum().backward()
    with capture(layer, ["b:output"], strategy, edits=[{"tap": "b:output", "dropout": 0.5}]) as cap:
        cap.enabled = enabled
        checkpoint(layer, dropped, use_reentrant=True).sum()  # freed at once: its context's address is reused
        loss = head(checkpoint(layer, x, use_reentrant=True)).sum()
        loss.backward()
        if enabled:
            recs = cap.records(loss)
            assert [(k.call, bool(h)) for k, h in zip(recs.keys, recs.has_grad, strict=True)] == [(0, False), (1, True)]
            assert recs.row(1)["norm"] == pytest.approx(float(arrived[0].norm()), rel=1e-6)
    for name, param in layer.named_parameters():  # call 1's mask, applied once
        assert torch.equal(param.grad, dict(ref.named_parameters())[name].grad), name
