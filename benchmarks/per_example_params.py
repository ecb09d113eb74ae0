"""Per-example parameter-gradient norms (`PerExampleNorms`) against a plain backward, and BackPACK's `BatchL2Grad`.

    python benchmarks/per_example_params.py             # MLP, GPT-2 (2 layers, d=128, 8 x 64 tokens), CNN; CPU
    python benchmarks/per_example_params.py --tiny      # smoke run (a test runs it)
    python benchmarks/per_example_params.py --device cuda
    python benchmarks/per_example_params.py --breakdown # where per_example's time goes (CPU time per step)
    python benchmarks/per_example_params.py --cpu-time  # steps timed by the thread's CPU time (a shared CPU)

Every variant takes the same step of the same randomly initialised model: forward, loss (mean over
rows), backward, `.grad` dropped. Variants, interleaved (`_common.interleaved`), ratios to `plain`:

- `plain`: the step alone;
- `per_example`: inside `PerExampleNorms(model, every parameter)`, then `norms()` (every parameter's
  per-row norms, with the check's one device-to-host transfer);
- `per_example_nocheck`: the same with `check=False` (no projection check: what the check costs);
- `capture`: `capture(model, every parameter tap, "hook", keep_grads=False)`, `cap.backward`,
  `cap.records` (statistics of every parameter's `.grad`, one transfer), per_example off;
- `capture+per_example`: the same with `per_example=True` (issue 37: every parameter tap's rows in
  the same transfer); its ratio to `capture` is what turning per_example on costs a captured run;
- `hooks_floor` (a model of Linears only: the MLP): the least any hook-based way pays, a forward hook
  keeping each Linear's input and a tensor hook on its output computing ||g_i||^2 ||x_i||^2 and
  ||g_i||^2, one stack and sqrt (no check, no bookkeeping, no capture);
- `capture_bp`, `capture+per_example_bp` (where BackPACK covers fewer parameters: GPT-2): `capture`
  and `capture+per_example` of only the parameters BackPACK covers, its like-for-like figure;
- `backpack`: BackPACK's `BatchL2Grad` (`extend(copy of the model)`, `with backpack(BatchL2Grad())`),
  when `backpack-for-pytorch` is installed; on GPT-2 it covers only the parameters of the modules it
  supports (fail mode "SILENT": Linear and Embedding; not transformers' Conv1D or LayerNorm), so
  its figure there is not a like-for-like one (the row says how many parameters it covered).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, report, synced

from gradrunner import capture
from gradrunner.capturing.per_example import PerExampleNorms
from gradrunner.models import MLP, SmallCNN

Variant = tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]
Batch = tuple[torch.Tensor, torch.Tensor]


def models(tiny: bool, device: str) -> dict[str, tuple[nn.Module, Batch, Callable[[Any, torch.Tensor], torch.Tensor]]]:
    """name: (model, (input, target), loss of (output, target)): a mean over rows."""
    torch.manual_seed(0)
    b, width, seq = (4, 16, 8) if tiny else (128, 512, 64)
    mlp = MLP(in_features=256 if not tiny else 8, hidden=width, depth=3, out_features=10).to(device)
    mlp_batch = (torch.randn(b, mlp[0].in_features, device=device), torch.randint(0, 10, (b,), device=device))
    cnn = SmallCNN(in_channels=3, num_classes=10, channels=4 if tiny else 16).to(device)
    side = 8 if tiny else 32
    cnn_batch = (torch.randn(b // 4 or 1, 3, side, side, device=device), torch.randint(0, 10, (b // 4 or 1,), device=device))
    gpt, vocab = gpt2(tiny, seq, device)
    tokens = torch.randint(0, vocab, (2 if tiny else 8, seq), device=device)
    ce = nn.functional.cross_entropy

    def lm(out: Any, labels: torch.Tensor) -> torch.Tensor:
        return ce(out.logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    return {"mlp": (mlp, mlp_batch, ce), "gpt2": (gpt, (tokens, tokens), lm), "cnn": (cnn, cnn_batch, ce)}


def gpt2(tiny: bool, seq: int, device: str) -> tuple[nn.Module, int]:
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    vocab = 64 if tiny else 512
    cfg = GPT2Config(n_layer=2, n_embd=16 if tiny else 128, n_head=2 if tiny else 4, vocab_size=vocab,
                     n_positions=seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).to(device), vocab


def params_of(model: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter]]:
    return [(f"{mn}:{pn}", m, p) for mn, m in model.named_modules() for pn, p in m.named_parameters(recurse=False)]


def call(model: nn.Module, x: torch.Tensor) -> Any:
    """GPT-2 gets position_ids with the batch dim, so that wpe's rows are per example too."""
    if x.dtype == torch.long:
        return model(x, position_ids=torch.arange(x.shape[1], device=x.device).expand_as(x))
    return model(x)


