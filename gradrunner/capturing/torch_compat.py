"""Every use of a torch internal in gradrunner, feature-detected once, each with a public fallback.

| function | private path (default where it buys something) | public fallback |
| --- | --- | --- |
| `gradient_edge(t)` | none: `torch.autograd.graph.get_gradient_edge` (public) | `(t.grad_fn, t.output_nr)`; a leaf's accumulator through `t.view_as(t)`; `autograd_grad` passes the tensor |
| `watch_edge(edge, fn)` | none: `Node.register_prehook` (public) | - |
| `accumulate(param, grad)` | none: the parameter's own `AccumulateGrad` node, called | `.grad` added by hand, then `_post_accumulate_grad_hooks` called |
| `version(t)` | `t._version`: retain_grad reads `.grad` unless the tensor changed in place | None: assume it changed, read the gradient edge |
| `is_view(t)` | `t._is_view()`: a tapped view written in place gets its own `reason` | False: "takes no part in the loss" |
| `in_backward()` | `torch._C._current_graph_task_id()`: also true inside a plain `loss.backward()` | a counter `backward_running()` raises around the strategies' backward |
| `reentrant_checkpoint(phase)` | frame walk for `torch.utils.checkpoint.CheckpointFunction` | None: the no-grad first pass records "made under no_grad" |
| `functorch_level(t)` | `torch._C._functorch.is_functorch_wrapped_tensor` | never detected: the tap's own "does not require grad" check |

`FEATURES` holds what was detected at import; tests monkeypatch it to force each fallback.

Example::

    node, nr = gradient_edge(tensor)
    handle = watch_edge((node, nr), lambda grad: seen.append(grad))   # handle.remove() undoes it
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint_module
from torch.utils.hooks import RemovableHandle

#: (node, input number, ...): torch's `GradientEdge` (a named tuple), or the fallback's pair.
Edge = tuple[Any, ...]

_get_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_CHECKPOINT_FUNCTION = getattr(checkpoint_module, "CheckpointFunction", None)
_functorch = getattr(torch._C, "_functorch", None)
_is_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)

#: What this torch offers; False forces the fallback (tests set these with monkeypatch).
FEATURES: dict[str, bool] = {
    "get_gradient_edge": _get_gradient_edge is not None,
    "call_accumulate_grad": True,
    "tensor_version": hasattr(torch.Tensor, "_version"),
    "is_view": hasattr(torch.Tensor, "_is_view"),
    "current_graph_task_id": _current_graph_task_id is not None,
    "checkpoint_frames": _CHECKPOINT_FUNCTION is not None,
    "functorch_wrapped": _is_functorch_wrapped is not None,
}


def gradient_edge(tensor: torch.Tensor) -> Edge:
    """The (autograd node, input number) through which `tensor`'s gradient flows, taken now.

    Held instead of the tensor, it keeps pointing at this value of the tensor after an in-place op.
    """
    if FEATURES["get_gradient_edge"]:
        return _get_gradient_edge(tensor)  # type: ignore[misc]
    if tensor.grad_fn is not None:
        return tensor.grad_fn, tensor.output_nr
    # A leaf: its gradient accumulator is the next node of any view of it (made with grad on, even inside no_grad).
    with torch.enable_grad():
        return tensor.view_as(tensor).grad_fn.next_functions[0]  # type: ignore[union-attr]


def watch_edge(edge: Edge, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> RemovableHandle:
    """Call `fn(grad)` with the gradient flowing into `edge` (None-gradients skipped), after the tensor's own hooks.

    A node's pre-hooks run after the tensor hooks (`register_hook`) and `retain_grad` of every tensor
    of that node: `fn` sees what autograd delivers to the tensor's `.grad`. `fn` may return a new
    gradient, which then flows on in its place (the seam for gradient edits).
    """
    node, nr = edge[0], edge[1]

    def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        grad = grad_outputs[nr]
        if grad is None:
            return None
        new = fn(grad)
        if new is None or new is grad:
            return None
        return (*grad_outputs[:nr], new, *grad_outputs[nr + 1 :])

    return node.register_prehook(prehook)


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` to `param.grad` exactly as `loss.backward()` would, firing its post-accumulate-grad hooks.

    The parameter's own `AccumulateGrad` node does what the engine does (layout, in-place add, hooks);
    the fallback adds by hand and calls the hooks `register_post_accumulate_grad_hook` keeps.
    """
    with torch.no_grad():
        if FEATURES["call_accumulate_grad"]:
            node = gradient_edge(param)[0]
            node(grad)
            return
        if param.grad is None:
            param.grad = grad.detach().clone(memory_format=torch.contiguous_format) if grad.layout == torch.strided \
                else grad.detach().clone()  # fmt: skip
        else:
            param.grad += grad
    for hook in list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
        hook(param)


def version(tensor: torch.Tensor) -> int | None:
    """`tensor`'s in-place version counter (shared with its views and base), or None when not readable."""
    return tensor._version if FEATURES["tensor_version"] else None


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another tensor's storage (its base)."""
    return bool(FEATURES["is_view"] and tensor._is_view())


_running = [0]


@contextlib.contextmanager
def backward_running() -> Iterator[None]:
    """Marks a strategy's backward pass (what `in_backward` falls back to)."""
    _running[0] += 1
    try:
        yield
    finally:
        _running[0] -= 1


def in_backward() -> bool:
    """Whether autograd's engine runs a backward pass on this thread (e.g. recomputing a checkpoint)."""
    if FEATURES["current_graph_task_id"]:
        return _current_graph_task_id() != -1  # type: ignore[misc]
    return _running[0] > 0


def reentrant_checkpoint(phase: str) -> object | None:
    """The autograd context of the `checkpoint(..., use_reentrant=True)` whose `phase` ("forward": the
    first, no-grad pass; "backward": the recomputation) the caller runs in, or None.

    The same context object is seen in both phases, so it pairs each recomputed call with its forward call.
    """
    if not FEATURES["checkpoint_frames"]:
        return None
    code = getattr(getattr(_CHECKPOINT_FUNCTION, phase, None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a torch.func transform's wrapper (inside `vmap`, `grad`, `jacrev`, ...)."""
    return bool(FEATURES["functorch_wrapped"] and _is_functorch_wrapped(tensor))  # type: ignore[misc]
