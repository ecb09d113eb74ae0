"""transformers' own RMSNorm classes (their `forward` overrides `nn.Module`'s): recognised by bytecode, each row's terms.

transformers models define their norms in each model's file; most are copies of a handful of forwards. A class whose
methods' bytecode equals one of these reference classes' (compared with `code_of`, as the stock experts loop is
in `per_example_experts`) computes the same, and its weight's share of row i is sum_t g_t * h_t (the `Dense` form),
h the normalised input as the forward multiplies it by the weight, recomputed from the saved input with the very ops
of that forward (bitwise what the call computed), and the product taken in the dtype autograd takes it in:

| kind | reference (classes of transformers 5.24 sharing its bytecode) | h (x the input, r = rsqrt(mean(x32^2) + eps)) | weight side |
| --- | --- | --- | --- |
| `hf_rms_norm` | `LlamaRMSNorm` (142: Mistral, Mixtral, Qwen2, Qwen3, Phi3, DeepSeek-V3, ...) | (x32 r).to(x.dtype) | `weight` |
| `hf_rms_norm_cast_after` | `GptOssRMSNorm` (12: GPT-OSS, OLMo2, OLMo3, FlexOlmo, ...) | x32 r (cast to x.dtype after the product) | `weight` |
| `hf_gemma_norm` | `GemmaRMSNorm` (13: Gemma, Gemma2, Gemma3, Qwen3-Next, Qwen3.5, ...) | x.float() r | `1 + weight.float()` |
| `hf_gemma3n_norm` | `Gemma3nRMSNorm` (8: Gemma3n, Gemma4, ...; `with_scale`) | x.float() (mean + eps)^-0.5 | `weight.float()` |
| `hf_t5_norm` | `T5LayerNorm` (10: T5, MT5, LongT5, Pix2Struct, ...) | x r, cast to a half weight's dtype | `weight` |

The output's gradient g is cast to the product's dtype (promote(weight side, h)), as autograd's cast of the output
does; each term g_t * h_t is that product, and the row's sum is taken in float32 (float64 for a float64 call). Not
recognised (null with the reason): a subclass that overrides `forward` (or Gemma's `_norm`), a forward set on the
instance (a hub kernel's), any class while a reference is replaced in its module (Liger's patching), a weight
that is not one entry per feature of the input's last dim.

Only where transformers is already imported are its references looked at (imported then, once, cached).

Example::

    kind_of(model.model.layers[0].input_layernorm)   # ('hf_rms_norm', None)
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
from torch import nn

#: kind: (reference module, class, the methods whose bytecode must be the reference's).
FORMS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "hf_rms_norm": ("llama", "LlamaRMSNorm", ("forward",)),
    "hf_rms_norm_cast_after": ("gpt_oss", "GptOssRMSNorm", ("forward",)),
    "hf_gemma_norm": ("gemma", "GemmaRMSNorm", ("forward", "_norm")),
    "hf_gemma3n_norm": ("gemma3n", "Gemma3nRMSNorm", ("forward", "_norm")),
    "hf_t5_norm": ("t5", "T5LayerNorm", ("forward",)),
}
KINDS = frozenset(FORMS)


def code_of(fn: Any) -> tuple[Any, ...] | None:
    """What makes two functions compute the same: their bytecode, names, constants and locals (None: no Python code)."""
    code: CodeType | None = getattr(fn, "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, code.co_consts, code.co_varnames


@functools.cache
def _reference(kind: str) -> tuple[tuple[Any, ...] | None, ...] | None:
    """The reference class's methods' `code_of` (None where this transformers has no such class, or where its methods
    are not the ones its file defines: patched by a kernel library, Liger's `LlamaRMSNorm = LigerRMSNorm`)."""
    package, name, methods = FORMS[kind]
    try:
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        cls = getattr(module, name)
    except (ImportError, AttributeError, RuntimeError):  # (transformers wraps a failed lazy import in a RuntimeError)
        return None
    fns = [getattr(cls, m, None) for m in methods]
    if not all(getattr(f, "__qualname__", None) == f"{name}.{m}" and getattr(getattr(f, "__code__", None), "co_filename",
               None) == module.__file__ for f, m in zip(fns, methods, strict=True)):  # fmt: skip
        return None
    return tuple(code_of(f) for f in fns)


def hf_norm_kind(module: nn.Module) -> str | None:
    """The kind of a transformers RMSNorm whose methods are one reference's, or None (cheap where transformers is not
    imported: nothing is looked at)."""
    if "transformers" not in sys.modules or "forward" in vars(module):
        return None
    t = type(module)
    forward = getattr(t, "forward", None)
    if code_of(forward) is None or getattr(forward, "__globals__", {}).get("torch") is not torch:
        return None
    for kind, (_, _, methods) in FORMS.items():
        ref = _reference(kind)
        if ref is not None and tuple(code_of(getattr(t, m, None)) for m in methods) == ref:
            return kind
    return None


def call_reason(module: nn.Module, x: torch.Tensor) -> str | None:
    """Why a call of a recognised norm with input `x` has no per-row share (beyond the rows' judgement), or None."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0]:
        return None  # (an unbatched input: `per_example_layers.call_reason`)
    shape = None if not isinstance(weight, torch.Tensor) else tuple(weight.shape)
    return (f"{type(module).__name__}'s weight of shape {shape} is not one entry per feature of its input of "
            f"shape {tuple(x.shape)} (last dim)")  # fmt: skip


def terms(kind: str, module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Every position's term g_t * h_t of the weight's gradient, shaped as the input, in the product's dtype."""
    h, side = _FORMS[kind](module, x)
    return g.to(torch.promote_types(side, h.dtype)) * h


def _llama(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return (h * torch.rsqrt(variance + module.variance_epsilon)).to(x.dtype), module.weight.dtype


def _cast_after(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(variance + module.variance_epsilon), module.weight.dtype


def _gemma(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps), torch.float32


def _gemma3n(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    h = x.float()
    return h * torch.pow(h.pow(2).mean(-1, keepdim=True) + module.eps, -0.5), torch.float32


def _t5(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + module.variance_epsilon)
    if module.weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(module.weight.dtype)
    return h, module.weight.dtype


_FORMS: dict[str, Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.dtype]]] = {
    "hf_rms_norm": _llama, "hf_rms_norm_cast_after": _cast_after, "hf_gemma_norm": _gemma,
    "hf_gemma3n_norm": _gemma3n, "hf_t5_norm": _t5,
}  # fmt: skip
