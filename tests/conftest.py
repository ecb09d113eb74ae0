"""Shared fixtures and helpers: strategies, seeding, the hooks-left check, composing configs, running the CLI.

Test modules import helpers from here (`from conftest import compose_cfg`) or from the helper modules beside it, the
files not named `test_*` (`rank_launch`, `per_example_reference`, `hf_reference`, ...), never from each other
(`test_layout` checks)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, TextIO

import pandas as pd
import pytest
import torch
import warm
from hydra import compose, initialize_config_module
from hypothesis import settings
from omegaconf import DictConfig
from torch import nn

from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.run.hydra_adapter import yaml_parsed_once

# In CI (CI=true) hypothesis is derandomised: the same examples every run, so a red build is reproducible
# and a green one cannot turn red by luck; locally it keeps exploring new examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

# Under pytest-xdist each worker gets its share of the cores for torch's thread pool: two workers of two
# threads each on two cores made in-process training tests many times slower (threads spinning on a busy core).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Ctrl-C must reach the tests that send it: a shell starts a background job (`pytest ... &`, `nohup`-like CI
# harnesses) with SIGINT ignored, which Python keeps and every worker and child inherits. Then an interrupt a test
# sends is lost, and gradrunner rightly keeps an inherited SIG_IGN (`run.signals.ignored`): the signal tests would
# pass or fail by the order the tests ran in. The tests that start a process with SIGINT ignored set it themselves.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: Every hook registry an `nn.Module` has (some only exist in newer torch versions).
MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marks into the groups it schedules by
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`, README "Development"): the tests of a module that share
    a fixture of that module wider than one test (scope module or class: a sweep run once, read by each test)
    form one group, run on one worker, so the fixture is built once as in a one-process run. Every other test
    goes to whichever worker is free. Without xdist installed nothing is marked."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = getattr(item, "module", None)
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})  # the fixtures the test uses
        shared = any(d.scope != "function" and getattr(d.func, "__module__", None) == getattr(module, "__name__", "")
                     for ds in defs.values() for d in ds)  # fmt: skip
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is alive once the tests are collected (every test module's imports: torch, transformers, Lightning,
    Hydra, pandas, ...) lives as long as this process: out of the garbage collector's reach (`gc.freeze`), so a
    full collection during the tests walks only what tests made since. Before, each worker spent about 20 s of
    CPU a suite in some fifty full collections of about a million objects (a `gc.callbacks` count)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request: pytest.FixtureRequest) -> str:
    """Every registered capture strategy: a new strategy gets the whole contract suite for free."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    if torch.cuda.is_available():
        torch.manual_seed(0)
    else:  # the CPU's generator is all there is; torch.manual_seed would also queue a seeding of CUDA, XPU and
        torch.default_generator.manual_seed(0)  # MTIA for their first use, each with a formatted stack, every test
    yield


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Put the logging set-up back after each test: the Hydra app run in-process (`cli.app.main()`) configures
    logging with handlers on the streams of that moment (pytest's captures, closed once the test ends); a
    handler left on a closed stream makes every later log call print "--- Logging error ---" and a traceback."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    before = {id(lg): (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers}
    yield
    for lg in loggers:  # loggers made during the test are a library's own: left as they are
        handlers, level, propagate, disabled = before[id(lg)]
        for h in [h for h in lg.handlers if h not in handlers]:
            lg.removeHandler(h)
            h.close()
        for h in handlers:
            if h not in lg.handlers:
                lg.addHandler(h)
        if lg.level != level:  # only where it moved: each setLevel clears every logger's cache (O(loggers))
            lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def leftover_hooks(model: nn.Module) -> list[str]:
    """Everything a capture could have left on `model`: hooks, patched `forward`s, parameter hooks."""
    found: list[str] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for attr in MODULE_HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                found.append(f"{path or '<root>'}.{attr}: {dict(hooks)}")
        if "forward" in module.__dict__:
            found.append(f"{path or '<root>'}: instance attribute forward = {module.__dict__['forward']!r}")
        for name, param in module.named_parameters(recurse=False):
            if getattr(param, "_backward_hooks", None):
                found.append(f"{path or '<root>'}.{name}._backward_hooks: {dict(param._backward_hooks)}")
            if getattr(param, "_post_accumulate_grad_hooks", None):
                found.append(f"{path or '<root>'}.{name}._post_accumulate_grad_hooks")
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"):
        if getattr(nn.modules.module, attr, None):
            found.append(f"torch.nn.modules.module.{attr}")
    return found


def tanh_mlp() -> nn.Sequential:
    """A seeded 4 -> 8 -> 2 MLP with a Tanh, for the loops of the `record()` and `.grad`-reset tests."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def regression_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` seeded (x, y) batches of 5 rows for `tanh_mlp`."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]


def close(actual: torch.Tensor | None, expected: torch.Tensor, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """Assert a captured gradient (present) equals a plain-torch reference; tight (float64) tolerances by default.

    Tensors of different dtypes are compared in float64 (a float32 capture against a float64 reference).
    """
    assert actual is not None
    if actual.dtype != expected.dtype:
        actual, expected = actual.double(), expected.double()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def class_forwards(model: nn.Module) -> dict[type, object]:
    """Snapshot of `type(m).forward` for every module class in `model`."""
    return {type(m): type(m).forward for m in model.modules()}


#: Overrides that interrupt a run (Ctrl-C) as it asks for the batch of step 3: steps 0-2 complete.
INTERRUPT_AT_STEP_3 = ("data=faulty", "data.at_batch=3", "data.fault=keyboard_interrupt")


#: The repository's root and the tests' own config dir (user options for `model=`, `data=`, ...).
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SEARCHPATH = f"hydra.searchpath=[file://{TESTS / 'conf'}]"


def by_micro_batch(rows: pd.DataFrame) -> pd.DataFrame:
    """A tap's rows of one step in micro-batch order: `micro_step` where the records have it, else `call`."""
    if "micro_step" in rows.columns and rows.micro_step.notna().any():
        return rows.sort_values(["micro_step", "call"])
    return rows.sort_values("call")


def assert_accumulation_rows(df: pd.DataFrame, ref: list[dict[str, list[torch.Tensor]]], taps: list[str],
                             param_tap: str, rel: float) -> None:
    """Records under gradient accumulation equal a plain-torch reference `ref[step][tap]` (a gradient per row):
    activation taps one row per micro-batch (`micro_step` 0, 1, ...), the parameter tap one per step (null)."""
    for s in range(len(ref)):
        for tap in taps:
            rows = df[(df.step == s) & (df.tap == tap)].pipe(by_micro_batch)
            assert len(rows) == len(ref[s][tap]), (s, tap)
            if tap == param_tap:
                assert rows.micro_step.isna().all(), (s, tap)
            else:
                assert rows.micro_step.tolist() == list(range(len(rows))), (s, tap)
            for call, g in enumerate(ref[s][tap]):
                assert rows.iloc[call].norm == pytest.approx(float(g.norm()), rel=rel), (s, tap, call)
                assert rows.iloc[call].abs_max == pytest.approx(float(g.abs().max()), rel=rel), (s, tap, call)
                assert rows.iloc[call]["min"] == pytest.approx(float(g.min()), rel=rel, abs=1e-12), (s, tap, call)


def compose_cfg(*overrides: str, hydra: bool = False) -> DictConfig:
    """The composed config for `overrides`, as the app would see it (with `hydra.*` when `hydra`).

    The tests' own options (tests/conf) are on the search path, as `--config-dir` would put them.
    Each config file's YAML is parsed once per worker, as the app parses it (`yaml_parsed_once`).
    """
    with yaml_parsed_once(), initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        return compose("config", overrides=[SEARCHPATH, *overrides], return_hydra_config=hydra)


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    # One thread: with two busy cores, torch's thread pool can make tiny steps 50x slower.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # A rank that aborts (SIGABRT, seen rarely at the exit of gloo ranks) prints every thread's Python stack.
    env["PYTHONFAULTHANDLER"] = "1"
    # This file's directory too, so `_target_` can name ScaledLinear above.
    # (once each: a test that sets PYTHONPATH from cli_env() gets the same value back, so the warm servers,
    # started with it, still match and are not started again)
    first = [str(ROOT), str(TESTS)]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    if "socket" in _WARM:  # in every environment, as in the warm server's: ranks' requests must match it
        env[warm.SOCKET_VARIABLE] = str(_WARM["socket"])
    return env


# -- torchrun with warm ranks ------------------------------------------------------------------------
#: This test worker's warm servers (`warm.py`): their sockets, processes, folder, environment and client, once started.
_WARM: dict[str, object] = {}


def torchrun_command(world: int, *entry: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=WORLD ENTRY` (`-m MODULE ARGS` or `SCRIPT ARGS`), ranks forked warm.

    The ranks are started by torchrun as ever, as `warm.py`'s client (`--no-python`): each is forked from this
    worker's server, which imported torch and the rest once, instead of paying 2 to 5 s of CPU for it; torchrun
    itself runs through the client too (`torchrun_argv`). Keep
    a plain `python -m torch.distributed.run` where a fresh interpreter is the subject (import-time behaviour).
    Run it with `cli_env()`. Example::

        subprocess.run(torchrun_command(2, "-m", "gradrunner", "+experiment=mlp"), env=cli_env(), ...)
    """
    return torchrun_argv(["--standalone", f"--nproc_per_node={world}"], entry)


def torchrun_argv(flags: Sequence[str], entry: Sequence[str]) -> list[str]:
    """`torchrun FLAGS ENTRY` as `torchrun_command` runs it: torchrun itself and its ranks forked warm (torchrun's
    agent imports torch.distributed, 1.5 to 2.5 s of CPU), or plain interpreters where no server would serve.

    Warm, torchrun's logs go into the servers' folder (`--log-dir`), removed with it when the session ends: by
    default each torchrun makes a `torchelastic_*` folder in the system's temp dir and never removes it.
    """
    client = warm_python()
    if client is None:
        return [sys.executable, "-m", "torch.distributed.run", *flags, *entry]
    logs = f"--log-dir={client.parent / 'torchrun-logs'}"
    return [str(client), "-m", "torch.distributed.run", *flags, logs, "--no-python", str(client), "-u", *entry]


def warm_python() -> Path | None:
    """The client of this worker's warm server, started on first use (None where it would not serve)."""
    if _WARM.get("client") is not None and _WARM.get("env") != _server_env():
        # The test process's environment changed since (a library it imported set a variable): the servers'
        # imports ran without it, so a rank would not start as a fresh one would. Start them again.
        if os.environ.get("GRADRUNNER_TEST_WARM_DEBUG"):
            env, was = _server_env(), _WARM.get("env") or {}
            changed = sorted(k for k in set(env) | set(was) if env.get(k) != was.get(k))  # type: ignore[attr-defined]
            with open(Path(os.environ["GRADRUNNER_TEST_WARM_DEBUG"]) / f"{os.getpid()}-restarts", "a") as log:
                log.write(f"{changed}\n")
        _stop_warm()
    if "client" not in _WARM:  # GRADRUNNER_TEST_COLD=1: every rank a fresh interpreter, as torchrun alone starts it
        _WARM["client"] = None if os.environ.get("GRADRUNNER_TEST_COLD") == "1" else _start_warm()
    client = _WARM["client"]
    assert client is None or isinstance(client, Path)
    return client


def _start_warm() -> Path | None:
    import secrets
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="gradrunner-warm-"))
    sockets = [folder / "socket0", folder / "socket1"]
    env = {**cli_env(), warm.SOCKET_VARIABLE: os.pathsep.join(map(str, sockets))}
    servers = []
    for path in sockets:  # two string-hash seeds (see warm.py), drawn here unless the tests fixed one
        seeded = "PYTHONHASHSEED" not in env
        extra = {"PYTHONHASHSEED": str(secrets.randbelow(2**32))} if seeded else {}
        servers.append(subprocess.Popen(
            [sys.executable, str(TESTS / "warm.py"), "--serve", str(path), *(["--forget-hash-seed"] * seeded)],
            env={**env, **extra}, stdout=subprocess.PIPE, text=True,
        ))  # fmt: skip
    _WARM.update(socket=env[warm.SOCKET_VARIABLE], servers=servers, folder=folder, env=_server_env())
    for server in servers:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "warm: ready":  # it says why on its stdout, or it died
            _stop_warm()
            return None
    client = folder / "python"
    # Python itself, not a shell (which would set PWD), without `site`: the client starts in about 20 ms
    client.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\nimport warm\n"
                      "warm.client(sys.argv[1:])\n")  # fmt: skip
    client.chmod(0o755)
    return client


def _server_env() -> dict[str, str]:
    """What a warm server's environment depends on: `cli_env()` but for the variables torchrun sets per rank (a
    test's process may have kept one: it changes nothing a rank sees), those its imports do not read (set later by
    mlflow, inductor, sklearn in this process: `warm.READ_AFTER_IMPORTS`) and the server's own."""
    ignored = warm.RANK_VARIABLES | warm.READ_AFTER_IMPORTS | {warm.SOCKET_VARIABLE}
    return {k: v for k, v in cli_env().items() if k not in ignored}


def _stop_warm() -> None:
    import shutil

    servers = _WARM.get("servers", [])
    assert isinstance(servers, list)
    for server in servers:
        server.kill()
        server.wait()
    if "folder" in _WARM:
        folder = Path(str(_WARM["folder"]))
        if os.environ.get("GRADRUNNER_TEST_WARM_DEBUG"):  # which ranks started cold, and why
            for log in folder.glob("*.fallbacks"):
                shutil.copy(log, Path(os.environ["GRADRUNNER_TEST_WARM_DEBUG"]) / f"{os.getpid()}-{log.name}")
        shutil.rmtree(folder, ignore_errors=True)
    _WARM.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The warm servers end with their test worker (they would anyway: they die with their parent)."""
    _stop_warm()


def gradrunner(cwd: Path, *args: str, timeout: float = 180, warm: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m gradrunner ARGS` from `cwd`, a process of its own: forked warm (`child_python`) unless `warm=False`."""
    return subprocess.run(
        [child_python() if warm else sys.executable, "-m", "gradrunner", *args],
        cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def child_python() -> str:
    """The interpreter for a child process (`[child_python(), "-m", "gradrunner", ...]`, run with `cli_env()`) whose
    subject is not a fresh interpreter: this worker's warm client, which forks it from a server that imported torch,
    Hydra and the rest once (`warm.py`: 3 of a tiny CLI run's 4 s of CPU), else `sys.executable`.

    Keep `sys.executable` where the subject is the child's imports, a limit its `preexec_fn` sets other than the file
    size (`RLIMIT_FSIZE`, which the client passes on; any other would apply to the client, not the forked process), its
    pid (the forked process has its own), or a signal the test sends it (the
    client passes it on; a SIGKILL'd client's process is killed by its waiter a moment later, not at once). A child
    that ends itself (exit status, a signal it raises) ends the client the same way.
    """
    client = warm_python()
    return str(client) if client is not None else sys.executable


@pytest.fixture
def cli_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sys.executable` children of the code under test (the autopsy's sweep) run in the environment of the CLI's
    tests (`cli_env()`: they import `planted_spikes` from this dir, as the source run did), started warm
    (`child_python`: their subject is the records, not a fresh interpreter)."""
    monkeypatch.setattr(sys, "executable", child_python())  # first: it starts the servers `cli_env()` names
    for name, value in cli_env().items():
        monkeypatch.setenv(name, value)


def check_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def job_dirs(root: Path, pattern: str = "outputs/*/*") -> list[Path]:
    return sorted(root.glob(pattern))


# -- a command run inside the test's process -----------------------------------------------------------
#: The interpreter's own warning filters (no -W, no PYTHONWARNINGS), as a fresh `python -m ...` starts with.
_PYTHON_WARNING_FILTERS: tuple[tuple[Literal["default", "ignore"], type[Warning], str], ...] = (
    ("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, ""),
)  # fmt: skip


def python_m(cwd: Path, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m module *args` from `cwd`, run inside this process: its stdout, stderr and exit status.

    For tests whose subject is what the command does, not the process boundary (a subprocess pays 2-3 s
    of start-up on the loaded 2-core machine). The command sees what a fresh process would
    (`_as_a_fresh_process`); its `atexit` callbacks run at its end, as at a process's exit; an uncaught
    exception is a traceback on stderr and status 1, as in Python.

    Keep a real subprocess where the process is the subject: signals, Ctrl-C, import-time behaviour,
    closed pipes, the console script, several processes at once, and one end-to-end smoke per command.

    Example::

        result = python_m(tmp_path, "gradrunner", "+experiment=mlp", "steps=2")
        check_ok(result)
    """
    import importlib.util
    import runpy

    spec = importlib.util.find_spec(module)
    assert spec is not None, f"no module {module}"
    # runpy warns about (and would not re-run) a module already imported: set it aside while it runs
    mains = ((module,) if spec.submodule_search_locations is None else ()) + (f"{module}.__main__",)
    return _run_as_main(cwd, [module, *args], env, str(cwd), mains,
                        lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))  # fmt: skip


def python_script(cwd: Path, script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python script *args` from `cwd`, run inside this process (its dir first on `sys.path`); see `python_m`.

    Example::

        result = python_script(tmp_path, ROOT / "benchmarks" / "per_fire.py", "--tiny")
    """
    import runpy

    return _run_as_main(cwd, [str(script), *args], env, str(script.parent), (),
                        lambda: runpy.run_path(str(script), run_name="__main__"))  # fmt: skip


def _run_as_main(cwd: Path, argv: list[str], env: dict[str, str] | None, path0: str, mains: tuple[str, ...],
                 run: Callable[[], object]) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`run()` as a fresh process's main module would run: its output, its exit status, then its `atexit`."""
    import io
    import signal
    import traceback

    out, err = (io.TextIOWrapper(io.BytesIO(), write_through=True) for _ in range(2))
    with _as_a_fresh_process(cwd, argv, env, out, err, path0, mains) as at_exit:
        try:
            run()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # what Python prints for an uncaught exception, and its status
            traceback.print_exc()
            code = 1
        for func, a, k in reversed(at_exit):  # the process's exit
            try:
                func(*a, **k)
            except BaseException:
                print("Exception ignored in atexit callback:", file=sys.stderr)
                traceback.print_exc()
    return subprocess.CompletedProcess(argv, code, *(s.buffer.getvalue().decode() for s in (out, err)))


def recorded(model: torch.nn.Module, taps: list[str], out: Path, steps: int = 3) -> Path:
    """`steps` SGD steps of `model` on random (8, 4) batches, its mean squared output the loss, `record`ed in `out`."""
    from gradrunner import record

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, taps, out) as rec:
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    return out


def gradrunner_in_process(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gradrunner(cwd, *args)` (`python -m gradrunner ...`) inside this process; see `python_m`."""
    return python_m(cwd, "gradrunner", *args)


#: `atexit.register` calls a command made: (function, args, kwargs), run at its end by `_run_as_main`.
AtExit = list[tuple[Callable[..., object], tuple[object, ...], dict[str, object]]]


@contextlib.contextmanager
def _as_a_fresh_process(
    cwd: Path, argv: list[str], env: dict[str, str] | None, out: TextIO, err: TextIO, path0: str, mains: tuple[str, ...]
) -> Iterator[AtExit]:
    """While open: `argv`, `cwd`, `path0` first on `sys.path`, `cli_env()` plus `env`, one torch thread, stdout
    and stderr into `out` and `err`, the modules `mains` out of `sys.modules`, no Hydra state, fresh logging
    (`_fresh_logging`), warnings and `atexit` (`_fresh_warnings_and_atexit`, whose callbacks it yields).

    Everything is put back afterwards: cwd, argv, sys.path, the environment, signal handlers, logging,
    Hydra's global state, torch's thread count, the RNG states, `mains`.
    """
    import random
    import signal

    import numpy as np
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), Path.cwd(), sys.argv[:], sys.path[:]
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}
    saved_torch = (torch.get_num_threads(), torch.get_rng_state(), random.getstate(), np.random.get_state())
    saved_modules = {m: sys.modules.pop(m) for m in mains if m in sys.modules}
    fresh_env = {**cli_env(), **(env or {})}
    try:
        os.environ.clear()
        os.environ.update(fresh_env)
        os.chdir(cwd)
        sys.argv = list(argv)
        sys.path.insert(0, path0)
        torch.set_num_threads(1)
        GlobalHydra.instance().clear()
        with _fresh_logging(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                _fresh_warnings_and_atexit() as at_exit:  # fmt: skip
            yield at_exit
    finally:
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
        for sig, on_signal in saved_signals.items():
            signal.signal(sig, on_signal)
        torch.set_num_threads(saved_torch[0])
        torch.set_rng_state(saved_torch[1])
        random.setstate(saved_torch[2])
        np.random.set_state(saved_torch[3])
        sys.modules.update(saved_modules)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _fresh_logging() -> Iterator[None]:
    """While open: no handler on the root logger (level WARNING), gradrunner's loggers at their defaults (a
    test may have left a level on them, or disabled them); afterwards the handlers the command's logging set
    up (Hydra's file and console) are closed and the test's logging is put back."""

    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    ours = [v for k, v in logging.Logger.manager.loggerDict.items()
            if isinstance(v, logging.Logger) and (k == "gradrunner" or k.startswith("gradrunner."))]  # fmt: skip
    saved = [(logger, logger.level, logger.disabled, logger.propagate) for logger in ours]
    try:
        root.handlers = []
        root.setLevel(logging.WARNING)  # setLevel: the loggers' cached levels are recomputed
        for logger in ours:
            logger.setLevel(logging.NOTSET)
            logger.disabled, logger.propagate = False, True
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.setLevel(level)
        root.handlers = handlers
        for logger, its_level, disabled, propagate in saved:
            logger.setLevel(its_level)
            logger.disabled, logger.propagate = disabled, propagate


@contextlib.contextmanager
def _fresh_warnings_and_atexit() -> Iterator[AtExit]:
    """While open: Python's default warning filters, warnings printed to (the current) stderr, and
    `atexit.register`/`unregister` collecting into the list it yields; all put back afterwards."""
    import atexit
    import warnings

    at_exit: AtExit = []

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: object = None,
             line: str | None = None) -> None:  # fmt: skip
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    def register(func: Callable[..., object], *args: object, **kwargs: object) -> Callable[..., object]:
        at_exit.append((func, args, kwargs))
        return func

    def unregister(func: Callable[..., object]) -> None:
        at_exit[:] = [e for e in at_exit if e[0] != func]

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.resetwarnings()
        for action, category, where in reversed(_PYTHON_WARNING_FILTERS):
            warnings.filterwarnings(action, category=category, module=where)
        warnings.showwarning = show
        patch.setattr(atexit, "register", register)
        patch.setattr(atexit, "unregister", unregister)
        yield at_exit


class EveryExpert(nn.Module):
    """Each expert called on the tokens routed to it, however few (`expert(h[idx])`): expert 2 gets none, a (0, 4) input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(3, 4), nn.Linear(4, 1)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        route = (h[:, 0] > 0).long()  # experts 0 and 1 only
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, expert(h[idx]))
        return self.head(h + out)  # type: ignore[no-any-return]
