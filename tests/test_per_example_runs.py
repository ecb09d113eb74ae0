"""Per-example norms of parameter taps in real loops: accumulation, autocast, DDP, `record()`, Lightning, HF Trainer.

Each against a per-example loop (`per_example_reference.loop`: each row alone, its loss scaled to
its share of the step's loss) on a twin of the model replayed in plain torch. Under accumulation a
row's norm is that of its share of the step's accumulated `.grad` (rows of every micro-batch, in
order); under DDP a rank's rows are their shares of the averaged `.grad` (the loop's / world size).
Also transparency: loss, `.grad` and a post-accumulate-grad hook bit-identical with per_example on and off.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import procs
import pytest
import torch
from per_example_reference import all_params, assert_matches, loop
from torch import nn

from gradrunner import capture, record
from gradrunner.analysis import load

STRATEGIES = ["retain_grad", "hook", "autograd_grad"]
TESTS = Path(__file__).resolve().parent


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))


def mse_rows(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def rows_of(df: pd.DataFrame, step: int, tap: str) -> torch.Tensor:
    pe = df[(df.step == step) & (df.tap == tap)].per_example_norm
    assert len(pe) == 1 and pe.iloc[0] is not None, (step, tap)
    return torch.tensor(np.asarray(pe.iloc[0], dtype=np.float64))


def reference(model: nn.Module, xs: list[torch.Tensor], ys: list[torch.Tensor], scale: float, taps: list[str]) -> dict[str, torch.Tensor]:
    """Every row of every micro-batch alone: ||grad(mse(row)) * scale|| (scale: the row's share of the step's loss)."""
    params = [p for p in all_params(model) if p[0] in taps]
    x, y = torch.cat(xs), torch.cat(ys)
    ref, _ = loop(model, {"input": x}, lambda out, i: mse_rows(out, y[i : i + 1]) * x.shape[0] * scale, params)
    return ref


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_rows_are_shares_of_the_steps_grad(strategy: str) -> None:
    """Two micro-batches of 3 rows, each loss / 2: six rows, each its share of the accumulated .grad."""
    model = mlp()
    taps = ["0:weight", "0:bias", "1:weight", "3:weight"]
    g = torch.Generator().manual_seed(1)
    xs, ys = [torch.randn(3, 4, generator=g) for _ in range(2)], [torch.randn(3, 2, generator=g) for _ in range(2)]
    with capture(model, taps, strategy=strategy, per_example=True) as cap:
        for x, y in zip(xs, ys, strict=True):
            loss = mse_rows(model(x), y) / 2
            cap.backward(loss)
        recs = cap.records()
    got = {recs.keys[i].tap: torch.from_numpy(recs.per_example_norm[i]) for i in range(len(recs))}  # type: ignore[index, arg-type]
    ref = reference(model, xs, ys, 1 / 6, taps)
    assert_matches(got, ref, {t: None for t in taps})
    assert all(v.shape == (6,) for v in got.values())


def test_autocast_bfloat16_through_capture() -> None:
    """CPU autocast (bf16 Linear): rows close to the loop run under the same autocast (bf16's rounding, 2e-2)."""
    model = mlp()
    taps = [n for n, _, _ in all_params(model)]
    x, y = torch.randn(5, 6, 4), torch.randn(5, 6, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with capture(model, taps, per_example=True) as cap:
            loss = mse_rows(model(x).float(), y)
            cap.backward(loss)
            recs = cap.records(loss)
        ref = reference(model, [x], [y], 1 / 5, taps)
    got = {recs.keys[i].tap: torch.from_numpy(recs.per_example_norm[i]) for i in range(len(recs))}  # type: ignore[index, arg-type]
    assert_matches(got, ref, {t: None for t in taps}, rtol=2e-2)


def _step(model: nn.Module, ids: torch.Tensor, strategy: str | None, per_example: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
    """One backward of tiny GPT-2; with `strategy`, under capture of every parameter (and its output), hooks' views kept."""
    model.zero_grad(set_to_none=True)
    seen: list[torch.Tensor] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone())) for p in model.parameters()]
    taps = [n for n, _, _ in all_params(model)] + ["transformer.h.0.mlp:output"]
    with contextlib.ExitStack() as stack:
        cap = stack.enter_context(capture(model, taps, strategy=strategy, per_example=per_example)) if strategy else None
        out = model(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids)).logits
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids.roll(1, 1).reshape(-1))
        if cap is not None:
            cap.backward(loss)
            pe = cap.records(loss).per_example_norm
            assert (pe is not None) == per_example and (pe is None or all(r is not None for r in pe))
        else:
            loss.backward()
    for h in handles:
        h.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_grad_and_hooks_bit_identical_with_per_example_on(strategy: str) -> None:
    """per_example on against off (the same strategy), and against no capture: loss, .grad, what hooks on .grad saw."""
    from per_example_reference import gpt2

    model = gpt2()
    ids = torch.randint(0, 40, (3, 7))
    bare, off, on = _step(model, ids, None, False), _step(model, ids, strategy, False), _step(model, ids, strategy, True)
    for a, b in ((off, on), (bare, on)):
        assert torch.equal(a[0], b[0])
        assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    # the hooks: the same tensors in the same order as with per_example off (autograd_grad accumulates in its own order)
    for a in (off, bare) if strategy != "autograd_grad" else (off,):
        assert len(a[2]) == len(on[2]) and all(torch.equal(x, y) for x, y in zip(a[2], on[2], strict=True))


