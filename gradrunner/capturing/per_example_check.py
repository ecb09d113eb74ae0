"""The per-step check behind per-example norms: a parameter's gradient is the sum of its calls' shares.

A parameter's rows are its calls' shares only if nothing else adds to its gradient (a functional use
such as `x @ lin.weight`, a weight penalty in the loss). Every step, each call's shares are projected
on a fixed random rank-one matrix u v^T (`per_example_math.projection`: matrix-vector products over
the factors, nothing of the parameter's size per row), and so is every gradient that reaches the
parameter (a tensor hook: u^T g v, one read of the gradient). The two sums must agree to rounding:
`CHECK_TOL` times the magnitude of the terms (one per row and position: the sum of their |.|), the
float32 sums' rounding on either side. Where a gradient or a call was bfloat16/float16 (unit roundoff
u_r: 2^-8, 2^-11), the shares are float32 sums of the same low-precision factors autograd multiplied,
and its gradient differs from them by its own roundings: a matmul's weight gradient (Linear, Conv1D,
conv: a GEMM summing in float32) by one rounding of each element, |u^T E v| <= u_r |u|^T |g| |v|
(read with the gradient; `LOW_ROUNDINGS` of them); a reduction's (bias, norm weight, embedding) may be
summed in the low dtype, by errors bounded by its terms' magnitudes (`REDUCTION_SIGMAS`). The terms'
projected magnitude is no bound there: it may be far larger than the gradient (rows that cancel: a
weight penalty of a fifth of a Linear's gradient passed a bound of 3e-2 of it) or smaller (each term's
projection cancels within itself: a pure use failed it). A 1-D parameter (a bias, a norm's weight) in
such a step is also compared element by element (`ELEMENT_ROUNDINGS`): a single projection may miss
a penalty there (LayerNorm weights near 1, u nearly orthogonal to them), and its few elements cost
little. The price is the low-precision reductions' noise: on CPU their gradient may miss its exact sum
by several percent, and a use outside the calls smaller than that is not seen.

A call's terms are kept as they are (a few per row) or, past `FOLD_ABOVE` (a convolution's rows
and positions), folded when they arrive into two numbers with the same sum and the same sum of |.|.
The verdicts of every checked parameter are then computed on the device in a fixed number of ops
over all of them (`verdicts`: one concatenation, two segment sums): no host synchronisation. A
parameter whose check fails has every row set to `FAILED`
(a norm is never negative), so the verdict travels with the norms in the step's one transfer and the
host turns those rows into None (`failed`).

Example::

    check = Projection(param, seed=0)
    check.add_call(form, None)          # in backward, for each call's share (None: not low precision)
    check.add_grad(grad)                # the parameter's own gradient (a tensor hook)
    ok = verdicts([check])              # (1,) bool on the parameter's device
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from gradrunner.capturing import reductions
from gradrunner.capturing.per_example_math import Dense, Factors, Form, Lazy, projection

if TYPE_CHECKING:
    from gradrunner.records.columns import StepRecords, TapKey

#: |g's projection - the calls' projections| above this fraction of the projections' magnitudes: not all of it is theirs.
CHECK_TOL = 1e-4
#: Where a gradient or a call is bfloat16/float16, this many of its unit roundoffs of |u|^T |g| |v| are added to the
#: tolerance: autograd's one rounding of each element of its weight gradient, and as much again for the partial sums
#: a low-precision matmul may round (cuBLAS's split-K reductions in bf16, allowed by default).
LOW_ROUNDINGS = 2.0
#: ... or, where smaller, this many times sqrt((u^2)^T (g^2) (v^2)): the spread of u^T E v for roundings E of independent
#: signs, which the worst case |u|^T |g| |v| exceeds about sqrt(numel) times (a 256x64 bf16 weight under autocast:
#: a penalty 9x the data's gradient passed the worst case; found 2026-11-27).
MATMUL_SIGMAS = 16.0
#: A low-precision call of a reduction (a bias, a norm's weight, an embedding) adds this many unit roundoffs of |M|_F,
#: M_k the sum of |terms| of element k: autograd may sum these in the low dtype (CPU's bf16/fp16 LayerNorm backward:
#: errors |E_k| up to 4 u_r M_k), and u^T E v has std |E|_F over the draw of u and v. Not derived but measured: over
#: 6,000 parameter-steps of small bf16/fp16 models on CPU the largest error was 10 u_r |M|_F (fp16 LayerNorm weight).
REDUCTION_SIGMAS = 32.0
#: A 1-D parameter (a bias, a norm's weight) in a low-precision step is also checked element by element (a projection
#: may happen to miss a penalty: LayerNorm weights near 1), to this many unit roundoffs of M_k: over 6,000 parameter-
#: steps of small bf16/fp16 models on CPU the largest error was 8 u_r M_k (fp16 LayerNorm weight).
ELEMENT_ROUNDINGS = 32.0
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


#: Why a parameter's per-example norms are null where a row is not finite but the gradient is: a share's squares
#: passed float32's range (a per-example norm above about 1.8e19, in a diverging run), not a true inf.
OVERFLOW = ("a row's squared norm overflowed float32 (a per-example norm above about 1.8e19) while the gradient's own "
            "norm is finite")  # fmt: skip


def null_reason(rows: np.ndarray | None, grad_norm: float) -> str | None:
    """Why these transferred per-example norms are no norms, or None: a failed check's mark (`OUTSIDE`), or a row
    that is not finite although the parameter's gradient norm is (`OVERFLOW`: a finite sum of finite shares)."""
    if rows is None or len(rows) == 0:
        return None
    if failed(rows):
        return OUTSIDE
    return OVERFLOW if np.isfinite(grad_norm) and not np.isfinite(rows).all() else None


