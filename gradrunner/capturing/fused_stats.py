"""One-pass gradient statistics: a small C kernel on CPU, a Triton kernel on CUDA.

`reduce_into(flat, out)` writes `[sum, sum of squares, min, max, non-zero, NaN, Inf]` of a flat
gradient into the float64 tensor `out` (7 elements, the gradient's device) in one read of the
gradient, accumulating in float64 without a float64 copy, and returns True; it returns False where
no fused kernel is available (the caller then takes the torch path in `stats`).
`cpu_hist_kernels()` give the same seven plus the |g| histogram counts of `extras.histogram_counts`
in the same read.

Example::

    out = torch.empty(7, dtype=torch.float64)
    if reduce_into(torch.randn(1000), out):
        s, ss, mn, mx, nonzero, nan, inf = out.tolist()

CPU: `csrc/fused_stats.c` is compiled on first use (never at import) with the system C compiler
(`$CC`, else `cc`) into `~/.cache/gradrunner/` (`$GRADRUNNER_CACHE` overrides), keyed by the
source, the compiler and the processor, and loaded through ctypes: no Python or torch headers,
about a second to build once. The build holds an exclusive `fcntl` lock on a file beside the
library, so processes starting together (a sweep) build it once and the others load that build.
Where the cache cannot be written, the build goes to a per-user folder under the system's temp
dir, with a WARNING. The loaded kernel is checked against numpy float64 on sizes across its
4,096-element blocks and SIMD tails, for every dtype, with NaN and Inf. No compiler, a failed build
or a failed check leaves one WARNING and the torch path. `GRADRUNNER_FUSED=0` turns the fused
kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from gradrunner.capturing import extras
from gradrunner.records.columns import HIST_BINS

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "fused_stats.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-strict-aliasing", "-fPIC", "-shared"]
_CPU_NAMES = {
    torch.float64: "gr_stats_f64",
    torch.float32: "gr_stats_f32",
    torch.float16: "gr_stats_f16",
    torch.bfloat16: "gr_stats_bf16",
}
#: elements per float64 partial sum in the C kernel (`BLOCK` in csrc/fused_stats.c)
BLOCK = 4096

Kernel = Callable[[int, int, int], None]
#: `fn(data pointer, numel, pointer to 7 float64, pointer to HIST_BINS int64 counts (added to))`
HistKernel = Callable[[int, int, int, int], None]

_cpu_kernels: dict[torch.dtype, Kernel] | None = None
_cpu_hist: dict[torch.dtype, HistKernel] = {}
_cpu_tried = False


def enabled() -> bool:
    """False when `GRADRUNNER_FUSED=0`: every gradient then takes the torch path."""
    return os.environ.get("GRADRUNNER_FUSED", "1") != "0"


def cache_dir() -> Path:
    """Where built kernels are kept: `$GRADRUNNER_CACHE`, else `~/.cache/gradrunner`."""
    return Path(os.environ.get("GRADRUNNER_CACHE") or Path.home() / ".cache" / "gradrunner")


def _temp_cache() -> Path:
    """The fallback where `cache_dir()` is not writable: private to this user."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"gradrunner-{uid}"


