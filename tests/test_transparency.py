"""Capture never changes what the model computes, and the three strategies agree everywhere.

For a zoo of models (stock `torch.nn` layers, tiny random-init `transformers` models, and the patterns of
issue 18: writes through views, an instance-level forward, the model's own tensor hooks, post-accumulate
hooks, a sparse embedding), every strategy with every tap kind (output, input, parameter, local) gives a
loss and parameter `.grad` bit-identical (`torch.equal`) to the uncaptured run, and each tap's gradient
(every call) equal to a reference taken here with plain tensor hooks, which see what autograd delivers
to the tensor's `.grad` when registered after the model's own hooks (no zoo model registers hooks on a
tensor the reference hooks).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner import capture
from gradrunner.capturing.elements import get_element

KINDS = ("output", "input", "param", "local")


@dataclass
class Zoo:
    model: nn.Module
    run: Callable[[], torch.Tensor]  # forward and loss
    taps: dict[str, list[str]]  # kind -> taps
    #: a local tap -> the module paths whose outputs are the local's successive values (the reference's hooks)
    local_refs: dict[str, list[str]] = field(default_factory=dict)


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K = self.fc(x)
        K.diagonal().add_(0.5)  # a write through a view of the tapped tensor
        K[:, 0].mul_(2.0)
        h = self.act(K)
        return h


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(h.tanh())


def _wrapped() -> nn.Module:
    m = Wrapped()
    m.forward = types.MethodType(lambda self, x: Wrapped.forward(self, x) * 0.5, m)  # type: ignore[method-assign]
    return m


class Scaled(nn.Module):
    """Gradient scaling inside the model, on a tensor the zoo does not tap (a tapped one is test_capture_findings')."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = h * 1.0
        if g.requires_grad:
            g.register_hook(lambda grad: grad * 0.25)
        return self.b(g)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _stock_mlp() -> Zoo:
    m = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    x = _x(4, 5)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["0:output", "*:output"], "input": ["2:input", ":input"],
                                              "param": ["0:weight", "4:bias"], "local": []})  # fmt: skip


def _conv() -> Zoo:
    m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(12, 2))  # fmt: skip
    x = _x(2, 2, 4, 4)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["1:output", "3:output"], "input": ["5:input"],
                                              "param": ["0:weight", "1:weight"], "local": []})  # fmt: skip


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, _ = self.rnn(x)
        last = self.head(seq[:, -1])
        return last


def _lstm() -> Zoo:
    m = Recurrent()
    x = _x(2, 5, 3)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["rnn:output.0", "rnn:output.1.0"], "input": ["head:input"],
               "param": ["rnn:weight_hh_l0"], "local": [":last"]}, {":last": ["head"]})  # fmt: skip


def _encoder_layer() -> Zoo:
    m = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    x = _x(2, 3, 8)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["linear1:output", "norm2:output"], "input": ["linear2:input"],
               "param": ["self_attn:in_proj_weight", "norm1:weight"], "local": []})  # fmt: skip


def _views() -> Zoo:
    m = Views()
    x = _x(4, 4)
    return Zoo(m, lambda: m(x).sum(), {"output": ["fc:output", "act:output"], "input": ["act:input"],
                                       "param": ["fc:weight"], "local": [":h"]}, {":h": ["act"]})  # fmt: skip


def _instance_forward() -> Zoo:
    m = _wrapped()
    x = _x(3, 4)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["fc:output"], "input": ["out:input"], "param": ["out:weight"],
                                              "local": [":h"]}, {":h": ["fc"]})  # fmt: skip


def _own_hooks() -> Zoo:
    m = Scaled()
    x = _x(3, 4)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["a:output"], "input": ["b:input"], "param": ["a:weight"],
                                              "local": [":h"]}, {":h": ["a"]})  # fmt: skip


def _post_accumulate() -> Zoo:
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    for p in m.parameters():  # optimizer-in-backward: the step happens as each gradient lands
        opt = torch.optim.SGD([p], lr=0.5)
        p.register_post_accumulate_grad_hook(lambda _p, opt=opt: opt.step())
    x = _x(3, 4)
    return Zoo(m, lambda: m(x).pow(2).sum(), {"output": ["0:output"], "input": ["2:input"], "param": ["2:weight"],
                                              "local": []})  # fmt: skip


