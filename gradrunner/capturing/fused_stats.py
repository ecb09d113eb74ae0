"""One-pass gradient statistics: a small C kernel on CPU, a Triton kernel on CUDA.

`reduce_into(flat, out)` writes `[sum, sum of squares, min, max, non-zero, NaN, Inf]` of a flat
gradient into the float64 tensor `out` (7 elements, the gradient's device) in one read of the
gradient, accumulating in float64 without a float64 copy, and returns True; it returns False where
no fused kernel is available (the caller then takes the torch path in `stats`).

Example::

    out = torch.empty(7, dtype=torch.float64)
    if reduce_into(torch.randn(1000), out):
        s, ss, mn, mx, nonzero, nan, inf = out.tolist()

CPU: `csrc/fused_stats.c` is compiled on first use with the system C compiler (`$CC`, else `cc`)
into `~/.cache/gradrunner/` (`$GRADRUNNER_CACHE` overrides), keyed by the source, the compiler
and the processor, and loaded through ctypes: no Python or torch headers, about a second to build
once. No compiler, a failed build or a kernel that fails its self-check leaves one log line and
the torch path. `GRADRUNNER_FUSED=0` turns the fused kernels off.
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
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "fused_stats.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-strict-aliasing", "-fPIC", "-shared"]
_CPU_NAMES = {
    torch.float64: "gr_stats_f64",
    torch.float32: "gr_stats_f32",
    torch.float16: "gr_stats_f16",
    torch.bfloat16: "gr_stats_bf16",
}

_cpu_kernels: dict[torch.dtype, Callable[[int, int, int], None]] | None = None
_cpu_tried = False


def enabled() -> bool:
    """False when `GRADRUNNER_FUSED=0`: every gradient then takes the torch path."""
    return os.environ.get("GRADRUNNER_FUSED", "1") != "0"


def cache_dir() -> Path:
    """Where built kernels are kept: `$GRADRUNNER_CACHE`, else `~/.cache/gradrunner`."""
    return Path(os.environ.get("GRADRUNNER_CACHE") or Path.home() / ".cache" / "gradrunner")


def _cpu_id() -> str:
    """The processor's model and flags: `-march=native` code is only reused on the same kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _build(cc: str) -> Path:
    source = _SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu_id().encode()]))
    target = cache_dir() / f"fused_stats-{key.hexdigest()[:16]}{'.dll' if sys.platform == 'win32' else '.so'}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: concurrent jobs (a multirun) never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".fused_stats-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _self_check(kernels: dict[torch.dtype, Callable[[int, int, int], None]]) -> None:
    """The built kernel against torch on a few values with a zero, -0.0, a NaN and an Inf."""
    out = torch.empty(7, dtype=torch.float64)
    for dtype, fn in kernels.items():
        for vals, want in (
            ([1.5, -2.0, 0.0, -0.0, 4.0], [3.5, 22.25, -2.0, 4.0, 3, 0, 0]),
            ([1.0, float("nan"), float("inf"), -float("inf")], [None, None, None, None, 4, 1, 2]),
        ):
            t = torch.tensor(vals, dtype=dtype)
            fn(t.data_ptr(), t.numel(), out.data_ptr())
            got = out.tolist()
            for g, w in zip(got, want, strict=True):
                if w is not None and g != w:
                    raise RuntimeError(f"self-check failed for {dtype}: {got} != {want}")
            if want[0] is None and not (got[2] != got[2] and got[3] != got[3]):
                raise RuntimeError(f"self-check failed for {dtype}: NaN did not reach min/max: {got}")


def _load_cpu() -> dict[torch.dtype, Callable[[int, int, int], None]] | None:
    global _cpu_kernels, _cpu_tried
    if _cpu_tried:
        return _cpu_kernels
    _cpu_tried = True
    try:
        # PyDLL keeps the GIL during a call: hooks of a model spread over devices may run on several
        # autograd threads, and the collector's row buffer must not grow under a running kernel.
        lib = ctypes.PyDLL(str(_build(os.environ.get("CC", "cc"))))
        kernels: dict[torch.dtype, Callable[[int, int, int], None]] = {}
        for dtype, name in _CPU_NAMES.items():
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            fn.restype = None
            kernels[dtype] = fn
        _self_check(kernels)
        _cpu_kernels = kernels
    except Exception as exc:
        log.info("gradrunner: fused CPU statistics unavailable (%s); using the torch path", exc)
    return _cpu_kernels


def cpu_available() -> bool:
    """Whether the fused CPU kernel is built and loaded (builds it on the first call).

    Example::

        cpu_available()  # True where a C compiler worked, False otherwise (one log line)
    """
    return enabled() and _load_cpu() is not None


def cpu_kernels() -> dict[torch.dtype, Callable[[int, int, int], None]]:
    """The CPU kernels by gradient dtype, `fn(data pointer, numel, pointer to 7 float64)`; empty if unavailable.

    Example::

        fn = cpu_kernels().get(torch.float32)   # a ctypes function, or None
    """
    if not enabled():
        return {}
    return _load_cpu() or {}


def reduce_into(flat: torch.Tensor, out: torch.Tensor) -> bool:
    """The seven reductions of contiguous 1-D `flat` into float64 `out` (7,), or False if no kernel fits.

    Example::

        out = torch.empty(7, dtype=torch.float64)
        reduce_into(torch.ones(3), out)  # out -> [3, 3, 1, 1, 3, 0, 0] where a kernel is built
    """
    if not enabled():
        return False
    if flat.device.type == "cpu":
        kernels = _cpu_kernels if _cpu_tried else _load_cpu()
        fn = None if kernels is None else kernels.get(flat.dtype)
        if fn is None or not flat.is_contiguous():
            return False
        fn(flat.data_ptr(), flat.numel(), out.data_ptr())
        return True
    if flat.device.type == "cuda":
        from gradrunner.capturing import fused_triton

        return fused_triton.reduce_into(flat, out)
    return False