def _cpu_id() -> str:
    """The processor's model and flags: `-march=native` code is only reused on the same kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created) for the block: one builder at a time, others wait."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no lock; the atomic rename still holds
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _library_name(cc: str) -> str:
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_id().encode()]))
    return f"fused_stats-{key.hexdigest()[:16]}{'.dll' if sys.platform == 'win32' else '.so'}"


def _build_in(folder: Path, name: str, cc: str) -> Path:
    """The library `name` in `folder`, compiled there under the folder's lock unless already built."""
    target = folder / name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / (name + ".lock")):
        if target.exists():  # built by another process while this one waited for the lock
            return target
        # Build under a temporary name and rename: nobody ever loads a half-written file.
        fd, tmp = tempfile.mkstemp(prefix=".fused_stats-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                [cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120
            )
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
            os.replace(tmp, target)
            log.debug("gradrunner: built %s", target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _build(cc: str) -> Path:
    name = _library_name(cc)
    try:
        return _build_in(cache_dir(), name, cc)
    except OSError as exc:  # a read-only or missing home: the temp dir instead
        fallback = _temp_cache()
        log.warning(
            "gradrunner: cannot write the kernel cache %s (%s); building the fused statistics kernel in %s",
            cache_dir(), exc, fallback,
        )  # fmt: skip
        return _build_in(fallback, name, cc)


#: sizes the self-check runs: within one SIMD vector, a block's tail, exactly one block, one block
#: and one element, and two full blocks plus a partial third with a SIMD tail
_CHECK_SIZES = (5, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + BLOCK // 2 + 3)


def _check_values(n: int, dtype: torch.dtype, special: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    g[:: max(1, n // 7)] = 0.0
    g[n // 2] = -0.0
    if special:  # NaN and Inf in the last block, where the first blocks' sums are already folded
        g[n - 2], g[n - 1], g[n // 3] = float("nan"), float("inf"), -float("inf")
    return g


def _expected(g: torch.Tensor) -> np.ndarray:
    d = g.double().numpy()
    nan, inf = int(np.isnan(d).sum()), int(np.isinf(d).sum())
    with np.errstate(invalid="ignore", over="ignore"):
        mn, mx = (np.nan, np.nan) if nan else (d.min(), d.max())
        return np.array([d.sum(), (d * d).sum(), mn, mx, np.count_nonzero(d), nan, inf])


def _self_check(kernels: dict[torch.dtype, Kernel], hist: dict[torch.dtype, HistKernel]) -> None:
    """Every built kernel against numpy float64 on `_CHECK_SIZES`, with zeros, -0.0, NaN and Inf.

    Sums within float64 rounding of the sum of magnitudes; min, max and counts exactly; the
    histogram variants' seven values equal the plain kernel's and their counts the torch ones'.
    """
    out = torch.empty(7, dtype=torch.float64)
    for dtype, fn in kernels.items():
        for n in _CHECK_SIZES:
            for special in (False, True):
                g = _check_values(n, dtype, special)
                fn(g.data_ptr(), n, out.data_ptr())
                got, want = out.numpy().copy(), _expected(g)
                if not _agrees(got, want, g, special):
                    raise RuntimeError(f"self-check failed for {dtype}, {n} elements: {got.tolist()} != {want.tolist()}")
                if dtype in hist:
                    counts = torch.zeros(HIST_BINS, dtype=torch.int64)
                    again = torch.empty(7, dtype=torch.float64)
                    hist[dtype](g.data_ptr(), n, again.data_ptr(), counts.data_ptr())
                    if not (torch.equal(again.nan_to_num(), out.nan_to_num()) and torch.equal(counts, extras.histogram_counts(g))):
                        raise RuntimeError(f"self-check failed for the histogram kernel, {dtype}, {n} elements")


def _agrees(got: np.ndarray, want: np.ndarray, g: torch.Tensor, special: bool) -> bool:
    """Sums within float64 rounding of the sum of magnitudes (both non-finite with NaN/Inf), the rest exact."""
    d = g.double().numpy()
    scale = float(np.abs(d[np.isfinite(d)]).sum()) + 1.0
    if special:
        sums = not np.isfinite(got[:2]).any()
    else:
        sums = abs(got[0] - want[0]) <= 1e-13 * scale and abs(got[1] - want[1]) <= 1e-13 * scale * scale
    # with a NaN, min and max are NaN in both
    return bool(sums and np.array_equal(got[2:], want[2:], equal_nan=True))


def _bind_hist(fn: ctypes._CFuncPtr) -> HistKernel:  # type: ignore[name-defined]
    cell, upper, fold = extras.hist_tables()
    tables = (cell.data_ptr(), upper.data_ptr(), fold.data_ptr(), upper.numel())

    def run(ptr: int, n: int, out: int, counts: int) -> None:
        fn(ptr, n, out, counts, *tables)

    run.tables = (cell, upper, fold)  # type: ignore[attr-defined]  # keeps the tables alive
    return run


def _load_cpu() -> dict[torch.dtype, Kernel] | None:
    global _cpu_kernels, _cpu_hist, _cpu_tried
    if _cpu_tried:
        return _cpu_kernels
    _cpu_tried = True
    try:
        # PyDLL keeps the GIL during a call: hooks of a model spread over devices may run on several
        # autograd threads, and the collector's row buffer must not grow under a running kernel.
        lib = ctypes.PyDLL(str(_build(os.environ.get("CC", "cc"))))
        kernels: dict[torch.dtype, Kernel] = {}
        hist: dict[torch.dtype, HistKernel] = {}
        for dtype, name in _CPU_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            fn.restype = None
            kernels[dtype] = fn
            fh = getattr(lib, name + "_hist")
            fh.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]  # fmt: skip
            fh.restype = None
            hist[dtype] = _bind_hist(fh)
        _self_check(kernels, hist)
        _cpu_kernels, _cpu_hist = kernels, hist
    except Exception as exc:
        log.warning("gradrunner: fused CPU statistics unavailable (%s); using the torch path", exc)
    return _cpu_kernels


def cpu_hist_kernels() -> dict[torch.dtype, HistKernel]:
    """The CPU kernels that also count the |g| histogram, by dtype; empty if unavailable.

    Example::

        fn = cpu_hist_kernels().get(torch.float32)
        counts = torch.zeros(HIST_BINS, dtype=torch.int64)   # added to, as extras.histogram_counts bins
        fn(g.data_ptr(), g.numel(), out.data_ptr(), counts.data_ptr())
    """
    if not enabled() or _load_cpu() is None:
        return {}
    return _cpu_hist


def cpu_available() -> bool:
    """Whether the fused CPU kernel is built and loaded (builds it on the first call).

    Example::

        cpu_available()  # True where a C compiler worked, False otherwise (one log line)
    """
    return enabled() and _load_cpu() is not None


def cpu_kernels() -> dict[torch.dtype, Kernel]:
    """The CPU kernels by gradient dtype, `fn(data pointer, numel, pointer to 7 float64)`; empty if unavailable.

    Example::

        fn = cpu_kernels().get(torch.float32)   # a ctypes function, or None
    """
    if not enabled():
        return {}
    return _load_cpu() or {}


def readable(t: torch.Tensor) -> bool:
    """Whether a fused kernel may be given `t`: a plain, dense, contiguous tensor (the one rule for every caller).

    Example::

        readable(torch.ones(3))          # True
        readable(dtensor_grad)           # False: a subclass (DTensor, an AsyncCollectiveTensor) may hold no storage

    The kernels read `t.data_ptr()`: a tensor subclass (a `DTensor`, a local piece still waiting for its
    collective, a functorch wrapper) may have no storage of its own there, a sparse or strided one not
    its elements in order. Anything else takes torch's ops, which know what they are given.
    """
    return type(t) is torch.Tensor and t.layout == torch.strided and t.is_contiguous()


def histogram_counts(grad: torch.Tensor) -> torch.Tensor:
    """`extras.histogram_counts` of `grad` (HIST_BINS int64 counts on its device), by the Triton kernel for a CUDA
    gradient where it applies (one launch, no host synchronisation), else by extras' torch ops
    (`GRADRUNNER_FUSED=0`, no Triton, another dtype, not CUDA).

    Example::

        histogram_counts(torch.tensor([0.0, 2e-3, float("inf")]))[0]   # 1: the exact zero
    """
    flat = grad.detach().reshape(-1)
    if flat.is_cuda and enabled() and readable(flat):
        from gradrunner.capturing import fused_triton

        counts = fused_triton.histogram(flat)
        if counts is not None:
            return counts
    return extras.histogram_counts(flat)


def reduce_into(flat: torch.Tensor, out: torch.Tensor) -> bool:
    """The seven reductions of contiguous 1-D `flat` into float64 `out` (7,), or False if no kernel fits.

    Example::

        out = torch.empty(7, dtype=torch.float64)
        reduce_into(torch.ones(3), out)  # out -> [3, 3, 1, 1, 3, 0, 0] where a kernel is built

    False too for what no kernel may be given (`readable`: a subclass, sparse, not contiguous).
    """
    if not enabled() or not readable(flat):
        return False
    if flat.device.type == "cpu":
        kernels = _cpu_kernels if _cpu_tried else _load_cpu()
        fn = None if kernels is None else kernels.get(flat.dtype)
        if fn is None:
            return False
        fn(flat.data_ptr(), flat.numel(), out.data_ptr())
        return True
    if flat.device.type == "cuda":
        from gradrunner.capturing import fused_triton

        return fused_triton.reduce_into(flat, out)
    return False
