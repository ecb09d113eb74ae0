"""The Lightning callback under FSDP2 (`ModelParallelStrategy`) records what an unsharded plain-torch run computes.

A real Lightning run, 2 gloo ranks on CPU started by torchrun (this file is also the ranks' script): a float64
`torch.nn` model whose 3-row weight is split 2 + 1 over the ranks, `fully_shard`ed in `configure_model`, trained
for `STEPS` SGD steps with `GradientCapture`. Each rank saves the batches Lightning gave it and its final
weights; the reference is computed here without gradrunner on the same model unsharded:

- parameter taps: the statistics of the whole gradient of the mean of the ranks' losses (FSDP2 averages), the
  same row on every rank;
- activation taps: DDP's convention, per rank, the gradient of the rank's own batch loss;
- the training itself: the ranks' final weights are the unsharded run's;
- with `accumulate_grad_batches=2` (Lightning does not `no_sync` FSDP2) and with `gradient_clip_val` (steps.parquet's
  `grad_norm`: the whole gradients' norm before clipping, and `clipped`).

Lightning's `strategy="fsdp"` (FSDP1) does not run on CPU (Lightning refuses it at `Trainer(...)`), and a GPU
run of it would be refused by the callback: that refusal is tested without a run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
import procs
import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

STEPS, LR, SEED, BATCH = 3, 0.1, 0, 4
TAPS = ["net.0:weight", "net.0:bias", "net.2:weight", "net.0:output", "net.2:output"]
RTOL = 1e-12  # float64: the ranks' reductions add in another order than the unsharded run's


def build_net() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def dataset(accumulate: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(SEED + 1)
    n = 2 * BATCH * STEPS * accumulate
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=g, dtype=torch.float64),
                                          torch.randn(n, 2, generator=g, dtype=torch.float64))  # fmt: skip


def run_rank(out: Path, accumulate: int, clip: float | None) -> None:
    """One rank of the Lightning FSDP2 run: records into `out/run`, this rank's batches and weights in a file."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from gradrunner.integrations.lightning import GradientCapture

    procs.mark(out)  # for the test's check: no rank left

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_net()
            self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.batches.append((x.clone(), y.clone()))
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Regression()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GradientCapture(taps=TAPS, dir=out / "run")])  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(dataset(accumulate), batch_size=BATCH))
    sharded = all(type(p).__name__ == "DTensor" for p in module.parameters())
    weights = {n: p.full_tensor().detach() for n, p in module.net.named_parameters()}  # type: ignore[operator]
    rank = trainer.global_rank
    torch.save({"batches": module.batches, "weights": weights, "sharded": sharded}, out / f"rank{rank}.pt")
    # Lightning leaves the process group up: torn down here, or gloo's threads can abort the exit
    # ("terminate called without an active exception", seen once in a full suite after the records were whole).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


#: Lightning's (accumulate_grad_batches, gradient_clip_val): plain, accumulation, clipping by the whole norm
CASES = {"plain": (1, None), "accumulate2": (2, None), "clip": (1, 0.05)}


@pytest.fixture(scope="module", params=list(CASES))
def lightning_fsdp2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, Any]:
    from rank_launch import torchrun

    out = tmp_path_factory.mktemp(f"lightning_fsdp2_{request.param}")
    torchrun(2, out, [request.param], timeout=600, script=Path(__file__).name)  # no rank left behind, or it fails
    return out, *CASES[request.param]


def reference(ranks: list[dict[str, Any]], n: int, clip: float | None = None) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """Per step, plain torch on the unsharded model: the whole parameter gradients and each rank's activation gradients.

    Lightning divides each micro-batch's loss by `n` (accumulate_grad_batches); FSDP2 averages over the ranks.
    """
    net = build_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        acts: dict[tuple[int, int, str], torch.Tensor] = {}
        for rank, r in enumerate(ranks):
            for micro in range(n):
                x, y = r["batches"][step * n + micro]
                alone = build_net()
                alone.load_state_dict(net.state_dict())
                hidden = alone[0](x)  # the rank's own micro-batch alone: its activation gradients
                output = alone[2](alone[1](hidden))
                grads = torch.autograd.grad(nn.functional.mse_loss(output, y) / n, [hidden, output])
                acts.update({(rank, micro, "net.0:output"): grads[0], (rank, micro, "net.2:output"): grads[1]})
                (nn.functional.mse_loss(net(x), y) / n / len(ranks)).backward()
        params = {f"net.{k}".replace(".weight", ":weight").replace(".bias", ":bias"): p.grad.clone()
                  for k, p in net.named_parameters() if p.grad is not None}  # fmt: skip
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None]))
        steps.append({"params": params, "acts": acts, "grad_norm": norm})
        if clip is not None:  # Lightning's gradient_clip_val: clip_grad_norm_ of the whole gradients
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return steps, {k: p.detach() for k, p in net.named_parameters()}