def settle_rows(recs: StepRecords, params: Collection[TapKey], reasons: Mapping[str, str | None], warned: set[str]) -> None:
    """Parameter taps' (`params`) rows after the transfer: a failed check's or overflowed become None; each left None
    named once per session (`warned`, the taps named so far), with why (`reasons`: by tap, from the step), in a warning.
    `reason` stays null (the contract: it says why `has_grad` is false, and the gradient itself is there)."""
    assert recs.per_example_norm is not None and recs.reason is not None
    reasons = dict(reasons)
    for i, key in enumerate(recs.keys):
        if key not in params:
            continue
        why = null_reason(recs.per_example_norm[i], float(recs.stats["norm"][i]))
        if why:
            recs.per_example_norm[i], reasons[key.tap] = None, why
        if recs.per_example_norm[i] is not None or not recs.has_grad[i]:
            continue
        why = reasons.get(key.tap) or "no per-example shares were computed"
        if key.tap not in warned:
            warned.add(key.tap)
            warnings.warn(f"per_example_norm of parameter tap {key.tap} is null: {why}", PerExampleWarning, stacklevel=2)


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
    global RNG is not touched), in float64 for a float64 parameter, else float32. They follow the parameter
    where it moves or changes dtype (`model.double()`, `.to(device)`: `_follow`).
    """

    def __init__(self, param: nn.Parameter, seed: int) -> None:
        self._param = param
        gen = torch.Generator(device=param.device).manual_seed(0x9E37 + seed)
        dt = torch.float64 if param.dtype == torch.float64 else torch.float32
        self.u = torch.randn(param.shape[0] if param.dim() else 1, generator=gen, device=param.device, dtype=dt)
        self.v = torch.randn(max(1, param.numel() // max(1, self.u.numel())), generator=gen, device=param.device, dtype=dt)
        self._uvw: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {dt: (self.u, self.v, None)}
        #: Each call's terms (1-D, `per_example_math.projection`), each gradient's projection (1 element) and its
        #: rounding bound (1 element: `LOW_ROUNDINGS` unit roundoffs of |u|^T |g| |v|; 0 for a float32 step).
        self.calls: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.bounds: list[torch.Tensor] = []
        #: The unit roundoff of the lowest precision a call ran in or a gradient came in this step (0: none low).
        self.unit = 0.0
        self._uv: torch.Tensor | None = None
        #: A 1-D parameter's low-precision step, element by element: (2, P) the shares' sum minus the gradients',
        #: and the tolerance; `spoiled` where a call or gradient of the step could not be added so (not low, not Dense).
        self.elements: torch.Tensor | None = None
        self._whole = param.dim() <= 1  # (u spans every element alone)
        self.spoiled = not self._whole

    def reset(self) -> None:
        self.calls, self.grads, self.bounds, self.unit = [], [], [], 0.0
        self.elements, self.spoiled = None, not self._whole

    def _follow(self) -> None:
        """u and v on the parameter's device now, in the dtype drawn for its dtype now, where it moved since
        (`model.double()`, `.to(device)`: a float32 u met a float64 gradient below float32's range as 0, and the
        check failed); the step's terms so far go with them (a move between micro-batches). Values are kept."""
        p, u = self._param, self.u
        dt = torch.float64 if p.dtype == torch.float64 else torch.float32
        if p.device == u.device and dt == u.dtype:
            return
        dev = p.device
        self.u, self.v = u.to(dev, dt), self.v.to(dev, dt)
        self._uvw, self._uv = {dt: (self.u, self.v, None)}, None
        self.calls, self.grads, self.bounds = ([t.to(dev) for t in ts] for ts in (self.calls, self.grads, self.bounds))
        self.elements = None if self.elements is None else self.elements.to(dev)

    def _add_elements(self, signed: torch.Tensor | None, tol: torch.Tensor | None) -> None:
        """Adds a call's shares (a gradient negated) and its tolerance to `elements`; None: it cannot be (`spoiled`)."""
        if signed is None or tol is None or self.spoiled:
            self.spoiled, self.elements = True, None
            return
        if self.elements is None:
            self.elements = torch.zeros(2, signed.numel(), dtype=torch.float32, device=signed.device)
        self.elements[0].add_(signed.reshape(-1))
        self.elements[1].add_(tol.reshape(-1))

    def projector(self, dtype: torch.dtype, dense: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u, v and (for a `Dense` form: the parameter is small) u v^T flattened, in `dtype`, each made once."""
        u, v, w = self._uvw.get(dtype) or (self.u.to(dtype), self.v.to(dtype), None)
        if w is None and dense:
            w = torch.outer(u, v).reshape(-1)
        self._uvw[dtype] = (u, v, w)
        return u, v, w if w is not None else u

    def add_call(self, form: Form, low: torch.dtype | None) -> None:
        """One call's shares: their projection's terms (on the device; summed with every other check's in `verdicts`).

        `low`: the bfloat16/float16 the call ran in (a low-precision input or gradient, autocast), else None."""
        self._follow()
        dtype = form.dtype if isinstance(form, Lazy) else form.rows.dtype if isinstance(form, Dense) else form.right.dtype
        terms = projection(form, *self.projector(dtype, isinstance(form, Dense)))
        if terms.numel() > FOLD_ABOVE:  # two numbers with the same sum and the same sum of |.|: P >= 0 and S - P <= 0
            positive = terms.clamp(min=0).sum()
            terms = torch.stack([positive, terms.sum() - positive])
        self.calls.append(terms)
        bound = mags = None
        if low is not None:
            self.unit = max(self.unit, _unit(low))
            if isinstance(form, Dense) or (isinstance(form, Factors) and form.index):  # a reduction, not a GEMM
                mags = _magnitudes(form)
                bound = torch.linalg.vector_norm(mags) * (REDUCTION_SIGMAS * _unit(low))
        if self._whole and low is not None and mags is not None and isinstance(form, Dense):  # a 1-D parameter
            self._add_elements(form.rows.float().sum(0), mags.float() * (CHECK_TOL + ELEMENT_ROUNDINGS * _unit(low)))
        elif self._whole:
            self._add_elements(None, None)
        self.bounds.append(terms.new_zeros(1) if bound is None else bound.reshape(1))

    def add_grad(self, grad: torch.Tensor) -> None:
        """A gradient reaching the parameter: u^T g v (two matrix-vector products: one read, no temporary of its size);
        in a low-precision step also |u|^T |g| |v| (one temporary of its size, the bound on its rounding)."""
        self._follow()
        u, v = self.u, self.v
        if grad.dtype in _LOW:
            self.unit = max(self.unit, _unit(grad.dtype))
        low = self.unit > 0
        bound = None
        if grad.is_sparse:
            g = grad.coalesce()
            rows, vals = u[g.indices()[0]], g.values().reshape(g.values().shape[0], -1).to(u.dtype)
            proj = torch.dot(rows, vals @ v)
            if low:
                bound = torch.dot(rows.abs(), vals.abs() @ v.abs())
        elif v.numel() == 1:  # a bias, a norm's weight: one dot with u v (made once)
            if self._uv is None:
                self._uv = u * v
            flat = grad.reshape(-1) if grad.dtype == u.dtype else grad.reshape(-1).to(u.dtype)
            proj = torch.dot(self._uv, flat)
            if low:
                bound = torch.dot(self._uv.abs(), flat.abs())
        else:
            flat = grad.reshape(u.numel(), -1)
            flat = flat if flat.dtype == u.dtype else flat.to(u.dtype)
            proj = torch.dot(u, torch.mv(flat, v))
            if low:
                mag = flat.abs()
                worst = torch.dot(u.abs(), torch.mv(mag, v.abs()))
                top = mag.amax().clamp_min(torch.finfo(mag.dtype).tiny)  # squares scaled to <= 1: no under/overflow
                spread = torch.dot(u.square(), torch.mv(mag.div_(top).square_(), v.square())).sqrt_()
                bound = torch.minimum(worst, spread * top * MATMUL_SIGMAS)
        self.grads.append(proj.reshape(1))
        self.bounds.append(proj.new_zeros(1) if bound is None else (bound * (LOW_ROUNDINGS * self.unit)).reshape(1))
        if self._whole:
            g32 = grad.to_dense().reshape(-1).float() if low else None
            tol = None if g32 is None else g32.abs() * (LOW_ROUNDINGS * self.unit)
            self._add_elements(None if g32 is None else -g32, tol)


def _magnitudes(form: Dense | Factors) -> torch.Tensor:
    """M_k = sum over rows and positions of |a term's element k|, in the parameter's layout (flattened)."""
    if isinstance(form, Dense):
        src = form.rows if form.terms is None else form.terms
        return src.abs().sum(tuple(range(src.dim() - 1)))
    b, _, t, size, q = form.shape  # an embedding: |g_t| added into its token's row
    out = torch.zeros(size, q, dtype=form.right.dtype, device=form.right.device)
    return out.index_add_(0, form.left.reshape(-1), form.right.reshape(b * t, q).abs()).reshape(-1)


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a float dtype: half its eps (2^-8 for bfloat16, 2^-11 for float16)."""
    return torch.finfo(dtype).eps / 2


class _Layout:
    """Which check each element of the step's stacked terms belongs to, built once per shape of step.

    The stack holds every check's call terms, then every check's gradient projections, then every check's
    rounding bounds: segments j (check j's calls), n + j (its gradients) and 2n + j (its bounds); the
    magnitudes sum |terms| over the first part. `element_segments`: one per check over the elements of those
    compared element by element (one element for the others), None where none is.
    """

    def __init__(self, checks: Sequence[Projection], device: torch.device) -> None:
        calls = tuple(sum(t.numel() for t in c.calls) for c in checks)
        grads = tuple(sum(t.numel() for t in c.grads) for c in checks)
        bounds = tuple(len(c.bounds) for c in checks)
        # each segment's elements lie together in the stack: summed in a fixed order (the same bits every run)
        self.segments = reductions.segments(calls + grads + bounds).to(device)
        self.call_segments = reductions.segments(calls).to(device)
        self.n_calls = sum(calls)
        whole = [_elements(c) for c in checks]
        widths = tuple(1 if e is None else e.shape[1] for e in whole)
        self.element_segments = None if all(e is None for e in whole) else reductions.segments(widths).to(device)


def _elements(check: Projection) -> torch.Tensor | None:
    """A check's element-by-element sums where its step was checked so (`Projection.elements`), else None."""
    return None if check.spoiled else check.elements


_LAYOUTS: dict[tuple[object, ...], _Layout] = {}


def verdicts(checks: Sequence[Projection]) -> torch.Tensor:
    """Whether each check passed: (len(checks),) bool on their device (one device), no host sync.

    Every check must have at least one call and one gradient. A NaN or Inf in the sums passes (the
    gradient is not finite: its norms say so themselves). A fixed number of ops for all checks.
    """
    device = checks[0].u.device
    parts = [t for c in checks for t in c.calls] + [t for c in checks for t in c.grads]
    parts += [t for c in checks for t in c.bounds]
    whole = [_elements(c) for c in checks]
    key = (device, tuple(t.shape[0] for t in parts), tuple((len(c.calls), len(c.grads)) for c in checks),
           tuple(-1 if e is None else e.shape[1] for e in whole))  # fmt: skip
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
    ok = ~((sums[:n] - sums[n : 2 * n]).abs() > CHECK_TOL * mags + sums[2 * n :])
    if layout.element_segments is None:
        return ok
    zero = wide.new_zeros(1)  # a check not compared element by element: no element over
    over = torch.cat([zero if e is None else (e[0].abs() > e[1]).to(wide.dtype) for e in whole])
    return ok & ~(reductions.segment_sums(over, layout.element_segments) > 0)


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
