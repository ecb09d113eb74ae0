"""transformers' mixture-of-experts layers whose experts are 3-D parameters: each row's share, `ExpertsShare`.

transformers 5 holds a layer's experts in one module (`MixtralExperts`, `Qwen2MoeExperts`, `OlmoeExperts`, ...,
decorated by `transformers.integrations.moe.use_experts_implementation`), called on the batch's tokens flattened,
`experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))`, with `gate_up_proj` (E, 2I, H) (or `up_proj`
without a gate), `down_proj` (E, H, I) (transposed: (E, H, 2I), (E, I, H)) and optional biases (E, out). For every
(token n, slot j) pair routed to expert e with weight w and the output's gradient g_n:

| parameter | pair's term of its expert's slice | |
| --- | --- | --- |
| `down_proj` | dy (outer) a, dy = w g_n, a = gate(z) | transposed: a (outer) dy |
| `gate_up_proj`, `up_proj` | dz (outer) x_n, z = W1[e] x_n (+ bias), dz the gate's vjp of da = W2[e]^T dy | transposed: x_n (outer) dz |
| biases | dz, dy | |

Row i's share is the sum of the terms of its tokens (N = B T tokens in row-major order: token n is row n // T), each
in its expert's slice. The terms are recomputed from the call's input, routing and output gradient (the gate's vjp by
autograd on the module's own `_apply_gate` / `act_fn`), in the dtype the call ran in (autocast's, or a bf16 model's),
then summed in float32 (float64 for a float64 call); the per-step check (`per_example_check`) compares their sum with
`.grad`. The pairs are sorted by expert then row (one host transfer per call: how many pairs each (expert, row) has, as
transformers' own eager loop syncs per expert), so that the recomputation is one matmul per expert, and each
(expert, row)'s squared norm is ghost (the Gram matrices of its pairs, float64) or S_ie materialised (p x q), the
cheaper by `GRAM_COST`: memory of the pairs' factors (as the forward's activations) plus one p x q at a time.

Followed: the experts implementations "eager" (only the stock loop transformers' models share, compared by bytecode),
"batched_mm" and "grouped_mm" (the same math; its kernel's layout does not matter here). Null with the reason: other
implementations (kernels), a post-expert norm, expert parallelism, and a call whose tokens are not the batch's rows
flattened.

Example::

    kind_of(model.model.layers[0].mlp.experts)   # ('experts', None)
    share("experts", experts, "down_proj", call, grad).self_sq()   # per_example_layers: (B,) squared row norms
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.per_example_hfnorms import code_of
from gradrunner.capturing.per_example_math import GRAM_COST, Lazy
from gradrunner.capturing.torch_compat import version

#: The parameters an experts module may hold (only those it has are tracked).
ROLES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
#: The experts implementations whose math is followed (the eager one only where it is transformers' stock loop).
FOLLOWED = ("eager", "batched_mm", "grouped_mm")
#: The implementations whose matmuls autocast runs in its dtype (grouped_mm casts the input to the weight's dtype).
_AUTOCAST = frozenset({"eager", "batched_mm"})


def looks_like_experts(module: nn.Module) -> bool:
    """Whether `module`'s class was decorated by transformers' `use_experts_implementation` (cheap: attribute reads)."""
    code = getattr(type(module).forward, "__code__", None)
    moe = sys.modules.get("transformers.integrations.moe")
    return code is not None and moe is not None and code.co_filename == moe.__file__ and hasattr(module, "has_gate")


def experts_reason(module: nn.Module) -> str | None:
    """Why the experts of `module` (`looks_like_experts`) cannot be followed, or None."""
    name = type(module).__name__
    impl = implementation(module)
    if impl not in FOLLOWED:
        return (f"{name} runs the experts implementation {impl!r}, whose kernels per-example norms do not follow "
                f"(they follow {', '.join(FOLLOWED)})")  # fmt: skip
    if impl == "eager" and code_of(type(module).forward.__wrapped__) != _stock_eager():  # type: ignore[attr-defined]
        return f"{name}'s eager forward is not transformers' stock experts loop: its math is not known here"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} normalises each expert's output (has_post_expert_norm): not followed"
    if getattr(module, "_is_expert_parallel", False):
        return f"{name} is expert parallel (each rank holds some experts; tokens are dispatched between ranks)"
    if getattr(module, "num_experts", None) is None:
        return f"{name} has no num_experts"
    return None


def implementation(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    return "eager" if impl is None else str(impl)


@functools.cache
def _stock_eager() -> tuple[Any, ...] | None:
    """The bytecode of transformers' stock eager experts loop (Mixtral's; 55 experts classes of transformers 5.24 share it);
    None where `MixtralExperts.forward` is not the loop its file defines (a class or forward patched in by a kernel
    library): then no experts module is taken for the stock loop."""
    mixtral = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    fn = getattr(getattr(mixtral.MixtralExperts, "forward", None), "__wrapped__", None)
    code = getattr(fn, "__code__", None)
    ours = getattr(fn, "__qualname__", None) == "MixtralExperts.forward" and code is not None
    return code_of(fn) if ours and code.co_filename == mixtral.__file__ else None  # type: ignore[union-attr]


def routing(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int) -> tuple[Any, ...]:
    """What a call's share needs beyond its input: (top_k_index, top_k_weights, rows, the parameters' versions)."""
    index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
    weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
    if not isinstance(index, torch.Tensor) or not isinstance(weights, torch.Tensor):
        return None, None, rows, _versions(module)  # (the share says why: `ExpertsShare`)
    return index.detach(), weights.detach(), rows, _versions(module)


def _versions(module: nn.Module) -> tuple[int | None, ...]:
    return tuple(version(p) for p in module._parameters.values() if p is not None)


def autocast_dtype(module: nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype the experts' matmuls run in under autocast now, or None."""
    if implementation(module) not in _AUTOCAST or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


