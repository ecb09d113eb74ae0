"""Capture overhead per training step, per strategy, against the same step with no capture.

    python benchmarks/capture_overhead.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/capture_overhead.py --tiny     # CI smoke run
    python benchmarks/capture_overhead.py --extras   # also hook with each of issue 15's options

Models: the 8x512 MLP at batch 256 with every Linear and ReLU output tapped (17 taps), the tiny
transformer with every submodule output tapped, the CNN with every submodule output tapped.
Each with statistics only and with full values; plus the naive tutorial baseline (retain_grad on
each tap, then per-tap host reads of each statistic) on the same taps. Steps of all variants of one
model are interleaved; the ratio is the median step time over the no-capture median.
`--extras` adds every weight to the taps (of all variants) and the variants `hook+per_example`,
`hook+histogram` and `hook+updates` (update norms: a copy of the tapped weights before each step,
records taken after it, as the runner does); every variant records `value_norm` but
`hook-value_norm` (`hook` with it patched out, to show its cost).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import forward_hooks, interleaved, median_ms, no_context, parse_args, plain_step, report

from gradrunner import capture
from gradrunner.capturing.stats import Collector
from gradrunner.capturing.taps import resolve_taps
from gradrunner.models import MLP, SmallCNN, TinyTransformerBlock
from gradrunner.records.columns import TapKey

STRATEGIES = ("hook", "retain_grad", "autograd_grad")


def workloads(tiny: bool, device: str = "cpu") -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor, list[str]]]:
    """name -> (model, inputs, targets, taps), on `device`."""
    return {name: (m.to(device), x.to(device), y.to(device), taps) for name, (m, x, y, taps) in _workloads(tiny).items()}


def _workloads(tiny: bool) -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor, list[str]]]:
    torch.manual_seed(0)
    width, batch = (32, 8) if tiny else (512, 256)
    mlp = MLP(width, width, 8, width)
    tf = TinyTransformerBlock(d_model=16 if tiny else 64, n_heads=2, d_ff=32 if tiny else 256, out_features=16)
    cnn = SmallCNN(channels=4 if tiny else 32)
    return {
        "mlp_8x512_b256": (mlp, torch.randn(batch, width), torch.randn(batch, width), ["fc*:output", "relu*:output", "head:output"]),
        "transformer": (tf, torch.randn(4 if tiny else 32, 8 if tiny else 64, tf.ln1.normalized_shape[0]),
                        torch.randn(4 if tiny else 32, 8 if tiny else 64, 16), ["*:output"]),
        "cnn": (cnn, torch.randn(8 if tiny else 256, 1, 8, 8), torch.randint(0, 10, (8 if tiny else 256,)), ["*:output"]),
    }


def _tapped(model: nn.Module, taps: list[str]) -> list[tuple[str, nn.Module]]:
    return [(t.module, model.get_submodule(t.module) if t.module else model) for t in resolve_taps(model, taps)]


def _tensor(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def naive(model: nn.Module, taps: list[str], sink: list[torch.Tensor]) -> AbstractContextManager[None]:
    """The tutorial way: forward hooks calling `retain_grad()` on each tapped output."""

    def keep(_path: str, out: Any) -> None:
        t = _tensor(out)
        if t.requires_grad:
            t.retain_grad()
            sink.append(t)

    return forward_hooks(_tapped(model, taps), keep)


def plain_tensor_hooks(model: nn.Module, taps: list[str], col: Collector) -> AbstractContextManager[None]:
    """Plain PyTorch: forward hooks registering a tensor hook on each output, gradrunner's statistics."""

    def register(path: str, out: Any) -> None:
        t, key = _tensor(out), TapKey(path, "output", 0)
        if t.requires_grad:
            t.register_hook(lambda g: col.add(key, g))

    return forward_hooks(_tapped(model, taps), register)


def naive_stats(sink: list[torch.Tensor]) -> list[list[float]]:
    out = []
    for t in sink:
        g = t.grad
        if g is None:
            continue
        out.append([g.norm().item(), g.mean().item(), g.std().item(), g.min().item(), g.max().item(),
                    g.abs().max().item(), (g == 0).float().mean().item(), torch.isnan(g).sum().item(),
                    torch.isinf(g).sum().item()])
    sink.clear()
    return out


