"""The per-step check behind per-example norms: a parameter's gradient is the sum of its calls' shares.

A parameter's rows are its calls' shares only if nothing else adds to its gradient (a functional use
such as `x @ lin.weight`, a weight penalty in the loss). Every step, each call's shares are projected
on a fixed random rank-one matrix u v^T (`per_example_math.projection`: matrix-vector products over
the factors, nothing of the parameter's size per row), and so is every gradient that reaches the
parameter (a tensor hook: u^T g v, one read of the gradient). The two sums must agree to rounding,
measured against the magnitude of the terms (one per row and position: the sum of their |.|):
`CHECK_TOL`, or `CHECK_TOL_LOW` where a gradient or a call was bfloat16/float16 (autograd rounds its
weight gradient there; the shares are float32).

A call's terms are kept as they are (a few per row) or, past `FOLD_ABOVE` (a convolution's rows
and positions), folded when they arrive into two numbers with the same sum and the same sum of |.|.
The verdicts of every checked parameter are then computed on the device in a fixed number of ops
over all of them (`verdicts`: one concatenation, two segment sums): no host synchronisation. A parameter whose check fails has every row set to `FAILED`
(a norm is never negative), so the verdict travels with the norms in the step's one transfer and the
host turns those rows into None (`failed`).

Example::

    check = Projection(param, seed=0)
    check.add_call(form, False)         # in backward, for each call's share
    check.add_grad(grad)                # the parameter's own gradient (a tensor hook)
    ok = verdicts([check])              # (1,) bool on the parameter's device
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gradrunner.capturing import reductions
from gradrunner.capturing.per_example_math import Dense, Form, Lazy, projection

#: |g's projection - the calls' projections| above this fraction of the projections' magnitudes: not all of it is theirs.
CHECK_TOL = 1e-4
#: The same where a gradient is bfloat16/float16 (autograd rounds its weight gradient there; ours is float32).
CHECK_TOL_LOW = 3e-2
#: Every row of a parameter whose check failed (on the device, before the transfer): never a norm.
FAILED = -1.0
_LOW = (torch.bfloat16, torch.float16)
#: A call with more projection terms than this (one per row and position) is folded to two numbers when it arrives.
FOLD_ABOVE = 2048
#: Why a parameter whose check failed has no per-example norms.
OUTSIDE = ("its gradient is not the sum of its modules' calls' shares: it is also used outside them (a functional "
           "use such as x @ module.weight, or a term of the loss such as a weight penalty)")  # fmt: skip


class PerExampleWarning(UserWarning):
    """A parameter tap's per-example norms are null (said once per tap and session, with the reason)."""


def failed(rows: np.ndarray | torch.Tensor) -> bool:
    """Whether these per-example norms (host or device) are the mark of a failed check.

    Example::

        failed(np.array([-1.0, -1.0]))     # True: the parameter's gradient is not its calls' shares
    """
    return len(rows) > 0 and _marked(float(rows[0]))


def _marked(first: float) -> bool:
    return first < 0  # every row is FAILED, and no norm is negative


