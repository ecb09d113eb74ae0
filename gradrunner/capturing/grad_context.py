"""What autograd and the model allow at a tap: why a value cannot carry a gradient, whether backward is
running (and recomputing a reentrant checkpoint), which models gradrunner refuses, what a forward that raised
because of an input tap's alias is told (`note_alias_error`), and hooks run eagerly in a compiled model (`eager`).

Example::

    no_grad_reason(3, is_input=False)   # ('not a tensor (an int)', 'an int, not a tensor')
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from gradrunner.capturing.elements import Missing
from gradrunner.capturing.per_example_experts import implementation, looks_like_experts
from gradrunner.capturing.torch_compat import (
    compiled_fullgraph,
    compiled_inner,
    in_backward,
    is_functorch_wrapped,
    reentrant_checkpoint,
)
from gradrunner.errors import GradrunnerError

__all__ = [
    "eager",
    "in_backward",
    "in_graph",
    "input_alias",
    "no_grad_reason",
    "not_assigned",
    "note_alias_error",
    "reentrant_checkpoint",
    "refuse_compiled",
    "refuse_transformed",
]

#: The `reason` of a record without gradient, where it is one of these fixed cases.
NOT_CALLED = "module not called in this step"
NOT_ASSIGNED = "not assigned in this step (module not called, or its forward() did not reach the assignment)"
NO_PART = "takes no part in the loss"
#: A parameter tap's step whose backwards all returned gradients without adding them to `.grad`.
NOT_FILLED = ("no backward of the step added to .grad (torch.autograd.grad returns gradients without filling .grad, "
              "and a parameter tap records what a backward adds to .grad)")  # fmt: skip
FROZEN = "parameter does not require grad (frozen)"
MADE_UNDER_NO_GRAD = "made under no_grad"
#: A value computed with grad mode on that does not require grad: detached, or computed only from frozen parameters.
NOT_REQUIRING_GRAD = "does not require grad (detached, or frozen)"
CHANGED_IN_PLACE = (
    "a view changed in place after it was tapped: autograd never computes the gradient of its value "
    "before the change; tap the tensor it is a view of, or the view after the change"
)
GRAPH_FREED = "no forward since the last backward, which freed the graph (pass retain_graph=True to backward twice)"
TRANSFORMED = "inside a torch.func transform (vmap, grad, jacrev, ...): not visible to autograd hooks"


def in_graph(ctx: object | None) -> bool:
    """Whether a custom Function's autograd context `ctx`, seen during its forward (`reentrant_checkpoint("forward")`),
    is a node of the graph (called with grad on, on an input that requires grad): a backward may reach it and run its
    `backward` (a checkpoint's recomputation). Public API: the node's `next_functions`; True where it has none, False
    for None.
    """
    return ctx is not None and bool(getattr(ctx, "next_functions", True))


def refuse_transformed(tap: object, value: torch.Tensor) -> bool:
    """A value inside `torch.vmap`/`torch.func`: refuse an explicit tap (True: a glob's, to record as `TRANSFORMED`)."""
    if not is_functorch_wrapped(value):
        return False
    if getattr(tap, "from_glob", False):
        return True
    raise GradrunnerError(
        f"tap {getattr(tap, 'tap', tap)!r} fired inside a torch.func transform (torch.vmap, torch.func.grad, jacrev, "
        "...): there its value is the transform's per-sample wrapper tensor, whose gradient autograd's hooks never "
        "see (the transform computes it inside its own levels), so gradrunner refuses the tap rather than record a "
        "wrong or missing gradient. Tap the module that calls the transform instead (its output or input), or the "
        "parameters used inside it (their gradient is captured as usual); for per-example gradient norms of taps "
        "outside the transform use capture.per_example=true."
    )


class _InputAlias(torch.autograd.Function):
    """Identity whose output shares its input's storage without being a view of a leaf (in-place ops stay allowed).

    Its forward-mode derivative is the identity too: a dual input's tangent (`torch.autograd.forward_ad`) goes on.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
        return tangent


def input_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A stand-in for an input that does not require grad: same storage, requires grad, the caller's tensor untouched.

    Example::

        a = input_alias(x); a.sub_(a.mean())   # x changes too, as it would without capture; x.requires_grad stays False

    A dual tensor's tangent (`fwAD.make_dual(x, t)` inside `fwAD.dual_level()`) is the alias's tangent too, so the
    model's forward-mode derivatives are those without capture (`detach()` alone would drop it).
    """
    leaf = tensor.detach().requires_grad_()
    tangent = fwAD.unpack_dual(tensor).tangent
    return _InputAlias.apply(leaf if tangent is None else fwAD.make_dual(leaf, tangent))


#: torch's error for `t.requires_grad = ...` on a tensor with autograd history (`THPVariable_set_requires_grad`).
_LEAF_ONLY = "you can only change requires_grad flags of leaf variables"


def note_alias_error(error: BaseException | None, taps: list[str]) -> None:
    """Name the input taps on torch's leaf-only error, raised by a forward in which they got `input_alias`.

    Example::

        note_alias_error(exc, ["feature_extractor:input"])   # exc.__notes__[-1] names the tap and the way out

    A forward that sets `requires_grad` on a tensor made from its input (transformers' Wav2Vec2, HuBERT and WavLM
    feature encoders: `h = input_values[:, None]; h.requires_grad = True` in training) can only do so while that input
    has no autograd history; the alias an input tap needs has one, so the forward raises, as it would without capture
    on an input that requires grad. torch's message names no tap; this note does (a warning where Python has no notes).
    """
    if not taps or not isinstance(error, RuntimeError) or _LEAF_ONLY not in str(error):
        return
    names = ", ".join(repr(t) for t in dict.fromkeys(taps))
    note = (f"gradrunner: in this forward the input tap(s) {names} handed the module an alias of an input that did not "
            "require grad, one that requires grad (the tap's gradient flows through it). A forward that sets "
            "`requires_grad` on a tensor made from that input (transformers' Wav2Vec2, HuBERT and WavLM feature "
            "encoders in training: `input_values[:, None]`) cannot do so on the alias, and raises this, as it does "
            "without capture on an input that requires grad. Tap the input of the first layer that forward calls "
            "instead (`feature_extractor.conv_layers.0:input`: the same gradient, with the dim the view added), or "
            "leave that input untapped.")  # fmt: skip
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)
    else:
        warnings.warn(note, stacklevel=2)


def no_grad_reason(value: object, is_input: bool) -> tuple[str, str] | None:
    """Why `value` cannot get a gradient: (the record's short `reason`, what the value is, for an error).

    None when it can (an input leaf that can be made to require grad is fine).

    Example::

        no_grad_reason(torch.arange(3), is_input=False)[0]   # 'not a floating-point tensor (torch.int64)'
    """
    if isinstance(value, Missing):
        return value.reason, value.reason
    if not isinstance(value, torch.Tensor):
        return f"not a tensor ({_a(type(value).__name__)})", f"{_a(type(value).__name__)}, not a tensor"
    if not (value.is_floating_point() or value.is_complex()):
        return (f"not a floating-point tensor ({value.dtype})",
                f"a {value.dtype} tensor (only floating-point tensors have gradients)")  # fmt: skip
    if not value.requires_grad and not (is_input and value.is_leaf):
        short = MADE_UNDER_NO_GRAD if not torch.is_grad_enabled() else NOT_REQUIRING_GRAD
        return short, ("a tensor that does not require grad (made under torch.no_grad(), detached, or computed only "
                       "from frozen parameters and inputs)")  # fmt: skip
    return None


def _a(name: str) -> str:
    """`name` with its article: 'a tuple', 'an int'."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def refuse_compiled(model: nn.Module) -> None:
    """TorchScript drops Python hooks and has no Python forward(), and `torch.compile(..., fullgraph=True)` turns the
    session's hooks (graph breaks) into dynamo's error at the first forward: refuse either with the way out.
    `model` as given to capture: `torch.compile(model)`'s eager modules are named as capture names them."""
    inner = compiled_inner(model)
    for path, module in [("", model)] * (inner is not model) + list(inner.named_modules()):
        where = "the model" if not path else f"module {path!r}"
        if compiled_fullgraph(module):
            raise GradrunnerError(
                f"{where} is compiled with fullgraph=True (torch.compile(..., fullgraph=True) or "
                "module.compile(fullgraph=True)), which allows no graph break, while the capture session's hooks "
                "are graph breaks: its first forward would fail inside dynamo, so gradrunner refuses it; compile it "
                "without fullgraph=True, or capture the eager model (compiling buys little under capture)"
            )
        if isinstance(module, torch.jit.ScriptModule):
            raise GradrunnerError(
                f"{where} is a TorchScript module ({type(module).__name__}), which drops Python hooks and has no "
                "Python forward() to tap, so gradrunner refuses it; give it the eager module instead (the "
                "nn.Module before torch.jit.script or trace; in a config, a model option that does not script it)"
            )


def not_assigned(model: nn.Module, path: str) -> str:
    """Why a local tap of module `path` was not assigned in a step: `NOT_ASSIGNED`, or, for transformers' experts
    (`MixtralExperts`, ...) whose forward dispatches to another experts implementation than "eager", that the forward()
    whose locals are tapped does not run.

    Example::

        not_assigned(model, "model.layers.0.mlp.experts")   # "... 'grouped_mm' ... set it to 'eager' ..."
    """
    try:
        module = model.get_submodule(path)
    except AttributeError:  # (gone: refused at the next step)
        return NOT_ASSIGNED
    if not looks_like_experts(module) or implementation(module) == "eager":
        return NOT_ASSIGNED
    return (f"not assigned in this step: {type(module).__name__}'s forward runs transformers' experts implementation "
            f"{implementation(module)!r} (config._experts_implementation), not the forward() whose locals are tapped, "
            "or the module was not called (set the implementation to 'eager' to tap these locals)")  # fmt: skip


_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """`fn` run as plain Python even inside a compiled model: under torch.compile the session's hooks
    are graph breaks, so that every call opens its slot and attaches the strategy, as in eager mode.

    Outside compilation `fn` is called directly: `torch.compiler.disable`'s wrapper (which switches
    the frame evaluator off and on around each call) costs about 0.5 µs per tap firing.
    """
    disabled = torch.compiler.disable(fn)
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():  # dynamo tracing the hook: a graph break, `fn` runs eagerly
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
