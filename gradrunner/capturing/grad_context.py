"""What autograd and the model allow at a tap: why a value cannot carry a gradient, whether backward is
running (and recomputing a reentrant checkpoint), and which models gradrunner refuses.

Example::

    no_grad_reason(torch.arange(3), is_input=False)   # 'a torch.int64 tensor (only floating-point ...)'
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from gradrunner.capturing.elements import Missing
from gradrunner.errors import GradrunnerError


def no_grad_reason(value: object, is_input: bool) -> str | None:
    """Why `value` cannot get a gradient, or None (an input leaf that can be made to require grad is fine)."""
    if isinstance(value, Missing):
        return value.reason
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if not (value.is_floating_point() or value.is_complex()):
        return f"a {value.dtype} tensor (only floating-point tensors have gradients)"
    if not value.requires_grad and not (is_input and value.is_leaf):
        return "a tensor that does not require grad (made under torch.no_grad(), detached, or computed only from frozen parameters and inputs)"
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


def refuse_compiled(model: nn.Module) -> None:
    """torch.compile and TorchScript bypass or drop Python hooks: refuse them with the way out."""
    for path, module in model.named_modules():
        where = "the model" if not path else f"module {path!r}"
        if type(module).__name__ == "OptimizedModule":
            raise GradrunnerError(
                f"{where} is compiled with torch.compile, under which tensor hooks and retain_grad on "
                "intermediates are unreliable, so gradrunner refuses it; give it the eager module instead (in "
                f"Python `{'model' if not path else path}._orig_mod`; in a config, a model option that does not call "
                "torch.compile), and compile again after capturing"
            )
        if isinstance(module, torch.jit.ScriptModule):
            raise GradrunnerError(
                f"{where} is a TorchScript module ({type(module).__name__}), which drops Python hooks and has no "
                "Python forward() to tap, so gradrunner refuses it; give it the eager module instead (the "
                "nn.Module before torch.jit.script or trace; in a config, a model option that does not script it)"
            )