class Projection:
    """One parameter's check for the step: its calls' projection terms, its gradients' projections.

    `u` spans the parameter's first dimension, `v` the rest; drawn once from their own generator (the
    global RNG is not touched), in float64 for a float64 parameter, else float32.
    """

    def __init__(self, param: nn.Parameter, seed: int) -> None:
        gen = torch.Generator(device=param.device).manual_seed(0x9E37 + seed)
        dt = torch.float64 if param.dtype == torch.float64 else torch.float32
        self.u = torch.randn(param.shape[0] if param.dim() else 1, generator=gen, device=param.device, dtype=dt)
        self.v = torch.randn(max(1, param.numel() // max(1, self.u.numel())), generator=gen, device=param.device, dtype=dt)
        self._uvw: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {dt: (self.u, self.v, None)}
        #: Each call's terms (1-D, `per_example_math.projection`) and each gradient's projection (1 element).
        self.calls: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.low_precision = False
        self._uv: torch.Tensor | None = None

    def reset(self) -> None:
        self.calls, self.grads, self.low_precision = [], [], False

    def projector(self, dtype: torch.dtype, dense: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u, v and (for a `Dense` form: the parameter is small) u v^T flattened, in `dtype`, each made once."""
        u, v, w = self._uvw.get(dtype) or (self.u.to(dtype), self.v.to(dtype), None)
        if w is None and dense:
            w = torch.outer(u, v).reshape(-1)
        self._uvw[dtype] = (u, v, w)
        return u, v, w if w is not None else u

    def add_call(self, form: Form, low_precision: bool) -> None:
        """One call's shares: their projection's terms (on the device; summed with every other check's in `verdicts`)."""
        dtype = form.dtype if isinstance(form, Lazy) else form.rows.dtype if isinstance(form, Dense) else form.right.dtype
        terms = projection(form, *self.projector(dtype, isinstance(form, Dense)))
        if terms.numel() > FOLD_ABOVE:  # two numbers with the same sum and the same sum of |.|: P >= 0 and S - P <= 0
            positive = terms.clamp(min=0).sum()
            terms = torch.stack([positive, terms.sum() - positive])
        self.calls.append(terms)
        self.low_precision |= low_precision

    def add_grad(self, grad: torch.Tensor) -> None:
        """A gradient reaching the parameter: u^T g v (two matrix-vector products: one read, no temporary of its size)."""
        u, v = self.u, self.v
        if grad.is_sparse:
            g = grad.coalesce()
            proj = torch.dot(u[g.indices()[0]], g.values().reshape(g.values().shape[0], -1).to(u.dtype) @ v)
        elif v.numel() == 1:  # a bias, a norm's weight: one dot with u v (made once)
            if self._uv is None:
                self._uv = u * v
            proj = torch.dot(self._uv, grad.reshape(-1) if grad.dtype == u.dtype else grad.reshape(-1).to(u.dtype))
        else:
            flat = grad.reshape(u.numel(), -1)
            proj = torch.dot(u, torch.mv(flat if flat.dtype == u.dtype else flat.to(u.dtype), v))
        self.grads.append(proj.reshape(1))
        self.low_precision |= grad.dtype in _LOW


class _Layout:
    """Which check each element of the step's stacked terms belongs to, built once per shape of step.

    The stack holds every check's call terms, then every check's gradient projections: segment j
    (check j's calls) and n + j (its gradients); the magnitudes sum |terms| over the first part.
    """

    def __init__(self, checks: Sequence[Projection], device: torch.device) -> None:
        calls = tuple(sum(t.numel() for t in c.calls) for c in checks)
        grads = tuple(sum(t.numel() for t in c.grads) for c in checks)
        # each segment's elements lie together in the stack: summed in a fixed order (the same bits every run)
        self.segments = reductions.segments(calls + grads).to(device)
        self.call_segments = reductions.segments(calls).to(device)
        self.n_calls = sum(calls)
        tols = [CHECK_TOL_LOW if c.low_precision else CHECK_TOL for c in checks]
        self.tol = torch.tensor(tols, dtype=torch.float32).to(device)


_LAYOUTS: dict[tuple[object, ...], _Layout] = {}


def verdicts(checks: Sequence[Projection]) -> torch.Tensor:
    """Whether each check passed: (len(checks),) bool on their device (one device), no host sync.

    Every check must have at least one call and one gradient. A NaN or Inf in the sums passes (the
    gradient is not finite: its norms say so themselves). A fixed number of ops for all checks.
    """
    device = checks[0].u.device
    parts = [t for c in checks for t in c.calls] + [t for c in checks for t in c.grads]
    key = (device, tuple(t.shape[0] for t in parts), tuple((len(c.calls), c.low_precision) for c in checks))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()  # shapes change from step to step (a parameter skipped): keep a few
        layout = _LAYOUTS[key] = _Layout(checks, device)
    # Summed in the terms' dtype (float32 unless a parameter is float64): its rounding over a step's terms is
    # ~1e-7 of their magnitude, three orders below CHECK_TOL.
    wide = torch.cat(parts)
    n = len(checks)
    sums = reductions.segment_sums(wide, layout.segments)
    mags = reductions.segment_sums(wide[: layout.n_calls].abs(), layout.call_segments)
    return ~((sums[:n] - sums[n:]).abs() > layout.tol.to(wide.dtype) * mags)


def host_verdicts(
    norms: dict[str, torch.Tensor | None], reasons: dict[str, str | None],
) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None]]:  # fmt: skip
    """`PerExampleNorms.device_norms`' result with a failed check's rows turned into None (OUTSIDE): one transfer per device.

    Example::

        norms, reasons = host_verdicts(*pex.device_norms())
    """
    firsts: dict[torch.device, list[str]] = {}
    for name, n in norms.items():
        if n is not None and n.shape[0]:
            firsts.setdefault(n.device, []).append(name)
    out, why = dict(norms), dict(reasons)
    for names in firsts.values():
        heads = torch.cat([norms[name][:1] for name in names]).tolist()  # type: ignore[index]
        for name, head in zip(names, heads, strict=True):
            if _marked(head):
                out[name], why[name] = None, OUTSIDE
    return out, why