class ExpertsShare(Lazy):
    """Every row's share of one parameter of an experts module from one call: the pairs' factors (recomputed once per
    call, sorted by expert then row), S_ie = left_ie^T right_ie for the pairs of row i routed to expert e."""

    def __init__(self, module: nn.Module, role: str, x: torch.Tensor, grad: torch.Tensor, extra: tuple[Any, ...],
                 low: torch.dtype | None, memo: dict[str, torch.Tensor]) -> None:  # fmt: skip
        index, weights, rows, versions = extra
        if index is None:
            raise ValueError("its call gave no top_k_index and top_k_weights tensors (arguments 2 and 3)")
        if versions != _versions(module):
            raise ValueError("its parameters were changed in place between its call and the backward")
        param = module._parameters[role]
        assert param is not None
        self.experts, self.batch, self.width = param.shape[0], rows, param.numel()
        self.dtype = torch.float64 if torch.float64 in (x.dtype, grad.dtype) else torch.float32
        if "counts" not in memo:
            memo.update(_pairs(module, x, index, weights, grad, low, self.dtype, rows))
        key = "up" if role.startswith(("gate_up_proj", "up_proj")) else "down"
        self.left, self.right = memo[f"{key}_l"], memo[f"{key}_r"]
        if role.endswith("_bias"):  # the output side's factor (dz, dy) against 1
            self.left = self.right if _flags(module)[0] else self.left
            self.right = self.left.new_ones(self.left.shape[0], 1)
        self.ids, self.p, self.q = memo["ids"], self.left.shape[-1], self.right.shape[-1]
        assert self.width == self.experts * self.p * self.q, (param.shape, self.p, self.q)
        #: (expert, row, first pair, end) of every (expert, row) that has pairs, in the pairs' order.
        self.segments: list[tuple[int, int, int, int]] = []
        start = 0
        for n, count in enumerate(memo["counts"].tolist()):
            if count:
                self.segments.append((n // rows, n % rows, start, start + count))
                start += count

    def self_sq(self) -> torch.Tensor:
        """Per (expert, row): ghost (Gram matrices of its pairs, float64) or S_ie materialised, the cheaper by
        `GRAM_COST`; added per row."""
        values, rows = [], []
        for _, row, i, j in self.segments:
            left, right = self.left[i:j], self.right[i:j]
            if GRAM_COST * (j - i) * (self.p + self.q) <= self.p * self.q:
                ll, rr = left.double(), right.double()
                values.append(torch.linalg.vecdot((ll @ ll.T).reshape(-1), (rr @ rr.T).reshape(-1)).to(self.dtype))
            else:
                values.append((left.T @ right).square().sum())
            rows.append(row)
        out = self.left.new_zeros(self.batch)
        if values:
            out.index_add_(0, torch.tensor(rows, device=out.device), torch.stack(values))
        return out

    def dense(self, i: int, j: int) -> torch.Tensor:
        """Rows i to j materialised, (j - i, E p q): S_ie = left_ie^T right_ie in expert e's slice."""
        j = min(j, self.batch)
        out = self.left.new_zeros(j - i, self.experts, self.p, self.q)
        for e, row, a, b in self.segments:
            if i <= row < j:
                out[row - i, e] = self.left[a:b].T @ self.right[a:b]
        return out.reshape(j - i, self.width)

    def project(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One term per pair: u[e] (left . V right), V = v as (p, q)."""
        left, right = self.left.to(u.dtype), self.right.to(u.dtype)
        return u[self.ids] * torch.linalg.vecdot(left @ v.view(self.p, self.q), right)


def _pairs(module: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor,
           low: torch.dtype | None, dtype: torch.dtype, rows: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Every (token, slot) pair's factors, sorted by expert then row: down (dy, a), up (dz, x) (transposed layouts
    swapped), its expert (`ids`), and the pairs of each (expert, row) (`counts`, on the host: the one transfer)."""
    k, experts = index.shape[-1], int(module.num_experts)
    ids = index.reshape(-1)
    valid = (ids >= 0) & (ids < experts)  # a sentinel (experts: no expert) adds nothing
    ids = ids.clamp(0, experts - 1)
    tokens_per_row = max(1, x.shape[0] // max(1, rows))
    key = ids * rows + torch.arange(ids.shape[0], device=ids.device) // (tokens_per_row * k)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=experts * rows).cpu()
    ids, token = ids[order], order // k
    run = low or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else None)
    cast = (lambda t: t.to(run)) if run is not None else (lambda t: t)
    h = cast(x)[token]
    w = cast(weights.reshape(-1) * valid.to(weights.dtype))[order]
    dy = cast(grad)[token] * w.unsqueeze(-1)
    t, gated, bias = _flags(module)
    sizes = counts.view(experts, rows).sum(1).tolist()
    z = _grouped(cast((module.gate_up_proj if gated else module.up_proj).detach()), sizes, h, t)
    if bias:
        z = z + cast(getattr(module, "gate_up_proj_bias" if gated else "up_proj_bias").detach())[ids]
    with torch.enable_grad():
        zz = z.detach().requires_grad_()
        if implementation(module) == "eager":  # the stock loop: act_fn(gate) * up, whatever _apply_gate says
            gate_, up_ = zz.chunk(2, dim=-1)
            a = module.act_fn(gate_) * up_
        else:
            a = module._apply_gate(zz) if gated else module.act_fn(zz)
        da = _grouped(cast(module.down_proj.detach()), sizes, dy, not t)
        (dz,) = torch.autograd.grad(a, zz, da.to(a.dtype))
    a = a.detach()
    up_pair = (h, dz) if t else (dz, h)
    down_pair = (a, dy) if t else (dy, a)
    out = {"up_l": up_pair[0], "up_r": up_pair[1], "down_l": down_pair[0], "down_r": down_pair[1]}
    return {"ids": ids, "counts": counts, **{n: v.to(dtype) for n, v in out.items()}}


def _flags(module: nn.Module) -> tuple[bool, bool, bool]:
    """(transposed, gated, with biases) as the call computes: the stock eager loop knows no flags (not, gated, none)."""
    if implementation(module) == "eager":
        return False, True, False
    return bool(module.is_transposed), bool(module.has_gate), bool(module.has_bias)


def _grouped(weight: torch.Tensor, sizes: list[int], h: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The pairs `h` (sorted by expert, `sizes` of each) through their expert's slice: W[e] h (not transposed) or
    h W[e], one matmul per expert."""
    parts, start = [], 0
    for e, size in enumerate(sizes):
        if size:
            part = h[start : start + size]
            parts.append(part @ weight[e] if transposed else part @ weight[e].T)
            start += size
    if not parts:
        return h.new_zeros(0, weight.shape[2 if transposed else 1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]
