"""A step researchers actually train: GPT-2 small, batch 8 x 512, AdamW, bf16 autocast, ~190 taps.

    python benchmarks/gpu_realistic.py --device cuda            # the issue-23 workload (needs a GPU)
    python benchmarks/gpu_realistic.py --tiny                   # CPU smoke run (a test runs it)

A randomly initialised `GPT2LMHeadModel(GPT2Config())` (124M parameters, no download), trained one
AdamW step per timed step under `torch.autocast(dtype=bfloat16)`. Taps: every block's output, its
attention output and its MLP output, and every parameter (36 + 148 = 184 taps), statistics only.
Variants, interleaved (`_common.interleaved`, medians, ratio to `none`): no capture; each strategy;
plain tensor hooks computing the same seven reductions on the same activations and parameters;
nnsight on the same activations (when installed); `wandb.watch(model, log="gradients",
log_freq=1)` in offline mode (when installed, not with `--tiny`). On CUDA it also reports each
variant's peak allocator memory against `none`, and runs one `cap.backward` per strategy under
`torch.cuda.set_sync_debug_mode("error")` (a host sync inside backward raises).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, parse_args, report, synced
from peers import Variant, activation_taps, gpt2, skipped, variants

from gradrunner import capture

STRATEGIES = ("hook", "retain_grad", "autograd_grad")


def taps_for(model: nn.Module) -> list[str]:
    """Block, attention and MLP outputs and every parameter, by its module and name."""
    params = []
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        params.append(f"{module}:{leaf}")
    return activation_taps(model) + params


@contextmanager
def _watched(model: nn.Module, run: Any) -> Iterator[None]:
    import wandb

    wandb.watch(model, log="gradients", log_freq=1)
    try:
        yield
    finally:
        wandb.unwatch(model)


def _wandb_variant(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None, folder: str) -> tuple[Variant, Any]:
    import wandb

    run = wandb.init(mode="offline", dir=folder, project="gradrunner-bench", settings=wandb.Settings(silent=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.log({"loss": loss.detach()})  # watch's histograms are written with the step's log

    return (lambda: _watched(model, run), step), run


def sync_check(model: nn.Module, x: torch.Tensor, taps: list[str], autocast: torch.dtype | None) -> dict[str, str]:
    """Per strategy: 'none' if a backward under `set_sync_debug_mode("error")` ran, else the error."""
    out = {}
    for strategy in STRATEGIES:
        with capture(model, taps, strategy=strategy, values="none", keep_grads=False) as cap:
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                loss = model(x, labels=x).loss
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                cap.backward(loss)
                out[strategy] = "none"
            except RuntimeError as exc:
                out[strategy] = str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            cap.records(loss)
            model.zero_grad(set_to_none=True)
    return out


def peak_memory(found: dict[str, Variant]) -> dict[str, float]:
    """Peak CUDA allocator MiB of one step of each variant."""
    peaks = {}
    for name, (ctx, step) in found.items():
        with ctx():
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
    return peaks


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
        p.add_argument("--no-wandb", action="store_true", help="leave wandb.watch out")

    args = parse_args(__doc__.splitlines()[0], extra)
    if args.threads:
        torch.set_num_threads(args.threads)
    layers, width, heads, vocab, batch, seq = (2, 32, 2, 100, 2, 16) if args.tiny else (12, 768, 12, 50257, 8, 512)
    repeats = args.repeats or (1 if args.tiny else 10)
    model = gpt2(layers, width, heads, vocab, seq, args.device)
    x = torch.randint(0, vocab, (batch, seq), device=args.device)
    taps = taps_for(model)
    bf16 = torch.bfloat16
    found = variants(model, x, taps, params=True, autocast=bf16, strategies=STRATEGIES)
    run = None
    with tempfile.TemporaryDirectory() as folder:
        if not args.tiny and not args.no_wandb and importlib.util.find_spec("wandb") is not None:
            found["wandb.watch"], run = _wandb_variant(model, x, bf16, folder)
        cuda = args.device.startswith("cuda")
        if cuda:
            found = {k: (ctx, synced(step)) for k, (ctx, step) in found.items()}
        try:
            times = interleaved(found, repeats=repeats, steps_per_block=1 if args.tiny else 3, warmup=1)
            peaks = peak_memory(found) if cuda else {}
            syncs = sync_check(model, x, taps, bf16) if cuda else {}
        finally:
            if run is not None:
                run.finish()
    base = median_ms(times["none"])
    rows = [{"variant": k, "step_ms": median_ms(v), "ratio": median_ms(v) / base, "peak_mib": peaks.get(k),
             "peak_vs_none": peaks[k] / peaks["none"] if peaks else None, "syncs_in_backward": syncs.get(k)}
            for k, v in times.items()]  # fmt: skip
    rows += [{"variant": k, "skipped": why} for k, why in skipped().items()]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    config = {"layers": layers, "width": width, "batch": batch, "seq": seq, "taps": len(taps), "device": device,
              "autocast": "bfloat16"}  # fmt: skip
    print(config)
    report("gpu_realistic", rows, ["variant", "step_ms", "ratio", "peak_mib", "peak_vs_none", "syncs_in_backward",
                                   "skipped"], args.out, config=config)  # fmt: skip


if __name__ == "__main__":
    main()
