"""gradrunner beside its peers on one model and one set of gradient statistics, interleaved.

    python benchmarks/peers.py                 # a 4-layer GPT-2 (d=256) at batch 8 x 128 on CPU
    python benchmarks/peers.py --tiny          # smoke run (a test runs it)
    python benchmarks/peers.py --device cuda --layers 12 --width 768 --seq 512

Every variant takes one AdamW training step of the same randomly initialised GPT-2 (from
`GPT2Config`, no download) and gets, for the gradient of every block's output, attention output and
MLP output, the same seven reductions (sum, sum of squares, min, max, non-zero, NaN and Inf
counts: what gradrunner derives its nine statistics from), moved to the host once per step:

- `none`: the step alone;
- `gradrunner`: `capture(model, taps, "hook")`, `cap.backward`, `cap.records`;
- `plain_hooks`: forward hooks registering tensor hooks that reduce each gradient with torch ops;
- `nnsight`: `NNsight(model).trace(...)` with the same reductions on `.output.grad` inside
  `loss.backward()` (when nnsight is installed: `pip install gradrunner[peers]`);
- `torchlens`: `torchlens.trace(model, ..., capture=CaptureOptions(layers_to_save=paths,
  save_grads=paths, backward_ready=True, unwrap_when_done=True), save=SaveOptions(grad_transform=
  reductions, save_raw_gradients=False))`, then `trace.log_backward(loss)`: its gradient hooks on
  the same modules' output operations apply the same reductions, read from each module's output
  layer's `transformed_grad` (when torchlens is installed). The loss is the trace's first output
  layer, which torchlens only keeps when layers are saved, so it also copies the tapped activations
  (`layers_to_save`; with no layer saved the trace's output is None and backward cannot start).
  `unwrap_when_done=True` restores torch's functions after each trace, so the variants after it
  run unwrapped torch; torchlens pays for wrapping them again on its next step (`--torchlens-wrapped`
  leaves them wrapped, torchlens' default, and then every variant runs on wrapped torch, nnsight
  left out: under wrapped torch its `with loss.backward():` gets None). Checked once by
  hand (2-layer GPT-2, torchlens 2.36.1): with the same dropout seed its seven reductions equal
  `plain_hooks`' exactly. With dropout off (eval, or p=0) the attention and MLP outputs, whose
  last operation is then an identity dropout, get no gradient from torchlens (`transformed_grad`
  None), so this variant needs the model's dropout on, as GPT-2's default config has it;
- TransformerLens is listed as skipped when not installed (its dependencies would change the
  shared environment here).

Variants run interleaved (`_common.interleaved`); ratios are to `none`.

`--per-example` (issue 37) compares per-example gradient norms of every parameter instead, each
variant one AdamW step: `none`; `gradrunner_params` (`capture` of every parameter tap, per_example
off); `gradrunner_per_example` (the same with `per_example=True`: each row's share of every
parameter's `.grad`, exact, null with a reason where not); `backpack` (BackPACK's `BatchL2Grad` on
an `extend`ed copy, fail mode silent: it covers only the parameters of modules it supports, on GPT-2
the Linear/Embedding ones, not transformers' Conv1D or LayerNorm: the row says how many); and,
with BackPACK, `gradrunner_params_bp` and `gradrunner_per_example_bp`: the same two on only the
parameters BackPACK covers (the like-for-like comparison).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, median_ms, no_context, parse_args, report, synced

from gradrunner import capture

Variant = tuple[Callable[[], AbstractContextManager[Any]], Callable[[], None]]


def gpt2(layers: int, width: int, heads: int, vocab: int, seq: int, device: str) -> nn.Module:
    """A randomly initialised GPT-2 language model (transformers' `GPT2LMHeadModel`)."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=max(seq, 16),
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).to(device)


def activation_modules(model: nn.Module) -> list[str]:
    """Every block, its attention and its MLP: the activations whose gradients all variants read."""
    n = len(model.transformer.h)  # type: ignore[union-attr,arg-type]
    return [f"transformer.h.{i}{part}" for i in range(n) for part in (".attn", ".mlp", "")]  # in forward order (nnsight asks in that order)


def activation_taps(model: nn.Module) -> list[str]:
    """gradrunner's taps for `activation_modules` (an attention module returns a tuple: its element 0)."""
    return [f"{p}:output.0" if p.endswith(".attn") else f"{p}:output" for p in activation_modules(model)]


