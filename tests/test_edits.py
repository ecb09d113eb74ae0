"""Gradient edits (`edits=[...]`): each operation, each strategy, against plain torch hooks written here.

The reference puts the edit where a user would by hand: a forward hook hands the model `out * 1.0`,
reads what arrives at it, and a tensor hook on `out` returns the edited gradient (a parameter: a
tensor hook on it). The random operations draw from a generator seeded with `generator_seed(seed,
step, tap, call)`, the documented seed; everything else here is plain torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import EveryExpert, check_ok, compose_cfg, gradrunner_in_process, leftover_hooks
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner import GradrunnerError, capture
from gradrunner.capturing.edits import generator_seed
from gradrunner.models import MLP, CosineRegression, SmallCNN, TinyTransformerBlock, TwoLayerSigmoid

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
MASK = {"dim": -1, "keep": [0, 5, 7]}
OPS: dict[str, Any] = {"scale": -0.5, "clip_norm": 0.01, "clip_value": 0.002, "mask": MASK, "dropout": 0.4,
                       "noise_std": 0.01}  # fmt: skip
Edit = Callable[[torch.Tensor, str, int], torch.Tensor]


def ref_op(op: str, value: Any, seed: int = 0, step: int = 0) -> Edit:
    """The README's table in plain torch: g -> the edited gradient, for the record (tap, call)."""

    def draw(g: torch.Tensor, tap: str, call: int, normal: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(generator_seed(seed, step, tap, call))
        return (torch.randn if normal else torch.rand)(g.shape, generator=gen, dtype=torch.float32)

    def edit(g: torch.Tensor, tap: str, call: int) -> torch.Tensor:
        if op == "scale":
            return g * value
        if op == "clip_norm":
            return g * min(1.0, value / (float(g.norm()) + 1e-6))
        if op == "clip_value":
            return torch.clamp(g, -value, value)
        if op == "mask":
            out = torch.zeros_like(g)
            index: list[Any] = [slice(None)] * g.dim()
            for k in value["keep"]:
                index[value["dim"]] = k
                out[tuple(index)] = g[tuple(index)]
            return out
        if op == "dropout":
            return torch.where(draw(g, tap, call, False) >= value, g / (1 - value), torch.zeros_like(g))
        assert op == "noise_std"
        return g + value * draw(g, tap, call, True).to(g.dtype)

    return edit


def reference(
    model: nn.Module, run: Callable[[nn.Module], torch.Tensor], outputs: dict[str, Edit | None],
    params: dict[str, Edit] | None = None,
) -> tuple[dict[tuple[str, int], torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Plain hooks: (the gradient arriving at each watched output call / edited parameter, every param's .grad).

    `outputs` maps a module path to its output's edit (None: only watch it, through a hook on the output).
    """
    arrived: dict[tuple[str, int], torch.Tensor] = {}
    handles: list[Any] = []
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}

    def forward_hook(path: str, edit: Edit | None) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, output: Any) -> Any:
            call = calls[path] = calls.get(path, -1) + 1
            tap = f"{path}:output.0" if isinstance(output, tuple) else f"{path}:output"
            out = output[0] if isinstance(output, tuple) else output
            if edit is None:
                out.register_hook(lambda g: arrived.__setitem__((tap, call), g))
                return None
            out.register_hook(lambda g: edit(g, tap, call))  # what flows on: edited
            mid = out * 1.0
            mid.register_hook(lambda g: arrived.__setitem__((tap, call), g))  # what arrived
            return (mid, *output[1:]) if isinstance(output, tuple) else mid

        return hook

    for path, edit in outputs.items():
        handles.append(modules[path].register_forward_hook(forward_hook(path, edit)))
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, edit in (params or {}).items():
        tap = ":".join(name.rsplit(".", 1)) if "." in name else f":{name}"
        handles.append(named[name].register_hook(lambda g, tap=tap: arrived.__setitem__((tap, 0), g)))
        handles.append(named[name].register_hook(lambda g, tap=tap, edit=edit: edit(g, tap, 0)))  # type: ignore[misc]
    run(model).backward()
    for h in handles:
        h.remove()
    return arrived, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def captured(
    model: nn.Module, run: Callable[[nn.Module], torch.Tensor], strategy: str, taps: Sequence[str],
    edits: list[dict[str, Any]],
) -> tuple[Any, Any, dict[str, torch.Tensor]]:  # fmt: skip
    with capture(model, list(taps), strategy, edits=edits) as cap:
        loss = run(model)
        cap.backward(loss)
        recs = cap.records(loss)
    assert leftover_hooks(model) == []
    return cap, recs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check(recs: Any, cap: Any, arrived: dict[tuple[str, int], torch.Tensor], edited: dict[str, Edit]) -> None:
    """Each record equals the reference's arriving gradient; edited ones carry the norm after the edit."""
    rows = {(k.tap, k.call): i for i, k in enumerate(recs.keys)}
    for (tap, call), g in arrived.items():
        i = rows[(tap, call)]
        torch.testing.assert_close(cap.grads[tap, call], g, rtol=1e-9, atol=1e-12)
        assert recs.stats["norm"][i] == pytest.approx(float(g.norm()), rel=1e-9)
        if tap in edited:
            assert recs.edited[i], tap
            assert recs.edited_norm[i] == pytest.approx(float(edited[tap](g, tap, call).norm()), rel=1e-6, abs=1e-12)
        else:
            assert not recs.edited[i] and np.isnan(recs.edited_norm[i]), tap


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-12, msg=name)


# -- each operation x each strategy, on the built-in MLP with in-place ReLUs -------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op", list(OPS))
def test_each_operation_edits_what_flows_on_and_records_what_arrived(op: str, strategy: str) -> None:
    model = MLP(in_features=8, hidden=32, depth=2, inplace=True).double()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)

    def run(m: nn.Module) -> torch.Tensor:
        return ((m(x) - y) ** 2).mean()

    edit = ref_op(op, OPS[op])
    arrived, want = reference(copy.deepcopy(model), run, {"fc1": None, "relu1": edit}, {"head.weight": edit})
    edits = [{"tap": "relu1:output", op: OPS[op]}, {"tap": "head:weight", op: OPS[op]}]
    cap, recs, got = captured(model, run, strategy, ["fc1:output"], edits)
    check(recs, cap, arrived, {"relu1:output": edit, "head:weight": edit})
    assert_same_grads(got, want)  # fc1's gradient came through the edit: it differs from the unedited one
    plain = copy.deepcopy(model)
    plain.zero_grad()
    run(plain).backward()
    assert not torch.allclose(plain.fc1.weight.grad, got["fc1.weight"])


def test_the_edited_taps_rows_exist_without_being_tapped_and_several_edits_apply_in_config_order() -> None:
    model = MLP(in_features=8, hidden=32, depth=1).double()
    x = torch.randn(4, 8, dtype=torch.float64)

    def run(m: nn.Module) -> torch.Tensor:
        return (m(x) ** 2).sum()

    a, b = ref_op("clip_value", 0.001), ref_op("scale", 3.0)

    def both(g: torch.Tensor, tap: str, call: int) -> torch.Tensor:
        return b(a(g, tap, call), tap, call)

    arrived, want = reference(copy.deepcopy(model), run, {"fc1": both})
    cap, recs, got = captured(model, run, "hook", [], [{"tap": "fc1:output", "clip_value": 0.001},
                                                        {"tap": "fc1:output", "scale": 3.0}])  # fmt: skip
    assert [k.tap for k in recs.keys] == ["fc1:output"]
    check(recs, cap, arrived, {"fc1:output": both})
    assert_same_grads(got, want)
    assert float(got["fc1.weight"].abs().max()) > 0  # clip then scale: 3x the clipped gradient, not clipped


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_edits_on_two_taps_of_one_tensor_apply_as_backward_meets_them(strategy: str) -> None:
    model = MLP(in_features=8, hidden=16, depth=1).double()  # fc1's output is relu1's input
    x = torch.randn(4, 8, dtype=torch.float64)
    by_hand = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}

    def hook(m: nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor:
        out.register_hook(lambda g: seen.setdefault("fc1", g).clamp(-1e-3, 1e-3))  # fires first: edits last
        mid = out * 1.0
        mid.register_hook(lambda g: seen.setdefault("relu1", g) * 10.0)
        return mid

    by_hand.fc1.register_forward_hook(hook)
    by_hand(x).sum().backward()
    cap, recs, got = captured(model, lambda m: m(x).sum(), strategy, [], [{"tap": "fc1:output", "clip_value": 1e-3},
                                                                          {"tap": "relu1:input", "scale": 10.0}])  # fmt: skip
    row = {k.tap: i for i, k in enumerate(recs.keys)}
    assert recs.stats["norm"][row["relu1:input"]] == pytest.approx(float(seen["relu1"].norm()))
    assert recs.stats["norm"][row["fc1:output"]] == pytest.approx(float(seen["fc1"].norm()))  # 10x what relu1 got
    assert recs.edited_norm[row["fc1:output"]] == pytest.approx(float(seen["fc1"].clamp(-1e-3, 1e-3).norm()))
    assert_same_grads(got, {n: p.grad for n, p in by_hand.named_parameters()})


# -- awkward places: module reuse, tied parameters, locals, a transformers model --------------------------
BUILT_IN = {
    "cnn": (lambda: SmallCNN(), (2, 1, 8, 8), {"relu1": ("clip_value", 0.01)}, {"fc.weight": ("mask", {"dim": 0, "keep": [1, 3]})}),
    "transformer": (lambda: TinyTransformerBlock(reuse_act=True), (2, 5, 16), {"act": ("scale", -1.0), "attn": ("dropout", 0.5)},
                    {"ff1.weight": ("clip_norm", 0.01)}),
    "cosine": (lambda: CosineRegression(a=0.7, b=0.2), (5,), {}, {"a": ("scale", 2.0), "b": ("noise_std", 0.1)}),
    "sigmoid2": (lambda: TwoLayerSigmoid(), (1, 1), {}, {"w1": ("noise_std", 0.1), "w2": ("clip_value", 0.01)}),
}  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(BUILT_IN))
def test_the_built_in_models_are_edited_like_plain_hooks_edit_them(name: str, strategy: str) -> None:
    make, shape, outputs, params = BUILT_IN[name]
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64)

    def run(m: nn.Module) -> torch.Tensor:
        return (m(x) ** 2).sum()

    def tap_of(path: str) -> str:
        return f"{path}:output.0" if path == "attn" else f"{path}:output"

    ref_outputs = {path: ref_op(*op) for path, op in outputs.items()}
    ref_params = {p: ref_op(*op) for p, op in params.items()}
    arrived, want = reference(copy.deepcopy(model), run, dict(ref_outputs), dict(ref_params))
    edits = [{"tap": tap_of(path), op: value} for path, (op, value) in outputs.items()]
    edits += [{"tap": ":".join(p.rsplit(".", 1)) if "." in p else f":{p}", op: value} for p, (op, value) in params.items()]
    cap, recs, got = captured(model, run, strategy, [], edits)
    edited = {tap_of(path): f for path, f in ref_outputs.items()}
    edited.update({":".join(p.rsplit(".", 1)) if "." in p else f":{p}": f for p, f in ref_params.items()})
    check(recs, cap, arrived, edited)
    assert_same_grads(got, want)


