"""Exact per-example gradient norms of parameters: `PerExampleNorms`, hooks on the layers that use them.

The norm of batch row i is that of row i's share of the parameter's `.grad` (the shares of all
rows sum to `.grad`; for a mean-reduced loss, row i's share is its own gradient / B). A forward hook on every
supported layer (`find_holders`: the others' calls only mark outputs whose rows are not the batch's) keeps the input
of a call holding a tracked parameter (detached); a pre-hook on the autograd node of the call's output
(`torch_compat.watch_edge`) receives its gradient, and `per_example_layers.share` + `per_example_math.row_sq` turn
the two into each row's squared norm, ghost or materialised (`per_example_math`), during backward. Nothing changes a
gradient, an output or another hook's behaviour: every hook returns None and no global RNG is used.

A step is everything between two `norms()` calls: each backward that fills `.grad` is a micro-batch (a
forward after it starts the next; a `torch.autograd.grad` of the user's, a gradient penalty's or an
attack's, is none: `torch_compat.fills_grad`), its rows after the previous one's; a forward that no such
backward reaches (a metric's, gradients on) adds no rows. Several calls of one parameter in a forward
(tied weights, a module called twice) add up exactly (cross terms).

`None` with a reason, never a wrong number, for a parameter:

- held by a module per-example norms do not support (`per_example_layers.kind_of`), or frozen (in that step);
- whose module was called on an unbatched input, or one whose dim 0 is not the batch (the first tensor given to
  `model`; without a call of `model`, the dim 0 all calls must share) nor provably its tokens flattened
  (`per_example_tokens`), or has its size but not its rows (`per_example_rows`: ids made in the forward, a parameter,
  rows picked by indexing, dim 0 transposed with another of its size);
- called before a module that mixes rows (batch norm on batch statistics) in the same forward, or
  of such a module: its rows' shares are not per-example gradients;
- in a micro-batch whose backward reached several forwards of the model given different batch tensors
  (`f(model(x1)) + f(model(x2))`): whether row i of each is one example or two is unknown, so rows are
  neither summed nor concatenated (forwards given the same tensor, R-drop's, are summed row by row);
- whose gradient does not add up to its calls' shares: checked on a random projection per step
  (`check=True`, `per_example_check`). This catches a parameter also used outside its modules'
  calls (`x @ lin.weight`, a penalty in the loss);
- that got no gradient this step.

Two ways to take a step's norms: `norms()` (standalone: one device-to-host transfer per device for
the check's verdicts), or `device_norms()` (a capture session: no transfer; a failed check's rows
are `per_example_check.FAILED`, which the host turns into None after the step's one transfer) then
`end_step()`. `enabled()` False (a capture session's uncaptured steps): the hooks compute nothing.

Under a GradScaler the shares carry the scale (as `.grad` does); under DDP they are each rank's
shares of its local gradient, before the all-reduce (the capture session divides them by the world
size: shares of the averaged `.grad`). Shares assume the loss is a sum of per-row terms; a loss that
mixes rows (contrastive) is not detected.

Example::

    with PerExampleNorms(model, [("fc1:weight", model.fc1, model.fc1.weight)]) as pex:
        loss_fn(model(x), y).backward()
        norms = pex.norms()     # {"fc1:weight": tensor of B float64 norms}; pex.reasons() says why a None
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradrunner.capturing.grad_context import FROZEN
from gradrunner.capturing.owned import owned
from gradrunner.capturing.pending import hook_held
from gradrunner.capturing.per_example_check import FAILED, OUTSIDE, Projection, host_verdicts, verdicts
from gradrunner.capturing.per_example_layers import (
    call_reason,
    first_tensor,
    make_call,
    mixes_rows,
    no_autocast,
    output_edge,
    share,
    tensors_of,
)
from gradrunner.capturing.per_example_math import row_sq
from gradrunner.capturing.per_example_rows import RowOrigins
from gradrunner.capturing.per_example_state import CallRecord, Holder, Micro, Tracked, find_holders, given
from gradrunner.capturing.torch_compat import (
    fills_grad,
    in_backward,
    reentrant_checkpoint,
    version,
    watch_edge,
)

NO_GRAD = "no gradient reached it in this step (its module was not called, or its output took no part in the loss)"


class PerExampleNorms:
    """Per-example gradient norms of `params` (`(name, module, parameter)`) of `model`, while open.

    Example::

        with PerExampleNorms(model, [(n, m, p) for n, m, p in my_params]) as pex:
            for x, y in micro_batches:
                (loss_fn(model(x), y) / len(micro_batches)).backward()
            norms, reasons = pex.norms(), pex.reasons()   # the step's rows, micro-batch after micro-batch

    `norms()` ends the step (the next forward starts another) and returns `{name: (rows,) float64
    tensor on the parameter's device, or None}`; `reasons()` says why each None is. All hooks are
    removed when the context closes, normally or by an exception. `enabled()` False: the hooks do
    nothing (a forward then is no part of any step).
    """

    def __init__(
        self, model: nn.Module, params: Sequence[tuple[str, nn.Module, nn.Parameter]], *, check: bool = True,
        enabled: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        self.model, self.check = model, check
        self._enabled = enabled or (lambda: True)
        self._tracked: list[Tracked] = []
        by_id: dict[int, Tracked] = {}
        for name, _module, param in params:
            if id(param) in by_id:
                by_id[id(param)].names.append(name)
            else:
                by_id[id(param)] = Tracked(param, [name])
                self._tracked.append(by_id[id(param)])
        self._holders, self._params = find_holders(model, by_id, self._tracked), [t.param for t in self._tracked]
        self._stack = contextlib.ExitStack()
        self._calls: list[tuple[int, Any]] = []  # (micro, the hook on a call's output node: it holds the call's record)
        self._roots: list[Any] = []  # pre-hooks on the model outputs' nodes of this step's forwards
        self._micros: list[Micro] = []
        self._clock, self._grad_seen, self._active = 0, False, False
        self._forward_rows: int | None = None
        self._forward = 0  # which forward of the model in the micro-batch the calls now belong to (`Micro.forwards`)
        #: A reentrant checkpoint's context: [the clock at its first pass, events recomputed] (`_position`).
        self._ckpt: dict[Any, list[int]] = {}
        self._origins = RowOrigins()  # where this forward's rows come from (dim 0 of the batch's size, not its rows)
        self._last: tuple[dict[str, torch.Tensor | None], dict[str, str | None]] | None = None

    def __enter__(self) -> PerExampleNorms:
        try:
            for h in self._holders:
                self._stack.enter_context(h.module.register_forward_hook(owned(
                    h.module, lambda m, a, k, out, h=h: self._on_call(h, a, k, out)), with_kwargs=True, prepend=True))  # fmt: skip
            for path, module in self.model.named_modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    self._stack.enter_context(module.register_forward_hook(owned(
                        module, lambda m, a, out, path=path: self._on_mixing(m, path, out))))  # fmt: skip
            model = self.model  # owned: a copy of the model made meanwhile (it carries these hooks) is not seen
            self._stack.enter_context(model.register_forward_pre_hook(owned(model, self._on_root), with_kwargs=True))
            self._stack.enter_context(model.register_forward_hook(owned(model, self._on_root_output)))
            for t in self._tracked:
                self._stack.callback(t.rehook, None)  # the check's hook removed, an emptied hook dict set back to None
                t.check = None  # an earlier entry's check went with its hooks: a new one for this entry
                self._watch(t)
            self._stack.callback(self._drop_calls)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _watch(self, t: Tracked) -> None:
        """The check's hook on `t`'s gradient once `t` requires grad (one frozen as the context opened: once unfrozen),
        and again where its tensor was swapped (`torch.utils.swap_tensors(p, new)`: the hook went with the old one)."""
        if t.reason is None and self.check and t.param.requires_grad and not t.hooked():
            t.check = t.check or Projection(t.param, next(i for i, u in enumerate(self._tracked) if u is t))
            t.rehook(functools.partial(self._on_param_grad, t))

    # -- hooks (each returns None: nothing they see changes) --

    def _tick(self) -> int:
        """The current micro-batch, starting a new step after `norms()` and a new micro-batch after a backward."""
        if not self._active:
            self._active, self._micros, self._clock, self._grad_seen = True, [Micro()], 0, False
            self._forward_rows, self._forward, self._ckpt = None, 0, {}
            self._drop_calls()
            for t in self._tracked:
                t.reset()
        elif self._grad_seen and not in_backward():
            self._micros.append(Micro())
            self._grad_seen, self._forward_rows, self._forward = False, None, 0
        self._clock += 1
        return len(self._micros) - 1

    def _on_root(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or (in_backward() and reentrant_checkpoint("backward") is None):
            return
        if not self._enabled():
            return
        micro = self._tick()  # (it may start a new list of micro-batches)
        # a forward no backward reached, whose graph went (a metric's): its records went with its nodes, hooks too
        self._calls, self._roots = [c for c in self._calls if hook_held(c[1])], [h for h in self._roots if hook_held(h)]
        m, x = self._micros[micro], first_tensor(args, kwargs)
        self._forward, m.forwards = m.forwards, m.forwards + 1
        m.given[self._forward] = given(x, self._forward)
        self._forward_rows = x.shape[0] if x is not None and x.dim() > 0 else None
        m.batch = m.batch or self._forward_rows or 0  # the rows of a micro-batch in which a parameter got nothing
        self._origins.start(args, kwargs, self._forward_rows)

    def _on_root_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """A backward through the model's output ends the micro-batch, whether or not a tracked layer got a part of it
        (a branch that skipped them: its rows are zeros)."""
        if not self._active or in_backward():
            return
        began = functools.partial(self._backward_began, len(self._micros) - 1, self._forward)
        nodes = [y.grad_fn for y in tensors_of((output,), {}) if y.grad_fn is not None]
        self._roots.extend(node.register_prehook(began) for node in nodes)

    def _backward_began(self, micro: int, forward: int, _grads: tuple[torch.Tensor | None, ...]) -> None:
        if fills_grad(self._params) is not False:
            self._grad_seen = self._micros[micro].backward = True
            self._micros[micro].reached.add(forward)

    def _on_mixing(self, module: nn.Module, path: str, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not mixes_rows(module) or not self._enabled():
            return
        if not output.requires_grad:  # a reentrant checkpoint's first pass (no grad): where it lies in the forward
            ctx = reentrant_checkpoint("forward") if self._active and not torch.is_grad_enabled() else None
            if ctx is not None:
                self._ckpt.setdefault(ctx, [self._clock, 0])
            return
        micro = self._tick()  # (it may start a new list of micro-batches)
        m = self._micros[micro]
        m.mix_name = f"{path!r} ({type(module).__name__} normalising with batch statistics)"
        m.mix_clock = self._position()

    def _position(self) -> tuple[int, int]:
        """Where the event now lies in the forward's order: (clock, 0); in the recomputation of a reentrant checkpoint
        whose first pass had a row-mixing module, (that pass's clock, the n-th event recomputed): after every call
        before the checkpoint, before every call after it (the head after a checkpointed BatchNorm)."""
        ctx = reentrant_checkpoint("backward") if self._ckpt and in_backward() else None
        seen = self._ckpt.get(ctx) if ctx is not None else None
        if seen is None:
            return self._clock, 0
        seen[1] += 1
        return seen[0], seen[1]

    def _on_call(self, h: Holder, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.requires_grad or not self._enabled():
            return
        if in_backward() and reentrant_checkpoint("backward") is None:
            return  # a non-reentrant checkpoint recomputing: the first call's hook gets the gradient
        micro = self._tick()
        x = first_tensor(args, kwargs)
        rows = self._forward_rows if self._forward_rows is not None else (x.shape[0] if x is not None and x.dim() else 0)
        reason = "called without a tensor input" if x is None else call_reason(h.kind, h.module, x, rows)
        if reason is None and x is not None:  # (dim 0 the batch's size by coincidence? its tokens flattened?)
            reason = self._origins.judge(h.kind, x, rows, output, h.path)
        reason = reason or mixes_rows(h.module)
        for t, _role in h.tracked:
            if t.reason is None:
                self._watch(t)
                t.expected[micro] = t.expected.get(micro, 0) + 1
                t.first_clock.setdefault(micro, self._position())
                if t.step_reason is None and (reason is not None or not t.param.requires_grad):  # frozen: in this step
                    t.step_reason = f"{h.path!r} {reason}" if reason is not None else FROZEN
        if reason is not None or all(t.reason or t.step_reason for t, _ in h.tracked):
            return
        assert x is not None
        call = make_call(h.kind, h.module, x, args, kwargs, rows)
        rec = CallRecord(h, call, micro, self._clock, rows, self._forward, tuple(output.shape))
        rec.handle = watch_edge(output_edge(output), functools.partial(self._on_grad, rec))
        self._calls.append((micro, rec.handle))

    def _on_grad(self, rec: CallRecord, grad: torch.Tensor) -> None:
        if fills_grad(self._params) is False:  # the user's torch.autograd.grad: not the step's backward
            return
        with no_autocast(grad.device):  # a backward inside autocast runs hooks under it: compute as written
            self._on_grad_body(rec, grad.reshape(rec.shape))

    def _on_grad_body(self, rec: CallRecord, grad: torch.Tensor) -> None:
        self._grad_seen = self._micros[rec.micro].backward = True
        self._micros[rec.micro].reached.add(rec.forward)
        h, call = rec.holder, rec.call
        if rec.fired or call is None:
            for t, _ in h.tracked:
                t.step_reason = t.step_reason or (f"{h.path!r}'s output got gradients from two backward passes "
                                                  "(retain_graph=True): not supported")  # fmt: skip
            return
        rec.fired = True
        self._micros[rec.micro].rows.add(rec.rows)
        changed = call.version is not None and version(call.x) != call.version
        low = grad.dtype if grad.dtype in (torch.bfloat16, torch.float16) else call.autocast
        for t, role in h.tracked:
            if t.reason or t.step_reason:
                continue
            if changed or rec.micro in t.sq:
                t.step_reason = (f"the input of {h.path!r} was changed in place after its call" if changed else
                                 f"{h.path!r} was called again after its micro-batch's shares were summed")  # fmt: skip
                continue
            try:
                form = share(h.kind, h.module, role, call, grad)
                if t.check is not None:
                    t.check.add_call(form, low)
            except (RuntimeError, ValueError, IndexError) as exc:  # inside the user's backward: a reason, not a crash
                t.step_reason = f"computing the share of {h.path!r} failed: {exc}"
                continue
            t.pending.setdefault(rec.micro, []).append(form)
            if len(t.pending[rec.micro]) == t.expected[rec.micro]:
                self._settle(t, rec.micro)
        rec.call = None

    def _on_param_grad(self, t: Tracked, grad: torch.Tensor) -> None:
        if t.check is None or not self._enabled() or fills_grad(self._params) is False:
            return
        self._grad_seen = True
        if self._micros:
            self._micros[-1].backward = True
        with no_autocast(grad.device):
            t.check.add_grad(grad)

    def _settle(self, t: Tracked, micro: int) -> None:
        forms = t.pending.pop(micro, [])
        if forms and t.step_reason is None:
            try:
                t.sq[micro] = row_sq(forms)
            except (RuntimeError, ValueError, IndexError) as exc:
                t.step_reason = f"summing the shares failed: {exc}"

    def _drop_calls(self) -> None:
        for handle in [h for _, h in self._calls] + self._roots:
            handle.remove()
        self._calls, self._roots = [], []
        self._origins.clear()

    def drop(self, params: set[int]) -> None:
        """These parameters' `.grad` was reset mid-step (`ParamTaps.replacing`): their rows are None this step."""
        for t in self._tracked:
            if id(t.param) in params and not t.step_reason:
                t.step_reason = t.reset_reason()

    def forget_forward(self) -> None:
        """Forget the calls of a forward whose backward will not come (its loss failed): the micro-batch starts again.

        Example::

            try:
                loss = loss_fn(model(x), y)
            except ValueError:
                pex.forget_forward()
        """
        if not self._active or self._grad_seen:
            return
        micro = len(self._micros) - 1
        for _, handle in [c for c in self._calls if c[0] == micro]:
            handle.remove()
        self._calls = [c for c in self._calls if c[0] != micro]
        self._micros[micro] = Micro()
        for t in self._tracked:
            t.expected.pop(micro, None)
            t.first_clock.pop(micro, None)
            t.pending.pop(micro, None)

    # -- the step's result --

    def norms(self) -> dict[str, torch.Tensor | None]:
        """Each name's per-row norms for the step so far (float64, rows of every micro-batch in order), or None.

        Ends the step: the next forward starts a new one. Called again without a new forward, it
        returns the same. Makes one device-to-host transfer per device (the check's verdicts).
        """
        if self._active or self._last is None:
            self._last = host_verdicts(*self.device_norms())
            self.end_step()
        return dict(self._last[0])

    def reasons(self) -> dict[str, str | None]:
        """Why each name's norms are None (None where they are not), for the step `norms()` ended."""
        if self._last is None:
            self.norms()
        assert self._last is not None
        return dict(self._last[1])

    def device_norms(
        self, scale: torch.Tensor | float | None = None,
    ) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None]]:  # fmt: skip
        """The step so far, on the device and without a host sync: (norms, reasons of the Nones).

        Example::

            norms, reasons = pex.device_norms()    # a failed check: every row per_example_check.FAILED
            ...                                    # the norms ride in the step's one transfer
            pex.end_step()

        `scale` (a 0-d tensor or a number) multiplies every norm (1/loss scale, 1/world size).
        Does not end the step (a later backward of the same step adds its rows; call again).
        """
        with contextlib.ExitStack() as stack:
            for device in {t.param.device for t in self._tracked}:
                stack.enter_context(no_autocast(device))
            return self._finish(scale)

    def end_step(self) -> None:
        """The step is over: the next forward starts a new one."""
        self._active = False
        self._drop_calls()

    def _finish(self, scale: torch.Tensor | float | None) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None]]:
        for t in self._tracked:
            for micro in list(t.pending):
                self._settle(t, micro)
        squares: list[tuple[Tracked, torch.Tensor]] = []
        reasons: dict[int, str | None] = {}
        for t in self._tracked:
            sq, reasons[id(t)] = self._result(t)
            if sq is not None:
                squares.append((t, sq))
        values = self._rooted(squares, scale)
        norms: dict[str, torch.Tensor | None] = {}
        named: dict[str, str | None] = {}
        for t in self._tracked:
            for name in t.names:
                norms[name], named[name] = values.get(id(t)), reasons[id(t)]
        return norms, named

    def _rooted(self, squares: list[tuple[Tracked, torch.Tensor]], scale: torch.Tensor | float | None) -> dict[int, torch.Tensor]:
        """sqrt of every parameter's squared row norms, a failed check's rows `FAILED`: a few ops per device and size."""
        groups: dict[tuple[torch.device, int], list[tuple[Tracked, torch.Tensor]]] = {}
        for t, sq in squares:
            groups.setdefault((sq.device, sq.shape[0]), []).append((t, sq))
        out: dict[int, torch.Tensor] = {}
        for group in groups.values():
            sqs = [sq for _, sq in group] if len({sq.dtype for _, sq in group}) == 1 else [sq.double() for _, sq in group]
            rooted = torch.stack(sqs).to(torch.float64).clamp_min_(0).sqrt_()
            if scale is not None:
                rooted.mul_(scale.to(rooted.device, torch.float64) if isinstance(scale, torch.Tensor) else scale)
            checks = [t.check for t, _ in group if t.check is not None]
            if checks:  # a check is on for every tracked parameter, or for none
                rooted = torch.where(verdicts(checks).unsqueeze(1), rooted, FAILED)
            out.update(zip([id(t) for t, _ in group], rooted.unbind(0), strict=True))
        return out

    def _result(self, t: Tracked) -> tuple[torch.Tensor | None, str | None]:
        """This step's squared row norms of `t` (device, its compute dtype), or None and why."""
        micros = [i for i, m in enumerate(self._micros) if m.backward]  # a forward never backwarded has no rows
        several = next(filter(None, (self._micros[i].forwards_reason() for i in micros)), None)
        several = several if self._active else None
        if t.reason or several or t.step_reason:  # several first: summing their rows may have failed meanwhile
            return None, t.reason or several or t.step_reason
        if not self._active:
            return None, "no forward and backward since the last norms()"
        why = next(filter(None, (self._micros[i].reason(t.first_clock.get(i)) for i in micros)), None)
        if why is not None:
            return None, why
        if not t.sq:
            return None, OUTSIDE if t.check is not None and t.check.grads else NO_GRAD if t.param.requires_grad else FROZEN
        if t.check is not None and not t.check.grads:
            return None, "its modules' outputs got gradients but it did not (a backward that did not ask for it)"
        if len(micros) == 1:
            return t.sq[micros[0]], None
        last = next(reversed(t.sq.values()))  # where the check is: a model moved between micro-batches (`Projection._follow`)
        return torch.cat([t.sq[i].to(last.device) if i in t.sq else last.new_zeros(next(iter(self._micros[i].rows),
                          self._micros[i].batch)) for i in micros]), None  # fmt: skip