def _captured_step(cap: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                   opt: torch.optim.Optimizer, updates: bool = False) -> None:
    """One training step under `cap`, in the runner's order: backward, optimizer step, then the records."""
    loss = loss_fn(model(x), y)
    cap.backward(loss)
    before = cap.snapshot_params() if updates else None
    opt.step()
    cap.records(loss, before)
    opt.zero_grad(set_to_none=True)


def variants_for(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, taps: list[str], values: str, extras: bool = False
) -> dict[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]]:
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        nn.functional.cross_entropy if y.dtype == torch.int64 else nn.functional.mse_loss
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    plain = plain_step(model, x, y, loss_fn, opt)

    out: dict[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]] = {"none": (no_context, plain)}
    for strategy in STRATEGIES:
        cap = capture(model, taps, strategy=strategy, values=values, keep_grads=False)
        out[strategy] = (lambda cap=cap: cap, partial(_captured_step, cap, model, x, y, loss_fn, opt))
    if extras:
        out.update(_extra_variants(model, x, y, taps, values, loss_fn, opt))
    if values == "none":
        col = Collector(values="none")

        def plain_hooks_step() -> None:
            loss = loss_fn(model(x), y)
            loss.backward()
            col.finish(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["plain_hooks"] = (lambda: plain_tensor_hooks(model, taps, col), plain_hooks_step)
        sink: list[torch.Tensor] = []

        def naive_step() -> None:
            loss = loss_fn(model(x), y)
            loss.backward()
            naive_stats(sink)
            loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["naive"] = (lambda: naive(model, taps, sink), naive_step)
    if x.is_cuda:  # time the GPU's work, not the launches
        out = {name: (ctx, _synced(step)) for name, (ctx, step) in out.items()}
    return out


def _extra_variants(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, taps: list[str], values: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer,
) -> dict[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]]:
    """`hook` with one of issue 15's options each: per-example norms, histograms, update norms."""
    out: dict[str, tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]] = {}
    for option in ("per_example", "histogram", "updates"):
        kwargs = {option: True} if option != "updates" else {}
        cap = capture(model, taps, strategy="hook", values=values, keep_grads=False, **kwargs)
        step = partial(_captured_step, cap, model, x, y, loss_fn, opt, updates=option == "updates")
        out[f"hook+{option}"] = (lambda cap=cap: cap, step)
    # The cost of the always-on value_norm: `hook` with it patched out of the forward side (capturing.firing).
    cap = capture(model, taps, strategy="hook", values=values, keep_grads=False)
    out["hook-value_norm"] = (lambda cap=cap: _without_value_norm(cap), partial(_captured_step, cap, model, x, y, loss_fn, opt))
    return out


@contextmanager
def _without_value_norm(cap: Any) -> Iterator[None]:
    import gradrunner.capturing.firing as firing

    real = firing.record_value_norm
    firing.record_value_norm = lambda _t: None  # type: ignore[assignment,return-value]
    try:
        with cap:
            yield
    finally:
        firing.record_value_norm = real


def _synced(step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        step()
        torch.cuda.synchronize()

    return run


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cpu")
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
        p.add_argument("--only", nargs="*", default=None, help="workloads to run (default: all)")
        p.add_argument("--values", nargs="*", default=["none", "full"], help="values modes (default: none full)")
        p.add_argument("--extras", action="store_true", help="tap every weight too; add hook with each issue-15 option")

    args = parse_args(__doc__.splitlines()[0], extra)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.tiny else 12)
    rows = []
    for name, (model, x, y, taps) in workloads(args.tiny, args.device).items():
        if args.only and name not in args.only:
            continue
        if args.extras:
            taps = [*taps, "*:weight"]
        n_taps = len(resolve_taps(model, taps))
        for values in args.values:
            times = interleaved(variants_for(model, x, y, taps, values, args.extras), repeats=repeats)
            base = median_ms(times["none"])
            for variant, samples in times.items():
                rows.append({"model": name, "taps": n_taps, "values": values, "variant": variant,
                             "step_ms": median_ms(samples), "ratio": median_ms(samples) / base,
                             "overhead_pct": 100 * (median_ms(samples) / base - 1)})
    report("capture_overhead", rows, ["model", "taps", "values", "variant", "step_ms", "ratio", "overhead_pct"], args.out)


if __name__ == "__main__":
    main()
