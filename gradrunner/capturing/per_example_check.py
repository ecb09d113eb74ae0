"""The per-step check behind per-example norms: a parameter's gradient is the sum of its calls' shares.

A parameter's rows are its calls' shares only if nothing else adds to its gradient (a functional use
such as `x @ lin.weight`, a weight penalty in the loss). Every step, each call's shares are projected
on a fixed random rank-one matrix u v^T (`per_example_math.projection`: matrix-vector products over
the factors, nothing of the parameter's size per row), and so is every gradient that reaches the
parameter (a tensor hook: u^T g v, one read of the gradient). The two sums must agree to rounding,
measured against the magnitude of the terms: `CHECK_TOL`, or `CHECK_TOL_LOW` where a gradient or a
call was bfloat16/float16 (autograd rounds its weight gradient there; the shares are float32).

The verdicts of every checked parameter are computed on the device in a fixed number of ops
(`verdicts`): no host synchronisation. A parameter whose check fails has every row set to `FAILED`
(a norm is never negative), so the verdict travels with the norms in the step's one transfer and the
host turns those rows into None (`failed`).

Example::

    check = Projection(param, seed=0)
    check.add_call(form)                # in backward, for each call's share
    check.add_grad(grad)                # the parameter's own gradient (a tensor hook)
    ok = verdicts([check])              # (1,) bool on the parameter's device
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gradrunner.capturing.per_example_math import Dense, Form, projection

#: |g's projection - the calls' projections| above this fraction of the projections' magnitudes: not all of it is theirs.
CHECK_TOL = 1e-4
#: The same where a gradient is bfloat16/float16 (autograd rounds its weight gradient there; ours is float32).
CHECK_TOL_LOW = 3e-2
#: Every row of a parameter whose check failed (on the device, before the transfer): never a norm.
FAILED = -1.0
_LOW = (torch.bfloat16, torch.float16)
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
    """One parameter's check for the step: its calls' projections and magnitudes, its gradients' projections.

    `u` spans the parameter's first dimension, `v` the rest; drawn once from their own generator (the
    global RNG is not touched), in float64 for a float64 parameter, else float32.
    """

    def __init__(self, param: nn.Parameter, seed: int) -> None:
        gen = torch.Generator(device=param.device).manual_seed(0x9E37 + seed)
        dt = torch.float64 if param.dtype == torch.float64 else torch.float32
        self.u = torch.randn(param.shape[0] if param.dim() else 1, generator=gen, device=param.device, dtype=dt)
        self.v = torch.randn(max(1, param.numel() // max(1, self.u.numel())), generator=gen, device=param.device, dtype=dt)
        self._uv: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {dt: (self.u, self.v)}
        self.calls: list[torch.Tensor] = []
        self.mags: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.low_precision = False

    def reset(self) -> None:
        self.calls, self.mags, self.grads, self.low_precision = [], [], [], False

    def projector(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """u and v in `dtype` (converted once)."""
        uv = self._uv.get(dtype)
        if uv is None:
            uv = self._uv[dtype] = (self.u.to(dtype), self.v.to(dtype))
        return uv

    def add_call(self, form: Form, low_precision: bool) -> None:
        """One call's shares: their projection's sum and its terms' magnitude (device scalars)."""
        dtype = form.rows.dtype if isinstance(form, Dense) else form.right.dtype
        proj, mag = projection(form, *self.projector(dtype))
        self.calls.append(proj)
        self.mags.append(mag)
        self.low_precision |= low_precision

    def add_grad(self, grad: torch.Tensor) -> None:
        """A gradient reaching the parameter: u^T g v (two matrix-vector products: one read, no temporary of its size)."""
        u, v = self.u, self.v
        if grad.is_sparse:
            g = grad.coalesce()
            proj = torch.dot(u[g.indices()[0]], g.values().reshape(g.values().shape[0], -1).to(u.dtype) @ v)
        else:
            flat = grad.reshape(u.numel(), -1)
            proj = torch.dot(u, (flat if flat.dtype == u.dtype else flat.to(u.dtype)) @ v)
        self.grads.append(proj)
        self.low_precision |= grad.dtype in _LOW


class _Layout:
    """Where each check's parts go in one stacked vector (segments 3j, 3j+1, 3j+2), built once per shape of step."""

    def __init__(self, checks: Sequence[Projection], device: torch.device) -> None:
        counts = [(len(c.calls), len(c.mags), len(c.grads)) for c in checks]
        seg = np.repeat(np.arange(3 * len(checks)), np.asarray(counts, dtype=np.int64).reshape(-1))
        self.ids = torch.from_numpy(seg).to(device)
        tols = [CHECK_TOL_LOW if c.low_precision else CHECK_TOL for c in checks]
        self.tol = torch.tensor(tols, dtype=torch.float64).to(device)


_LAYOUTS: dict[tuple[object, ...], _Layout] = {}


def verdicts(checks: Sequence[Projection]) -> torch.Tensor:
    """Whether each check passed: (len(checks),) bool on their device (one device), no host sync.

    Every check must have at least one call and one gradient. A NaN or Inf in the sums passes (the
    gradient is not finite: its norms say so themselves). A fixed number of ops for all checks.
    """
    device = checks[0].u.device
    key = (device, tuple((len(c.calls), len(c.mags), len(c.grads), c.low_precision) for c in checks))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()  # shapes change from step to step (a parameter skipped): keep a few
        layout = _LAYOUTS[key] = _Layout(checks, device)
    parts = [p for c in checks for p in (*c.calls, *c.mags, *c.grads)]
    if len({p.dtype for p in parts}) == 1:
        wide = torch.stack(parts).to(torch.float64)
    else:  # a model with parameters of several dtypes on one device
        wide = torch.stack([p.to(torch.float64) for p in parts])
    sums = torch.zeros(3 * len(checks), dtype=torch.float64, device=device).index_add_(0, layout.ids, wide).view(-1, 3)
    return ~((sums[:, 0] - sums[:, 2]).abs() > layout.tol * sums[:, 1])


def host_verdicts(
    norms: dict[str, torch.Tensor | None], reasons: dict[str, str | None],
) -> tuple[dict[str, torch.Tensor | None], dict[str, str | None]]:  # fmt: skip
    """`PerExampleNorms.device_norms`' result with a failed check's rows turned into None (OUTSIDE): one transfer per device.

    Example::

        norms, reasons = host_verdicts(*pex.device_norms())
    """
    firsts: dict[torch.device, list[str]] = {}
    for name, n in norms.items():
        if n is not None and len(n):
            firsts.setdefault(n.device, []).append(name)
    out, why = dict(norms), dict(reasons)
    for names in firsts.values():
        heads = torch.cat([norms[name][:1] for name in names]).tolist()  # type: ignore[index]
        for name, head in zip(names, heads, strict=True):
            if _marked(head):
                out[name], why[name] = None, OUTSIDE
    return out, why
