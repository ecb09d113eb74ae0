"""Every use of a torch internal in gradrunner, feature-detected once, each with a public fallback.

| function | private path (default where it buys something) | public fallback |
| --- | --- | --- |
| `gradient_edge(t)` | `torch.autograd.graph.get_gradient_edge` (public); for a node of torch's own (not a `torch._C._FunctionBase`, which needs an owner token) the same `GradientEdge` built directly (`direct_edge`) | `(t.grad_fn, t.output_nr)`; a leaf's accumulator through `t.view_as(t)`; `autograd_grad` passes the tensor |
| `watch_edge(edge, fn)` | none: `Node.register_prehook` (public) | - |
| `grad_of(loss, edges, retain)` | `torch.autograd.graph._engine_run_backward`: `autograd.grad`'s own engine call, without its per-input Python checks (~1 µs each) | `torch.autograd.grad` |
| `accumulate(nodes, grads)` | calling a parameter's held `AccumulateGrad` node: `.grad` filled as backward fills it, post-accumulate-grad hooks included | `autograd_grad`'s one engine call is `loss.backward()`, the taps read at their nodes (`watch_edge`) |
| `at_backward_end(fn)` | `Variable._execution_engine.queue_callback` (what DDP and FSDP use): `fn` runs once the backward finished, after every callback queued before | False: the session finishes the backward at its next `records()`, forward or `backward()` |
| `has_own_hooks(t)` | `t._backward_hooks`: `autograd_grad` reads a tap at its node only where the tensor has hooks | True: always read at the node |
| `drop_hook_dict(t)` | `t._backward_hooks = None` where it holds no hook: after `torch.utils.swap_tensors(t, new)` the dict stays with the object, tied to the old tensor, and a hook registered into it never fires | False: the per-example check of a swapped parameter cannot hook it (its rows null); an emptied dict stays (a hook of yours added after a later swap does not fire) |
| `tensor_impl(t)` | `t._cdata`: the C++ tensor the object holds, which `torch.utils.swap_tensors` swaps (a held accumulator is then another tensor's) | `t`'s accumulator node, looked up (~4 µs a parameter per forward) |
| `storage_ref(t)`, `same_storage(t, ref)` | `t.untyped_storage()._cdata` against a `StorageWeakRef` held (while held, a freed storage's address is not reused): a parameter's storage replaced (`p.data = p.data.double()`, and back) is seen with one compare, its accumulator then looked up | never the same: the accumulator node looked up at each check (~4 µs a parameter per forward) |
| `version(t)` | `t._version`: retain_grad reads `.grad` unless the tensor changed in place | None: assume it changed, read the gradient edge |
| `writes_grad(node)` | `torch._C._FunctionBase`: a tap whose gradient flows into a custom Function's node is copied as it arrives | True: always copied |
| `shares_memory(t)` | `torch._C._storage_Use_Count`: a kept gradient another tensor views (a leaf's `.grad`) is copied | True: always copied |
| `is_view(t)` | `t._is_view()`: a tapped view written in place gets its own `reason` | False: "takes no part in the loss" |
| `in_backward()` | `torch._C._current_graph_task_id()`: also true inside a plain `loss.backward()` | a counter `backward_running()` raises around the session's own backward |
| `fills_grad(params)` | `torch._C._will_engine_execute_node` on leaves' `AccumulateGrad` nodes, from `_current_autograd_node()`: does the backward running now fill `.grad` (`loss.backward()`) or only return gradients (`torch.autograd.grad`)? | None (unknown): every backward counts as one that fills `.grad` |
| `reentrant_checkpoint(phase)` | frame walk for `torch.utils.checkpoint.CheckpointFunction` | None: the no-grad first pass records "made under no_grad" |
| `functorch_level(t)` | `torch._C._functorch.is_functorch_wrapped_tensor` | never detected: the tap's own "does not require grad" check |
| `sub_all(a, b)`, `norms_all(ts, dtype)` | `torch._foreach_sub`, `torch._foreach_norm`: one launch for a list on an accelerator (a float64 norm of float32 tensors accumulated in the kernel, no copy) | one op per tensor |
| `compiled_inner(model)`, `compiled_fullgraph(module)` | `OptimizedModule._orig_mod`: tap `torch.compile(model)`'s eager modules; its `dynamo_ctx.fullgraph` (or that in `module.compile()`'s `_compiled_call_impl` closure): refuse `fullgraph=True` up front | a GradrunnerError: pass the model before `torch.compile`; False: dynamo's own error at the first forward |
| `scale_tensor(scaler, device)` | `GradScaler._scale`: the device scale tensor, no host sync | `scaler.scale(torch.ones((), device=device))`: one tiny multiply, no sync |
| `running_ddp()` | `DistributedDataParallel._get_active_ddp_module()`: the DDP wrapper whose forward runs now (a model given as DDP's `.module` is refused: its parameter taps would read each rank's gradient before the all-reduce) | None: not detected (README: pass the wrapper) |
| `sequence_nr(node)` | `Node._sequence_nr()`: the order autograd made its nodes in (a node's inputs are older): `pending` searches no further back than the oldest returned node | 0 for every node: no returned node is taken for an inner one, the forward is kept (as before `pending`) |
| `waited(t)` | `AsyncCollectiveTensor.trigger_wait()` (`torch.distributed._functional_collectives`): a DTensor's local piece still waiting for its collective (a sequence-parallel reduce-scatter) as the plain tensor it wraps | the wrapper itself: torch's ops on it wait (the statistics' torch path; the fused kernels refuse it) |

`FEATURES` holds what was detected at import (autograd nodes' internals too: `node_compat`); tests monkeypatch it to
force each fallback.

Example::

    node, nr = gradient_edge(tensor)
    handle = watch_edge((node, nr), lambda grad: seen.append(grad))   # handle.remove() undoes it
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.leaves import accumulators_below
from gradrunner.errors import GradrunnerError

#: (node, input number, ...): torch's `GradientEdge` (a named tuple), or the fallback's pair.
Edge = tuple[Any, ...]

_get_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None)
_current_autograd_node = getattr(torch._C, "_current_autograd_node", None)
_CHECKPOINT_FUNCTION = getattr(checkpoint_module, "CheckpointFunction", None)
_functorch = getattr(torch._C, "_functorch", None)
_is_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)
_engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
_queue_callback = getattr(_engine, "queue_callback", None)
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
_GradientEdge = getattr(torch.autograd.graph, "GradientEdge", None)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_PYTHON_NODE = getattr(torch._C, "_FunctionBase", None)  # a custom Function's node: its edge needs an owner


def _calls_accumulate_grad() -> bool:
    """Whether calling a leaf's `AccumulateGrad` node fills its `.grad` (probed once on a throw-away leaf)."""
    try:
        probe = torch.zeros(1, requires_grad=True)
        node: Any = probe.view_as(probe).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        with torch.no_grad():
            node(torch.ones(1))
        return probe.grad is not None and float(probe.grad[0]) == 1.0
    except Exception:  # any failure means: not available
        return False