class Twice(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sin(self.lin(x)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_module_called_twice_is_edited_at_each_call(strategy: str) -> None:
    model = Twice().double()
    x = torch.randn(5, 6, dtype=torch.float64)

    def run(m: nn.Module) -> torch.Tensor:
        return (m(x) ** 2).sum()

    edit = ref_op("dropout", 0.5)
    arrived, want = reference(copy.deepcopy(model), run, {"lin": edit})
    assert len(arrived) == 2
    cap, recs, got = captured(model, run, strategy, [], [{"tap": "lin:output", "dropout": 0.5}])
    check(recs, cap, arrived, {"lin:output": edit})
    assert_same_grads(got, want)


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's (two names, one Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_edit_on_a_tied_parameter_edits_it_under_both_names(strategy: str) -> None:
    model = Tied().double()
    ids = torch.tensor([[1, 2, 3], [3, 4, 9]])

    def run(m: nn.Module) -> torch.Tensor:
        return (m(ids) ** 2).sum()

    edit = ref_op("clip_norm", 0.05)
    arrived, want = reference(copy.deepcopy(model), run, {}, {"out.weight": edit})
    cap, recs, got = captured(model, run, strategy, ["emb:weight"], [{"tap": "out:weight", "clip_norm": 0.05}])
    assert_same_grads(got, want)
    assert float(got["emb.weight"].norm()) == pytest.approx(0.05, rel=1e-4)
    g = arrived[("out:weight", 0)]
    for i, key in enumerate(recs.keys):  # both names: the gradient before the edit, marked edited
        assert recs.edited[i] and recs.stats["norm"][i] == pytest.approx(float(g.norm())), key
        assert recs.edited_norm[i] == pytest.approx(float(edit(g, "out:weight", 0).norm()), rel=1e-9)


class Skip(nn.Module):
    """`hidden` reaches the head by two paths: through fc2 and around it (the skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        through = self.fc2(hidden)
        return self.head(through + hidden)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_edit_on_a_local_variable_matches_the_same_edit_written_into_forward(strategy: str) -> None:
    model = Skip().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    edit = ref_op("mask", {"dim": 0, "keep": [1, 4]})
    seen: list[torch.Tensor] = []

    def by_hand(m: Skip) -> torch.Tensor:  # forward() with the edit written in: the reference
        hidden = torch.tanh(m.fc1(x))
        hidden.register_hook(lambda g: edit(g, ":hidden", 0))
        mid = hidden * 1.0
        mid.register_hook(seen.append)
        return m.head(m.fc2(mid) + mid).sum()

    ref = copy.deepcopy(model)
    by_hand(ref).backward()
    cap, recs, got = captured(model, lambda m: m(x).sum(), strategy, [], [{"tap": ":hidden", "mask": {"dim": 0, "keep": [1, 4]}}])
    check(recs, cap, {(":hidden", 0): seen[0]}, {":hidden": edit})
    assert_same_grads(got, {n: p.grad for n, p in ref.named_parameters()})


transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=50, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_transformers_model_is_edited_like_plain_hooks_edit_it(strategy: str) -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 50, (2, 8))

    def run(m: nn.Module) -> torch.Tensor:
        logits = m(input_ids=ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))

    stop, keep, noise = ref_op("scale", 0.0), ref_op("mask", {"dim": 1, "keep": [0, 3]}), ref_op("noise_std", 1e-3)
    arrived, want = reference(copy.deepcopy(model), run, {"transformer.h.0": stop, "transformer.h.1.mlp": keep},
                              {"lm_head.weight": noise})  # fmt: skip
    edits = [{"tap": "transformer.h.0:output", "scale": 0.0}, {"tap": "transformer.h.1.mlp:output", "mask": {"dim": 1, "keep": [0, 3]}},
             {"tap": "lm_head:weight", "noise_std": 1e-3}]  # fmt: skip
    cap, recs, got = captured(model, run, strategy, [], edits)
    check(recs, cap, arrived, {"transformer.h.0:output": stop, "transformer.h.1.mlp:output": keep, "lm_head:weight": noise})
    assert_same_grads(got, want)
    assert float(got["transformer.h.0.mlp.c_fc.weight"].abs().sum()) == 0  # stop-gradient: nothing reaches block 0


class Checkpointed(nn.Module):
    """`a` and `b` inside `torch.utils.checkpoint`: their forward runs again during backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=self.reentrant)
        return self.head(inner)


@pytest.mark.parametrize("captured_step", [True, False], ids=["captured", "uncaptured"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_an_edit_inside_a_checkpoint_is_applied_once(reentrant: bool, captured_step: bool) -> None:
    model = Checkpointed(reentrant)
    x = torch.randn(3, 4, requires_grad=reentrant)  # reentrant checkpointing needs an input that requires grad
    by_hand = copy.deepcopy(model)
    by_hand.a.register_forward_hook(lambda m, a, out: out.register_hook(lambda g: -2.0 * g) and None)
    by_hand.head(torch.tanh(by_hand.b(torch.tanh(by_hand.a(x))))).sum().backward()
    for strategy in STRATEGIES[:2] if reentrant else STRATEGIES:  # autograd.grad refuses reentrant checkpoints
        model.zero_grad()
        with capture(model, [], strategy, edits=[{"tap": "a:output", "scale": -2.0}]) as cap:
            cap.enabled = captured_step
            cap.backward(model(x).sum())
        for (name, want), got in zip(by_hand.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, msg=f"{strategy}: {name}")


@pytest.mark.parametrize("captured_step", [True, False], ids=["captured", "uncaptured"])
def test_a_seeded_edit_inside_a_reentrant_checkpoint_draws_what_it_draws_without_one(captured_step: bool) -> None:
    """dropout on a tap inside `checkpoint(use_reentrant=True)` (HF's `gradient_checkpointing_kwargs={"use_reentrant":
    True}`): the recomputation runs inside the backward whose number seeds the draw, and draws that backward's masks,
    not the next one's: every backward's `.grad` is the unchecked model's (before: other masks from the first)."""
    model, x = Checkpointed(reentrant=True), torch.randn(3, 4, requires_grad=True)
    plain = copy.deepcopy(model)
    plain.forward = lambda t: plain.head(torch.tanh(plain.b(torch.tanh(plain.a(t)))))  # type: ignore[method-assign]
    edits = [{"tap": "a:output", "dropout": 0.5}]
    for strategy in STRATEGIES[:2]:  # autograd.grad refuses reentrant checkpoints
        with capture(model, [], strategy, edits=edits) as cap, capture(plain, [], strategy, edits=edits) as ref:
            for _ in range(3):  # backwards 0, 1, 2: each its own masks
                cap.enabled = ref.enabled = captured_step
                model.zero_grad(), plain.zero_grad()
                cap.backward(model(x).sum())
                ref.backward(plain(x).sum())
                for (name, want), got in zip(plain.named_parameters(), model.parameters(), strict=True):
                    torch.testing.assert_close(got.grad, want.grad, msg=f"{strategy}: {name}")


def test_a_seeded_edit_on_a_root_run_inside_a_reentrant_checkpoint_draws_what_it_draws_without_one() -> None:
    """`capture(layer)` of a layer its parent runs as `checkpoint(layer, x, use_reentrant=True)`: in an uncaptured
    step the recomputation fires before the session sees its backward begin. Its draws are the unchecked layer's:
    after a captured step (whose recomputed calls were counted into the next forward's: call 1's mask), and after a
    backward of the session's that raised (it left the edits' backward running: the aborted backward's mask)."""
    torch.manual_seed(0)
    layer, head, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 1), torch.randn(3, 4)
    plain = copy.deepcopy(layer)
    edits = [{"tap": "0:output", "dropout": 0.5}]

    def fail(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a backward that raises")

    for strategy in STRATEGIES[:2]:  # autograd.grad refuses reentrant checkpoints
        with capture(layer, [], strategy, edits=edits) as cap, capture(plain, [], strategy, edits=edits) as ref:
            for enabled, raises in [(True, False), (False, False), (True, True), (False, False)]:
                cap.enabled = ref.enabled = enabled
                layer.zero_grad(), plain.zero_grad()
                outs = checkpoint(layer, x.requires_grad_(), use_reentrant=True), plain(x)
                if raises:
                    for session, out in zip((cap, ref), outs, strict=True):
                        out.register_hook(fail)
                        with pytest.raises(RuntimeError, match="a backward that raises"):
                            session.backward(head(out).sum())
                    continue
                for out in outs:
                    head(out).sum().backward()
                for (name, want), got in zip(plain.named_parameters(), layer.parameters(), strict=True):
                    assert torch.equal(got.grad, want.grad), f"{strategy}: {name}"


def test_a_glob_edit_skips_matches_that_cannot_carry_a_gradient() -> None:
    model = nn.Sequential(Embed(), nn.Linear(4, 1))
    ids = torch.tensor([1, 2, 3])
    with capture(model, [], "hook", edits=[{"tap": "*:input", "scale": 0.5}]) as cap:
        loss = model(ids).sum()
        cap.backward(loss)
        recs = cap.records(loss)
    rows = {k.tap: i for i, k in enumerate(recs.keys)}
    assert not recs.has_grad[rows["0.emb:input"]] and not recs.edited[rows["0.emb:input"]]
    assert recs.edited[rows["1:input"]] and recs.edited_norm[rows["1:input"]] == pytest.approx(0.5 * recs.stats["norm"][rows["1:input"]])


# -- what an edit leaves alone, and when it applies -----------------------------------------------------
def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, cap: Any = None, every: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if cap is not None:
            cap.enabled = step % every == 0
        loss = ((model(x) - y) ** 2).mean()
        cap.backward(loss) if cap is not None else loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("edits", [[], [{"tap": "fc2:output", "scale": 1.0}]], ids=["no edits", "scale 1"])
def test_no_edits_and_an_identity_edit_leave_training_bit_identical(edits: list[dict[str, Any]]) -> None:
    model = MLP(in_features=8, hidden=16, depth=2)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    plain = copy.deepcopy(model)
    train(plain, x, y, 4)
    with capture(model, ["fc1:output"], "hook", edits=edits, keep_grads=False) as cap:
        train(model, x, y, 4, cap, every=2)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_edits_apply_on_uncaptured_steps_too() -> None:
    model = MLP(in_features=8, hidden=16, depth=1)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    by_hand = copy.deepcopy(model)
    by_hand.head.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    by_hand.fc1.register_forward_hook(lambda m, a, out: out.register_hook(lambda g: -g) and None)
    train(by_hand, x, y, 3)
    with capture(model, [], "retain_grad", edits=[{"tap": "head:weight", "clip_value": 1e-3},
                                                 {"tap": "fc1:output", "scale": -1}]) as cap:  # fmt: skip
        train(model, x, y, 3, cap, every=100)  # only step 0 is captured
    for (name, a), b in zip(by_hand.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


class CalledAgain(nn.Module):
    """`a` called twice per forward: first under no_grad (a target branch) or inside a reentrant checkpoint, then plainly."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        self.first, self.checkpointed = first, True

    def inner(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == "no_grad":
            with torch.no_grad():
                target = self.a(x * 0.5)  # call 0: no gradient
            return self.head(self.a(x) + target)  # call 1
        inner = checkpoint(self.inner, x, use_reentrant=True) if self.checkpointed else self.inner(x)  # call 0
        return self.head(self.a(inner))  # call 1


@pytest.mark.parametrize("first", ["no_grad", "reentrant"])
def test_an_uncaptured_step_draws_with_the_calls_a_captured_step_records(first: str) -> None:
    """dropout on a module whose first call in a forward is under no_grad, or inside a reentrant checkpoint: a step
    outside `capture.every` numbered the calls otherwise than a captured step does (the no_grad call not counted; the
    recomputed call after the plain one, where no captured step had run before), so it drew other masks and the weights
    depended on `every`. Every step now draws the masks of the README's recipe with the record's `call`, as the
    hand-edited model (no checkpoint) does."""
    torch.manual_seed(0)
    model = CalledAgain(first)
    x, y = torch.randn(3, 4, requires_grad=first == "reentrant"), torch.randn(3, 1)  # reentrant: an input with grad
    plain, calls = copy.deepcopy(model), []
    plain.checkpointed = False

    def by_hand(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        call = len(calls)
        calls.append(call)
        if out.requires_grad:
            drop = ref_op("dropout", 0.5, step=step)
            out.register_hook(lambda g: drop(g, "a:output", call))

    plain.a.register_forward_hook(by_hand)
    for strategy in STRATEGIES if first == "no_grad" else STRATEGIES[:2]:  # autograd.grad refuses reentrant checkpoints
        m = copy.deepcopy(model)
        # a glob: the no_grad call is a row without gradient, no mistake
        with capture(m, [], strategy, edits=[{"tap": "a*:output", "dropout": 0.5}]) as cap:
            for step in range(4):
                cap.enabled = step % 2 == 1  # capture.every=2, resumed at an uncaptured step
                calls.clear()
                plain.zero_grad(), m.zero_grad()
                ((plain(x) - y) ** 2).mean().backward()
                cap.backward(((m(x) - y) ** 2).mean())
                for (name, want), got in zip(plain.named_parameters(), m.parameters(), strict=True):
                    torch.testing.assert_close(got.grad, want.grad, msg=f"{strategy}, step {step}: {name}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_second_backward_through_one_forward_draws_its_own_masks(strategy: str) -> None:
    """Two losses backpropagated through one forward (`retain_graph=True`): the second is backward 1, and the README
    seeds its dropout with step 1 (before: the forward's step, 0, the first backward's masks again; its record's
    `edited_norm` 2.3097 where the recipe gives 2.4403). The hand-edited model draws by the running backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    x, plain, running = torch.randn(6, 4), copy.deepcopy(model), [0]
    plain[1].register_forward_hook(lambda m, a, out: out.register_hook(lambda g: ref_op("dropout", 0.5, step=running[0])(
        g, "1:output", 0)) and None)  # fmt: skip
    out = plain(x)
    out[:, 0].sum().backward(retain_graph=True)
    running[0] = 1
    out[:, 1].pow(2).sum().backward()
    with capture(model, ["1:output"], strategy, edits=[{"tap": "1:output", "dropout": 0.5}]) as cap:
        out = model(x)
        cap.backward(out[:, 0].sum(), retain_graph=True)
        cap.backward(out[:, 1].pow(2).sum())
        arrived = cap.grads["1:output", 0]  # the second backward's
        recs = cap.records()
    assert recs.micro_step == [0, 1]
    assert recs.edited_norm[1] == pytest.approx(float(ref_op("dropout", 0.5, step=1)(arrived, "1:output", 0).norm()))
    for (name, want), got in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_seeded_edits_give_identical_records_across_strategies_and_reruns() -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    edits = [{"tap": "relu1:output", "dropout": 0.3}, {"tap": "fc2:weight", "noise_std": 0.01}]
    seen = []
    for strategy in [*STRATEGIES, "hook"]:
        torch.manual_seed(1)
        model = MLP(in_features=8, hidden=16, depth=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = []
        with capture(model, ["fc1:output"], strategy, edits=edits, keep_grads=False, seed=7) as cap:
            for _ in range(3):
                loss = ((model(x) - y) ** 2).mean()
                cap.backward(loss)
                opt.step()
                opt.zero_grad()
                recs = cap.records(loss)
                rows.append(np.concatenate([recs.stats["norm"], recs.edited_norm]))
        seen.append(np.stack(rows))
    for other in seen[1:]:
        np.testing.assert_array_equal(other, seen[0])
    assert len({float(r[-1]) for r in seen[0]}) == 3  # the noise is drawn anew each step


# -- mistakes: one paragraph each ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"tap": "fc1:output", "scale": 0}, "must be a list"),
        ([{"tap": "fc1:output", "scal": 0}], "unknown operation 'scal'. Did you mean 'scale'"),
        ([{"tap": "fc1:output", "scale": 0, "clip_norm": 1}], "has 2 operations (scale, clip_norm)"),
        ([{"tap": "fc1:output"}], "names no operation"),
        ([{"scale": 0.5}], "has no tap"),
        ([{"tap": "fc1:output", "clip_norm": -1.0}], "clip_norm=-1.0 is not allowed: it must be >= 0"),
        ([{"tap": "fc1:output", "dropout": 1.5}], "a probability is between 0 and 1"),
        ([{"tap": "fc1:output", "scale": "half"}], "must be a finite number"),
        ([{"tap": "fc1:output", "mask": {"dim": 0}}], "exactly the keys dim and keep"),
        ([{"tap": "fc1:output", "mask": {"dim": 0, "keep": []}}], "non-empty list"),
        ([{"tap": "fc9:output", "scale": 0}], "edits[0] {tap: 'fc9:output', scale: 0.0}: tap 'fc9:output': no module 'fc9'"),
        ([{"tap": "fc1:weight", "mask": {"dim": 1, "keep": [8]}}], "mask.keep index 8 is out of range for dim 1"),
    ],
)
def test_bad_edits_are_refused_when_the_session_opens(edits: Any, message: str) -> None:
    model = MLP(in_features=8, hidden=16, depth=1)
    with pytest.raises(GradrunnerError) as info:
        capture(model, [], edits=edits)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert leftover_hooks(model) == []


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


@pytest.mark.parametrize(
    ("model", "inputs", "edit", "message"),
    [
        (MLP(in_features=8, hidden=16, depth=1), torch.randn(3, 8), {"tap": "fc1:output", "mask": {"dim": 0, "keep": [3]}},
         "mask.keep index 3 is out of range for dim 0 of fc1:output's gradient, shape [3, 16]"),
        (Embed(), torch.tensor([1, 2]), {"tap": "emb:input", "scale": 0.0}, "emb:input cannot carry a gradient"),
    ],
    ids=["mask out of range", "integer input"],
)
@pytest.mark.parametrize("taps", [[], ["*:input", "*:output"]], ids=["edit alone", "a glob tap matches it too"])
def test_edits_that_cannot_apply_are_refused_at_the_first_forward(model: nn.Module, inputs: torch.Tensor, edit: Any,
                                                                  message: str, taps: list[str]) -> None:  # fmt: skip
    """A named edit's mistake is refused also where a glob in `taps` matches its tap (before: the session took the
    glob's tap, and the integer input's edit was skipped as a glob's match, with nothing said)."""
    with capture(model, taps, "hook", edits=[edit]), pytest.raises(GradrunnerError, match=message.replace("[", r"\[")):
        model(inputs)
    assert leftover_hooks(model) == []


def test_an_edit_on_a_frozen_parameter_is_refused() -> None:
    model = MLP(in_features=8, hidden=16, depth=1)
    model.fc1.weight.requires_grad_(False)
    with pytest.raises(GradrunnerError, match=r"fc1:weight cannot carry a gradient: the parameter does not require grad"):
        capture(model, [], edits=[{"tap": "fc1:weight", "scale": 0.0}])


# -- the runner and the command line ----------------------------------------------------------------------
def test_the_runner_edits_every_step_and_writes_the_two_columns(tmp_path: Any) -> None:
    import pandas as pd

    from gradrunner.run.loop import train

    cfg = compose_cfg("+experiment=mlp", "steps=3", "device=cpu", "capture.every=2",
                      'edits=[{tap:"relu2:output",scale:0.0}]')  # fmt: skip
    df = pd.read_parquet(train(cfg, out_dir=tmp_path))
    assert sorted(set(df.step)) == [0, 2]
    edited = df[df.edited]
    assert set(edited.tap) == {"relu2:output"} and (edited.edited_norm == 0).all() and (edited.norm > 0).all()
    assert df[~df.edited].edited_norm.isna().all()
    fc1 = df[df.tap == "fc1:weight"].set_index("step")
    assert (fc1.norm == 0).all()  # nothing reaches below the stopped gradient
    # fc1's weight did not move at step 1 either, an uncaptured step: the edit applied there too
    assert fc1.value_norm[2] == fc1.value_norm[0]
    head = df[df.tap == "head:weight"].set_index("step")
    assert head.value_norm[2] != head.value_norm[0]


# -- the command line ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_sweep_over_an_edits_strength_from_the_command_line(tmp_path: Any) -> None:
    result = gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "steps=2", "device=cpu", "hydra.sweep.dir=sweep",
                                   'edits=[{tap:"relu2:output",scale:0.0}]', "edits.0.scale=0,0.5,1")  # fmt: skip
    check_ok(result)
    from gradrunner.analysis import load

    df = load(tmp_path / "sweep")
    rows = df[df.tap == "relu2:output"]
    assert sorted(set(rows["edits.0.scale"])) == [0.0, 0.5, 1.0] and rows.edited.all()
    np.testing.assert_allclose(rows.edited_norm, rows["edits.0.scale"] * rows.norm, rtol=1e-6)
    others = df[df.tap != "relu2:output"]
    assert not others.edited.any() and others.edited_norm.isna().all()
    below = df[(df.tap == "fc1:weight") & (df.step == 0)].set_index("edits.0.scale").norm
    assert below[0.0] == 0 and below[0.5] == pytest.approx(below[1.0] / 2, rel=1e-5)  # step 0: all else equal
    pytest.importorskip("matplotlib")
    from gradrunner.report.write import write_report

    page = write_report(tmp_path / "sweep").read_text()
    assert "Gradient edits" in page and "The sweep over edits.0.scale" in page


@pytest.mark.slow
def test_a_bad_edit_on_the_command_line_is_one_paragraph_and_exit_2(tmp_path: Any) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=1", "device=cpu",
                                   'edits=[{tap:"relu2:output",clip_norm:-1}]')  # fmt: skip
    assert result.returncode == 2, result.stderr
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "edits[0] (tap 'relu2:output'): clip_norm=-1 is not allowed" in err[0], result.stderr
    assert not list(tmp_path.rglob("grads.parquet"))


def test_a_glob_and_a_name_on_one_tap_both_apply_in_config_order() -> None:
    """The same tap edited by two entries, through a glob and by name: both edits, one row per call."""
    model = MLP(in_features=8, hidden=16, depth=2)
    with capture(model, ["relu*:output"], "autograd_grad", edits=[{"tap": "relu*:output", "scale": 2.0},
                                                                   {"tap": "relu1:output", "scale": 0.5}]) as cap:  # fmt: skip
        loss = model(torch.randn(3, 8)).sum()
        cap.backward(loss)
        recs = cap.records(loss)
    got = dict(zip([k.tap for k in recs.keys], zip(recs.stats["norm"], recs.edited_norm, strict=True), strict=True))
    assert got["relu1:output"][1] == pytest.approx(got["relu1:output"][0])  # 2 * 0.5
    assert got["relu2:output"][1] == pytest.approx(2 * got["relu2:output"][0])
    assert list(got) == ["relu1:output", "relu2:output"]


# -- CUDA (skipped without a GPU) ------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_edits_on_cuda_never_sync_the_host_and_match_cpu() -> None:
    # The random edits sit where no compared gradient depends on them (CPU and CUDA draw different numbers):
    # fc1:output is the last output the backward reaches, and noise on fc2's weight reaches only its `.grad`.
    every_op = [{"tap": "relu2:output", "clip_norm": 0.01}, {"tap": "fc2:output", "clip_value": 0.001},
                {"tap": "relu1:output", "mask": {"dim": 1, "keep": [0, 3]}}, {"tap": "head:weight", "scale": -1.0},
                {"tap": "fc1:output", "dropout": 0.3}, {"tap": "fc2:weight", "noise_std": 1e-3}]  # fmt: skip
    deterministic = {"relu2:output", "fc2:output", "relu1:output", "head:weight"}
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = MLP(in_features=8, hidden=32, depth=2).to(device)
        xd, yd = x.to(device), y.to(device)  # a copy from pageable host memory syncs: outside the checked region
        with capture(model, ["fc*:output"], "hook", edits=every_op, keep_grads=False) as cap:
            for step in range(3):
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error" if device == "cuda" and step > 0 else "default")
                try:
                    loss = ((model(xd) - yd) ** 2).mean()
                    cap.backward(loss)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                recs = cap.records(loss)
                model.zero_grad()
        keep = [i for i, k in enumerate(recs.keys) if k.tap in deterministic]
        results[device] = (recs.stats["norm"][keep], recs.edited_norm[keep])
    for cpu, cuda in zip(results["cpu"], results["cuda"], strict=True):
        np.testing.assert_allclose(cuda, cpu, rtol=1e-4)


def test_a_parameter_edit_under_accumulation_records_the_steps_gradient_before_and_after_it(tmp_path: Any) -> None:
    """train.accumulate=2 and `scale: 0.5` on fc1's weight: its one row per step holds the gradient that arrived
    over both micro-batches (before the edit) and `edited_norm` the same after it, as plain hooks see them."""
    import pandas as pd

    from gradrunner.run.build import setup
    from gradrunner.run.loop import train

    cfg = compose_cfg("+experiment=mlp", "steps=2", "device=cpu", "train.accumulate=2", "taps=[fc1:weight]",
                      'edits=[{tap:"fc1:weight",scale:0.5}]')  # fmt: skip
    df = pd.read_parquet(train(cfg, out_dir=tmp_path)).set_index("step")
    job = setup(cfg)  # the runner's model, data and optimiser again, from the seed
    arrived: list[torch.Tensor] = []
    weight = job.model.fc1.weight
    weight.register_hook(lambda g: arrived.append(g.clone()))
    weight.register_hook(lambda g: 0.5 * g)  # the edit, by hand
    for step in range(2):
        arrived.clear()
        for _ in range(2):
            x, y = next(job.batches)
            (job.loss_fn(job.model(x), y) / 2).backward()
        want = arrived[0] + arrived[1]
        row = df.loc[step]
        assert row.edited and pd.isna(row.micro_step)
        assert row.norm == pytest.approx(float(want.norm()), rel=1e-5)
        assert row.edited_norm == pytest.approx(float(0.5 * want.norm()), rel=1e-5)
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)


