"""Run something on a model and leave no trace: `untouched(model)` puts back its parameters, buffers, `.grad`,
every module's train/eval mode and the random number generators exactly as they were (the tap explorer's
forward pass runs inside it); `evaluating(model)` is eval mode for a block, each module's own mode back after
it (the runner's evaluation and its check of the eval data run inside it).

Example::

    with untouched(model):
        model(x)              # BatchNorm's running stats move, Dropout draws from the generator ...
    # ... and here both are bit for bit as before
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class _Held:
    """One parameter or buffer as it was: its copy and its `.grad` (the object itself)."""

    tensor: torch.Tensor
    copy: torch.Tensor
    grad: torch.Tensor | None


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Inside: anything may call `.train()` / `.eval()` on `model`; on exit each module's `training` flag is back.

    Example::

        model.backbone.eval()          # a frozen block kept in eval mode while the rest trains
        with modes_kept(model):
            model.eval()
        model.training, model.backbone.training     # True, False

    `model.train(was_training)` would not do: it sets every submodule to the one mode.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode inside; each module's own train/eval mode back on exit (`modes_kept`).

    Example::

        with evaluating(model), torch.no_grad():
            loss = loss_fn(model(x), y)
    """
    with modes_kept(model):
        model.eval()
        yield


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Inside: anything may happen to `model`'s tensors and the generators; on exit (exception or not) they are back.

    Example::

        with untouched(bn_dropout_model):
            bn_dropout_model(x)
        # running_mean, running_var, num_batches_tracked, torch.get_rng_state(): as before

    Restored: which tensor each module holds under each parameter and buffer name (one reassigned in the
    forward is put back, one added is removed), the values of each (copied back into the same tensor), each
    tensor's `.grad` (the same object), each module's train/eval mode (`modes_kept`), and the generator states of the CPU and, when CUDA is initialised,
    of every CUDA device.
    The copies cost the memory of the parameters and buffers once more, for as long as the block runs.
    """
    modules = list({id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values())
    names = [(m, _own(m)) for m in modules]
    held: dict[int, _Held] = {}
    with torch.no_grad():
        for _, own in names:
            for t in own.values():
                if id(t) not in held:
                    held[id(t)] = _Held(t, t.detach().clone(), t.grad)
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with modes_kept(model):
            yield
    finally:
        for module, own in names:
            now = _own(module)
            for name in now.keys() - own.keys():
                delattr(module, name)
            for name, t in own.items():
                if now.get(name) is not t:
                    setattr(module, name, t)
        with torch.no_grad():
            for h in held.values():
                h.tensor.copy_(h.copy)  # always: kernels such as batch_norm's update running stats unversioned
                if h.tensor.grad is not h.grad:
                    h.tensor.grad = h.grad
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