def variants(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> tuple[dict[str, Variant], dict[str, Any]]:
    x, y = batch
    params = params_of(model)
    nulls: dict[str, set[str]] = {}  # a per-example variant's null norms in its last step (`measured_what_it_says`)
    info: dict[str, Any] = {"nulls": nulls}

    def plain() -> None:
        loss_fn(call(model, x), y).backward()
        model.zero_grad(set_to_none=True)

    out: dict[str, Variant] = {"plain": (no_context, plain)}
    for name, check in (("per_example", True), ("per_example_nocheck", False)):
        pex = PerExampleNorms(model, params, check=check)

        def ours(pex: PerExampleNorms = pex, name: str = name) -> None:
            loss_fn(call(model, x), y).backward()
            nulls[name] = {k for k, v in pex.norms().items() if v is None}
            model.zero_grad(set_to_none=True)

        out[name] = (lambda pex=pex: pex, ours)
    taps = [n for n, _, p in params if p.requires_grad]

    def captured_pair(suffix: str, taps: list[str]) -> None:
        """`capture<suffix>` and `capture+per_example<suffix>`: capture of `taps`, per_example off and on."""
        for name, on in ((f"capture{suffix}", False), (f"capture+per_example{suffix}", True)):
            cap = capture(model, taps, strategy="hook", keep_grads=False, per_example=on)

            def captured(cap: Any = cap, name: str = name, on: bool = on) -> None:
                loss = loss_fn(call(model, x), y)
                cap.backward(loss)
                rec = cap.records(loss)
                if on:
                    nulls[name] = {f"{k.module}:{k.name}" for k, v in zip(rec.keys, rec.per_example_norm, strict=True) if v is None}
                model.zero_grad(set_to_none=True)

            out[name] = (lambda cap=cap: cap, captured)

    captured_pair("", taps)
    with PerExampleNorms(model, params) as pex:
        plain_loss = loss_fn(call(model, x), y)
        plain_loss.backward()
        info["none_params"] = sorted(k for k, v in pex.norms().items() if v is None)
        model.zero_grad(set_to_none=True)
    if all(isinstance(m, nn.Linear) for _, m, _ in params):
        out["hooks_floor"] = floor_variant(model, x, y, loss_fn)
    bp = backpack_variant(model, x, y, loss_fn)
    if bp is not None:
        out["backpack"], info["backpack_covered"] = bp[0], bp[1]
        if len(bp[2]) < len(taps):  # the same parameters as BackPACK: a like-for-like figure
            captured_pair("_bp", bp[2])
    return out, info


def floor_variant(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Variant:  # fmt: skip
    """The least any hook-based way pays on a model of 2-D Linears: a forward hook keeping the input and a tensor
    hook on the output computing ||g_i||^2 ||x_i||^2 and ||g_i||^2, then one stack and sqrt (no check, no
    bookkeeping, no capture): what per_example costs beyond it is gradrunner's."""
    rows: list[torch.Tensor] = []

    def on_output(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        xin = args[0].detach()

        def on_grad(g: torch.Tensor) -> None:
            g_sq = torch.linalg.vecdot(g, g)
            rows.extend((g_sq * torch.linalg.vecdot(xin, xin), g_sq))

        out.register_hook(on_grad)

    @contextmanager
    def hooked() -> Iterator[None]:
        handles = [m.register_forward_hook(on_output) for m in model.modules() if isinstance(m, nn.Linear)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def step() -> None:
        loss_fn(call(model, x), y).backward()
        torch.stack(rows).double().sqrt()
        rows.clear()
        model.zero_grad(set_to_none=True)

    return hooked, step


def backpack_variant(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                     call: Callable[[nn.Module, torch.Tensor], Any] = call) -> tuple[Variant, str, list[str]] | None:  # fmt: skip
    """BackPACK's BatchL2Grad on a copy of the model (`extend` leaves hooks on the module it extends)."""
    if importlib.util.find_spec("backpack") is None:
        return None
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad
    from backpack.extensions.backprop_extension import FAIL_SILENT

    twin = extend(copy.deepcopy(model), use_converter=False)
    ext = BatchL2Grad()
    ext._fail_mode = FAIL_SILENT  # skip the modules it does not support (its constructor takes no fail_mode)

    def step() -> None:
        with warnings.catch_warnings(), backpack(ext):
            warnings.simplefilter("ignore")
            loss_fn(call(twin, x), y).backward()
        twin.zero_grad(set_to_none=True)

    with warnings.catch_warnings(), backpack(ext):
        warnings.simplefilter("ignore")
        loss_fn(call(twin, x), y).backward()
    names = {id(p): n for n, _, p in params_of(model)}
    covered = [names[id(p)] for p, q in zip(model.parameters(), twin.parameters(), strict=True) if hasattr(q, "batch_l2")]
    twin.zero_grad(set_to_none=True)
    return (no_context, step), f"{len(covered)}/{len(list(twin.parameters()))}", covered


def breakdown(model: nn.Module, batch: Batch, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
              steps: int) -> list[tuple[str, float]]:  # fmt: skip
    """Where `per_example`'s time goes (thread CPU ms per step, medians): its hooks in all; the shares (`share`: the
    layers' terms, and a 2-D Linear's norms); the norms of the weights' shares (`row_sq` of a Factors or convolution
    form) against the layer's own weight gradient computed from the same tensors (all rows at once, as autograd
    does); the check (`Projection.add_call`, `add_grad`)."""
    from gradrunner.capturing import per_example as pe
    from gradrunner.capturing import per_example_check as pc
    from gradrunner.capturing.per_example_conv import ConvShare
    from gradrunner.capturing.per_example_math import Factors

    spent: dict[str, float] = {}

    def timed(owner: Any, attr: str, part: str) -> None:
        inner = getattr(owner, attr)

        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                spent[part] = spent.get(part, 0.0) + time.thread_time() - start

        setattr(owner, attr, wrapper)

    def own_grad(forms: list[Any]) -> None:  # the weight gradient autograd computes from the same tensors
        f = forms[0]
        start = time.thread_time()
        if isinstance(f, Factors) and not f.index:
            b, g, t, p, q = f.shape
            torch.matmul(f.left.transpose(0, 1).reshape(g, b * t, p).transpose(1, 2), f.right.transpose(0, 1).reshape(g, b * t, q))
        elif isinstance(f, ConvShare):
            size = (f.g.shape[1], f.x.shape[1] // f.groups, *f.kernel)
            weight_grad = {1: nn.grad.conv1d_weight, 2: nn.grad.conv2d_weight, 3: nn.grad.conv3d_weight}[f.nd]
            weight_grad(f.x, size, f.g, f.stride, 0, f.dilation, f.groups)
        else:
            return
        spent["weights' own gradients (reference)"] = spent.get("weights' own gradients (reference)", 0.0) + time.thread_time() - start

    originals = {(pe, "row_sq"): pe.row_sq, (pc.Projection, "add_call"): pc.Projection.add_call,
                 (pc.Projection, "add_grad"): pc.Projection.add_grad, (pe.PerExampleNorms, "_on_grad"): pe.PerExampleNorms._on_grad,
                 (pe.PerExampleNorms, "_on_call"): pe.PerExampleNorms._on_call, (pe.PerExampleNorms, "_finish"): pe.PerExampleNorms._finish,
                 (pe.PerExampleNorms, "_on_param_grad"): pe.PerExampleNorms._on_param_grad,
                 (pe.PerExampleNorms, "_on_root"): pe.PerExampleNorms._on_root}  # fmt: skip
    row_sq = pe.row_sq

    def weights_sq(forms: list[Any]) -> torch.Tensor:
        if not any(isinstance(f, Factors | ConvShare) for f in forms):
            return row_sq(forms)
        own_grad(forms)
        start = time.thread_time()
        out = row_sq(forms)
        spent["norms of the weights' shares"] = spent.get("norms of the weights' shares", 0.0) + time.thread_time() - start
        return out

    pe.row_sq = weights_sq  # type: ignore[assignment]
    originals[(pe, "share")] = pe.share
    timed(pe, "share", "shares (the layers' terms; a 2-D Linear's norms)")
    for attr in ("add_call", "add_grad"):
        timed(pc.Projection, attr, "the check's projections")
    for attr in ("_on_grad", "_on_call", "_finish", "_on_param_grad", "_on_root"):
        timed(pe.PerExampleNorms, attr, "per_example's hooks and step end, in all")
    x, y = batch
    out: dict[str, list[float]] = {}
    ref = "weights' own gradients (reference)"
    try:
        for i in range(steps + 2):  # a plain step, then one with per_example (its reference taken out)
            start = time.thread_time()
            loss_fn(call(model, x), y).backward()
            plain = time.thread_time() - start
            model.zero_grad(set_to_none=True)
            with PerExampleNorms(model, params_of(model)) as pex:
                spent.clear()
                start = time.thread_time()
                loss_fn(call(model, x), y).backward()
                pex.norms()
                total = time.thread_time() - start - spent.get(ref, 0.0)
                spent["per_example's hooks and step end, in all"] -= spent.get(ref, 0.0)
                model.zero_grad(set_to_none=True)
            if i >= 2:
                for part, sec in {"plain step": plain, "per_example step": total, **spent}.items():
                    out.setdefault(part, []).append(sec)
    finally:
        for (owner, attr), fn in originals.items():
            setattr(owner, attr, fn)
    return [(part, 1e3 * statistics.median(v)) for part, v in out.items()]


def measured_what_it_says(model: str, info: dict[str, Any]) -> None:
    """Stop where a per-example variant's last step had null norms a plain `PerExampleNorms` step has not: its
    time would be that of a path computing fewer norms (as re-entered sessions did before 2026-11-27)."""
    for variant, nulls in info["nulls"].items():
        if extra := sorted(nulls - set(info["none_params"])):
            raise SystemExit(f"per_example_params: {model} {variant} recorded null per-example norms for {extra}; "
                             "its time is not that of the norms it names")  # fmt: skip


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cpu")
        p.add_argument("--breakdown", action="store_true", help="where per_example's time goes, per model (CPU time)")
        p.add_argument("--cpu-time", action="store_true",
                       help="time steps by this thread's CPU time, not wall time (one-thread CPU runs, shared machine)")

    args = parse_args(__doc__.splitlines()[0], extra)
    repeats = args.repeats or (2 if args.tiny else 20)
    rows: list[dict[str, Any]] = []
    if args.breakdown:
        for name, (model, batch, loss_fn) in models(args.tiny, args.device).items():
            rows += [{"model": name, "part": part, "ms": ms} for part, ms in breakdown(model, batch, loss_fn, repeats)]
        report("per_example_breakdown", rows, ["model", "part", "ms"], args.out, repeats=repeats, device=args.device)
        return
    for name, (model, batch, loss_fn) in models(args.tiny, args.device).items():
        vs, info = variants(model, batch, loss_fn)
        if args.device != "cpu":
            vs = {k: (c, synced(s)) for k, (c, s) in vs.items()}
        clock = time.thread_time if args.cpu_time else time.perf_counter
        times = interleaved(vs, repeats=repeats, steps_per_block=2 if args.tiny else 5, clock=clock)
        measured_what_it_says(name, info)
        base, captured = median_ms(times["plain"]), median_ms(times["capture"])
        captured_bp = median_ms(times["capture_bp"]) if "capture_bp" in times else captured
        for variant, samples in times.items():
            ms = median_ms(samples)
            row = {"model": name, "variant": variant, "ms": ms, "ratio": ms / base, "rows": int(batch[0].shape[0]),
                   "vs_capture": ms / (captured_bp if variant.endswith("_bp") else captured)}  # fmt: skip
            if variant == "backpack" or variant.endswith("_bp"):
                row["note"] = f"BatchL2Grad's {info['backpack_covered']} parameters"
            elif variant.startswith("per_example") and info["none_params"]:
                row["note"] = f"None for {info['none_params']}"
            rows.append(row)
    if importlib.util.find_spec("backpack") is None:
        print("BackPACK not installed (pip install --no-deps backpack-for-pytorch einops unfoldNd): skipped", file=sys.stderr)
    report("per_example_params", rows, ["model", "variant", "rows", "ms", "ratio", "vs_capture", "note"], args.out,
           repeats=repeats, device=args.device, clock="thread CPU time" if args.cpu_time else "wall")  # fmt: skip


if __name__ == "__main__":
    main()
