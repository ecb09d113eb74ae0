"""What capture costs inside the user's own loop: `record`, the Lightning and HF callbacks, and `wandb.watch`.

Side by side, interleaved (`_common.interleaved` for the plain loop; whole `fit`/`train` runs
alternated for the frameworks), per-step medians:

- plain loop: bare · `gradrunner.record` (hook, every tap's statistics every step) · `wandb.watch(log="gradients",
  log_freq=1)` in offline mode (parameter gradients only, when wandb is installed);
- Lightning: `Trainer.fit` bare · with `GradientCapture` (step = `on_train_batch_start` to `on_train_batch_end`);
- HF Trainer: tiny GPT-2, bare · with `GradientCaptureCallback` (step = one `on_step_begin` to the next).

Each row states the taps its specs resolve to (`resolved_taps`): globs expanded as the capture expands them.

Example::

    OMP_NUM_THREADS=2 python benchmarks/integrations_overhead.py          # CPU figures in BENCHMARKS.md
    python benchmarks/integrations_overhead.py --tiny                     # smoke run (CI)
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, report

import gradrunner

TAPS = ["*:output", "*:weight"]
#: The HF Trainer's taps: `*` matches dots too, so `transformer.h.*` reaches every submodule of every block.
HF_TAPS = ["transformer.h.*:output", "transformer.h.*.mlp.c_fc:weight"]


def gpt2(tiny: bool) -> nn.Module:
    import transformers

    size = dict(n_layer=1, n_embd=16, n_head=2) if tiny else dict(n_layer=2, n_embd=128, n_head=4)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=64, **size))


def resolved_taps(width: int, depth: int, tiny: bool) -> dict[str, int]:
    """How many taps each loop's specs resolve to (what BENCHMARKS.md states), per loop."""
    from gradrunner.capturing.taps import resolve_taps

    counts = {"plain": len(resolve_taps(mlp(width, depth), TAPS))}
    counts["lightning"] = counts["plain"]  # the same MLP as `net`, the same specs under "net."
    with contextlib.suppress(ImportError):
        counts["hf"] = len(resolve_taps(gpt2(tiny), HF_TAPS))
    return counts


def mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def plain_loop(width: int, depth: int, batch: int, repeats: int, tmp: Path) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = mlp(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    n = iter(range(10**9))
    current: list[Any] = [None]

    def bare() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        with gradrunner.record(model, TAPS, tmp / f"rec{next(n)}", live_every=0) as rec:
            current[0] = rec
            yield

    def recorded() -> None:
        rec = current[0]
        loss = nn.functional.mse_loss(model(x), y)
        rec.backward(loss)
        opt.step()
        opt.zero_grad()
        rec.step(loss)

    variants: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {"bare loop": (no_context, bare),
                                                                         "record (hook)": (recording, recorded)}  # fmt: skip
    run = None
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(mode="offline", dir=str(tmp), project="bench")

        @contextlib.contextmanager
        def watching() -> Iterator[None]:
            run.watch(model, log="gradients", log_freq=1)
            try:
                yield
            finally:
                run.unwatch(model)

        def watched() -> None:
            bare()
            run.log({"loss": 0.0})  # wandb.watch's histograms are committed with the step's log

        variants["wandb.watch(log='gradients')"] = (watching, watched)
    except ImportError:
        pass
    try:
        times = interleaved(variants, repeats=repeats)
    finally:
        if run is not None:
            run.finish()
    base = median_ms(times["bare loop"])
    return [{"loop": "plain", "variant": k, "ms_per_step": median_ms(v), "ratio": median_ms(v) / base} for k, v in times.items()]


class StepTimer:
    """Per-step seconds between two framework events (the timer runs after every other callback)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t: float | None = None

    def start(self) -> None:
        self._t = time.perf_counter()

    def stop(self) -> None:
        if self._t is not None:
            self.times.append(time.perf_counter() - self._t)
        self._t = None

    def lap(self) -> None:
        self.stop()
        self.start()


def lightning_rows(width: int, depth: int, batch: int, steps: int, repeats: int, tmp: Path) -> list[dict[str, Any]]:
    import lightning.pytorch as pl

    from gradrunner.integrations.lightning import GradientCapture

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width, depth)

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.t = StepTimer()

        def on_train_batch_start(self, *a: Any) -> None:
            self.t.start()

        def on_train_batch_end(self, *a: Any) -> None:
            self.t.stop()

    data = torch.utils.data.TensorDataset(torch.randn(batch * steps, width), torch.randn(batch * steps, 1))
    times: dict[str, list[float]] = {"Lightning bare": [], "Lightning + GradientCapture": []}
    for r in range(repeats):
        for name in list(times)[r % 2 :] + list(times)[: r % 2]:
            timer = Timer()
            cbs: list[pl.Callback] = [timer]
            if "Capture" in name:
                cbs = [GradientCapture(taps=["net." + t for t in TAPS], dir=tmp / f"pl{r}", live_every=0), timer]
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pl.Trainer(max_steps=steps, callbacks=cbs, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                           devices=1).fit(Module(), torch.utils.data.DataLoader(data, batch_size=batch))  # fmt: skip
            times[name] += timer.t.times[2:]
    base = median_ms(times["Lightning bare"])
    return [{"loop": "lightning", "variant": k, "ms_per_step": median_ms(v), "ratio": median_ms(v) / base} for k, v in times.items()]


def hf_rows(steps: int, repeats: int, tmp: Path, tiny: bool) -> list[dict[str, Any]]:
    import transformers

    from gradrunner.integrations.hf import GradientCaptureCallback

    class Timer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.t = StepTimer()

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t.lap()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            self.t.stop()

    times: dict[str, list[float]] = {"HF Trainer bare": [], "HF Trainer + GradientCaptureCallback": []}
    for r in range(repeats):
        for name in list(times)[r % 2 :] + list(times)[: r % 2]:
            torch.manual_seed(0)
            model = gpt2(tiny)
            data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (8 * steps, 64))]
            timer = Timer()
            cbs: list[Any] = [timer]
            if "Capture" in name:
                cbs = [GradientCaptureCallback(taps=HF_TAPS, dir=tmp / f"hf{r}", live_every=0), timer]
            args = transformers.TrainingArguments(str(tmp / f"hfout{r}{name[-3:]}"), max_steps=steps,
                                                  per_device_train_batch_size=8, report_to="none", save_strategy="no",
                                                  use_cpu=True, disable_tqdm=True, logging_steps=10**6)  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=cbs).train()
            times[name] += timer.t.times[2:]
    base = median_ms(times["HF Trainer bare"])
    return [{"loop": "hf", "variant": k, "ms_per_step": median_ms(v), "ratio": median_ms(v) / base} for k, v in times.items()]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    tiny = args.tiny
    width, depth, batch = (16, 2, 8) if tiny else (256, 6, 64)
    repeats = args.repeats or (2 if tiny else 20)
    steps = 4 if tiny else 30
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = plain_loop(width, depth, batch, repeats, tmp)
        with contextlib.suppress(ImportError):
            rows += lightning_rows(width, depth, batch, steps, max(2, repeats // 4), tmp)
        with contextlib.suppress(ImportError):
            rows += hf_rows(steps, max(2, repeats // 4), tmp, tiny)
    taps = resolved_taps(width, depth, tiny)
    for row in rows:  # every variant of a loop captures the same resolved taps (bare ones none)
        row["taps"] = 0 if "bare" in str(row["variant"]) else taps[str(row["loop"])]
    report("integrations_overhead", rows, ["loop", "variant", "taps", "ms_per_step", "ratio"], out=args.out,
           sizes={"width": width, "depth": depth, "batch": batch, "steps": steps, "repeats": repeats})  # fmt: skip


if __name__ == "__main__":
    main()
