"""The tests' warm ranks (`tests/warm.py`, started by `conftest.torchrun_command`) behave as fresh processes would.

Each case runs a probe script through the warm client as torchrun would run a rank, and checks what its
parent sees (exit status, output, signals) and what the probe saw (its pid, cwd, argv, environment, hash seed).
A warm rank is a fork of the server, so its pid is not the client's; a real interpreter (the fallback) is
`exec`ed by the client and keeps its pid: that is how each case knows which of the two ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import conftest
import procs
import pytest
from conftest import cli_env, warm_python

pytestmark = pytest.mark.slow

PROBE = """
import json, os, sys, time
import resource
print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv, "hash": hash("gradrunner"),
                  "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
                  "probe": os.environ.get("PROBE"), "gradrunner": "gradrunner" in sys.modules,
                  "mlflow": os.environ.get("MLFLOW_ALLOW_FILE_STORE"), "rjem": os.environ.get("_RJEM_MALLOC_CONF")}),
      flush=True)
if sys.argv[1] == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(600)
if sys.argv[1] == "raise":
    raise ValueError("the probe raised")
if sys.argv[1].startswith("SIG"):
    import signal
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def client() -> Path:
    found = warm_python()
    if found is None:
        pytest.skip("no warm server on this machine (GRADRUNNER_TEST_COLD=1, or it printed why)")
    return found


