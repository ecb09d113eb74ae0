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
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gradrunner.capturing.torch_compat import version


@dataclass
class _Held:
    """One parameter or buffer as it was: its copy, its `.grad` (the object itself) and its in-place version."""

    tensor: torch.Tensor
    copy: torch.Tensor
    grad: torch.Tensor | None
    version: int | None

    def changed(self) -> bool:
        """Whether the tensor's values differ from the copy: its version moved, or (kernels such as batch_norm's
        update running statistics without a version bump) its values do (NaN where NaN was counts as the same)."""
        if version(self.tensor) != self.version:
            return True
        t, c = self.tensor, self.copy
        if t.is_floating_point() or t.is_complex():
            return not torch.allclose(t, c, rtol=0.0, atol=0.0, equal_nan=True)
        return not torch.equal(t, c)


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
    forward is put back, one added is removed), the values of each (copied back into the same tensor where they
    changed, without moving its in-place version: a graph built before the block still backpropagates), each
    tensor's `.grad` (the same object), each module's train/eval mode (`modes_kept`), and the generator states of
    the CPU, of every CUDA device when CUDA is initialised, of Python's `random` and, when the program imported
    numpy, of `numpy.random`'s global generator.
    The copies cost the memory of the parameters and buffers once more, for as long as the block runs.
    """
    modules = list({id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values())
    names = [(m, _own(m)) for m in modules]
    held: dict[int, _Held] = {}
    with torch.no_grad():
        for _, own in names:
            for t in own.values():
                if id(t) not in held:
                    held[id(t)] = _Held(t, t.detach().clone(), t.grad, version(t))
    cpu = torch.get_rng_state()
    py_random = random.getstate()
    numpy = sys.modules.get("numpy")  # only if the program imported it: never imported here
    np_random = numpy.random.get_state() if numpy is not None else None
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
                # Only what changed, and through `.data` (its own version counter): a copy_ on the tensor bumps its
                # version, and a graph built before the block (a loss not yet backpropagated) that saved it would
                # refuse its backward ("modified by an inplace operation") though its values are back as saved.
                if h.changed():
                    h.tensor.data.copy_(h.copy)
                if h.tensor.grad is not h.grad:
                    h.tensor.grad = h.grad
        torch.set_rng_state(cpu)
        random.setstate(py_random)
        if numpy is not None:
            numpy.random.set_state(np_random)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