#: What this torch offers; False forces the fallback (tests set these with monkeypatch).
FEATURES: dict[str, bool] = {
    "get_gradient_edge": _get_gradient_edge is not None,
    "call_accumulate_grad": _calls_accumulate_grad(),
    "queue_callback": _queue_callback is not None,
    "engine_run_backward": _engine_run_backward is not None,
    "direct_edge": _PYTHON_NODE is not None and _GradientEdge is not None,
    "tensor_hooks": hasattr(torch.zeros(()), "_backward_hooks"),
    "tensor_version": hasattr(torch.Tensor, "_version"),
    "tensor_cdata": hasattr(torch.zeros(()), "_cdata"),
    "storage_cdata": hasattr(torch.zeros(()).untyped_storage(), "_cdata"),
    "sequence_nr": hasattr(torch.zeros((), requires_grad=True).exp().grad_fn, "_sequence_nr"),
    "is_view": hasattr(torch.Tensor, "_is_view"),
    "current_graph_task_id": _current_graph_task_id is not None,
    "will_engine_execute_node": None not in (_will_engine_execute_node, _current_autograd_node, _current_graph_task_id),
    "checkpoint_frames": _CHECKPOINT_FUNCTION is not None,
    "functorch_wrapped": _is_functorch_wrapped is not None,
    "foreach": hasattr(torch, "_foreach_sub") and hasattr(torch, "_foreach_norm"),
    "compiled_module": True,  # `torch.compile`'s wrapper (class name, `_orig_mod`, `dynamo_ctx`), `_compiled_call_impl`
    "scaler_scale": True,  # `GradScaler._scale`, read when it is a tensor
    "wait_collective": True,  # `AsyncCollectiveTensor.trigger_wait`, found once DTensor imported its module
    "active_ddp_module": True,  # `DistributedDataParallel._get_active_ddp_module`, found once DDP was imported
    "storage_use_count": _storage_use_count is not None,
    "python_node": _PYTHON_NODE is not None,  # a custom Function's node (`writes_grad`)
    # autograd nodes' own, read where `node_compat` is (per-example norms' walk): its shapes, saved values, view bases
    "input_metadata": hasattr(torch.zeros(1, requires_grad=True).view(1).grad_fn, "_input_metadata"),
    "saved_values": hasattr(torch.zeros(2, 2, requires_grad=True).transpose(0, 1).grad_fn, "_saved_dim0"),
    "view_base": hasattr(torch.Tensor, "_base"),
}


