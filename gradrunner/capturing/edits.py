"""Gradient edits: change the gradient flowing back through a tap, and record what arrived and what left.

An edit is a tap spec and one operation on the gradient ``g`` that backward brings to that tap:

| operation | value | the gradient becomes |
| --- | --- | --- |
| `scale` | a number `s` | `s * g` (`s = 0`: exact zeros, also where `g` was not finite; `-1`: gradient reversal) |
| `clip_norm` | `c >= 0` | `g * min(1, c / (norm(g) + 1e-6))`, per call (as `torch.nn.utils.clip_grad_norm_`) |
| `clip_value` | `v >= 0` | `g` clamped to `[-v, v]` |
| `mask` | `{dim: d, keep: [i, ...]}` | `g` at the listed indices along dim `d`, zero elsewhere |
| `dropout` | `0 <= p <= 1` | `g * m / (1 - p)`, `m` Bernoulli(1 - p) (`p = 1`: zeros) |
| `noise_std` | `s >= 0` | `g + s * n`, `n` standard normal |

`dropout` and `noise_std` draw from a `torch.Generator` on the gradient's device seeded from
(seed, step, tap, call): the same numbers for every strategy and every re-run.

How it is applied (one mechanism, whatever strategy reads the gradient):

- an activation, input or local tap: when the tap fires, the value the model goes on with passes
  through an identity node (`_EditNode`, no copy) whose backward applies the edit. The strategy
  attaches to the node's output, so every strategy reads the gradient *before* the edit; what flows
  on upstream (earlier layers, parameter `.grad`, the optimiser step) is the edited one. A hook on the
  tapped tensor itself could not do this: `retain_grad`'s `.grad` and `torch.autograd.grad`'s result
  are both taken after a tensor's hooks have run.
- a parameter: a tensor hook on the parameter returns the edited gradient, so `.grad` (and the
  optimiser step) get it under every strategy; the hook keeps the gradient that arrived, which the
  session records in place of what the strategy read (`Edits.arrived`).
- a leaf that did not require grad when its tap fired, turned on in place by a later forward hook
  (transformers' `enable_input_require_grads()`): the forward went on with the leaf itself, so a hook
  on it, registered as the backward begins, hands the gradient that arrived to the record and returns
  the edited one for its `.grad` (`on_late_leaf`): what the edit node gives a leaf that required grad.

The operations themselves (and the seeds random ones draw from) are in `edit_ops`.

Several edits on one tap apply in config order; edits on different taps of one tensor (`fc1:output`
and `relu1:input`) apply as backward meets them: the tap that fires later lies downstream, its edit
comes first and the other one edits what it let through. A parameter tied under several names is one
tensor: an edit under any name edits it, and every name's record says so.

Example::

    edits = parse_edits([{"tap": "fc1:output", "scale": 0.0}, {"tap": "head:weight", "clip_norm": 1.0}])  # config.edits
    with capture(model, ["fc*:output"], edits=edits) as cap:   # capture() also takes the plain dicts
        cap.backward(loss_fn(model(x), y))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradrunner.capturing.dtensors import is_dtensor, like, local_piece
from gradrunner.capturing.edit_ops import APPLY as APPLY
from gradrunner.capturing.edit_ops import apply_all, apply_sharded
from gradrunner.capturing.edit_ops import apply_edit as apply_edit
from gradrunner.capturing.edit_ops import generator_seed as generator_seed
from gradrunner.capturing.grad_context import in_backward
from gradrunner.capturing.owned import owned
from gradrunner.capturing.recorded_norms import record_norm
from gradrunner.capturing.taps import Tap, resolve_taps
from gradrunner.capturing.torch_compat import drop_hook_dict, tensor_impl

# The spec side (what an entry may say) is torch-free, for the config layer: re-exported here.
from gradrunner.config.edits import OPERATIONS as OPERATIONS
from gradrunner.config.edits import Edit, Mask, parse_edits
from gradrunner.errors import GradrunnerError

if TYPE_CHECKING:
    from gradrunner.capturing.strategies.base import Slot

_V = TypeVar("_V")


def _unhook(handle: RemovableHandle, param: nn.Parameter) -> None:
    """An edit's hook removed, and the parameter's hook dict set back to None where it emptied: torch ties that dict
    to the tensor held when it was made, so a hook of the user's added to it after a swap would never fire."""
    handle.remove()
    drop_hook_dict(param)