def reductions(g: torch.Tensor) -> torch.Tensor:
    """The seven reductions of one gradient with plain torch ops, float64, on its device (no sync)."""
    g = g.detach()
    mn, mx = torch.aminmax(g)
    wide = torch.float64 if g.device.type != "mps" else torch.float32
    return torch.stack([
        g.sum(dtype=wide), torch.linalg.vector_norm(g, dtype=wide).square(), mn.to(wide), mx.to(wide),
        torch.count_nonzero(g).to(wide), torch.isnan(g).sum().to(wide), torch.isinf(g).sum().to(wide),
    ])  # fmt: skip


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def tensor_hooks(model: nn.Module, paths: list[str], sink: list[torch.Tensor], params: bool = False) -> Iterator[None]:
    """Plain PyTorch: a forward hook per module registers a tensor hook reducing the output's gradient."""
    handles = []

    def on_forward(_m: nn.Module, _a: Any, out: Any) -> None:
        t = _first(out)
        if t.requires_grad:
            t.register_hook(lambda g: sink.append(reductions(g)))

    for path in paths:
        handles.append(model.get_submodule(path).register_forward_hook(on_forward))
    if params:
        handles += [p.register_hook(lambda g: sink.append(reductions(g))) for p in model.parameters()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def variants(model: nn.Module, x: torch.Tensor, taps: list[str], *, params: bool = False,
             autocast: torch.dtype | None = None, peers: bool = True,
             strategies: tuple[str, ...] = ("hook",), torchlens_unwrap: bool = True) -> dict[str, Variant]:  # fmt: skip
    """`none`, gradrunner (`gradrunner`, or each of `strategies` by name), `plain_hooks` and the installed
    peers, one AdamW step each; `params` also reduces every parameter's gradient in `plain_hooks`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    paths = activation_modules(model)

    def loss_of() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            return model(x, labels=x).loss

    def finish() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain() -> None:
        loss_of().backward()
        finish()

    out: dict[str, Variant] = {"none": (no_context, plain)}
    for strategy in strategies:
        cap = capture(model, taps, strategy=strategy, values="none", keep_grads=False)

        def ours(cap: Any = cap) -> None:
            loss = loss_of()
            cap.backward(loss)
            finish()
            cap.records(loss)

        out["gradrunner" if strategies == ("hook",) else strategy] = (lambda cap=cap: cap, ours)
    sink: list[torch.Tensor] = []

    def hooked() -> None:
        loss = loss_of()
        loss.backward()
        finish()
        torch.cat([torch.stack(sink).reshape(-1), loss.detach().double().reshape(1)]).cpu()
        sink.clear()

    out["plain_hooks"] = (lambda: tensor_hooks(model, paths, sink, params), hooked)
    if peers and importlib.util.find_spec("nnsight") is not None:
        out["nnsight"] = (no_context, _nnsight_step(model, x, paths, autocast, finish))
    if peers and importlib.util.find_spec("torchlens") is not None:
        out["torchlens"] = (no_context, _torchlens_step(model, x, paths, autocast, finish, torchlens_unwrap))
    return out


def _torchlens_step(model: nn.Module, x: torch.Tensor, paths: list[str], autocast: torch.dtype | None,
                    finish: Callable[[], None], unwrap: bool = True) -> Callable[[], None]:  # fmt: skip
    """torchlens 2.x: trace the forward, backward from the traced loss; its gradient hooks reduce."""
    import torchlens as tl

    save = tl.options.SaveOptions(grad_transform=reductions, save_raw_gradients=False)
    options = tl.options.CaptureOptions(layers_to_save=paths, save_grads=paths, backward_ready=True,
                                        unwrap_when_done=unwrap)  # fmt: skip

    def step() -> None:
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            trace = tl.trace(model, input_args=[x], input_kwargs={"labels": x}, save=save, capture=options)
        trace.log_backward(trace[trace.output_layers[0]].out)  # output 0 of a causal LM with labels: the loss
        rows = [trace[trace.modules[p].output_ops[0]].transformed_grad for p in paths]  # "add_3_37:2": one pass
        torch.stack(rows).cpu()
        finish()

    return step


def _nnsight_step(model: nn.Module, x: torch.Tensor, paths: list[str], autocast: torch.dtype | None,
                  finish: Callable[[], None]) -> Callable[[], None]:  # fmt: skip
    """nnsight's trace: the same loss under the same autocast, the same reductions of the same gradients."""
    from nnsight import NNsight

    wrapped = NNsight(model)
    envoys = [_envoy(wrapped, path) for path in paths]

    def step() -> None:
        rows: list[torch.Tensor] = []
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None), wrapped.trace(x, labels=x):
            acts = []
            for e in envoys:
                o = e.output  # each output is read once, in forward order
                acts.append(_first(o))
            loss = wrapped.output.loss
            with loss.backward():
                for a in reversed(acts):  # in the order backward meets them
                    rows.append(reductions(a.grad).save())
        assert len(rows) == len(paths)
        torch.stack(rows).cpu()
        finish()

    return step


def _envoy(wrapped: Any, path: str) -> Any:
    for part in path.split("."):
        wrapped = wrapped[int(part)] if part.isdigit() else getattr(wrapped, part)
    return wrapped