def stats_of(g: torch.Tensor) -> dict[str, float]:
    g = g.detach().double().reshape(-1)
    return {"norm": float(g.norm()), "mean": float(g.mean()), "std": float(g.std()), "min": float(g.min()),
            "max": float(g.max()), "abs_max": float(g.abs().max())}  # fmt: skip


@pytest.mark.slow
def test_lightning_fsdp2_records_equal_the_unsharded_plain_torch_run(lightning_fsdp2: Path) -> None:
    from gradrunner.analysis import load

    out, n, clip = lightning_fsdp2
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(r["sharded"] for r in ranks)  # FSDP2 did shard the model: its parameters are DTensors
    assert all(len(r["batches"]) == STEPS * n for r in ranks)
    assert not torch.equal(ranks[0]["batches"][0][0], ranks[1]["batches"][0][0])  # each rank its own batch
    want, weights = reference(ranks, n, clip)
    for r in ranks:  # the training was the unsharded run's (and the capture did not change it)
        for k, w in weights.items():
            torch.testing.assert_close(r["weights"][k], w, rtol=RTOL, atol=RTOL)
    df = load(out / "run")
    assert (out / "run" / "done.json").exists()
    assert sorted(df["rank"].unique()) == [0, 1]
    params = [t for t in TAPS if not t.endswith(":output")]
    # one row per (step, rank, parameter tap) and per (step, rank, micro-batch, activation tap): nothing lost or doubled
    assert len(df) == STEPS * 2 * (len(params) + n * (len(TAPS) - len(params)))
    seen = set()
    for row in df.itertuples():
        tap, micro = str(row.tap), (0 if pd.isna(row.micro_step) else int(row.micro_step))
        if tap.endswith(":output"):  # per rank, from its own micro-batch
            assert n == 1 or not pd.isna(row.micro_step), row
            grad = want[row.step]["acts"][row.rank, micro, tap]
        else:  # the whole parameter's gradient of the step (the sum of its micro-batches), recorded once
            assert pd.isna(row.micro_step), row
            grad = want[row.step]["params"][tap]
        scale = float(grad.abs().max())
        for col, v in stats_of(grad).items():
            got = getattr(row, col)
            assert abs(got - v) <= RTOL * (abs(v) + (scale if col in ("mean", "std") else 0.0)), (row, col, got, v)
        seen.add((row.step, row.rank, micro, tap))
    assert len(seen) == len(df)
    # parameter rows: the whole gradient, the same on both ranks (a rank's shard alone has another norm)
    w0 = df[df.tap == "net.0:weight"].sort_values(["step", "rank"])["norm"].to_numpy()
    assert (w0[0::2] == w0[1::2]).all()
    steps = pd.read_parquet(out / "run" / "steps.parquet")  # the whole gradients' norm before clipping, every rank
    assert len(steps) == STEPS * 2
    for row in steps.itertuples():
        norm = want[row.step]["grad_norm"]
        assert abs(row.grad_norm - norm) <= RTOL * norm, (row.step, row.rank, row.grad_norm, norm)
        assert row.clipped == (clip is not None and norm > clip), row


def test_lightning_fsdp1_strategy_is_refused_in_one_paragraph(tmp_path: Path) -> None:
    """Lightning's strategy='fsdp' needs a GPU (Lightning says so on CPU); the callback refuses it in one paragraph."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy

    from gradrunner.errors import GradrunnerError
    from gradrunner.integrations.lightning import GradientCapture

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)

    class FakeTrainer:
        strategy = FSDPStrategy()
        world_size = 2

    with pytest.raises(GradrunnerError) as e:
        GradientCapture(taps=["net.0:weight"], dir=tmp_path / "run")._distributed(FakeTrainer())  # type: ignore[arg-type]
    msg = str(e.value)
    assert "FSDPStrategy" in msg and "ModelParallelStrategy" in msg and "needs a GPU" in msg and "\n" not in msg, msg


if __name__ == "__main__":  # a rank under torchrun: `torchrun ... test_integration_fsdp.py OUT`
    run_rank(Path(sys.argv[1]), *CASES[sys.argv[2]])