def _sparse() -> Zoo:
    m = nn.Sequential(nn.Embedding(12, 4, sparse=True), nn.Linear(4, 2))
    idx = torch.tensor([[1, 3, 3], [0, 11, 1]])
    return Zoo(m, lambda: m(idx).pow(2).sum(), {"output": ["0:output"], "input": ["1:input"],
                                                "param": ["0:weight", "1:weight"], "local": []})  # fmt: skip


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 6))


def _gpt2() -> Zoo:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    m = transformers.GPT2LMHeadModel(cfg).eval()
    ids = _tokens(50)
    return Zoo(m, lambda: m(ids).logits.pow(2).mean(),
               {"output": ["transformer.h.0.mlp.c_fc:output", "transformer.ln_f:output"],
                "input": ["transformer.h.1.mlp:input", "lm_head:input"],
                "param": ["transformer.wte:weight", "transformer.h.0.mlp.c_proj:weight"],
                "local": ["transformer.h.0.mlp:hidden_states"]},
               {"transformer.h.0.mlp:hidden_states": ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.act",
                                                      "transformer.h.0.mlp.c_proj", "transformer.h.0.mlp.dropout"]})  # fmt: skip


def _bert() -> Zoo:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)  # fmt: skip
    m = transformers.BertModel(cfg).eval()
    ids = _tokens(50)
    out = "encoder.layer.0.output"
    return Zoo(m, lambda: m(ids).last_hidden_state.pow(2).mean(),
               {"output": ["encoder.layer.0.intermediate:output", "pooler.dense:output"],
                "input": ["encoder.layer.1.intermediate:input"],
                "param": ["embeddings.word_embeddings:weight", f"{out}.dense:weight"],
                "local": [f"{out}:hidden_states"]},
               {f"{out}:hidden_states": [f"{out}.dense", f"{out}.dropout", f"{out}.LayerNorm"]})  # fmt: skip


def _llama() -> Zoo:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=32, vocab_size=50, max_position_embeddings=16)  # fmt: skip
    m = transformers.LlamaForCausalLM(cfg).eval()
    ids = _tokens(50)
    return Zoo(m, lambda: m(ids).logits.pow(2).mean(),
               {"output": ["model.layers.0.mlp:output", "model.norm:output"],
                "input": ["model.layers.1.mlp.down_proj:input"],
                "param": ["model.layers.0.self_attn.q_proj:weight", "model.embed_tokens:weight"],
                "local": ["model.layers.1.mlp:down_proj"]},
               {"model.layers.1.mlp:down_proj": ["model.layers.1.mlp.down_proj"]})  # fmt: skip


ZOO: dict[str, Callable[[], Zoo]] = {
    "mlp": _stock_mlp, "conv": _conv, "lstm": _lstm, "encoder_layer": _encoder_layer, "views": _views,
    "instance_forward": _instance_forward, "own_hooks": _own_hooks, "post_accumulate": _post_accumulate,
    "sparse": _sparse, "gpt2": _gpt2, "bert": _bert, "llama": _llama,
}  # fmt: skip


