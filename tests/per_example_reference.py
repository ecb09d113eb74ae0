"""The per-example reference the per-example tests share: each batch row alone through plain autograd (`loop`), gradrunner's
`PerExampleNorms` on the whole batch (`batched`), the comparison (`assert_matches`), and the stock layers and models they run on.

The reference (`loop`) feeds each batch row alone through the model and backwards its own loss scaled to its
share (a mean loss: loss_i / B), with plain autograd. Used by test_per_example_params, _capture, _conv and _runs, and test_noise_scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import torch
from conftest import leftover_hooks
from torch import nn

from gradrunner.capturing.per_example import PerExampleNorms

B = 4
Params = list[tuple[str, nn.Module, nn.Parameter]]


def all_params(model: nn.Module) -> Params:
    return [(f"{mn}:{pn}", m, p) for mn, m in model.named_modules() for pn, p in m.named_parameters(recurse=False)]


def loop(model: nn.Module, inputs: dict[str, torch.Tensor], rows_loss: Callable[..., torch.Tensor],
         params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
    """Each row alone: its norms per parameter (float64), and the sum over rows of its gradients."""
    norms: dict[str, list[float]] = {n: [] for n, _, _ in params}
    total = {n: torch.zeros_like(p) for n, _, p in params}
    rows = next(iter(inputs.values())).shape[0]
    for i in range(rows):
        model.zero_grad(set_to_none=True)
        (rows_loss(model(**{k: v[i : i + 1] for k, v in inputs.items()}), i) / rows).backward()
        for n, _, p in params:
            norms[n].append(0.0 if p.grad is None else p.grad.double().norm().item())
            total[n] += 0 if p.grad is None else p.grad
    model.zero_grad(set_to_none=True)
    return {n: torch.tensor(v, dtype=torch.float64) for n, v in norms.items()}, total


def row(out: object, i: int) -> object:
    """Row i of a batched output (a tensor, or a transformers output's logits), as the loop's one-row forward gives it."""
    if isinstance(out, torch.Tensor):
        return out[i : i + 1]
    return SimpleNamespace(logits=out.logits[i : i + 1])  # type: ignore[attr-defined]


def batched(model: nn.Module, inputs: dict[str, torch.Tensor], rows_loss: Callable[..., torch.Tensor],
            params: Params, check: bool = True) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None]]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    with PerExampleNorms(model, params, check=check) as pex:
        out = model(**inputs)
        rows = next(iter(inputs.values())).shape[0]
        loss = sum(rows_loss(row(out, i), i) for i in range(rows)) / rows
        loss.backward()
        norms, reasons = pex.norms(), pex.reasons()
    assert not leftover_hooks(model)
    return norms, reasons


def assert_matches(got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor], reasons: dict[str, str | None],
                   rtol: float = 1e-5) -> None:  # fmt: skip
    """rtol of each norm, atol rtol x the parameter's largest row norm; and a floor 1e-9 x the model's largest norm
    for parameters whose true gradient is zero (BERT's key bias: softmax ignores a shift), rounding noise on both sides."""
    floor = 1e-9 * max(float(r.max()) for r in ref.values())
    for name, expected in ref.items():
        actual = got[name]
        assert actual is not None, f"{name}: {reasons[name]}"
        assert actual.dtype == torch.float64 and actual.shape == expected.shape
        atol = max(rtol * float(expected.max()), floor)
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=name)


class Net(nn.Module):
    """body, then the sum of squares of (output - fixed target) per row: every layer's share is non-trivial."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def sq_loss(out: torch.Tensor, i: int) -> torch.Tensor:
    target = torch.linspace(-1, 1, out[0].numel()).view(out.shape[1:]) * (i + 1)
    return (out - target).square().sum()


def ids(shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    t = torch.randint(0, vocab, shape)
    t.view(-1)[::3] = 0  # the padding token, several times
    t.view(-1)[1::5] = 5  # a repeated token
    return t


LAYERS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "linear_2d": lambda: (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(B, 6)),
    "linear_seq": lambda: (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(B, 7, 6)),
    "linear_4d": lambda: (nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)), torch.randn(B, 2, 3, 6)),
    "embedding_pad": lambda: (nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.Tanh(), nn.Linear(4, 3)),
                              ids((B, 9), 11)),
    "embedding_1d": lambda: (nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 3)), ids((B,), 11)),
    "conv1d": lambda: (nn.Sequential(nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2), nn.Tanh(), nn.Flatten(),
                                     nn.Linear(24, 2)), torch.randn(B, 3, 11)),
    "conv2d_groups": lambda: (nn.Sequential(nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                                                      groups=2), nn.Tanh(), nn.Conv2d(6, 2, 1)), torch.randn(B, 4, 7, 6)),
    "conv2d_same_reflect": lambda: (nn.Sequential(nn.Conv2d(3, 4, 4, padding="same"), nn.Tanh(),
                                                  nn.Conv2d(4, 2, 3, padding=2, padding_mode="reflect")),
                                    torch.randn(B, 3, 6, 5)),
    "conv2d_circular_depthwise": lambda: (nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular",
                                                                  groups=3)), torch.randn(B, 3, 5, 5)),
    "conv3d": lambda: (nn.Sequential(nn.Conv3d(2, 3, 2, padding=1, stride=(1, 2, 1))), torch.randn(B, 2, 3, 4, 3)),
    # >= 8 input channels per group and >= 128 positions: rows as groups of one convolution (per_example_conv)
    "conv2d_grouped_rows": lambda: (nn.Sequential(nn.Conv2d(16, 6, 3, padding=1, groups=2, padding_mode="reflect"),
                                                  nn.Tanh(), nn.Conv2d(6, 2, 1)), torch.randn(B, 16, 12, 12)),
    "conv1d_grouped_rows": lambda: (nn.Sequential(nn.Conv1d(8, 3, 5, stride=1, dilation=2, padding=3)),
                                    torch.randn(B, 8, 140)),
    "layer_norm": lambda: (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm((3, 4)), nn.Tanh(), nn.Linear(4, 2)),
                           torch.randn(B, 5, 3, 4)),
    "rms_norm": lambda: (nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.RMSNorm(6, eps=1e-3), nn.Linear(6, 2)),
                         torch.randn(B, 5, 4)),
    "group_norm": lambda: (nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.GroupNorm(4, 4)),
                           torch.randn(B, 2, 5, 5)),
    "batch_norm_eval": lambda: (_eval_bn(), torch.randn(B, 3, 4, 4)),
}


def _eval_bn() -> nn.Module:
    bn = nn.BatchNorm2d(3)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
    return nn.Sequential(nn.Conv2d(3, 3, 1), bn.eval(), nn.Tanh())


def gpt2(dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_positions=16, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_loss(out: object, i: int) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    labels = torch.arange(logits.shape[1]).roll(i) % logits.shape[-1]
    return nn.functional.cross_entropy(logits[0], labels, reduction="sum") / logits.shape[1]


def tiny_moe(family: str, impl: str, top_k: int = 2, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random-init one-layer transformers MoE model of `family` with experts implementation `impl` (expert and router
    weights drawn N(0, 0.3): zeros and 0.02 would hide a wrong expert or slice)."""
    import transformers as tf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    common = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  num_experts_per_tok=top_k)  # fmt: skip
    configs: dict[str, Callable[[], tuple[type, object]]] = {
        "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)),
        "qwen2_moe": lambda: (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=3, **common)),
        "qwen3_moe": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, num_experts=4, head_dim=8, **common)),
        "olmoe": lambda: (tf.OlmoeForCausalLM, tf.OlmoeConfig(intermediate_size=20, num_experts=2, **common)),
        "gpt_oss": lambda: (tf.GptOssForCausalLM, tf.GptOssConfig(
            intermediate_size=12, num_local_experts=4, head_dim=8, layer_types=["full_attention"], **common)),
    }  # fmt: skip
    torch.manual_seed(0)
    cls, cfg = configs[family]()
    cfg._experts_implementation = impl  # type: ignore[attr-defined]
    model = cls(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith(".gate.weight") or ".router." in name:
                p.normal_(0, 0.3)  # (zeros and 0.02 would hide a wrong expert or slice)
    return model
