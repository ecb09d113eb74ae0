"""Building the C statistics kernel: on first use only, once under a lock, a temp dir where the cache is read-only."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradrunner.capturing import fused_stats

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")

# A compiler wrapper that logs every compile (not `--version`) and, when GATE is set, waits for that
# file to exist before compiling: the test decides when the first build may finish.
_WRAPPER = """#!/bin/sh
case " $* " in *" -o "*) echo "$$" >> "{log}"; if [ -n "{gate}" ]; then while [ ! -e "{gate}" ]; do sleep 0.05; done; fi ;; esac
exec "{cc}" "$@"
"""

_CHILD = """
import torch
from gradrunner.capturing import fused_stats
out = torch.empty(7, dtype=torch.float64)
ok = fused_stats.reduce_into(torch.tensor([3.0, -4.0, 0.0] * 3000), out)
print(ok, out.tolist())
"""


def _wrapper(tmp_path: Path, gate: Path | None) -> tuple[Path, Path]:
    log = tmp_path / "compiles.log"
    cc = shutil.which(os.environ.get("CC", "cc"))
    assert cc is not None
    script = tmp_path / "cc-wrapper"
    script.write_text(_WRAPPER.format(log=log, gate=gate or "", cc=cc))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def _blocked_flocks() -> int:
    """Processes waiting for a flock right now, from the kernel's own table (Linux)."""
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and "FLOCK" in line)


@pytest.mark.slow  # two fresh interpreters importing torch: several seconds
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks to see a waiting process")
def test_two_processes_building_at_once_compile_once(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    cc, log = _wrapper(tmp_path, gate)
    env = {**os.environ, "CC": str(cc), "GRADRUNNER_CACHE": str(tmp_path / "cache"), "GRADRUNNER_FUSED": "1",
           "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}  # fmt: skip
    before = _blocked_flocks()
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    try:
        # Let the first build finish only once the other process waits on the lock, or has started
        # a compile of its own (which the lock exists to prevent): no timing decides the outcome.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            compiles = len(log.read_text().splitlines()) if log.exists() else 0
            if compiles >= 2 or (compiles == 1 and _blocked_flocks() > before):
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        gate.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.split(" ", 1)[0] == "True", (out, err[-2000:])
        assert eval(out.split(" ", 1)[1]) == [-3000.0, 75000.0, -4.0, 3.0, 6000.0, 0.0, 0.0]  # 3000 x (3, -4, 0)
    assert len(log.read_text().splitlines()) == 1
    assert len(list((tmp_path / "cache").glob("fused_stats-*.so"))) == 1


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_stats, "_cpu_tried", False)
    monkeypatch.setattr(fused_stats, "_cpu_kernels", None)
    monkeypatch.setattr(fused_stats, "_cpu_hist", {})
    monkeypatch.setenv("GRADRUNNER_FUSED", "1")


def test_unwritable_cache_builds_in_the_temp_dir_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fresh(monkeypatch)
    blocker = tmp_path / "home-cache"
    blocker.write_text("a file where the cache folder should be: nothing can be created under it")
    monkeypatch.setenv("GRADRUNNER_CACHE", str(blocker / "gradrunner"))
    monkeypatch.setattr(fused_stats.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    cc, log = _wrapper(tmp_path, None)
    monkeypatch.setenv("CC", str(cc))
    out = torch.empty(7, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger=fused_stats.__name__):
        assert fused_stats.reduce_into(torch.tensor([1.0, -2.0, 0.0]), out)
    assert out.tolist() == [-1.0, 5.0, -2.0, 1.0, 2.0, 0.0, 0.0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(blocker / "gradrunner") in warnings[0].getMessage()
    assert len(list((tmp_path / "tmp").glob("gradrunner-*/fused_stats-*.so"))) == 1
    assert len(log.read_text().splitlines()) == 1


def test_a_read_only_cache_folder_also_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock file cannot be created in a read-only folder (as another user sees a shared cache)."""
    _fresh(monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    real_open = os.open

    def read_only(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if Path(path).parent == cache and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(fused_stats.os, "open", read_only)
    monkeypatch.setenv("GRADRUNNER_CACHE", str(cache))
    monkeypatch.setattr(fused_stats.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert fused_stats.cpu_available()
    assert list(cache.iterdir()) == []
    assert len(list((tmp_path / "tmp").glob("gradrunner-*/fused_stats-*.so"))) == 1


@pytest.mark.slow  # a fresh interpreter importing torch
def test_nothing_is_built_at_import(tmp_path: Path) -> None:
    cc, log = _wrapper(tmp_path, None)
    env = {**os.environ, "CC": str(cc), "GRADRUNNER_CACHE": str(tmp_path / "cache"), "GRADRUNNER_FUSED": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    code = "import gradrunner.capturing.stats, gradrunner.capturing.fused_stats, gradrunner.capturing.session"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not log.exists() and not (tmp_path / "cache").exists()


def test_self_check_covers_two_blocks_and_a_tail() -> None:
    sizes = fused_stats._CHECK_SIZES
    assert max(sizes) > 2 * fused_stats.BLOCK and max(sizes) % fused_stats.BLOCK % 8 != 0
    assert {fused_stats.BLOCK - 1, fused_stats.BLOCK, fused_stats.BLOCK + 1} <= set(sizes)


def test_a_wrong_kernel_fails_the_self_check() -> None:
    """The check reads the whole vector: a kernel that drops the second block is caught."""
    real = fused_stats.cpu_kernels().get(torch.float32)
    if real is None:
        pytest.skip("no kernel built")

    def first_block_only(ptr: int, n: int, out: int) -> None:
        real(ptr, min(n, fused_stats.BLOCK), out)

    with pytest.raises(RuntimeError, match="self-check failed"):
        fused_stats._self_check({torch.float32: first_block_only}, {})