def gradient_edge(tensor: torch.Tensor) -> Edge:
    """The (autograd node, input number) through which `tensor`'s gradient flows, taken now.

    Held instead of the tensor, it keeps pointing at this value of the tensor after an in-place op."""
    if FEATURES["get_gradient_edge"]:
        node = tensor.grad_fn
        if node is not None and FEATURES["direct_edge"] and not isinstance(node, _PYTHON_NODE):  # type: ignore[arg-type]
            # what get_gradient_edge returns for an intermediate whose node is torch's own, without its checks
            return _GradientEdge(node, tensor.output_nr)  # type: ignore[misc]
        return _get_gradient_edge(tensor)  # type: ignore[misc]
    if tensor.grad_fn is not None:
        return tensor.grad_fn, tensor.output_nr
    # A leaf: its gradient accumulator is the next node of any view of it (made with grad on, even inside no_grad).
    with torch.enable_grad():
        return tensor.view_as(tensor).grad_fn.next_functions[0]  # type: ignore[union-attr]


def watch_edge(edge: Edge, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> RemovableHandle:
    """Call `fn(grad)` with the gradient flowing into `edge` (None-gradients skipped), after the tensor's own hooks.

    A node's pre-hooks run after the tensor hooks (`register_hook`) and `retain_grad` of every tensor
    of that node: `fn` sees what autograd delivers to the tensor's `.grad` (a leaf's `AccumulateGrad`
    node: what is added to `.grad`). `fn` may return a new gradient, which then flows on in its place."""
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


def grad_of(loss: torch.Tensor, inputs: Sequence[Any], retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(loss, inputs, retain_graph=retain_graph, allow_unused=True)`. Example::

        grad_of(loss, [gradient_edge(h), gradient_edge(w)], False)   # (dloss/dh, dloss/dw)

    Where `inputs` are gradient edges and `loss` a plain scalar tensor that requires grad, the engine
    call `autograd.grad` itself makes (`torch.autograd.graph._engine_run_backward`) without its
    per-input checks, which cost about 1 µs per input; anything else goes through `autograd.grad`."""
    if (
        FEATURES["engine_run_backward"] and FEATURES["get_gradient_edge"] and type(loss) is torch.Tensor
        and loss.requires_grad and not loss.is_nested and loss.numel() == 1 and loss.is_floating_point()
    ):  # fmt: skip
        ones = torch.ones_like(loss, memory_format=torch.preserve_format)  # what autograd.grad makes for a scalar
        return _engine_run_backward(  # type: ignore[misc]
            (loss,), (ones,), retain_graph, False, tuple(inputs), True, accumulate_grad=False
        )
    return torch.autograd.grad(loss, inputs, retain_graph=retain_graph, allow_unused=True)


def accumulate(nodes: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> None:
    """For each node and its grad (None: skipped): add `grad` to the `.grad` of the parameter whose
    `AccumulateGrad` node is `node`, as backward would.

    The node does what the engine does (layout, in-place add, post-accumulate-grad hooks). Only where
    `FEATURES["call_accumulate_grad"]`; without it `autograd_grad` lets `loss.backward()` fill `.grad`."""
    assert FEATURES["call_accumulate_grad"]
    with torch.no_grad():
        for node, grad in zip(nodes, grads, strict=True):
            if grad is not None:
                node(grad)


def accumulator_edge(node: Any) -> Any:
    """What `grad_of` takes for a leaf's `AccumulateGrad` node: its gradient edge, or the leaf where torch has no edges."""
    if FEATURES["get_gradient_edge"] and _GradientEdge is not None:
        return _GradientEdge(node, 0)
    return accumulator_leaf(node)


def accumulator_leaf(node: Any) -> torch.Tensor:
    """The leaf tensor whose `.grad` an `AccumulateGrad` node fills (the node's `variable`)."""
    return node.variable


def at_backward_end(fn: Callable[[], None]) -> bool:
    """Run `fn` once the backward running now has finished (call it from a hook inside that backward). Example::

        at_backward_end(lambda: print("done"))   # inside a tensor or node hook

    `fn` runs after the whole graph ran (every `AccumulateGrad` and post-accumulate-grad hook) and after
    every callback queued so far, DDP's finalize included (which queues its own during backward): it is
    queued from a callback queued now. False where torch offers no callbacks: then nothing is queued.
    """
    if FEATURES["queue_callback"]:
        _queue_callback(lambda: _queue_callback(fn))  # type: ignore[misc]
    return FEATURES["queue_callback"]


def has_own_hooks(tensor: torch.Tensor) -> bool:
    """Whether hooks were registered on `tensor` itself (`register_hook`); True when that cannot be read."""
    return not FEATURES["tensor_hooks"] or bool(getattr(tensor, "_backward_hooks", None))


def drop_hook_dict(tensor: torch.Tensor) -> bool:
    """Set `tensor`'s hook dict back to None where it holds no hook (the next `register_hook` makes one tied to the
    tensor the object holds then: after `torch.utils.swap_tensors` the old dict is tied to the old one); False where
    it holds hooks, or cannot be read."""
    if not FEATURES["tensor_hooks"] or tensor._backward_hooks:
        return False
    if tensor._backward_hooks is not None:  # (setting it clears the hooks on the tensor held now: None is left as is)
        tensor._backward_hooks = None
    return True


def tensor_impl(tensor: torch.Tensor) -> object:
    """What `tensor`'s object holds now (`swap_tensors` swaps it, keeping the object): its C++ address or accumulator."""
    return tensor._cdata if FEATURES["tensor_cdata"] else gradient_edge(tensor)[0]


def storage_ref(tensor: torch.Tensor) -> StorageWeakRef | None:
    """A weak reference to `tensor`'s storage, for `same_storage`; None where that is not readable (a wrapper subclass)."""
    try:
        return StorageWeakRef(tensor.untyped_storage()) if FEATURES["storage_cdata"] else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def same_storage(tensor: torch.Tensor, ref: StorageWeakRef | None) -> bool:
    """Whether `tensor` holds the storage `ref` was taken of (False where unknown: the caller looks further)."""
    try:
        return ref is not None and tensor.untyped_storage()._cdata == ref.cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def sequence_nr(node: Any) -> int:
    """The order autograd made `node` in (its inputs' are lower); 0 for every node where that is not readable."""
    return int(node._sequence_nr()) if FEATURES["sequence_nr"] else 0


def version(tensor: torch.Tensor) -> int | None:
    """`tensor`'s in-place version counter (shared with its views and base), or None when not readable."""
    return tensor._version if FEATURES["tensor_version"] else None


def writes_grad(node: Any) -> bool:
    """Whether `node`'s backward may write its received gradient in place (a custom Function's: Liger's RMSNorm does)."""
    return node is not None and (not FEATURES["python_node"] or isinstance(node, _PYTHON_NODE))  # type: ignore[arg-type]


def shares_memory(t: torch.Tensor) -> bool:
    """Whether another tensor uses `t`'s memory (a leaf's `.grad` autograd took as a view of it); True if unknown."""
    if not FEATURES["storage_use_count"] or type(t) is not torch.Tensor or t.layout != torch.strided:
        return True
    storage = t.untyped_storage()
    return int(_storage_use_count(storage._cdata)) > 2  # type: ignore[misc]  # `t` and `storage` itself


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another tensor's storage (its base)."""
    return bool(FEATURES["is_view"] and tensor._is_view())


_running = [0]


@contextlib.contextmanager
def backward_running() -> Iterator[None]:
    """Marks the session's own backward pass (what `in_backward` falls back to)."""
    _running[0] += 1
    try:
        yield
    finally:
        _running[0] -= 1


def in_backward() -> bool:
    """Whether autograd's engine runs a backward pass on this thread (e.g. recomputing a checkpoint)."""
    return _current_graph_task_id() != -1 if FEATURES["current_graph_task_id"] else _running[0] > 0  # type: ignore[misc]


#: (graph task id, verdict) of the last `fills_grad` answer: one answer per backward, however many hooks ask.
_fills_memo: list[Any] = [-1, None]
_PROBES = 8  # parameters probed before walking the graph


def fills_grad(params: Iterable[torch.Tensor]) -> bool | None:
    """Inside a backward: whether it fills leaves' `.grad` (`loss.backward()`, `backward(inputs=...)`), or
    only returns gradients (`torch.autograd.grad`: a gradient penalty's, a PINN's derivatives, an attack's
    step, a MAML inner step). None where that cannot be told (no backward runs, or this torch lacks the API). Example::

        fills_grad(model.parameters())   # in a hook: False inside torch.autograd.grad(out.sum(), x)

    `torch.autograd.grad` runs no leaf's `AccumulateGrad` node, `loss.backward()` runs every one in its
    graph: the engine's own answer for a few of `params` (which may be absent from this graph: FSDP2's
    sharded parameters, `functional_call`), else for the leaves found by a walk from the node running now.
    Asked once per backward (each hook after the first gets the remembered answer). True inside the
    session's own backward (`backward_running`): `autograd_grad` fills `.grad` itself after its engine call.
    """
    if _running[0]:
        return True
    if not FEATURES["will_engine_execute_node"]:
        return None
    task = _current_graph_task_id()  # type: ignore[misc]
    if task == -1:
        return None
    if _fills_memo[0] != task:
        _fills_memo[0], _fills_memo[1] = task, _fills(params)
    return _fills_memo[1]


def _runs(node: Any) -> bool:
    try:
        return bool(_will_engine_execute_node(node))  # type: ignore[misc]
    except RuntimeError:  # torch refuses a leaf that autograd.grad captures: not run, then
        return False


def _fills(params: Iterable[torch.Tensor]) -> bool | None:
    probed = 0
    for p in params:
        if p.requires_grad and p.grad_fn is None:
            try:  # inside a torch.func transform (a user's vmap(grad(...))) a view of p records no node: its .grad is not filled
                node = gradient_edge(p)[0]
            except AttributeError:
                return False
            if _runs(node):
                return True
            probed += 1
            if probed == _PROBES:
                break
    start = _current_autograd_node()  # type: ignore[misc]
    if start is None:
        return None
    found = False
    for node in accumulators_below(start):
        if _runs(node):
            return True
        found = True
    return False if found else None


def reentrant_checkpoint(phase: str) -> object | None:
    """The autograd context of the `checkpoint(..., use_reentrant=True)` whose `phase` ("forward": the first,
    no-grad pass; "backward": the recomputation) the caller runs in, or None. The same context object is seen
    in both phases, so it pairs each recomputed call with its forward call.
    """
    function = getattr(_CHECKPOINT_FUNCTION, phase, None) if FEATURES["checkpoint_frames"] else None
    code = getattr(function, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a torch.func transform's wrapper (inside `vmap`, `grad`, `jacrev`, ...)."""
    return bool(FEATURES["functorch_wrapped"] and _is_functorch_wrapped(tensor))  # type: ignore[misc]


def sub_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`[x - y for x, y in zip(a, b)]`, in one multi-tensor op on an accelerator."""
    if FEATURES["foreach"] and a and not a[0].is_cpu:
        return list(torch._foreach_sub(list(a), list(b)))
    return [x - y for x, y in zip(a, b, strict=True)]


def norms_all(ts: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The 2-norm of each tensor (tensors of one device and dtype), in one multi-tensor op where torch has it
    (`norms_all([torch.full((4,), 1e20)], dtype=torch.float64)`: `[tensor(2.0000e+20, dtype=torch.float64)]`).

    `dtype` (None: the tensors' own): the norm's accumulation and result. CUDA's multi-tensor kernel accumulates
    in `dtype` (no copy); on the CPU, and in the fallback, each tensor is converted to `dtype` first (a copy).
    """
    if FEATURES["foreach"]:
        return list(torch._foreach_norm(list(ts), 2, dtype=dtype))
    return [torch.linalg.vector_norm(t, dtype=dtype) for t in ts]


def compiled_inner(model: nn.Module) -> nn.Module:
    """The eager module behind `torch.compile(model)` (its `_orig_mod`: `compiled_inner(torch.compile(m)) is m`);
    any other model as it is."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ != "OptimizedModule" or not isinstance(inner, nn.Module):
        return model
    if not FEATURES["compiled_module"]:
        raise GradrunnerError(
            "the model is torch.compile(model), whose eager modules this torch does not expose: pass the model "
            "before torch.compile to capture (compile it after the capture session opened, with model.compile())."
        )
    return inner


def compiled_fullgraph(module: nn.Module) -> bool:
    """Whether `module` is `torch.compile(m, fullgraph=True)` or had `module.compile(fullgraph=True)`; False if unknown."""
    cells = getattr(module.__dict__.get("_compiled_call_impl"), "__closure__", None) or ()  # torch's: none empty
    found = [c for c in (getattr(module, "dynamo_ctx", None), *(c.cell_contents for c in cells)) if c is not None]
    return FEATURES["compiled_module"] and any(type(c).__name__ == "OptimizeContext" and c.fullgraph for c in found)


def scale_tensor(scaler: Any, device: torch.device | str) -> torch.Tensor | None:
    """A `torch.amp.GradScaler`'s current scale as a 0-d tensor on the device (no host sync); None when it is off."""
    if not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None) if FEATURES["scaler_scale"] else None
    return scale if isinstance(scale, torch.Tensor) else scaler.scale(torch.ones((), device=device))


def waited(t: torch.Tensor) -> torch.Tensor:
    """`t`, or the plain tensor an `AsyncCollectiveTensor` `t` wraps once its collective has finished (a wait). Example::

        waited(sp_output_grad.to_local())     # the reduce-scatter's result, a tensor with storage of its own

    Tensor parallel hands a local piece still waiting for its collective as that wrapper, which has no
    storage of its own: torch's ops wait on it, a kernel reading its data pointer would not. Where the
    wrapper's class is not found (DTensor never imported) or the feature is off, `t` comes back as it is.
    """
    if type(t) is torch.Tensor:
        return t
    module = sys.modules.get("torch.distributed._functional_collectives")
    cls = getattr(module, "AsyncCollectiveTensor", None)
    if FEATURES["wait_collective"] and cls is not None and isinstance(t, cls) and hasattr(t, "trigger_wait"):
        return t.trigger_wait()
    return t


def running_ddp() -> nn.Module | None:
    """The `DistributedDataParallel` wrapper whose forward runs now (from a forward hook); None if none or unknown."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    cls = getattr(module, "DistributedDataParallel", None)
    active = getattr(cls, "_get_active_ddp_module", None)
    if not FEATURES["active_ddp_module"] or active is None:
        return None
    return found if isinstance(found := active(), nn.Module) else None
