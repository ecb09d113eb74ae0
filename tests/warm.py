"""A warm Python for the tests' torchrun ranks: `python warm.py ARGS` runs as `python ARGS` would, forked from a
server that has already imported torch (and torch._dynamo, Hydra, transformers, Lightning).

Why: each rank of a torchrun pays 2 to 5 s of CPU importing those before it does anything, and the suite starts
about sixty ranks on a 2-core machine. A rank forked from the server pays none of it; everything else is a
process of its own as before: its own pid, session, file descriptors, environment, argv, cwd, exit status and
signals, and gradrunner itself (imported by no server) is imported afresh by each rank.

Two halves, one file:

- the **server** (`python warm.py --serve SOCKET`, started once per test worker by `conftest.warm_python`):
  imports `PRELOAD`, refuses to serve if that started a thread (a fork would lose it), then for each request
  forks a waiter, which forks the rank (`_run`), tells the client its pid, and reports its exit status. If
  the client dies first (SIGKILL'd with its torchrun), the waiter kills the rank and what it started (a warm
  torchrun's rank clients, whose waiters then kill their ranks): as a killed process does,
  it leaves nothing behind.
- the **client** (`python -S warm.py [-u] (-m MODULE | -c CODE | SCRIPT) ARGS`, what torchrun starts with `--no-python`,
  and what starts torchrun itself: `-m torch.distributed.run`):
  sends its argv, environment, cwd and its stdin/stdout/stderr to the server, forwards the signals it gets to
  the rank, and exits as the rank did (the same code, or killed by the same signal). Without a server, or where
  its environment differs from the server's in anything but a rank's own variables (`RANK_VARIABLES`: the
  imports might read it), those the server's imports set (as they set them) and those no import of the server
  reads (`READ_AFTER_IMPORTS`), it `exec`s the real
  interpreter instead: the answer is never a warm process that could differ from a fresh one.

A fork shares its server's string-hash seed, where fresh ranks each draw their own (and a set of names iterated
in another order on each rank is a real bug a test must see): each worker has two servers with different seeds,
and a rank goes to the one of its `LOCAL_RANK`'s parity, so neighbouring ranks never share a seed.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import sys
import types

#: The variables torchrun sets per rank (and pytest per test): a request may differ from the server in these only.
RANK_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTEST_CURRENT_TEST", "GRADRUNNER_TEST_WARM_DEBUG",
})  # fmt: skip
#: Variables that libraries set in the test process as it goes (mlflow's export, torch's inductor, sklearn and joblib)
#: and that no import of `PRELOAD` reads: a request may differ from the server in them (the rank gets the request's
#: values, before anything reads them), so a test worker need not start its servers again (12 s of CPU) for them.
#: - `MLFLOW_ALLOW_FILE_STORE`: read by mlflow (not preloaded) when it opens a store;
#: - `_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`: read (getenv) by an inductor-compiled module as it loads: in the rank;
#: - `KMP_DUPLICATE_LIB_OK`, `KMP_INIT_AT_FORK`: read by Intel's OpenMP runtime as it loads (`serve` drops these two
#:   where the imports loaded it; torch's CPU build on Linux uses GNU OpenMP);
#: - `_RJEM_MALLOC_CONF`: set by `import polars` and read by polars' own jemalloc as its library loads (polars is not
#:   preloaded; a rank that imports it sees the request's value, as a fresh process started with it would).
#: - `WANDB_SERVICE`: set by `wandb.init` (the W&B export's tests) to its service's address, read by wandb (not
#:   preloaded) when a run starts;
#: - `PYTORCH_NVML_BASED_CUDA_CHECK`: set by `import lightning` (lightning.fabric's `__init__`, which the servers
#:   preload too) and read by `torch.cuda` only when asked (`is_available`, `device_count`), never as it imports.
INTEL_OPENMP_VARIABLES = frozenset({"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"})
READ_AFTER_IMPORTS = INTEL_OPENMP_VARIABLES | {
    "MLFLOW_ALLOW_FILE_STORE", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "_RJEM_MALLOC_CONF",
    "PYTORCH_NVML_BASED_CUDA_CHECK", "WANDB_SERVICE",
}  # fmt: skip
#: What the server imports once (each only if installed): the costly imports of a rank.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor.parallel", "numpy", "hydra", "hydra.utils", "omegaconf", "transformers",
           "transformers.models.gpt2.modeling_gpt2", "lightning")  # fmt: skip
#: Signals the client passes on to the rank (as a shell's `exec` would have them reach it).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
SOCKET_VARIABLE = "GRADRUNNER_TEST_WARM_SOCKET"


# -- the wire: a 4-byte length, then JSON --------------------------------------------------------------
def _send(conn: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    packet = struct.pack("!I", len(data)) + data
    if fds:  # the descriptors ride with the length; the rest follows as a plain stream
        socket.send_fds(conn, [packet[:4]], fds)
        packet = packet[4:]
    conn.sendall(packet)


def _recv_exactly(conn: socket.socket, n: int, first: bytes = b"") -> bytes:
    data = first
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _recv(conn: socket.socket, with_fds: int = 0) -> tuple[object, list[int]]:
    fds: list[int] = []
    if with_fds:
        head, fds, _, _ = socket.recv_fds(conn, 4, with_fds)
    else:
        head = conn.recv(4)
    if len(head) < 4:
        head = _recv_exactly(conn, 4, head)
    (n,) = struct.unpack("!I", head[:4])
    return json.loads(_recv_exactly(conn, n, head[4:])), fds


# -- the client ------------------------------------------------------------------------------------------
def _exec_python(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def client(args: list[str]) -> None:
    """Run `python ARGS` warm where the server can, else exec it; exit as the rank did."""
    target = args[1:] if args[:1] == ["-u"] else args  # the server runs unbuffered (PYTHONUNBUFFERED=1)
    paths = os.environ.get(SOCKET_VARIABLE, "").split(os.pathsep)
    path = paths[int(os.environ.get("LOCAL_RANK", "0") or 0) % len(paths)]  # neighbours: two hash seeds
    runnable = len(target) >= 2 if target[:1] in (["-m"], ["-c"]) else bool(target) and not target[0].startswith("-")
    if not path or not runnable:  # another interpreter option: the real interpreter
        _exec_python(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        leader = "session" if os.getsid(0) == os.getpid() else "group" if os.getpgid(0) == os.getpid() else ""
        # the file-size limit a test's preexec_fn set on this client (a full disk) is the rank's too
        fsize = resource.getrlimit(resource.RLIMIT_FSIZE)
        request = {"argv": target, "env": dict(os.environ), "cwd": os.getcwd(), "leader": leader, "fsize": fsize}
        _send(conn, request, [0, 1, 2])
        answer, _ = _recv(conn)
    except (OSError, EOFError):
        conn.close()
        _exec_python(args)
    assert isinstance(answer, dict)
    if "fallback" in answer:  # the server logged which variables differ (conftest reports them)
        conn.close()
        _exec_python(args)
    pid = int(answer["pid"])
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    try:  # a forwarded signal interrupts the wait, which Python resumes (PEP 475)
        status, _ = _recv(conn)
    except EOFError:  # the waiter died: the rank was killed with it
        status = {"status": signal.SIGKILL}
    assert isinstance(status, dict)
    st = int(status["status"])
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to set back
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(st))


# -- the server ------------------------------------------------------------------------------------------
def serve(path: str, forget_hash_seed: bool) -> None:
    import ctypes
    import importlib.util

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the test worker that started it
    if forget_hash_seed:  # this server's own seed: not in its ranks' environment, as it was not in the request
        del os.environ["PYTHONHASHSEED"]
    env = dict(os.environ)  # what a request's must equal (but for RANK_VARIABLES)
    for name in PRELOAD:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            __import__(name)
    try:  # a waiter watches its rank through a pidfd (Linux 5.3): without one, no server
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as e:
        print(f"warm: not serving, no pidfd here ({e})", flush=True)
        return
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork keeps only the forking thread: refuse, the clients exec a real Python
        print(f"warm: not serving, the imports started {len(threads) - 1} thread(s)", flush=True)
        return
    import gc

    gc.collect()
    gc.freeze()  # the preloaded modules live as long as each rank: its collections need not walk (nor copy) them
    imports_set = {k: v for k, v in os.environ.items() if env.get(k) != v}  # torch sets some: so would the rank's
    with open("/proc/self/maps") as maps:
        intel_openmp = "libiomp" in maps.read()
    read_later = READ_AFTER_IMPORTS - (INTEL_OPENMP_VARIABLES if intel_openmp else set())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    print("warm: ready", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = _recv(conn, with_fds=3)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        assert isinstance(request, dict)
        # a variable the imports set may come back set as they set it (from a warm process: torchrun's agent)
        differ = sorted(k for k in set(env) | set(request["env"])
                        if k not in RANK_VARIABLES and k not in read_later and env.get(k) != request["env"].get(k)
                        and not (k in imports_set and request["env"].get(k) == imports_set[k]))  # fmt: skip
        if differ or len(fds) != 3:
            _send(conn, {"fallback": differ})
            with open(f"{path}.fallbacks", "a") as log:  # conftest reports them at the session's end
                log.write(json.dumps({"argv": request["argv"], "differ": differ}) + "\n")
        elif os.fork() == 0:
            listener.close()
            request["env"] = {**imports_set, **request["env"]}
            _wait_for_rank(conn, fds, request)  # never returns
        for fd in fds:
            os.close(fd)
        conn.close()


def _wait_for_rank(conn: socket.socket, fds: list[int], request: dict[str, object]) -> None:
    """The waiter: fork the rank, tell the client its pid, then its exit status; if the client goes first (killed, or
    gone before it read the pid), kill the rank and what it started. The rank runs nothing until the client has its pid:
    a rank whose client was gone by then is killed before it starts, never left behind."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        go, started = os.pipe()
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.close(started)
            if os.read(go, 1) != b"g":  # the waiter died first: nobody would see this rank
                os._exit(1)
            os.close(go)
            _run(fds, request)  # never returns
        os.close(go)
        for fd in fds:
            os.close(fd)
        if not _report(conn, pid, started):  # the client is gone: so is its rank, and what the rank started
            for gone in [*descendants(pid), pid]:  # a warm torchrun's rank clients: their waiters end the ranks
                with contextlib.suppress(ProcessLookupError):
                    os.kill(gone, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        os._exit(0)


def _report(conn: socket.socket, pid: int, started: int) -> bool:
    """Send the rank's pid, let it start (`started`), then send its exit status: False where the client went first."""
    import select

    try:
        _send(conn, {"pid": pid})
        os.write(started, b"g")
        os.close(started)
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(conn, select.POLLIN | select.POLLHUP)
        poller.register(pidfd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if pidfd in ready:
                break
            if not conn.recv(4096):
                return False
    except OSError:  # the client's end closed under a send or a read (a broken pipe, a reset)
        return False
    _, st = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):  # the client may be gone by now: the rank is, too
        _send(conn, {"status": st})
    return True


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, found through /proc's parent ids (a forked torchrun's rank clients; the tests'
    torchruns' ranks)."""
    from procs import stat_fields  # here, not at the top: the client starts in about 20 ms and needs none of it

    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents.setdefault(int(stat_fields(entry)[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _run(fds: list[int], request: dict[str, object]) -> None:
    """The rank: this process becomes `python ARGV` started by the client, then exits as Python would."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        leader = request["leader"]
        if leader == "session":
            os.setsid()
        elif leader == "group":
            os.setpgid(0, 0)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        env, argv, cwd = request["env"], request["argv"], request["cwd"]
        assert isinstance(env, dict) and isinstance(argv, list) and isinstance(cwd, str)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        fsize = request.get("fsize")
        if isinstance(fsize, list | tuple) and tuple(fsize) != resource.getrlimit(resource.RLIMIT_FSIZE):
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize[0]), int(fsize[1])))
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS: so does this one
            sys.modules["numpy"].random.seed()
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = cwd
                # a preloaded module (torchrun's own) runs as a fresh `-m` runs it: not imported before as itself
                sys.modules.pop(argv[1], None)
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":  # as `python -c CODE ARGS`: argv[0] "-c", the cwd first on the path, a new __main__
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(str(argv[1]), "<string>", "exec"), main.__dict__)
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException as e:  # uncaught, as Python handles it: sys.last_* set, then sys.excepthook prints it
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
            sys.excepthook(type(e), e, e.__traceback__)
            code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
        threading._shutdown()  # type: ignore[attr-defined]  # as at Python's exit: non-daemon threads, then atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code < 0:  # an uncaught KeyboardInterrupt: Python ends by SIGINT
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3:] == ["--forget-hash-seed"])
    else:
        client(sys.argv[1:])
