"""The layers whose parameters get exact per-example gradient norms, and each one's share of a row.

`kind_of(module)` names a supported layer (or gives why not); `call_reason` checks one call's input
(batched, dim 0 the batch, or for `per_example_tokens.FLAT_KINDS` a multiple: its tokens flattened?);
`share(kind, module, role, call, grad)` turns a call's saved input and its output's gradient into the
`per_example_math` form of every row's share of `module.<role>`'s `.grad`:

| kind | modules | weight share of row i (positions t: all dims between batch and features; its tokens, flattened) | bias |
| --- | --- | --- | --- |
| `linear` | `nn.Linear` | sum_t g_t (outer) x_t (`Factors`) | sum_t g_t |
| `conv1d_hf` | `transformers.pytorch_utils.Conv1D` (GPT-2's: weight (in, out)) | sum_t x_t (outer) g_t | sum_t g_t |
| `conv` | `nn.Conv1d/2d/3d` (any padding and padding mode, stride, dilation, groups) | per group, sum over output positions of g (outer) the input patch (`per_example_conv.ConvShare`) | sum over positions of g |
| `embedding` | `nn.Embedding` (padding_idx rows get nothing, as in its backward) | sum_t onehot(id_t) (outer) g_t | - |
| `layer_norm`, `rms_norm` | `nn.LayerNorm`, `nn.RMSNorm` | sum_t g_t * xhat_t (`Dense`) | sum_t g_t |
| `hf_rms_norm`, ... (`per_example_hfnorms.KINDS`) | transformers' RMSNorm classes whose bytecode is Llama's, GPT-OSS's, Gemma's, Gemma3n's or T5's | sum_t g_t * h_t, h recomputed by that forward's ops (`per_example_hfnorms`) | - |
| `group_norm` | `nn.GroupNorm` | per channel, sum over positions of g * xhat | per channel sum of g |
| `batch_norm` | `nn.BatchNorm1d/2d/3d` in eval mode with running statistics | as group_norm | as group_norm |
| `experts` | transformers' experts of 3-D parameters (`MixtralExperts`, ...: `per_example_experts`) on the batch's tokens flattened | per expert slice, sum over the row's tokens routed to it (`ExpertsShare`) | the same, of the output side |

xhat is the normalised input, recomputed from the saved input by the same functional without affine
parameters. A module whose forward mixes rows (`mixes_rows`: batch norm using batch statistics) has
no per-example share; neither has `Embedding(scale_grad_by_freq=True)` (its gradient divides by
counts over the whole batch). Subclasses that override `forward` are not assumed to compute the same.

Under autocast, Linear/Conv1D/conv compute with their input cast to the autocast dtype: the share is
computed from that cast (upcast to float32), as autograd's own weight gradient is.

Example::

    kind, why = kind_of(nn.Linear(4, 3))        # ('linear', None)
    form = share("linear", lin, "weight", call, grad)   # Factors over (B, 1, T, 3) x (B, 1, T, 4)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradrunner.capturing import per_example_experts as experts
from gradrunner.capturing import per_example_hfnorms as hfnorms
from gradrunner.capturing.elements import tensors_in
from gradrunner.capturing.per_example_conv import ConvShare
from gradrunner.capturing.per_example_math import Dense, Factors, Form
from gradrunner.capturing.per_example_tokens import FLAT_KINDS
from gradrunner.capturing.torch_compat import Edge, gradient_edge, version

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: The parameters each kind has a share for.
ROLES: dict[str, tuple[str, ...]] = {
    "linear": ("weight", "bias"), "conv1d_hf": ("weight", "bias"), "conv": ("weight", "bias"),
    "embedding": ("weight",), "layer_norm": ("weight", "bias"), "rms_norm": ("weight",),
    "group_norm": ("weight", "bias"), "batch_norm": ("weight", "bias"), "experts": experts.ROLES,
    **{kind: ("weight",) for kind in hfnorms.KINDS},
}  # fmt: skip
#: Kinds whose weight gradient is a matmul that autocast runs in its lower precision.
_AUTOCAST_KINDS = frozenset({"linear", "conv1d_hf", "conv"})


@dataclass
class Call:
    """What a forward hook keeps of one module call: its input (detached), what it needs to recompute the share."""

    x: torch.Tensor
    #: The input's in-place version at the call (None where torch does not expose it).
    version: int | None
    #: The autocast dtype the call ran under (None outside autocast, or for kinds autocast does not cast).
    autocast: torch.dtype | None
    #: What the shares of this call's parameters have in common, computed once (a 2-D Linear's ||g_i||^2).
    memo: dict[str, torch.Tensor] = field(default_factory=dict)
    #: What else the kind needs (experts: `per_example_experts.routing`).
    extra: tuple[Any, ...] = ()
    #: The batch's rows: dim 0 of `x`, or its divisor where `x` is the batch's tokens flattened (row i's `x.shape[0] //
    #: rows` tokens together, `per_example_tokens`); 0: dim 0.
    rows: int = 0


#: Modules whose `batch_first=False` (torch's default) puts the sequence in dim 0 of their inputs.
SEQUENCE_FIRST = (nn.MultiheadAttention, nn.RNNBase)


def kind_of(module: nn.Module) -> tuple[str | None, str | None]:
    """(kind, None) for a supported module, else (None, why not).

    Example::

        kind_of(nn.LSTM(3, 4))[1]     # 'LSTM is not a layer per-example norms support (...)'
    """
    t = type(module)
    if isinstance(module, nn.Linear) and t.forward is nn.Linear.forward:
        return "linear", None
    if t.__name__ == "Conv1D" and t.__module__.startswith("transformers.") and hasattr(module, "nf"):
        return "conv1d_hf", None
    if isinstance(module, _CONVS) and t.forward in tuple(c.forward for c in _CONVS):
        return "conv", None
    if isinstance(module, nn.Embedding) and t.forward is nn.Embedding.forward:
        if module.scale_grad_by_freq:
            return None, "Embedding(scale_grad_by_freq=True) divides by token counts over the whole batch: rows mix"
        return "embedding", None
    if isinstance(module, nn.LayerNorm) and t.forward is nn.LayerNorm.forward:
        return "layer_norm", None
    if isinstance(module, nn.RMSNorm) and t.forward is nn.RMSNorm.forward:
        return "rms_norm", None
    if isinstance(module, nn.GroupNorm) and t.forward is nn.GroupNorm.forward:
        return "group_norm", None
    if isinstance(module, _BatchNorm) and t.forward is _BatchNorm.forward:
        return "batch_norm", None
    if experts.looks_like_experts(module):
        why = experts.experts_reason(module)
        return ("experts", None) if why is None else (None, why)
    hf = hfnorms.hf_norm_kind(module)
    if hf is not None:
        return hf, None
    return None, (f"{t.__name__} is not a layer per-example norms support (Linear, transformers' Conv1D, Conv1d/2d/3d, "
                  "Embedding, LayerNorm, RMSNorm, GroupNorm, BatchNorm in eval mode, transformers' experts, transformers' "
                  "RMSNorm classes whose forward is Llama's, GPT-OSS's, Gemma's, Gemma3n's or T5's)")  # fmt: skip


def mixes_rows(module: nn.Module) -> str | None:
    """Why this call of `module` mixes batch rows (batch norm normalising by the batch's statistics), or None."""
    if not isinstance(module, _BatchNorm):
        return None
    if module.training:
        return "normalises with the batch's statistics (training mode): its rows mix"
    if module.running_mean is None:
        return "normalises with the batch's statistics (track_running_stats=False: it keeps none): its rows mix"
    return None


def autocast_dtype(kind: str, device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives this kind's matmul now, or None."""
    if kind not in _AUTOCAST_KINDS or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def call_reason(kind: str, module: nn.Module, x: torch.Tensor, rows: int) -> str | None:
    """Why this call's input has no per-row share (unbatched, dim 0 not the batch), or None. A dim 0 of a multiple of
    the batch's rows passes for a kind that takes the batch's tokens flattened: `RowOrigins.judge` tells whether it is."""
    if kind == "experts":
        why = experts.experts_reason(module)  # (again: the implementation may have been switched since)
        if why is not None:
            return why
        if x.dim() == 2 and rows > 0 and x.shape[0] % rows == 0:
            return None
        return (f"called on tokens of shape {tuple(x.shape)} that are not the batch's {rows} rows flattened (a "
                "row-major view of a tensor whose dim 0 is the batch): which row each token is cannot be told")  # fmt: skip
    if kind in hfnorms.KINDS:
        why = hfnorms.call_reason(module, x)
        if why is not None:
            return why
    least = {"group_norm": 2, "batch_norm": 2, "embedding": 1}.get(kind, 2)
    if isinstance(module, _CONVS):
        least = module.weight.dim()
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        least = len(module.normalized_shape) + 1
    if kind == "conv" and x.dim() != least:
        return f"called with an unbatched input of shape {tuple(x.shape)}"
    if x.dim() < least:
        return f"called with an unbatched input of shape {tuple(x.shape)}"
    if x.shape[0] == rows or (kind in FLAT_KINDS and rows > 0 and x.shape[0] % rows == 0):
        return None
    flat = "" if rows <= 0 or x.shape[0] % rows else (
        "; a multiple of them is taken for the batch's rows flattened only by Linear, transformers' Conv1D, Embedding, "
        f"LayerNorm and RMSNorm, not {type(module).__name__}")  # fmt: skip
    return f"called with an input of shape {tuple(x.shape)} whose dim 0 ({x.shape[0]}) is not the batch ({rows} rows){flat}"


def make_call(kind: str, module: nn.Module, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any],
              rows: int) -> Call:  # fmt: skip
    """What the forward hook keeps of a call of `module` (a supported `kind`) with input `x`."""
    if kind == "experts":
        extra = experts.routing(module, args, kwargs, rows)
        return Call(x.detach(), version(x), experts.autocast_dtype(module, x.device), extra=extra, rows=rows)
    return Call(x.detach(), version(x), autocast_dtype(kind, x.device), rows=rows)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any of them is float64, else float32 (never lower: bf16/fp16 inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def share(kind: str, module: nn.Module, role: str, call: Call, grad: torch.Tensor) -> Form:
    """Every row's share of `module.<role>`'s gradient from one call: its saved input and its output's gradient."""
    if kind == "experts":
        return experts.ExpertsShare(module, role, call.x, grad, call.extra, call.autocast, call.memo)
    dt = compute_dtype(call.x, grad)
    b = call.rows or grad.shape[0]  # (the batch's tokens flattened: row i's tokens are its positions)
    if kind in hfnorms.KINDS:  # (from the input and gradient as the call had them: their dtypes matter)
        return _summed(hfnorms.terms(kind, module, call.x, grad).to(dt).reshape(b, -1, call.x.shape[-1]))
    x = call.x if call.autocast is None else call.x.to(call.autocast)
    if kind in ("linear", "conv1d_hf"):
        g = _as(grad.reshape(b, 1, -1, grad.shape[-1]), dt)
        g_sq = None
        if g.shape[2] == 1:  # one position: ||g_i||^2, shared by the weight and the bias
            g_sq = call.memo.get("g_sq")
            if g_sq is None:
                g2 = g.reshape(b, -1)
                g_sq = call.memo["g_sq"] = torch.linalg.vecdot(g2, g2)
        if role == "bias":
            return _summed(g.reshape(b, -1, g.shape[-1]), g_sq)
        a = _as(x.reshape(b, 1, -1, x.shape[-1]), dt)
        sq = None
        if g_sq is not None:
            a2 = a.reshape(b, -1)
            sq = g_sq * torch.linalg.vecdot(a2, a2)
        return Factors(g, a, g.shape[-1], sq) if kind == "linear" else Factors(a, g, a.shape[-1], sq)
    if kind == "conv":
        if role == "bias":
            return _summed(grad.reshape(b, grad.shape[1], -1).transpose(1, 2).to(dt))
        return ConvShare(module, x, grad, dt)  # type: ignore[arg-type]
    if isinstance(module, nn.Embedding):
        ids = x.reshape(b, 1, -1)
        g = grad.reshape(b, 1, ids.shape[-1], -1).to(dt)
        if module.padding_idx is not None:
            g = g * torch.ne(ids, module.padding_idx).unsqueeze(-1).to(dt)
        return Factors(ids, g, module.num_embeddings)
    return _norm_share(kind, module, role, x.to(dt), grad.to(dt), b)


def _norm_share(kind: str, module: nn.Module, role: str, x: torch.Tensor, g: torch.Tensor, b: int) -> Dense:
    """`x`, `g` upcast to float32 (float64 for a float64 call): torch computes these norms in that dtype (a bf16/fp16
    input upcast), and RMSNorm's default eps (None) is its epsilon, not the input's: `F.rms_norm` with eps None on the
    upcast `x` picks the same. `b` rows: LayerNorm's and RMSNorm's may be the batch's tokens flattened."""
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        shape = tuple(module.normalized_shape)
        width = math.prod(shape)
        if role == "bias":
            return _summed(g.reshape(b, -1, width))
        if isinstance(module, nn.LayerNorm):
            xhat = F.layer_norm(x, shape, None, None, module.eps)
        else:
            xhat = F.rms_norm(x, shape, None, module.eps)
        return _summed((g * xhat).reshape(b, -1, width))
    channels = g.shape[1]
    if role == "bias":
        return _summed(g.reshape(b, channels, -1).transpose(1, 2))
    if isinstance(module, nn.GroupNorm):
        xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
    else:
        assert isinstance(module, _BatchNorm) and module.running_mean is not None and module.running_var is not None
        xhat = F.batch_norm(x, module.running_mean.to(x.dtype), module.running_var.to(x.dtype), None, None, False, 0.0,
                            module.eps)  # fmt: skip
    return _summed((g * xhat).reshape(b, channels, -1).transpose(1, 2))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _summed(terms: torch.Tensor, sq: torch.Tensor | None = None) -> Dense:
    """Each row's share as the sum over positions of (B, T, P) `terms` (kept for the check); `sq`: its squared norms if known."""
    if terms.shape[1] == 1:
        return Dense(terms[:, 0], None, sq)
    return Dense(terms.sum(1), terms, sq)


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off on `device` (hooks of a backward run inside `torch.autocast` run under it)."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among a call's positional then keyword arguments (one level into lists, tuples, mappings)."""
    return tensors_in((*args, *kwargs.values()))


def first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first tensor among a call's positional then keyword arguments (one level into lists, tuples, mappings)."""
    return next(tensors_of(args, kwargs), None)


def output_edge(output: torch.Tensor) -> Edge:
    """Where a call's output gradient is watched: where the output is a `view` of a whole tensor (a Linear's on 3-D
    input views its matmul's 2-D output), the view node's input edge, which gets the same gradient reshaped and stays
    in the graph when the output is changed in place (ReLU(inplace=True), `+=`: autograd drops the view's node);
    else the output's own edge."""
    node = output.grad_fn
    if node is not None and node.name().startswith("ViewBackward") and len(node.next_functions) == 1:
        edge = node.next_functions[0]
        if edge[0] is not None:
            return tuple(edge)
    return gradient_edge(output)


def storage(t: torch.Tensor) -> int:
    """Where `t`'s memory is (a view shares its base's); -1 for a tensor without plain storage."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return -1