def per_example_variants(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, Variant], str]:
    """`none`, gradrunner on every parameter tap without and with per_example, BackPACK's BatchL2Grad (when installed)."""
    from per_example_params import backpack_variant

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    positions = torch.arange(x.shape[1], device=x.device).expand_as(x)  # wpe's rows per example too

    def loss_of(m: nn.Module) -> torch.Tensor:
        return m(x, position_ids=positions, labels=x).loss

    def plain() -> None:
        loss_of(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out: dict[str, Variant] = {"none": (no_context, plain)}

    first_nulls: dict[str, set[str]] = {}

    def captured_pair(suffix: str, taps: list[str]) -> None:
        """`gradrunner_params<suffix>` and `gradrunner_per_example<suffix>`: capture of `taps`, per_example off/on."""
        for name, on in ((f"gradrunner_params{suffix}", False), (f"gradrunner_per_example{suffix}", True)):
            cap = capture(model, taps, strategy="hook", keep_grads=False, per_example=on)

            def ours(cap: Any = cap, name: str = name, on: bool = on) -> None:
                loss = loss_of(model)
                cap.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec = cap.records(loss)
                if on:  # a step with more null norms than the session's first computed fewer: its time is not theirs
                    nulls = {k.tap for k, v in zip(rec.keys, rec.per_example_norm, strict=True) if v is None}
                    if extra := sorted(nulls - first_nulls.setdefault(name, nulls)):
                        raise SystemExit(f"peers: {name} recorded null per-example norms for {extra} after its first step")

            out[name] = (lambda cap=cap: cap, ours)

    captured_pair("", [f"{mn}:{pn}" for mn, m in model.named_modules() for pn, _ in m.named_parameters(recurse=False)])
    covered = "BackPACK not installed"
    bp = backpack_variant(model, x, x, lambda out, y: out.loss, call=lambda m, t: m(t, position_ids=positions, labels=t))
    if bp is not None:
        out["backpack"], covered = bp[0], f"BatchL2Grad on {bp[1]} parameters (the other modules unsupported)"
        captured_pair("_bp", bp[2])  # BackPACK's parameters only: a like-for-like figure
    return out, covered


def skipped() -> dict[str, str]:
    """Peers not run here, and why."""
    why = {}
    if importlib.util.find_spec("nnsight") is None:
        why["nnsight"] = "not installed (pip install gradrunner[peers])"
    if importlib.util.find_spec("transformer_lens") is None:
        why["transformer_lens"] = "not installed (pip install gradrunner[peers])"
    if importlib.util.find_spec("torchlens") is None:
        why["torchlens"] = "not installed (pip install gradrunner[peers])"
    return why


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="cpu")
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--width", type=int, default=256)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--seq", type=int, default=128)
        p.add_argument("--cpu-time", action="store_true",
                       help="time steps by this thread's CPU time, not wall time (one-thread CPU runs, shared machine)")
        p.add_argument("--per-example", action="store_true",
                       help="per-example norms of every parameter: gradrunner against BackPACK's BatchL2Grad")
        p.add_argument("--torchlens-wrapped", action="store_true",
                       help="leave torch's functions wrapped after torchlens' first trace (its default): every "
                            "variant then runs on wrapped torch")  # fmt: skip

    args = parse_args(__doc__.splitlines()[0], extra)
    torch.set_num_threads(args.threads)
    if args.tiny:
        args.layers, args.width, args.batch, args.seq = 2, 32, 2, 16
    repeats = args.repeats or (2 if args.tiny else 10)
    model = gpt2(args.layers, args.width, max(2, args.width // 64), 1000, args.seq, args.device)
    x = torch.randint(0, 1000, (args.batch, args.seq), device=args.device)
    taps = activation_taps(model)
    if args.per_example:
        found, covered = per_example_variants(model, x)
        why = {"backpack": covered}
    else:
        found = variants(model, x, taps, torchlens_unwrap=not args.torchlens_wrapped)
        why = skipped()
    if args.torchlens_wrapped and found.pop("nnsight", None) is not None:
        # seen with nnsight 0.8.1 and torchlens 2.36.1: `with loss.backward():` inside nnsight's trace
        # gets None ("'NoneType' object does not support the context manager protocol")
        why["nnsight"] = "not run with --torchlens-wrapped: torchlens' wrapped torch breaks its loss.backward() context"
    if args.device.startswith("cuda"):
        found = {k: (ctx, synced(step)) for k, (ctx, step) in found.items()}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    times = interleaved(found, repeats=repeats, steps_per_block=3 if not args.tiny else 1, warmup=1, clock=clock)
    base = median_ms(times["none"])
    rows = [{"variant": k, "step_ms": median_ms(v), "ratio": median_ms(v) / base} for k, v in times.items()]
    rows += [{"variant": k, "skipped": reason} for k, reason in why.items() if not args.per_example]
    if args.per_example:
        rows = [{**r, "note": why["backpack"]} if r["variant"] == "backpack" else r for r in rows]
    config = {"layers": args.layers, "width": args.width, "batch": args.batch, "seq": args.seq, "taps": len(taps),
              "device": args.device, "per_example": args.per_example, "cpu_time": args.cpu_time}  # fmt: skip
    print(config)
    report("peers", rows, ["variant", "step_ms", "ratio", "skipped", "note"], args.out, config=config)


if __name__ == "__main__":
    main()
