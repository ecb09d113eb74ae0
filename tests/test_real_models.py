"""Real model code nobody here wrote: HuggingFace GPT-2 (tied embeddings), BERT and Llama, built from tiny
random-init configs (no downloads), tapped every way the contract allows, with every strategy.

Every gradient is compared with an independent reference computed without gradrunner: forward hooks
written here collect the tapped tensors on a deep copy of the model (in-place ops turned off, float64)
and `torch.autograd.grad` differentiates the loss with respect to them. A local variable's reference
is the module output or input that the model's source binds to it (noted beside each).

torchvision is not tested where it does not import: PyPI's build is made against CUDA torch and fails
beside a CPU torch (`operator torchvision::nms does not exist`); its test then skips, saying so.
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner import capture

transformers = pytest.importorskip("transformers", reason="the real-model suite needs the extra gradrunner[hf]")

#: (kind, module path or parameter name, element, call): "out"/"in" of a module call, or "param".
Ref = tuple[str, str, Any, int]


def out(path: str, element: Any = None, call: int = 0) -> Ref:
    return ("out", path, element, call)


def inp(path: str, call: int = 0) -> Ref:
    return ("in", path, None, call)


def param(name: str) -> Ref:
    return ("param", name, None, 0)


@dataclass
class RealCase:
    name: str
    build: Callable[[], nn.Module]
    taps: list[str]
    #: Resolved tap -> the reference point of each of its calls.
    refs: dict[str, list[Ref]]
    batch: int = 2
    seq: int = 8
    vocab: int = 50

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().double().train()

    def loss(self, model: nn.Module) -> torch.Tensor:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=torch.Generator().manual_seed(1))
        return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


def _pick(value: Any, element: Any) -> Any:
    if element is None:
        return value
    if isinstance(element, int):
        return value[element]
    return value[element] if isinstance(value, dict) else getattr(value, element)


def reference(case: RealCase, model: nn.Module) -> dict[str, list[torch.Tensor | None]]:
    """Gradients at every reference point, by forward hooks and torch.autograd.grad on a deep copy."""
    m = copy.deepcopy(model)
    for module in m.modules():
        if hasattr(module, "inplace"):
            module.inplace = False
    modules = dict(m.named_modules())
    seen: dict[tuple[str, str], list[Any]] = defaultdict(list)
    handles = []
    for path in {r[1] for refs in case.refs.values() for r in refs if r[0] != "param"}:
        handles.append(modules[path].register_forward_hook(
            lambda _m, _a, o, path=path: seen["out", path].append(o)))  # fmt: skip
        handles.append(modules[path].register_forward_pre_hook(
            lambda _m, a, path=path: seen["in", path].append(a[0] if a else None)))  # fmt: skip
    try:
        loss = case.loss(m)
    finally:
        for h in handles:
            h.remove()
    points = [(tap, r) for tap, refs in case.refs.items() for r in refs]
    tensors = [m.get_parameter(r[1]) if r[0] == "param" else _pick(seen[r[0], r[1]][r[3]], r[2]) for _, r in points]
    grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    result: dict[str, list[torch.Tensor | None]] = defaultdict(list)
    for (tap, _), g in zip(points, grads, strict=True):
        result[tap].append(g)
    return dict(result)


def captured(case: RealCase, model: nn.Module, strategy: str) -> dict[str, list[torch.Tensor | None]]:
    m = copy.deepcopy(model)
    with capture(m, case.taps, strategy=strategy) as cap:
        cap.backward(case.loss(m))
    assert leftover_hooks(m) == []
    assert set(cap.grads) == set(case.refs), "every resolved tap has a reference"
    return {tap: cap.grads.calls(tap) for tap in cap.grads}


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=50, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, vocab_size=50, max_position_embeddings=16,
                                   attn_implementation="eager")  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


H0, H1 = "transformer.h.0", "transformer.h.1"
L0, B0 = "model.layers.0", "bert.encoder.layer.0"
CASES = [
    RealCase("gpt2", _gpt2, [
        "transformer.h.?:output", f"{H0}.attn:output.0", f"{H0}.attn:output.1", ":output.logits",
        "transformer.wte:output", "transformer.wpe:output", "transformer.wte:weight", "lm_head:weight",
        f"{H0}.mlp.c_fc:weight", "transformer.ln_f:weight", f"{H1}.ln_1:input",
        f"{H0}:feed_forward_hidden_states", f"{H1}:residual", f"{H0}:attn_output",  # decorated GPT2Block.forward
        f"{H0}.attn:attn_weights", f"{H0}.mlp:hidden_states",  # plain GPT2Attention / GPT2MLP forwards
    ], {
        f"{H0}:output": [out(H0)], f"{H1}:output": [out(H1)],
        f"{H0}.attn:output.0": [out(f"{H0}.attn", 0)], f"{H0}.attn:output.1": [out(f"{H0}.attn", 1)],
        ":output.logits": [out("", "logits")],
        "transformer.wte:output": [out("transformer.wte")], "transformer.wpe:output": [out("transformer.wpe")],
        "transformer.wte:weight": [param("transformer.wte.weight")],
        "lm_head:weight": [param("transformer.wte.weight")],  # tied: the same Parameter
        f"{H0}.mlp.c_fc:weight": [param(f"{H0}.mlp.c_fc.weight")],
        "transformer.ln_f:weight": [param("transformer.ln_f.weight")],
        f"{H1}.ln_1:input": [inp(f"{H1}.ln_1")],
        f"{H0}:feed_forward_hidden_states": [out(f"{H0}.mlp")],
        f"{H1}:residual": [inp(f"{H1}.ln_1"), inp(f"{H1}.ln_2")],  # the block's input, then attn + residual
        f"{H0}:attn_output": [out(f"{H0}.attn", 0)],
        f"{H0}.attn:attn_weights": [out(f"{H0}.attn", 1)],  # also output.1: one tensor, two taps
        f"{H0}.mlp:hidden_states": [out(f"{H0}.mlp.c_fc"), out(f"{H0}.mlp.act"), out(f"{H0}.mlp.c_proj"),
                                    out(f"{H0}.mlp.dropout")],  # fmt: skip
    }),
    RealCase("bert", _bert, [
        "bert.encoder.layer.?:output", f"{B0}.attention.self:output.1", f"{B0}.attention:output.0", ":output.logits",
        "bert.embeddings:output", "bert.embeddings.word_embeddings:weight", "cls.predictions.decoder:weight",
        f"{B0}.intermediate.dense:weight",
        f"{B0}:self_attention_output", f"{B0}:attention_output", f"{B0}:layer_output",  # decorated BertLayer.forward
        f"{B0}.attention.self:attn_weights",  # plain BertSelfAttention.forward
    ], {
        f"{B0}:output": [out(B0)], "bert.encoder.layer.1:output": [out("bert.encoder.layer.1")],
        f"{B0}.attention.self:output.1": [out(f"{B0}.attention.self", 1)],
        f"{B0}.attention:output.0": [out(f"{B0}.attention", 0)], ":output.logits": [out("", "logits")],
        "bert.embeddings:output": [out("bert.embeddings")],
        "bert.embeddings.word_embeddings:weight": [param("bert.embeddings.word_embeddings.weight")],
        "cls.predictions.decoder:weight": [param("bert.embeddings.word_embeddings.weight")],  # tied
        f"{B0}.intermediate.dense:weight": [param(f"{B0}.intermediate.dense.weight")],
        f"{B0}:self_attention_output": [out(f"{B0}.attention", 0)],
        f"{B0}:attention_output": [out(f"{B0}.attention", 0)],  # bound to self_attention_output: the same tensor
        f"{B0}:layer_output": [out(B0)],
        f"{B0}.attention.self:attn_weights": [out(f"{B0}.attention.self", 1)],
    }),
    RealCase("llama", _llama, [
        "model.layers.?:output", f"{L0}.self_attn:output.0", f"{L0}.self_attn:output.1", ":output.logits",
        "model.embed_tokens:output", "model.embed_tokens:weight", "lm_head:weight", f"{L0}.mlp.gate_proj:weight",
        f"{L0}:residual", f"{L0}:hidden_states",  # decorated LlamaDecoderLayer.forward
        f"{L0}.self_attn:attn_weights",  # plain LlamaAttention.forward
    ], {
        f"{L0}:output": [out(L0)], "model.layers.1:output": [out("model.layers.1")],
        f"{L0}.self_attn:output.0": [out(f"{L0}.self_attn", 0)],
        f"{L0}.self_attn:output.1": [out(f"{L0}.self_attn", 1)], ":output.logits": [out("", "logits")],
        "model.embed_tokens:output": [out("model.embed_tokens")],
        "model.embed_tokens:weight": [param("model.embed_tokens.weight")], "lm_head:weight": [param("lm_head.weight")],
        f"{L0}.mlp.gate_proj:weight": [param(f"{L0}.mlp.gate_proj.weight")],
        f"{L0}:residual": [inp(f"{L0}.input_layernorm"), inp(f"{L0}.post_attention_layernorm")],
        f"{L0}:hidden_states": [out(f"{L0}.input_layernorm"), out(f"{L0}.self_attn", 0),
                                inp(f"{L0}.post_attention_layernorm"), out(f"{L0}.post_attention_layernorm"),
                                out(f"{L0}.mlp"), out(L0)],  # fmt: skip
        f"{L0}.self_attn:attn_weights": [out(f"{L0}.self_attn", 1)],
    }),
]
CASE_IDS = [c.name for c in CASES]


def assert_same(got: dict[str, list[torch.Tensor | None]], expected: dict[str, list[torch.Tensor | None]],
                rtol: float = 1e-9) -> None:  # fmt: skip
    for tap, calls in expected.items():
        assert len(got[tap]) == len(calls), tap
        for n, (g, e) in enumerate(zip(got[tap], calls, strict=True)):
            assert e is not None, f"{tap} call {n}: the reference point takes part in the loss"
            assert g is not None, f"{tap} call {n}: no gradient captured"
            torch.testing.assert_close(g, e, rtol=rtol, atol=1e-12, msg=lambda m, t=tap, n=n: f"{t} call {n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_tap_matches_an_independent_reference(case: RealCase, strategy: str) -> None:
    model = case.model()
    assert_same(captured(case, model, strategy), reference(case, model))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_three_strategies_give_the_same_gradients(case: RealCase) -> None:
    model = case.model()
    results = {s: captured(case, model, s) for s in ("retain_grad", "hook", "autograd_grad")}
    for a, b in itertools.combinations(results, 2):
        assert_same(results[a], results[b], rtol=1e-12)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_parameter_grads_and_the_model_are_left_as_plain_backward_leaves_them(case: RealCase, strategy: str) -> None:
    model = case.model()
    plain = copy.deepcopy(model)
    case.loss(plain).backward()
    tapped = copy.deepcopy(model)
    with capture(tapped, case.taps, strategy=strategy) as cap:
        cap.backward(case.loss(tapped))
    for (name, p), q in zip(plain.named_parameters(), tapped.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=0)
    assert leftover_hooks(tapped) == []


def test_torchvision_models_when_torchvision_imports() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:
        pytest.skip(f"torchvision does not import beside this torch ({type(exc).__name__}: {exc}); PyPI's "
                    "torchvision is built against CUDA torch, so torchvision models are not tested here")  # fmt: skip
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=3).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    case = RealCase("resnet18", lambda: model, ["layer1.?:output", "fc:weight", "relu:output"], {
        "layer1.0:output": [out("layer1.0")], "layer1.1:output": [out("layer1.1")],
        "fc:weight": [param("fc.weight")], "relu:output": [out("relu")],
    })  # fmt: skip
    case.loss = lambda m: m(x).square().mean()  # type: ignore[method-assign]
    for strategy in ("retain_grad", "hook", "autograd_grad"):
        assert_same(captured(case, model, strategy), reference(case, model))