def test_record_a_real_run(tmp_path: Path) -> None:
    """record() over 3 SGD steps: each step's rows against the loop on a plain-torch twin trained in lockstep."""
    model, twin = mlp(), mlp()
    taps = ["0:weight", "1:bias", "3:weight"]
    opt, opt_twin = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    refs = []
    with record(model, taps, tmp_path / "run", per_example=True) as rec:
        for x, y in data:
            refs.append(reference(twin, [x], [y], 1 / 4, taps))
            mse_rows(twin(x), y).backward()
            opt_twin.step()
            opt_twin.zero_grad()
            loss = mse_rows(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "run")
    for step, ref in enumerate(refs):
        assert_matches({t: rows_of(df, step, t) for t in taps}, ref, {t: None for t in taps})


pl = None
try:
    import lightning.pytorch as pl  # type: ignore[no-redef]
except ImportError:  # pragma: no cover
    pass


def test_lightning_with_accumulation(tmp_path: Path) -> None:
    if pl is None:
        pytest.skip("lightning not installed")
    from gradrunner.integrations.lightning import GradientCapture

    class Module(pl.LightningModule):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return mse_rows(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g))
    taps = ["net.0:weight", "net.1:weight", "net.3:bias"]
    cb = GradientCapture(taps=taps, dir=tmp_path / "run", per_example=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=2, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu", devices=1, accumulate_grad_batches=2).fit(
            Module(), torch.utils.data.DataLoader(data, batch_size=3, shuffle=False))  # fmt: skip
    df = load(tmp_path / "run")
    twin = mlp()
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(2):
        xs = [data.tensors[0][(2 * step + m) * 3 : (2 * step + m + 1) * 3] for m in range(2)]
        ys = [data.tensors[1][(2 * step + m) * 3 : (2 * step + m + 1) * 3] for m in range(2)]
        ref = reference(twin, xs, ys, 1 / 6, [t.removeprefix("net.") for t in taps])
        assert_matches({t: rows_of(df, step, "net." + t) for t in ref}, ref, {t: None for t in ref})
        for x, y in zip(xs, ys, strict=True):
            (mse_rows(twin(x), y) / 2).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
def test_hf_trainer_tiny_gpt2(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hf_reference import Seen, tiny_gpt2

    from gradrunner.integrations.hf import GradientCaptureCallback

    model = tiny_gpt2()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (4, 8), generator=g)]
    seen = Seen(model)
    taps = ["transformer.h.0.mlp.c_fc:weight", "transformer.h.1.ln_1:weight", "lm_head:weight"]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    cb = GradientCaptureCallback(taps=taps, dir=tmp_path / "run", per_example=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[seen, cb]).train()
    df = load(tmp_path / "run")
    batch = torch.cat([b["input_ids"] for b in seen.batches])
    items = batch.numel()  # the Trainer divides the step's summed token loss by its (unshifted) label count

    def row_loss(out: Any, i: int) -> torch.Tensor:
        logits, labels = out.logits[0, :-1].float(), batch[i, 1:]
        return nn.functional.cross_entropy(logits, labels, reduction="sum") / items * batch.shape[0]

    params = [p for p in all_params(twin) if p[0] in taps]
    ref, _ = loop(twin, {"input_ids": batch}, row_loss, params)  # the loop divides by the rows
    got = {t: rows_of(df, 0, t) for t in taps}
    assert_matches(got, ref, {t: None for t in taps}, rtol=1e-4)