def start(
    client: Path, cwd: Path, *args: str, env: dict[str, str] | None = None, fsize: int | None = None,
) -> subprocess.Popen[str]:  # fmt: skip
    """The probe through the warm client; `fsize`: a file-size limit set on the client (`preexec_fn`), as a test of a full disk does."""
    (cwd / "probe.py").write_text(PROBE)

    def limit() -> None:
        if fsize is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen([str(client), "-u", str(cwd / "probe.py"), *args], cwd=cwd, env={**cli_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=limit)  # fmt: skip


def finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, json.loads(out.splitlines()[0]), err


def test_a_warm_rank_exits_as_its_script_did_from_its_cwd_and_argv(client: Path, tmp_path: Path) -> None:
    proc = start(client, tmp_path, "3", env={"RANK": "1", "LOCAL_RANK": "1"})
    code, seen, _ = finish(proc)
    assert code == 3
    assert seen["pid"] != proc.pid  # forked warm, not exec'ed
    assert seen["cwd"] == str(tmp_path) and seen["argv"] == [str(tmp_path / "probe.py"), "3"]
    assert not seen["gradrunner"]  # the server imports no gradrunner: each rank imports its own


def test_a_file_size_limit_set_on_the_client_is_the_warm_ranks(client: Path, tmp_path: Path) -> None:
    """A full disk simulated by `RLIMIT_FSIZE` in a test's `preexec_fn` applies to the client: it passes it on."""
    proc = start(client, tmp_path, "0", fsize=123_456)
    code, seen, _ = finish(proc)
    assert code == 0 and seen["pid"] != proc.pid and seen["fsize"] == 123_456
    code, seen, _ = finish(start(client, tmp_path, "0"))
    assert code == 0 and seen["fsize"] == resource.RLIM_INFINITY  # the server's own limit is left as it was


def test_an_uncaught_exception_is_a_traceback_and_status_1(client: Path, tmp_path: Path) -> None:
    code, seen, err = finish(start(client, tmp_path, "raise"))
    assert code == 1 and "ValueError: the probe raised" in err and "Traceback" in err


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_rank_that_signals_itself_ends_the_client_by_that_signal(client: Path, tmp_path: Path, sig: str) -> None:
    """As a run that SIGKILLs itself mid-run (`data=killing`) does: the client cannot set SIGKILL's handler."""
    code, seen, err = finish(start(client, tmp_path, sig))
    assert code == -getattr(signal, sig) and "Traceback" not in err, err


def test_another_environment_gets_a_real_interpreter(client: Path, tmp_path: Path) -> None:
    proc = start(client, tmp_path, "0", env={"PROBE": "set"})  # the server's imports ran without it
    code, seen, _ = finish(proc)
    assert code == 0 and seen["pid"] == proc.pid and seen["probe"] == "set"


def test_a_variable_no_preloaded_import_reads_still_forks_warm_and_reaches_the_rank(client: Path, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow's export sets MLFLOW_ALLOW_FILE_STORE in the test process (inductor, sklearn and polars set others):
    neither the server nor the worker's client is started again for it, and the rank sees it as a fresh process
    would."""
    servers = [s.pid for s in conftest._WARM["servers"]]  # type: ignore[attr-defined]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("_RJEM_MALLOC_CONF", "dirty_decay_ms:500,muzzy_decay_ms:1000")  # what `import polars` sets
    assert warm_python() == client and [s.pid for s in conftest._WARM["servers"]] == servers  # type: ignore[attr-defined]
    proc = start(client, tmp_path, "0", env={"KMP_INIT_AT_FORK": "FALSE"})
    code, seen, _ = finish(proc)
    assert code == 0 and seen["pid"] != proc.pid and seen["mlflow"] == "true"
    assert seen["rjem"] == "dirty_decay_ms:500,muzzy_decay_ms:1000"


def test_a_warm_process_starts_its_own_children_warm(client: Path, tmp_path: Path) -> None:
    """torchrun's agent runs warm too and starts each rank through the client with its own environment, which
    holds what the server's imports set (torch, Lightning set variables): a rank still forks, not a fallback."""
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.argv[1], '-u', sys.argv[2], '0'], stdout=subprocess.PIPE, text=True)\n"
        "print(child.communicate()[0].strip(), child.pid, flush=True)\n"
    )  # fmt: skip
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run([str(client), "-u", str(tmp_path / "parent.py"), str(client), str(tmp_path / "probe.py")],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen, child_pid = proc.stdout.rsplit(" ", 1)
    assert json.loads(seen)["pid"] != int(child_pid)  # forked by the server: not the client's exec


def test_a_pythonpath_set_from_cli_env_leaves_cli_env_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_docs and test_autopsy set PYTHONPATH for their runs' own processes: were cli_env's value to change with
    it, the warm servers (started with the old one) would be started again, twice, about 30 s of CPU."""
    before = cli_env()["PYTHONPATH"]
    monkeypatch.setenv("PYTHONPATH", before)
    assert cli_env()["PYTHONPATH"] == before
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([before.split(os.pathsep)[0], os.environ["PYTHONPATH"]]))
    assert cli_env()["PYTHONPATH"] == before


def test_neighbouring_ranks_have_their_own_hash_seeds(client: Path, tmp_path: Path) -> None:
    seen = [finish(start(client, tmp_path, "0", env={"LOCAL_RANK": str(r)}))[1] for r in (0, 1)]
    assert seen[0]["hash"] != seen[1]["hash"]


def test_a_signal_to_the_client_ends_the_rank_and_the_client_as_that_signal(client: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    proc = start(client, tmp_path, "sleep", str(pid_file))
    rank = _wait_for_pid(pid_file, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(rank)


def test_a_sigkilled_client_takes_its_rank_with_it(client: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    proc = start(client, tmp_path, "sleep", str(pid_file))
    rank = _wait_for_pid(pid_file, proc)
    proc.kill()
    proc.communicate(timeout=120)
    assert _gone(rank), f"rank {rank} outlived its killed client"


def test_a_sigkilled_client_takes_what_its_rank_started_through_the_client(client: Path, tmp_path: Path) -> None:
    """torchrun's agent runs warm and starts its ranks through the client: a test that SIGKILLs torchrun on a
    time-out must not leave the ranks running (they are not below the client, but below their servers)."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "agent.py").write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.argv[1], '-u', sys.argv[2], 'sleep', sys.argv[3]], stdout=subprocess.DEVNULL)\n"
        "time.sleep(600)\n"
    )  # fmt: skip
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([str(client), "-u", str(tmp_path / "agent.py"), str(client), str(tmp_path / "probe.py"),
                             str(pid_file)], cwd=tmp_path, env=cli_env(), text=True, start_new_session=True)  # fmt: skip
    rank = _wait_for_pid(pid_file, proc)
    proc.kill()
    proc.communicate(timeout=120)
    assert _gone(rank), f"rank {rank}, started by a warm process whose client was killed, outlived it"