def _reference(zoo: Zoo, taps: list[str]) -> tuple[torch.Tensor, dict[str, list[torch.Tensor | None]]]:
    """The loss and each tap's gradient per call, by plain tensor hooks registered as values appear."""
    model = zoo.model
    modules = dict(model.named_modules(remove_duplicate=False))
    got: dict[str, list[torch.Tensor | None]] = {}
    handles = []

    def watch(tap: str, value: object) -> None:
        calls = got.setdefault(tap, [])
        calls.append(None)
        at = len(calls) - 1
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(lambda g: calls.__setitem__(at, g.clone()))

    def on_output(tap: str, path: tuple[str | int, ...]) -> Callable[..., None]:
        return lambda _m, _a, out: watch(tap, get_element(out, path, tap))

    def on_input(tap: str, path: tuple[str | int, ...]) -> Callable[..., object]:
        def hook(_m: nn.Module, args: tuple[object, ...]) -> object:
            value = get_element(args, path or (0,), tap)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
                value = value.detach().requires_grad_()  # an input's own gradient: make it require grad here
                watch(tap, value)
                return (value, *args[1:]) if not path or path == (0,) else None
            watch(tap, value)
            return None

        return hook

    params = []
    seen: set[str] = set()
    for tap in taps:
        module_path, _, name = tap.rpartition(":")
        head, _, rest = name.partition(".")
        path: tuple[str | int, ...] = tuple(int(p) for p in rest.split(".")) if rest else ()
        if tap in zoo.local_refs:
            for ref in zoo.local_refs[tap]:
                handles.append(modules[ref].register_forward_hook(on_output(tap, ())))
        elif head == "output":
            matched = [p for p in modules if p and __import__("fnmatch").fnmatchcase(p, module_path)] \
                if "*" in module_path else [module_path]  # fmt: skip
            for p in matched:
                if f"{p}:{name}" in seen:
                    continue
                seen.add(f"{p}:{name}")
                handles.append(modules[p].register_forward_hook(on_output(f"{p}:{name}", path)))
        elif head == "input":
            handles.append(modules[module_path].register_forward_pre_hook(on_input(tap, path)))
        else:
            params.append((tap, getattr(modules[module_path], name)))
    model.zero_grad(set_to_none=True)
    try:
        loss = zoo.run()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    for tap, p in params:
        got[tap] = [None if p.grad is None else p.grad.clone()]
    return loss, got


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else _dense(p.grad).clone() for p in model.parameters()]  # type: ignore[union-attr]


