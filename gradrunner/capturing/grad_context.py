"""What autograd and the model allow at a tap: why a value cannot carry a gradient, whether backward is
running (and recomputing a reentrant checkpoint), compiled models' eager modules, and which models gradrunner refuses.

Example::

    no_grad_reason(3, is_input=False)   # ('not a tensor (a int)', 'a int, not a tensor')
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from gradrunner.capturing.elements import Missing
from gradrunner.errors import GradrunnerError

#: The `reason` of a record without gradient, where it is one of these fixed cases.
NOT_CALLED = "module not called in this step"
NOT_ASSIGNED = "not assigned in this step (module not called, or its forward() did not reach the assignment)"
NO_PART = "takes no part in the loss"
FROZEN = "parameter does not require grad (frozen)"
MADE_UNDER_NO_GRAD = "made under no_grad"


def no_grad_reason(value: object, is_input: bool) -> tuple[str, str] | None:
    """Why `value` cannot get a gradient: (the record's short `reason`, what the value is, for an error).

    None when it can (an input leaf that can be made to require grad is fine).

    Example::

        no_grad_reason(torch.arange(3), is_input=False)[0]   # 'not a floating-point tensor (torch.int64)'
    """
    if isinstance(value, Missing):
        return value.reason, value.reason
    if not isinstance(value, torch.Tensor):
        return f"not a tensor (a {type(value).__name__})", f"a {type(value).__name__}, not a tensor"
    if not (value.is_floating_point() or value.is_complex()):
        return (f"not a floating-point tensor ({value.dtype})",
                f"a {value.dtype} tensor (only floating-point tensors have gradients)")  # fmt: skip
    if not value.requires_grad and not (is_input and value.is_leaf):
        short = MADE_UNDER_NO_GRAD if not torch.is_grad_enabled() else "does not require grad (detached, or frozen)"
        return short, ("a tensor that does not require grad (made under torch.no_grad(), detached, or computed only "
                       "from frozen parameters and inputs)")  # fmt: skip
    return None


_CURRENT_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (e.g. recomputing a checkpoint)."""
    return _CURRENT_GRAPH_TASK_ID is not None and _CURRENT_GRAPH_TASK_ID() != -1


_CHECKPOINT_FUNCTION = getattr(checkpoint_module, "CheckpointFunction", None)


def reentrant_checkpoint(phase: str) -> object | None:
    """The autograd context of the `checkpoint(..., use_reentrant=True)` whose `phase` ("forward": the
    first, no-grad pass; "backward": the recomputation) the caller runs in, or None.

    The same context object is seen in both phases, so it pairs each recomputed call with its forward call.
    """
    code = getattr(getattr(_CHECKPOINT_FUNCTION, phase, None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The eager module behind `torch.compile(model)` (its `_orig_mod`); any other model as it is.

    Example::

        unwrap_compiled(torch.compile(model)) is model   # True

    Hooks and patched forwards are installed on the eager modules; calling the compiled one runs them
    (dynamo traces through, breaking the graph where a tap calls back into Python). `model.compile()`
    compiles in place, so its modules are the eager ones already: both spellings capture the same.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module) else model


def refuse_compiled(model: nn.Module) -> None:
    """TorchScript drops Python hooks and has no Python forward(): refuse it with the way out."""
    for path, module in model.named_modules():
        where = "the model" if not path else f"module {path!r}"
        if isinstance(module, torch.jit.ScriptModule):
            raise GradrunnerError(
                f"{where} is a TorchScript module ({type(module).__name__}), which drops Python hooks and has no "
                "Python forward() to tap, so gradrunner refuses it; give it the eager module instead (the "
                "nn.Module before torch.jit.script or trace; in a config, a model option that does not script it)"
            )
