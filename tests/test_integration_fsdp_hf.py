"""The HF Trainer asked for FSDP2 on CPU: what runs (DDP, not sharded) and that the callback's records are right for it.

A real Trainer run, 2 gloo ranks on CPU under torchrun (this file is also the ranks' script), with
`fsdp="full_shard"`, `fsdp_config={"fsdp_version": 2, ...}` and `use_cpu=True`: accelerate (1.15) turns its
FSDP plugin on only for accelerators, so on CPU the Trainer trains DDP without a word. The test pins that fact
(docs/scale-out.md, "Lightning and the HF Trainer under FSDP", says so: if a later accelerate shards on CPU,
this test fails and the docs and a sharded check are due) and checks what did run: `GradientCaptureCallback`'s
records against an unsharded plain-torch run of the same float64 GPT-2 on the batches each rank saw
(parameter taps: the gradient of the mean of the ranks' losses, the same on both ranks; activation taps: the
rank's own batch loss).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import procs
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, LR, BATCH = 2, 0.1, 2
TAPS = ["transformer.h.0.mlp.c_fc:weight", "transformer.ln_f:weight", "transformer.h.1.mlp:output"]
RTOL = 1e-9  # float64: the ranks' all-reduce adds in another order than the unsharded run


def build_model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).double()


def run_rank(out: Path) -> None:
    """One rank: the Trainer with FSDP2 asked for, the callback into `out/run`; the batches it saw and what ran."""
    from transformers import Trainer, TrainingArguments

    from gradrunner.integrations.hf import GradientCaptureCallback

    procs.mark(out)  # for the test's check: no rank left
    model = build_model()
    batches: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, a, kw: batches.append(kw["input_ids"].clone()), with_kwargs=True)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (2 * BATCH * STEPS, 8), generator=g)]
    args = TrainingArguments(str(out / "trainer"), max_steps=STEPS, per_device_train_batch_size=BATCH, optim="sgd",
                             learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none",
                             save_strategy="no", use_cpu=True, fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GradientCaptureCallback(taps=TAPS, dir=out / "run")])  # fmt: skip
    trainer.train()
    ran = {"sharded": any(type(p).__name__ == "DTensor" for p in model.parameters()),
           "fsdp_enabled": trainer.is_fsdp_enabled, "wrapper": type(trainer.model_wrapped).__name__,
           "distributed_type": str(trainer.accelerator.distributed_type)}  # fmt: skip
    torch.save({"batches": batches, "ran": ran}, out / f"rank{os.environ['RANK']}.pt")


@pytest.fixture(scope="module")
def hf_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rank_launch import torchrun

    out = tmp_path_factory.mktemp("hf_fsdp2")
    torchrun(2, out, [], timeout=600, script=Path(__file__).name)  # no rank left behind, or it fails
    return out


def reference(batches: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    """Per step, plain torch on one unsharded model: the whole parameter gradients and each rank's activation gradients."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        acts = {}
        for rank, seen in enumerate(batches):
            ids = seen[step]
            held: list[torch.Tensor] = []
            handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, a, o, into=held: into.append(o))
            # What the Trainer backpropagates: the tokens' summed loss over the batch's label count (16, not the
            # 14 shifted predictions: average_tokens_across_devices divides by all ranks' count, times the world)
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(ids.numel())).loss
            handle.remove()
            (acts[rank],) = torch.autograd.grad(loss, held, retain_graph=True)  # the rank's own batch alone
            (loss / len(batches)).backward()  # DDP averages the ranks' gradients
        params = {t: model.get_parameter(t.replace(":", ".")).grad.clone() for t in TAPS if not t.endswith(":output")}
        steps.append({"params": params, "acts": acts})
        opt.step()
        opt.zero_grad()
    return steps


@pytest.mark.slow
def test_hf_trainer_asked_for_fsdp2_on_cpu_trains_ddp_and_the_records_are_right_for_it(hf_fsdp2: Path) -> None:
    from gradrunner.analysis import load

    ranks = [torch.load(hf_fsdp2 / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:  # what docs/scale-out.md says: on CPU the FSDP plugin is dropped and the Trainer trains DDP
        assert r["ran"] == {"sharded": False, "fsdp_enabled": False, "wrapper": "DistributedDataParallel",
                            "distributed_type": "DistributedType.MULTI_CPU"}, r["ran"]  # fmt: skip
        assert len(r["batches"]) == STEPS
    assert not torch.equal(ranks[0]["batches"][0], ranks[1]["batches"][0])  # each rank its own batch
    want = reference([r["batches"] for r in ranks])
    df = load(hf_fsdp2 / "run")
    assert (hf_fsdp2 / "run" / "done.json").exists()
    logged = (hf_fsdp2 / "run" / "gradrunner.log").read_text()  # the user is told what ran, once (rank 0)
    assert logged.count("asked for FSDP (TrainingArguments.fsdp) but trains the model unsharded (DDP)") == 1, logged
    assert len(df) == STEPS * 2 * len(TAPS) and sorted(df["rank"].unique()) == [0, 1]
    for row in df.itertuples():
        tap = str(row.tap)
        grad = want[row.step]["acts"][row.rank] if tap.endswith(":output") else want[row.step]["params"][tap]
        g = grad.reshape(-1)
        for col, v in {"norm": g.norm(), "max": g.max(), "min": g.min(), "mean": g.mean()}.items():
            scale = float(g.abs().max()) if col == "mean" else 0.0
            got = getattr(row, col)
            assert abs(got - float(v)) <= RTOL * (abs(float(v)) + scale), (row.step, row.rank, tap, col, got, float(v))


if __name__ == "__main__":  # a rank under torchrun: `torchrun ... test_integration_fsdp_hf.py OUT`
    run_rank(Path(sys.argv[1]))
