"""`conftest.python_m` / `python_script`: a command run inside the test's process answers as the real process does.

Many CLI tests run `python -m gradrunner ...` in-process (no 2-3 s start-up each); these tests hold the
harness to the real thing: the same stdout, stderr and exit status as a subprocess, `atexit` callbacks
and warnings as at a process's end, and the test's process left as it was.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_env, gradrunner, gradrunner_in_process, python_script

SCRIPT = '''
import atexit, sys, warnings
atexit.register(print, "at exit, last")
atexit.register(lambda: print("unregistered", file=sys.stderr))
atexit.unregister(print)
atexit.register(print, "at exit")
print("argv", sys.argv[1:], "path0", sys.path[0].endswith("scripts"))
warnings.warn("a user warning")
warnings.warn("a deprecation", DeprecationWarning)  # shown: Python shows those of __main__
sys.exit(int(sys.argv[1]))
'''


def test_a_script_prints_warns_and_exits_as_in_its_own_process(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "s.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    real = subprocess.run([sys.executable, str(script), "3"], cwd=tmp_path, env=cli_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    inside = python_script(tmp_path, script, "3")
    assert inside.returncode == real.returncode == 3
    assert inside.stdout == real.stdout == "argv ['3'] path0 True\nat exit\n"
    assert inside.stderr == real.stderr
    assert "UserWarning: a user warning" in real.stderr and "DeprecationWarning: a deprecation" in real.stderr
    assert "unregistered" in real.stderr


def test_an_uncaught_exception_is_a_traceback_and_status_1(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('boom')\n")
    inside = python_script(tmp_path, script)
    assert inside.returncode == 1 and inside.stderr.startswith("Traceback") and "ValueError: boom" in inside.stderr


@pytest.mark.parametrize("args", [("--help",), ("+experiment=mlp", "steps=2", "device=tpu"),
                                  ("+experiment=mlp", "capture.stratgy=hook")], ids=["help", "bad-value", "typo"])
def test_the_app_answers_as_the_real_cli(tmp_path: Path, args: tuple[str, ...]) -> None:
    (tmp_path / "real").mkdir()
    real = gradrunner(tmp_path / "real", *args, warm=False)
    inside = gradrunner_in_process(tmp_path, *args)
    assert (inside.returncode, inside.stdout, inside.stderr) == (real.returncode, real.stdout, real.stderr)


def process_state() -> tuple[object, ...]:
    """What a command run in-process must leave as it found it."""
    return (os.getcwd(), dict(os.environ), sys.argv[:], sys.path[:], torch.get_num_threads(),
            signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), logging.getLogger().handlers[:],
            logging.getLogger("gradrunner").level)  # fmt: skip


def test_a_run_leaves_the_test_process_as_it_was(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ours, found = logging.getLogger("gradrunner"), logging.getLogger("gradrunner").level
    ours.setLevel(logging.ERROR)  # as another test may leave it: the run still logs as a fresh process does
    try:
        before, rng = process_state(), torch.get_rng_state()
        result = gradrunner_in_process(tmp_path, "-m", "+experiment=cosine", "steps=1", "seed=0,1", "hydra.sweep.dir=s")
        after = process_state()
    finally:
        ours.setLevel(found)
    assert result.returncode == 0, result.stderr
    assert re.search(r"sweep .*/s: 2 completed, 0 failed, 0 missing; manifest: s/manifest\.json", result.stdout)
    assert "[gradrunner.run.loop][INFO] - step 0 (1/1, 100%)" in result.stdout
    assert (tmp_path / "s" / "manifest.json").is_file() and (tmp_path / "s" / "0" / "gradrunner.log").stat().st_size
    assert after == before and torch.equal(torch.get_rng_state(), rng)
    logging.getLogger("gradrunner.test").error("still captured by pytest")
    assert "still captured by pytest" in caplog.text
