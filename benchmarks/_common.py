"""Shared pieces of the benchmarks: interleaved timing, medians, a table, a JSON file.

Every comparison is measured side by side in one run: repetitions of all variants are
interleaved, so a slow moment of a shared machine hits them alike; the medians are reported.

Example::

    times = interleaved({"none": step, "hook": hooked_step}, repeats=30)
    report("overhead", rows, ["variant", "ms", "ratio"])
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """`--tiny` (CI: tiny sizes, a few repeats, nothing asserted about time) and `--repeats N`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and few repeats (CI smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path (default benchmarks/results/)")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def interleaved(
    variants: Mapping[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]],
    repeats: int,
    steps_per_block: int = 5,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Per-step seconds of each variant, blocks interleaved: `{name: (context factory, step)}`.

    `clock`: wall time by default; `time.thread_time` (this thread's CPU time) for one-thread CPU runs on a
    shared machine, where other jobs' time slices would otherwise land in the steps they interrupt.

    The context (a capture session, say) is entered around each block and not timed. The order of
    the variants rotates from one repetition to the next, and each block starts with one untimed
    step, so neither going first nor following another variant favours anyone.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name, (ctx, step) in variants.items():
        with ctx():
            for _ in range(warmup):
                step()
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ctx, step = variants[name]
            with ctx():
                step()
                for _ in range(steps_per_block):
                    start = clock()
                    step()
                    times[name].append(clock() - start)
    return times


def no_context() -> AbstractContextManager[None]:
    return nullcontext()


def plain_step(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
) -> Callable[[], None]:  # fmt: skip
    """One training step without capture: forward, loss, backward, optimiser step, gradients dropped."""

    def plain() -> None:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return plain


def synced(step: Callable[[], None]) -> Callable[[], None]:
    """`step` followed by a CUDA synchronize, so a timer around it measures the GPU's work too."""

    def run() -> None:
        step()
        torch.cuda.synchronize()

    return run


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def machine() -> dict[str, Any]:
    """Where the figures came from."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def report(name: str, rows: list[dict[str, Any]], columns: Sequence[str], out: Path | None = None, **extra: Any) -> Path:
    """Print `rows` as a table and write them, with the machine, to JSON."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), "rows": rows, **extra}, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "" if v is None else str(v)


def chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def fsync_file(path: Path) -> None:
    """Flush a written file to the disk (what each writer compared here is charged with)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def forward_hooks(modules: Iterable[tuple[str, torch.nn.Module]], on_output: Callable[[str, Any], None]) -> Iterator[None]:
    """Plain forward hooks calling `on_output(path, output)` on each module, removed on exit: the peers' way."""
    handles = []
    for path, module in modules:

        def hook(_m: torch.nn.Module, _a: Any, out: Any, path: str = path) -> None:
            on_output(path, out)

        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
