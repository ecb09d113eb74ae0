"""Where the suite's CPU goes, per test: an opt-in pytest plugin (not loaded unless asked for).

For issue 33's 8-minute `.ci/run`: the two cores are saturated, so only less CPU makes the suite faster, and
wall times per test (`--durations`) hide what a test's subprocesses cost. Each test appends one JSON line:

| key | what |
| --- | --- |
| `id` | the test's node id |
| `worker` | the xdist worker (`gw0`, ...), "" without xdist |
| `self` | CPU seconds of the test's own process (every thread) while the test ran (setup and teardown included) |
| `children` | CPU seconds of the subprocesses the test waited for (`RUSAGE_CHILDREN`; not the warm servers' ranks) |
| `wall` | seconds |
| `compositions`, `composition_cpu` | Hydra compositions (`ConfigLoaderImpl.load_configuration`) in the test's process, and their CPU |

Example::

    CPU_ACCOUNTING=/tmp/cpu.jsonl PYTHONPATH=tests python -m pytest -q -n auto --dist loadgroup -p cpu_accounting
    python -c "import pandas as pd; d = pd.read_json('/tmp/cpu.jsonl', lines=True); print(d[['self', 'children', 'composition_cpu']].sum())"
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable, Generator
from typing import Any

import pytest

VARIABLE = "CPU_ACCOUNTING"
_COMPOSITIONS = [0, 0.0]  # count, CPU seconds, in this process


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _counted(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_configuration(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return load(*args, **kwargs)
        finally:
            _COMPOSITIONS[0] += 1
            _COMPOSITIONS[1] += time.process_time() - start

    return load_configuration


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(VARIABLE):
        raise pytest.UsageError(f"-p cpu_accounting writes one JSON line per test to the file named by {VARIABLE}: "
                                f"set it, e.g. {VARIABLE}=/tmp/cpu.jsonl")  # fmt: skip
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    if not hasattr(ConfigLoaderImpl.load_configuration, "__wrapped_by_cpu_accounting__"):
        counted = _counted(ConfigLoaderImpl.load_configuration)
        counted.__wrapped_by_cpu_accounting__ = True  # type: ignore[attr-defined]
        ConfigLoaderImpl.load_configuration = counted  # type: ignore[method-assign]  # opt-in measurement only


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    count, composing = _COMPOSITIONS
    yield
    line = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "self": _cpu(resource.RUSAGE_SELF) - own, "children": _cpu(resource.RUSAGE_CHILDREN) - children,
            "wall": time.monotonic() - wall, "compositions": _COMPOSITIONS[0] - count,
            "composition_cpu": _COMPOSITIONS[1] - composing}  # fmt: skip
    with open(os.environ[VARIABLE], "a") as out:  # one short line per write: the workers' lines do not interleave
        out.write(json.dumps(line) + "\n")