def _assert_same_grads(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    """Each gradient bit-identical to the uncaptured run's, None where it is None."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w)), i


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_dense() if t is not None and t.layout != torch.strided else t


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(ZOO))
def test_capture_is_transparent(name: str, kind: str, strategy: str) -> None:
    torch.manual_seed(0)
    zoo = ZOO[name]()
    taps = zoo.taps[kind]
    if not taps:
        pytest.skip(f"{name} has no {kind} tap in the zoo")
    model = zoo.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    own = leftover_hooks(model)

    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    bare = zoo.run()
    bare.backward()
    want_params, want_state = _grads(model), {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(state)
    torch.manual_seed(1)
    ref_loss, ref = _reference(zoo, taps)
    assert torch.equal(ref_loss, bare)

    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with capture(model, taps, strategy=strategy) as cap:
        loss = zoo.run()
        cap.backward(loss)
    assert torch.equal(loss, bare)
    _assert_same_grads(_grads(model), want_params)
    for k, v in model.state_dict().items():  # post-accumulate-hook steps, BatchNorm statistics
        assert torch.equal(v, want_state[k]), k
    assert leftover_hooks(model) == own
    for tap, calls in ref.items():
        captured = [_dense(g) for g in cap.grads.calls(tap)]
        assert len(captured) == len(calls), tap
        for c, (g, r) in enumerate(zip(captured, calls, strict=True)):
            assert (g is None) == (r is None), (tap, c)
            if g is not None:
                torch.testing.assert_close(g, _dense(r), rtol=1e-6, atol=1e-7, msg=f"{tap} call {c}")


# -- gradient accumulation (issue 33): several backwards before one optimiser step ---------------------------
def _accumulating_mlp() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    return model, [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]


def _accumulate(strategy: str | None, taps: list[str]) -> tuple[list[tuple[str, int, torch.Tensor]], list[torch.Tensor]]:
    """Three backwards without zero_grad; every parameter has a post-accumulate-grad hook that keeps what it
    sees: (parameter, id of its `.grad` tensor, `.grad`'s value). `strategy=None`: no capture."""
    model, xs = _accumulating_mlp()
    seen: list[tuple[str, int, torch.Tensor]] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen.append((name, id(p.grad), p.grad.clone())))
    if strategy is None:
        for x in xs:
            model(x).pow(2).sum().backward()
    else:
        with capture(model, taps, strategy=strategy) as cap:
            for x in xs:
                cap.backward(model(x).pow(2).sum())
    return seen, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("taps", [["0:output", "0:weight", "2:bias"], ["0:weight", "0:bias", "2:weight", "2:bias"]])
def test_post_accumulate_grad_hooks_see_the_accumulated_grad_under_accumulation(strategy: str, taps: list[str]) -> None:
    """Each post-accumulate-grad hook sees `.grad` as without capture (the running sum over the backwards), and
    `.grad` stays one tensor object across the backwards, as in torch (retain_grad set `.grad` aside and
    added it back, so the hook saw only one backward's gradient and `.grad` became a new tensor)."""
    bare, bare_grads = _accumulate(None, taps)
    got, grads = _accumulate(strategy, taps)
    for name in {n for n, _, _ in bare}:  # per parameter (autograd_grad accumulates after its engine call)
        values = [v for n, _, v in got if n == name]
        want = [v for n, _, v in bare if n == name]
        assert len(values) == len(want) == 3 and all(torch.equal(v, w) for v, w in zip(values, want, strict=True)), name
        ids = [i for n, i, _ in got if n == name]
        bare_ids = [i for n, i, _ in bare if n == name]
        assert len(set(ids)) == len(set(bare_ids)) == 1, name  # one `.grad` tensor for the whole accumulation
    for g, w in zip(grads, bare_grads, strict=True):
        assert torch.equal(g, w)


def test_a_parameter_edit_under_accumulation_records_the_steps_gradient_before_and_after_the_edit(strategy: str) -> None:
    """`norm` is the gradient that arrived over the whole step (before the edit), `edited_norm` the same after it
    (with accumulation, `norm` was the already-edited `.grad` and `edited_norm` the last backward's part)."""
    model, xs = _accumulating_mlp()
    arrived: list[torch.Tensor] = []  # a plain hook on the weight: every backward's gradient as it arrives
    handle = model[0].weight.register_hook(lambda g: arrived.append(g.clone()))
    for x in xs[:2]:
        model(x).pow(2).sum().backward()
    handle.remove()
    want = arrived[0] + arrived[1]
    model.zero_grad(set_to_none=True)
    edits = [{"tap": "0:weight", "scale": 0.5}]
    with capture(model, ["0:weight", "0:output"], strategy=strategy, edits=edits, keep_grads=False) as cap:
        for x in xs[:2]:
            cap.backward(model(x).pow(2).sum())
        recs = cap.records()
    row = recs.row([k.tap for k in recs.keys].index("0:weight"))
    assert row["edited"]
    assert row["norm"] == pytest.approx(float(want.norm()), rel=1e-12)
    assert row["mean"] == pytest.approx(float(want.mean()), rel=1e-12)
    assert row["edited_norm"] == pytest.approx(float((0.5 * want).norm()), rel=1e-12)
    torch.testing.assert_close(model[0].weight.grad, 0.5 * want, rtol=1e-12, atol=1e-15)  # the edit took effect


# -- leaves that are not the model's parameters ------------------------------------------------------------------
def _leaves_outside(strategy: str | None, taps: list[str]) -> tuple[list[torch.Tensor | None], list[tuple[str, torch.Tensor]]]:
    """Two backwards (accumulating) of a loss that also uses leaves the captured model does not hold: its input made
    with `requires_grad=True` (saliency), a second model's parameters (a GAN's discriminator) and a learnable
    scalar. Each of those has a tensor hook and a post-accumulate-grad hook that keep what they see. Returns every
    leaf's `.grad` and what the hooks saw, in order. `strategy=None`: no capture."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    disc = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).double()
    xs = [torch.randn(5, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    seen: list[tuple[str, torch.Tensor]] = []
    outside = {"x0": xs[0], "x1": xs[1], "temperature": temperature, **{f"disc.{n}": p for n, p in disc.named_parameters()}}
    for name, leaf in outside.items():
        leaf.register_hook(lambda g, name=name: seen.append((f"{name} hook", g.clone())))
        leaf.register_post_accumulate_grad_hook(lambda t, name=name: seen.append((f"{name} post", t.grad.clone())))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return (disc(gen(x)) / temperature).pow(2).sum()

    if strategy is None:
        for x in xs:
            loss_of(x).backward()
    else:
        with capture(gen, taps, strategy=strategy) as cap:
            for x in xs:
                cap.backward(loss_of(x))
    grads = [leaf.grad for leaf in outside.values()] + [p.grad for p in gen.parameters()]
    return [None if g is None else g.clone() for g in grads], seen


@pytest.mark.parametrize("taps", [["0:output", "2:weight"], ["0:input", "0:weight"]])
def test_leaves_outside_the_model_get_their_grad_and_hooks_as_without_capture(strategy: str, taps: list[str]) -> None:
    """An input that requires grad, another model's parameters and a learnable scalar of the loss get the `.grad`
    `loss.backward()` gives them, and their hooks fire as often with the same values (autograd_grad's engine call
    fills no `.grad`: it left these unfilled)."""
    want_grads, want_seen = _leaves_outside(None, taps)
    got_grads, got_seen = _leaves_outside(strategy, taps)
    assert all(g is not None for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g is not None and w is not None and torch.equal(g, w)
    assert sorted(n for n, _ in got_seen) == sorted(n for n, _ in want_seen)
    for name in {n for n, _ in want_seen}:  # per leaf, in order (autograd_grad fills `.grad` after its engine call)
        got = [v for n, v in got_seen if n == name]
        want = [v for n, v in want_seen if n == name]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name


def test_a_saliency_input_of_a_transformers_model_gets_its_grad_as_without_capture(strategy: str) -> None:
    """Input-gradient saliency on a tiny random-init BERT: `inputs_embeds` made with `requires_grad=True`, one
    tapped layer output and one tapped weight. The embeddings' `.grad` and every parameter's equal the uncaptured
    run's bit for bit (under autograd_grad the embeddings got no `.grad` before its graph walk)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = _tokens(50)

    def saliency(captured: bool) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        model.zero_grad(set_to_none=True)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        if captured:
            with capture(model, ["encoder.layer.0.intermediate:output", "pooler.dense:weight"], strategy=strategy) as cap:
                loss = model(inputs_embeds=embeds).pooler_output.sum()
                cap.backward(loss)
                assert cap.grads["encoder.layer.0.intermediate:output"] is not None
        else:
            model(inputs_embeds=embeds).pooler_output.sum().backward()
        assert embeds.grad is not None
        return embeds.grad.clone(), _grads(model)

    want_embeds, want_params = saliency(False)
    got_embeds, got_params = saliency(True)
    assert torch.equal(got_embeds, want_embeds)
    _assert_same_grads(got_params, want_params)


class _Scaled(torch.autograd.Function):
    """A custom Function between a leaf and the loss: its node is Python's, not torch's own."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


def _random_outside_run(seed: int, strategy: str | None) -> list[torch.Tensor | None]:
    """A seeded random mix of leaves outside the captured model, each reaching the loss a random way (through the
    model's input, a view of it, a custom Function, twice, or not at all), over two accumulating backwards."""
    import random

    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    leaves = [torch.randn(2, 4, dtype=torch.float64, requires_grad=True) for _ in range(rng.randint(1, 4))]
    ways = [rng.choice(["input", "view", "function", "twice", "loss", "unused"]) for _ in leaves]
    with_hooks = [rng.random() < 0.5 for _ in leaves]
    for leaf, hooked in zip(leaves, with_hooks, strict=True):
        if hooked:
            leaf.register_hook(lambda g: g * 0.5)
    taps = rng.choice([["0:output"], ["0:input", "2:weight"], ["2:output", "0:bias"]])

    def loss_fn() -> torch.Tensor:
        x = torch.ones(2, 4, dtype=torch.float64)
        extra = torch.zeros((), dtype=torch.float64)
        for leaf, way in zip(leaves, ways, strict=True):
            if way == "input":
                x = x + leaf
            elif way == "view":
                x = x + leaf[:, :2].repeat(1, 2)
            elif way == "function":
                x = x * _Scaled.apply(leaf).sigmoid()
            elif way == "twice":
                x = x + leaf
                extra = extra + leaf.pow(2).sum()
            elif way == "loss":
                extra = extra + leaf.sum().tanh()
        return model(x).pow(2).sum() + extra

    if strategy is None:
        for _ in range(2):
            loss_fn().backward()
    else:
        with capture(model, taps, strategy=strategy) as cap:
            for _ in range(2):
                cap.backward(loss_fn())
    return [None if t.grad is None else t.grad.clone() for t in [*leaves, *model.parameters()]]


@pytest.mark.parametrize("seed", range(12))
def test_random_leaves_outside_the_model_get_the_uncaptured_grad(strategy: str, seed: int) -> None:
    want = _random_outside_run(seed, None)
    _assert_same_grads(_random_outside_run(seed, strategy), want)


def test_a_model_changed_between_backwards_keeps_its_grads_and_records(strategy: str) -> None:
    """Inside one session: a backward, then the model cast to float64 (every parameter's accumulator replaced),
    a backward, then one layer frozen and another unfrozen, a backward. `.grad` after each and the tapped weight's
    recorded norm equal the uncaptured run's."""

    def run(captured: bool) -> tuple[list[list[torch.Tensor | None]], list[float]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        model[2].weight.requires_grad_(False)
        x = torch.randn(5, 3)
        grads: list[list[torch.Tensor | None]] = []
        norms: list[float] = []

        def phases() -> None:
            for phase in range(3):
                if phase == 1:
                    model.double()
                if phase == 2:
                    model[0].weight.requires_grad_(False)
                    model[2].weight.requires_grad_(True)
                model.zero_grad(set_to_none=True)
                inp = x.double() if phase else x
                loss = model(inp).pow(2).sum()
                if captured:
                    cap.backward(loss)
                    rows = cap.records(loss)
                    norms.append(rows.row([k.tap for k in rows.keys].index("0:bias"))["norm"])
                else:
                    loss.backward()
                    norms.append(float(model[0].bias.grad.double().norm()))  # type: ignore[union-attr]
                grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])

        if captured:
            with capture(model, ["0:output", "0:bias"], strategy=strategy, keep_grads=False) as cap:
                phases()
        else:
            phases()
        return grads, norms

    want_grads, want_norms = run(False)
    got_grads, got_norms = run(True)
    for got, want in zip(got_grads, want_grads, strict=True):
        _assert_same_grads(got, want)
    assert got_norms == pytest.approx(want_norms, rel=1e-6)


# -- a gradient the model or the user retains itself (Grad-CAM keeps `h.grad`) --------------------------------
def _grad_cam(strategy: str | None, own: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Two backwards through one forward of a stock CNN whose user retains a conv output's gradient in a forward
    hook (as Grad-CAM code does): the retained `.grad` after each backward, and the tap's record per backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(2, 3, 6, 6)
    model(x)  # the lazy layer's shape
    kept: list[torch.Tensor] = []

    def keep(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        out.retain_grad()
        kept.append(out)

    model[2].register_forward_hook(keep)
    seen: list[torch.Tensor] = []
    records: list[torch.Tensor | None] = []
    with contextlib.nullcontext() if strategy is None else capture(model, ["2:output", "0:output"], strategy=strategy) as cap:
        logits = model(x)
        for cls in (0, 2):
            score = logits[:, cls].sum()
            if cap is None or not own:
                score.backward(retain_graph=True)
            else:
                cap.backward(score, retain_graph=True)
            seen.append(kept[-1].grad.clone())  # type: ignore[union-attr]
            if cap is not None:
                records.append(cap.grads["2:output"])
    return seen, records


@pytest.mark.parametrize("own", [True, False], ids=["cap.backward", "loss.backward"])
def test_a_gradient_the_user_retains_reads_as_without_capture(strategy: str, own: bool) -> None:
    if strategy == "autograd_grad" and not own:
        pytest.skip("autograd_grad runs its own backward")
    want, _ = _grad_cam(None, own)
    got, records = _grad_cam(strategy, own)
    for g, w in zip(got, want, strict=True):  # the second is the sum of both backwards', as torch leaves it
        assert torch.equal(g, w)
    torch.testing.assert_close(records[0], want[0])
    torch.testing.assert_close(records[1], want[1] - want[0], rtol=1e-5, atol=1e-6)  # each backward's own