def _check_shape(edits: Sequence[Edit], tap: str, shape: torch.Size) -> None:
    """A mask's dim and indices must exist in the gradient's shape (that of the tapped value)."""
    for edit in edits:
        m = edit.value
        if not isinstance(m, Mask):
            continue
        if not -len(shape) <= m.dim < len(shape) or not shape:
            raise GradrunnerError(
                f"{edit.label}: the gradient of {tap} has shape {list(shape)}, which has no dim {m.dim}; "
                f"mask.dim takes {'-' + str(len(shape)) + '..' + str(len(shape) - 1) if shape else 'nothing (0-d)'}."
            )
        size = shape[m.dim]
        bad = [k for k in m.keep if not -size <= k < size]
        if bad:
            raise GradrunnerError(
                f"{edit.label}: mask.keep index {bad[0]} is out of range for dim {m.dim} of {tap}'s gradient, shape "
                f"{list(shape)} (size {size}); indices run 0..{size - 1} (negative ones count from the end)."
            )


class _EditNode(torch.autograd.Function):
    """Identity forward (no copy) and forward-mode derivative; backward applies `edit` to the gradient and returns the
    result."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, edit: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.edit = edit
        # `detach()` shares the storage but is no differentiable view: the model may change it in place.
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.edit(grad), None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, _edit: None) -> torch.Tensor:
        """Forward-mode AD (`torch.autograd.forward_ad`) through the edited value: an edit changes only the backward."""
        return tangent


# -- the session's side --------------------------------------------------------------------------------
class Edits:
    """The edits of one capture session, resolved on its model (the one seam `Capture` calls into).

    Example::

        edits = Edits(model, [{"tap": "fc1:output", "scale": -1.0}], seed=0)
        edits.taps          # [Tap('fc1', 'output', ...)]: the session taps these too (one row per firing)

    - `install(stack, capturing, seen)` when the session opens: the parameters' hooks (`seen()` is called
      from every hook of ours inside a backward: that is how the session sees a backward begin);
    - `on_fire(tap, value, call, slot)` when a tap fires: the value the model goes on with (`refuse` first,
      for a value that cannot carry a gradient);
    - `begin_backward()` at the start of each backward (the step number that seeds random edits),
      `end_backward()` at its end;
    - `norms`: the edited activation gradients' norms of the backward, by record `order` (0-d, on the device);
    - `step_arrived(param)`: an edited parameter's gradient as it arrived (before the edit), summed over
      the step's backwards, for its record (`forget_step()` once the step's records are taken).
    """

    def __init__(self, model: nn.Module, entries: object, seed: int = 0, sharded: bool = False) -> None:
        self.edits = parse_edits(entries)
        self.seed = seed
        #: The model holds DTensor parameters: those are edited piece by piece (`_sharded_hooks`).
        self.sharded = sharded
        #: resolved tap name -> its edits in config order
        self.by_tap: dict[str, list[Edit]] = {}
        #: resolved tap name -> the first edit naming it, not by a glob (its mistakes are refused)
        self._named: dict[str, Edit] = {}
        self.taps: list[Tap] = []
        modules = dict(model.named_modules(remove_duplicate=False))
        #: id(parameter) -> (parameter, its edits, its tap names)
        self._params: dict[int, tuple[nn.Parameter, list[Edit], list[str]]] = {}
        for edit in self.edits:
            try:
                resolved = resolve_taps(model, [edit.tap])
            except GradrunnerError as e:
                raise GradrunnerError(f"{edit.label}: {e}") from None
            for tap in resolved:
                if tap.tap not in self.by_tap:
                    self.taps.append(tap)
                self.by_tap.setdefault(tap.tap, []).append(edit)
                if not tap.from_glob:
                    self._named.setdefault(tap.tap, edit)
                if tap.kind == "param":
                    self._add_param(edit, tap, getattr(modules[tap.module], tap.name))
        self.step = -1  # becomes 0 at the first backward
        self._running = False  # between `begin_backward` and `end_backward`: backward `step` runs
        #: edited norms of the backward in progress (then: the last one), by record `order` (one key may be two calls'
        #: until the backward ends: a held forward's and a `retain_graph` one's, `pending.through_older`)
        self.norms: dict[int, torch.Tensor] = {}
        #: parameters' gradients as they arrived (before the edit), summed over the backward's parts
        self._arrived: dict[int, torch.Tensor] = {}
        #: ... and over the step's backwards (gradient accumulation)
        self._step_arrived: dict[int, torch.Tensor] = {}
        self._parts: dict[int, int] = {}
        self.capturing: Callable[[], bool] = lambda: True
        self.seen: Callable[[], None] = lambda: None
        #: the last captured backward's parameter gradients as they arrived, by parameter `id` (for `cap.grads`)
        self.last_arrived: dict[int, torch.Tensor] = {}
        #: The model, and each hooked parameter's tensor as hooked (`_check_swapped`), by parameter `id`.
        self._model, self._hooked = model, dict[int, object]()

    def _add_param(self, edit: Edit, tap: Tap, param: nn.Parameter) -> None:
        if not param.requires_grad:
            if tap.from_glob:
                return  # a glob also matched a frozen parameter: nothing to edit (its record says frozen)
            raise GradrunnerError(
                f"{edit.label}: {tap.tap} cannot carry a gradient: the parameter does not require grad (frozen). "
                "Edit a parameter that trains, or unfreeze it, or drop the edit."
            )
        _check_shape([edit], tap.tap, param.shape)
        entry = self._params.setdefault(id(param), (param, [], []))
        if edit not in entry[1]:  # a glob naming one tied parameter twice edits it once
            entry[1].append(edit)
        entry[2].append(tap.tap)

    @property
    def params(self) -> set[int]:
        """`id` of every edited parameter."""
        return set(self._params)

    def install(self, stack: contextlib.ExitStack, capturing: Callable[[], bool], seen: Callable[[], None]) -> None:
        """Hook every edited parameter (removed when `stack` closes); `capturing()`: keep what arrived?"""
        self.capturing, self.seen = capturing, seen
        for key, (param, edits, names) in self._params.items():
            if self.sharded and is_dtensor(param):
                for handle in self._sharded_hooks(key, param, edits, names[0]):
                    stack.callback(handle.remove)
            else:
                handle = param.register_hook(self._param_hook(key, edits, names[0]))
                stack.callback(_unhook, handle, param)
                self._hooked[key] = tensor_impl(param)
        if self._hooked:
            stack.callback(self._model.register_forward_pre_hook(owned(self._model, self._check_swapped)).remove)

    def _check_swapped(self, *_: object) -> None:
        """Refuse a root forward once an edited parameter's tensor was swapped: its edit's hook stays on the old one."""
        for key, impl in self._hooked.items():
            param, edits, names = self._params[key]
            if tensor_impl(param) != impl:
                raise GradrunnerError(
                    f"{edits[0].label}: the tensor inside parameter {names[0]} was swapped since the session was made "
                    "(torch.utils.swap_tensors, or .to()/.double() under torch.__future__."
                    "set_swap_module_params_on_conversion(True)); torch leaves a Parameter's hooks with the tensor it "
                    "held, so the edit would no longer reach its gradient. Make the session again after the swap, or "
                    "swap before making it."
                )

    def _param_hook(self, key: int, edits: list[Edit], name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.seen()
            # A parameter's gradient may come in parts (reentrant checkpointing): each part draws its own numbers.
            part = self._parts.get(key, 0)
            self._parts[key] = part + 1
            if self.capturing():
                before = self._arrived.get(key)
                self._arrived[key] = grad.detach().clone() if before is None else before + grad
            return apply_all(edits, grad, self.seed, max(self.step, 0), name, part)

        return hook

    def _sharded_hooks(self, key: int, param: nn.Parameter, edits: list[Edit], name: str) -> list[Any]:
        """A sharded parameter's edit: the whole gradient's edit, applied by each rank to its piece.

        Under tensor parallel the parameter is in the graph: a tensor hook edits each backward's gradient
        (as unsharded). FSDP2 computes with an unsharded copy, so its parameter's hooks never fire: the
        edit is applied to `.grad` in place once FSDP2 has reduce-scattered it (a post-accumulate-grad
        hook), i.e. to the synchronised gradient of the ranks' backwards (a step's, under
        `set_requires_gradient_sync(False)`). The random draws are the unsharded run's (each rank draws
        the whole gradient's numbers and keeps its elements'), `clip_norm` uses the whole gradient's norm.
        """
        from gradrunner.capturing.sharded import summed, whole_of  # DTensor's machinery: only where one is

        edited_now: set[int] = set()

        def edit(grad: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            self.seen()
            part = self._parts.get(key, 0)
            self._parts[key] = part + 1
            if self.capturing():
                before = self._arrived.get(key)
                self._arrived[key] = like(grad, local.detach().clone()) if before is None else before + grad
            return apply_all(edits, local, self.seed, max(self.step, 0), name, part, whole_of(grad))

        def tensor_hook(grad: torch.Tensor) -> torch.Tensor:
            edited_now.add(key)
            grad = summed(grad)  # a sequence-parallel LayerNorm's weight: Partial(sum), edited as the sum
            return like(grad, edit(grad, local_piece(grad)))

        def after_accumulation(p: torch.Tensor) -> None:
            if key in edited_now:  # tensor parallel: edited on its way into .grad already
                edited_now.discard(key)
                return
            if p.grad is not None:
                local = local_piece(p.grad)
                local.copy_(edit(p.grad, local))

        return [param.register_hook(tensor_hook), param.register_post_accumulate_grad_hook(after_accumulation)]

    def refuse(self, tap: Tap, why: str) -> None:
        """An edited tap fired on a value that cannot carry a gradient: an edit naming it is a mistake (an edit's glob
        match is skipped), whether the session's `tap` came from a glob of its taps or not. The caller does not ask for
        a value without gradient only while parameters are frozen (the other network of a GAN step): the edit does
        nothing in that call (`on_fire` lets a value without grad through)."""
        edit = self._named.get(tap.tap)
        if edit is not None:
            raise GradrunnerError(
                f"{edit.label}: {tap.tap} cannot carry a gradient: its value is {why}. Edit a tensor computed "
                "from parameters (or from an input that requires grad), or drop the edit."
            )

    def on_fire(self, tap: Tap, value: _V, call: int | Callable[[], int], slot: Slot | None = None) -> _V:
        """The value the model goes on with: `value` through an edit node when `tap` is edited.

        `call` is the firing's call, numbered by the session's forward side in every step (`Firing`: the
        captured step's record's call, in the seeds); `slot` the record's slot in a captured step (its edited
        norm is kept under its key; its call, read as the edit draws, is the one in the seeds: a forward
        before it that no backward reached, dropped, moves it down), None otherwise; in an uncaptured step `call` may be
        read as the edit draws too (`pending.Numbered`). A value without gradient passes as it is.
        """
        edits = self.by_tap.get(tap.tap)
        if edits is None or not isinstance(value, torch.Tensor) or not value.requires_grad:
            return value
        _check_shape(edits, tap.tap, value.shape)
        # the backward the gradient flows in: the next one, or the one running, whose start was seen, for a value
        # recomputed inside it (a reentrant checkpoint's second pass; its first, without grad, is not edited)
        first = max(self.step + (0 if self._running and in_backward() else 1), 0)
        return cast(_V, _EditNode.apply(value, self._editor(tap.tap, edits, call, slot, first)))

    def on_late_leaf(
        self, tap: Tap, leaf: torch.Tensor, call: int, slot: Slot | None, arrived: Callable[[torch.Tensor], object]
    ) -> RemovableHandle:
        """Edit the gradient of `leaf`, a tapped leaf made to require grad in place after its tap fired (by a later
        forward hook: transformers' `enable_input_require_grads()`), as the backward that begins now reaches it.

        The forward used the leaf itself, with no edit node after it: a hook on the leaf hands the gradient that
        arrived to `arrived` (the tap's record, as a strategy reads it in front of an edit node) and returns the
        edited one, which the leaf's `.grad` gets, as it would behind an edit node had the leaf required grad when
        the tap fired. Nothing lies upstream of a leaf: no other gradient changes. Removed with the returned handle.
        """
        edits = self.by_tap[tap.tap]
        _check_shape(edits, tap.tap, leaf.shape)
        edit = self._editor(tap.tap, edits, call, slot, max(self.step, 0))  # the backward begun (`begin_backward`)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            arrived(grad)
            return edit(grad)

        return leaf.register_hook(hook)

    def _editor(
        self, tap: str, edits: list[Edit], call: int | Callable[[], int], slot: Slot | None, first: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """What `edits` do to a gradient of call `call` of `tap` that flows in backward `first` (or a later one)."""

        def edit(grad: torch.Tensor) -> torch.Tensor:
            self.seen()
            if grad.numel() == 0:  # no elements (an expert given no tokens): nothing to edit, its record not edited
                return grad
            # a later backward through the same forward (retain_graph) is a backward of its own: its number; a
            # `torch.autograd.grad` inside a loss (a gradient penalty) begins none: the forward's next one
            step = max(first, self.step) if self._running else first
            # a DTensor: an activation's under tensor parallel, edited as the whole gradient
            at = slot.key.call if slot is not None else call if isinstance(call, int) else call()
            new = (apply_sharded if is_dtensor(grad) else apply_all)(edits, grad, self.seed, step, tap, at)
            if slot is not None:  # into the norms of the backward running now (a second one too)
                self.norms[slot.order] = record_norm(new)
            return new

        return edit

    def begin_backward(self) -> None:
        """A backward starts: it is step `self.step`; forget the previous backward's norms and parameter parts."""
        self.step += 1
        self._running = True
        self._arrived, self._parts = {}, {}
        self.norms = {}

    def end_backward(self, replacing: Collection[int] = ()) -> dict[int, torch.Tensor]:
        """The backward ended (or raised): its parameters' gradients as they arrived join the step's (replace it, for
        the parameters in `replacing`: their `.grad` was reset before it, `ParamTaps.replacing`); returned by `id`.
        (A tap's call number comes with each firing, `Firing`'s count: nothing of it is kept here.)"""
        done, self._arrived, self._running = self._arrived, {}, False
        for key, g in done.items():
            before = self._step_arrived.get(key)
            self._step_arrived[key] = g if before is None or key in replacing else before + g
        return done

    def step_arrived(self, param: torch.Tensor) -> torch.Tensor | None:
        """An edited parameter's gradient before the edit, summed over the step's backwards (None: not edited)."""
        return self._step_arrived.get(id(param)) if id(param) in self._params else None

    def forget_step(self) -> None:
        """The step's records were taken (or the step abandoned): the next step sums anew."""
        self._step_arrived = {}