def _rank(rank: int, out: str) -> None:
    """One DDP rank (gloo): capture(per_example) of the averaged step, and its own loop's rows / world size."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradrunner.run.distributed import capture_target

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)  # torchrun's MASTER_ADDR and MASTER_PORT
    try:
        model = mlp()
        twin = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        g = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        taps = ["0:weight", "1:weight", "3:bias"]
        inner, synced = capture_target(ddp)
        with capture(inner, taps, per_example=True, params_synced=synced) as cap:
            loss = mse_rows(ddp(x), y)
            loss.backward()
            recs = cap.records(loss)
        got = {recs.keys[i].tap: torch.from_numpy(recs.per_example_norm[i]) for i in range(len(recs))}  # type: ignore[index, arg-type]
        norms = {recs.keys[i].tap: float(recs.stats["norm"][i]) for i in range(len(recs))}
        grads = {t: float(dict(all_params_of(model))[t].grad.double().norm()) for t in taps}
        ref = reference(twin, [x], [y], 1 / 3 / 2, taps)
        # accumulation: two micro-batches of 3 rows, DDP synchronising on the last only (no_sync before it)
        model.zero_grad(set_to_none=True)
        xs, ys = [x, torch.randn(3, 4, generator=g)], [y, torch.randn(3, 2, generator=g)]
        with capture(inner, taps, per_example=True, params_synced=synced) as cap:
            with ddp.no_sync():
                (mse_rows(ddp(xs[0]), ys[0]) / 2).backward()
            (mse_rows(ddp(xs[1]), ys[1]) / 2).backward()
            recs = cap.records()
        acc = {recs.keys[i].tap: torch.from_numpy(recs.per_example_norm[i]) for i in range(len(recs))}  # type: ignore[index, arg-type]
        acc_ref = reference(twin, xs, ys, 1 / 6 / 2, taps)
        torch.save({"got": got, "ref": ref, "norms": norms, "grads": grads, "acc": acc, "acc_ref": acc_ref},
                   os.path.join(out, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


def all_params_of(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, _, p in all_params(model)]


def test_ddp_two_ranks_rows_are_shares_of_the_averaged_grad_with_and_without_accumulation(tmp_path: Path) -> None:
    from rank_launch import torchrun

    torchrun(2, tmp_path, [], timeout=600, script=Path(__file__).name)  # no rank left behind, or it fails
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in results:
        assert_matches(res["got"], res["ref"], {t: None for t in res["ref"]})
        assert res["norms"] == pytest.approx(res["grads"], rel=1e-6)  # the record: the averaged .grad
        assert all(v.shape == (6,) for v in res["acc"].values())  # both micro-batches' rows, in order
        assert_matches(res["acc"], res["acc_ref"], {t: None for t in res["acc_ref"]})
    assert not torch.equal(results[0]["got"]["0:weight"], results[1]["got"]["0:weight"])  # each rank its own rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_loss_scale_is_divided_out_of_the_rows(strategy: str) -> None:
    """A loss multiplied by a scaler's scale (fp16 style): the rows are the true ones, as every captured gradient."""
    model = mlp()
    taps = ["0:weight", "1:bias", "3:weight"]
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    scale = torch.tensor(1024.0)
    rows = []
    for loss_scale in (None, lambda: scale):
        model.zero_grad(set_to_none=True)
        with capture(model, taps, strategy=strategy, per_example=True, loss_scale=loss_scale) as cap:
            loss = mse_rows(model(x), y)
            cap.backward(loss if loss_scale is None else loss * scale)
            rows.append(cap.records(loss).per_example_norm)
    for plain, scaled in zip(*rows, strict=True):
        np.testing.assert_allclose(scaled, plain, rtol=1e-6)


if __name__ == "__main__":  # a rank under torchrun (the DDP test above): `torchrun ... test_per_example_runs.py OUT`
    procs.mark(sys.argv[1])  # for the test's check: no rank left
    _rank(int(os.environ["RANK"]), sys.argv[1])