def test_every_operation_is_named_checked_and_applied_in_one_list_each() -> None:
    """config.edits.OPERATIONS names and checks the operations, capturing.edits.APPLY applies them; a name in one
    and not the other fails at import (here: the check itself, and each operation applied to a gradient)."""
    from gradrunner.capturing.edits import APPLY, apply_edit
    from gradrunner.config.edits import OPERATIONS, Edit, parse_edits

    assert list(APPLY) == list(OPERATIONS)
    g = torch.randn(3, 4)
    values = {"scale": 0.5, "clip_norm": 0.1, "clip_value": 0.1, "mask": {"dim": 0, "keep": [1]}, "dropout": 0.5,
              "noise_std": 0.1}  # fmt: skip
    assert set(values) == set(OPERATIONS)
    for op, value in values.items():
        (edit,) = parse_edits([{"tap": "fc1:output", op: value}])
        out = apply_edit(edit, g, seed=3)
        assert out.shape == g.shape and not torch.equal(out, g), op
        with pytest.raises(GradrunnerError, match=f"{op}=.*is not allowed"):
            parse_edits([{"tap": "fc1:output", op: "x" if op != "mask" else 1.0}])
    assert isinstance(Edit("t", "scale", 1.0).label, str)


@pytest.mark.parametrize("strategy", ["retain_grad", "hook", "autograd_grad"])
def test_an_edit_on_an_expert_given_no_tokens_edits_nothing(strategy: str) -> None:
    """An expert called on a (0, d) tensor (no token routed to it) has a gradient of no elements: a `scale` edit on it
    changed nothing, yet its record said edited, edited_norm 0 (found 2026-11-27). Now edited false, edited_norm NaN;
    the other experts edited, and every `.grad` is what plain hooks scaling the same outputs give."""
    torch.manual_seed(0)
    model, x = EveryExpert(), torch.randn(5, 3)
    ref = copy.deepcopy(model)

    def doubled(m: nn.Module, a: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: g * 2.0)

    hooks = [e.register_forward_hook(doubled) for e in ref.experts]
    ref(x).pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    cap, recs, grads = captured(model, lambda m: m(x).pow(2).mean(), strategy, ["experts.*:output"],
                                [{"tap": "experts.*:output", "scale": 2.0}])  # fmt: skip
    rows = {k.tap: i for i, k in enumerate(recs.keys)}
    empty = rows["experts.2:output"]
    assert recs.numel[empty] == 0 and recs.has_grad[empty]
    assert not recs.edited[empty] and np.isnan(recs.edited_norm[empty])
    for e in (0, 1):
        i = rows[f"experts.{e}:output"]
        assert recs.edited[i] and recs.edited_norm[i] == pytest.approx(2 * recs.stats["norm"][i], rel=1e-6)
    assert_same_grads(grads, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_session_entered_again_draws_its_seeded_edits_on_from_the_earlier_entries(strategy: str) -> None:
    """`with cap:` once more goes on with the session's backward count: the second entry's first backward draws
    step 1's dropout mask, not step 0's (the README said a re-entered session records what a new session would,
    which a new session's step-0 mask is not). Checked against the README's formula in plain torch hooks."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    plain = copy.deepcopy(model)
    cap = capture(model, ["0:output"], strategy, edits=[{"tap": "0:output", "dropout": 0.5}])
    for step in range(3):  # three entries of one session: steps 0, 1, 2
        with cap:
            cap.backward(model(x).pow(2).mean())
            got = cap.records()
        arrived: list[torch.Tensor] = []
        edit = ref_op("dropout", 0.5, step=step)

        def hook(g: torch.Tensor, edit: Edit = edit, arrived: list[torch.Tensor] = arrived) -> torch.Tensor:
            arrived.append(g)
            return edit(g, "0:output", 0)

        out = plain[0](x)
        out.register_hook(hook)
        plain[2](plain[1](out)).pow(2).mean().backward()
        assert float(got.stats["norm"][0]) == pytest.approx(float(arrived[0].norm()), rel=1e-6)
        assert float(got.edited_norm[0]) == pytest.approx(float(edit(arrived[0], "0:output", 0).norm()), rel=1e-6)
        for (name, want), param in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(param.grad, want.grad), f"step {step}: {name}"
        model.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