def test_a_client_gone_before_it_read_the_pid_leaves_no_rank(client: Path, tmp_path: Path) -> None:
    """The waiter sends the rank's pid to a client that can no longer read it (killed as its rank started, as a test's
    SIGTERM can do): the rank is killed before it runs anything, not left sleeping under init."""
    import socket

    import warm

    (tmp_path / "probe.py").write_text(PROBE)
    servers = {s.pid for s in conftest._WARM["servers"]}  # type: ignore[attr-defined]
    folder = str(conftest._WARM["folder"]).encode()  # type: ignore[attr-defined]
    socket0 = str(conftest._WARM["socket"]).split(os.pathsep)[0]  # type: ignore[attr-defined]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket0)
    request = {"argv": [str(tmp_path / "probe.py"), "sleep", str(tmp_path / "pid")], "env": cli_env(), "cwd": str(tmp_path),
               "leader": ""}  # fmt: skip
    with open(os.devnull, "r+") as null:
        warm._send(conn, request, [null.fileno()] * 3)
    conn.close()  # as a dead client, before the server has even read the request: the waiter's send of the pid fails
    fallbacks = Path(f"{socket0}.fallbacks")
    # the server serves one request at a time: once a later one has run, it has forked this one's waiter
    assert finish(start(client, tmp_path, "0", env={"LOCAL_RANK": "0"}))[0] == 0

    def forks_of_the_servers() -> list[int]:  # waiters and ranks show their server's command line
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if folder in cmdline.read_bytes() and int(cmdline.parent.name) not in servers:
                    if procs.running(cmdline.parent.name):
                        found.append(int(cmdline.parent.name))
        return found

    deadline = time.monotonic() + 60  # the waiter and the rank end at once; the deadline only bounds a failure
    while (left := forks_of_the_servers()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in left:  # the test fails, and leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    assert not left and not (tmp_path / "pid").exists(), f"left running: {left}"
    assert not fallbacks.exists() or str(tmp_path) not in fallbacks.read_text()  # the server took the request


def _wait_for_pid(pid_file: Path, proc: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "the probe never started"
        time.sleep(0.02)
    rank = int(pid_file.read_text())
    assert rank != proc.pid
    return rank


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not procs.running(pid):
            return True
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # still there: the test fails, and leaves nothing behind
    return False


C_PROBE = """
import atexit, json, os, sys
atexit.register(lambda: print("at exit:", repr(getattr(sys, "last_value", None)), file=sys.stderr, flush=True))
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "main": sys.modules["__main__"].__dict__ is globals(), "cwd": os.getcwd()}), flush=True)
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[1] == "raise":
    raise ValueError("the -c probe raised")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["4", "raise", "interrupt"])
def test_python_c_runs_warm_as_a_real_python_c_runs(client: Path, tmp_path: Path, how: str) -> None:
    """`python -c CODE ARGS` through the client: the same argv, path, `__main__`, exit status, and the uncaught error
    in `sys.last_value` at exit (what `record()`'s HF callback reads to say how a script's `train()` ended)."""
    seen = {}
    for name, python in (("warm", str(client)), ("real", sys.executable)):
        proc = subprocess.Popen([python, "-c", C_PROBE, how], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        out, err = proc.communicate(timeout=120)
        probe = json.loads(out.splitlines()[0])
        seen[name] = (proc.returncode, {k: v for k, v in probe.items() if k != "pid"}, err.strip().splitlines()[-1:])
        if name == "warm":
            assert probe["pid"] != proc.pid  # forked warm, not exec'ed
    assert seen["warm"] == seen["real"]
    assert seen["real"][1]["argv"] == ["-c", how] and seen["real"][1]["path0"] == ""
    assert seen["real"][2] == [{"4": "at exit: None", "raise": "at exit: ValueError('the -c probe raised')",
                                "interrupt": "at exit: KeyboardInterrupt()"}[how]]  # fmt: skip
