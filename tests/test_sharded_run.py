"""The runner under `train.parallel=fsdp2|hsdp` (gradrunner.run.parallel): bad input, sharding, and the parity certificate.

Bad input is checked in-process (a process group of one, on a free port, for what needs a mesh);
the happy path and the certificate are real 2-rank `torchrun` jobs on CPU (gloo), whose records
`python -m gradrunner.compare` compares: fsdp2 against ddp agree, a different learning rate first
differs at step 1.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from conftest import cli_env, gradrunner_in_process
from rank_launch import gradrunner_torchrun
from torch import nn

from gradrunner.errors import GradrunnerError
from gradrunner.models import MLP, CosineRegression
from gradrunner.run import parallel
from gradrunner.run.parallel import Plan

ACTIVATIONS = "taps=[fc1:output,relu1:output,head:output]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (world 1): enough for `fully_shard` to run in-process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compare(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gradrunner.compare", str(a), str(b)], env=cli_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# -- bad input: one paragraph, before anything runs ------------------------------------------------


@pytest.mark.parametrize("mode", ["fsdp2", "hsdp"])
def test_a_sharded_mode_in_one_process_says_how_to_start_torchrun(tmp_path: Path, mode: str) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=1", f"train.parallel={mode}", "hydra.run.dir=run")
    assert result.returncode == 2, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("gradrunner: error: ") and "Traceback" not in result.stderr
    assert f"train.parallel={mode}" in line and "torchrun --standalone --nproc_per_node=" in line
    assert not list(tmp_path.glob("run/*.parquet"))


def test_a_sweep_of_sharded_jobs_in_one_process_is_refused_before_any_job(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "-m", "+experiment=mlp", "steps=1", "train.parallel=fsdp2", "seed=0,1",
                                   "hydra.sweep.dir=sw")  # fmt: skip
    assert result.returncode == 2 and "torchrun --standalone --nproc_per_node=2" in result.stderr, result.stderr
    assert not list(tmp_path.glob("sw/*/*.parquet")) and not (tmp_path / "sw" / "0").exists()


def test_an_unknown_parallel_mode_names_the_allowed_ones(tmp_path: Path) -> None:
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=1", "train.parallel=zero3", "hydra.run.dir=run")
    assert result.returncode == 2 and "train.parallel='zero3'" in result.stderr, result.stderr
    assert "ddp, fsdp2, hsdp" in result.stderr


def test_more_ranks_than_gpus_is_one_paragraph_before_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """device=auto on a machine with one GPU and `--nproc_per_node=2`: the second rank got torch's
    "CUDA error: invalid device ordinal" with a traceback (seen on an H100). CUDA is faked: one device."""
    import gradrunner.run.distributed as distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _: pytest.fail("set_device reached"))
    monkeypatch.setattr(dist, "init_process_group", lambda **_: pytest.fail("the group was joined"))
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    result = gradrunner_in_process(tmp_path, "+experiment=mlp", "steps=1", "hydra.run.dir=run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.strip() and not x.startswith("[")]
    assert "rank 1 is process 2 on its machine, but the machine has 1 CUDA device(s)" in line
    assert "torchrun --nproc_per_node=1" in line and "device=cpu" in line
    assert distributed.world_from_env() == (1, 2, 1) and not list(tmp_path.glob("run/*.parquet"))


def test_hsdp_world_sizes_factor_into_replicas_by_shard_groups() -> None:
    assert parallel.hsdp_shape(4, None) == (2, 2)
    assert parallel.hsdp_shape(6, None) == (3, 2)
    assert parallel.hsdp_shape(8, 4) == (2, 4)
    with pytest.raises(GradrunnerError, match=r"the 5 processes .* 5 does not"):
        parallel.check_world(Plan("hsdp"), 5)
    with pytest.raises(
        GradrunnerError, match=r"train.shard_size=4 does not factor the 6 processes.*allowed here: 2, 3"
    ):
        parallel.hsdp_shape(6, 4)
    with pytest.raises(GradrunnerError, match="replicas x shard groups"):
        parallel.check_world(Plan("hsdp"), 2)  # 2 = 1 x 2: no second replica (that is fsdp2)
    parallel.check_world(Plan("fsdp2"), 2)
    parallel.check_world(Plan("ddp"), None)


def test_default_units_are_the_children_holding_parameters() -> None:
    mlp = MLP(in_features=4, hidden=8, depth=3, out_features=1)
    assert parallel.shard_targets(mlp, None) == ["fc1", "fc2", "fc3", "head"]  # relu* hold none


def test_shard_globs_match_module_paths_of_a_transformers_model_innermost_first() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    gpt2 = transformers.GPT2LMHeadModel(config)
    got = parallel.shard_targets(gpt2, ["transformer", "transformer.h.*"])
    assert got == ["transformer.h.0", "transformer.h.1", "transformer"]
    # lm_head shares its weight with transformer.wte: neither child is a unit of its own by default
    assert parallel.shard_targets(gpt2, None) == []
    assert parallel.split_parameters(gpt2, ["transformer", "lm_head"]) == [
        "transformer.wte.weight (also lm_head.weight) in units 'transformer' and 'lm_head'"
    ]
    # FSDP2 refuses both at the first forward (checked with fully_shard): gradrunner says so before step 0
    assert parallel.split_parameters(gpt2, got) == [
        "transformer.wte.weight (also lm_head.weight) in units 'transformer' and '<root>'"
    ]
    assert parallel.split_parameters(gpt2, parallel.shard_targets(gpt2, ["transformer.h.*"])) == []
    with pytest.raises(
        GradrunnerError, match=r"glob 'blocks\.\*' matches no module of GPT2LMHeadModel.*transformer\.h\.0"
    ):
        parallel.shard_targets(gpt2, ["blocks.*"])


def test_a_scalar_parameter_is_named_before_anything_is_sharded() -> None:
    with pytest.raises(GradrunnerError, match=r"a, b are 0-dimensional parameters") as e:
        parallel.shard_model(CosineRegression(), [], mesh=None)  # type: ignore[arg-type]  # refused before the mesh
    assert "train.parallel=ddp" in str(e.value)


def test_modules_sharing_a_parameter_in_two_units_are_refused_in_one_paragraph(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    with pytest.raises(
        GradrunnerError,
        match=r"puts one parameter into two FSDP2 units.*0.weight \(also 1.weight\) in units .0. and .1.",
    ):
        parallel.shard_model(model, parallel.shard_targets(model, ["0", "1"]), init_device_mesh("cpu", (1,)))


def test_sharding_repoints_the_optimizer_and_steps_like_the_unsharded_model(group_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    plain = MLP(in_features=4, hidden=8, depth=2, out_features=1)
    sharded = MLP(in_features=4, hidden=8, depth=2, out_features=1)
    sharded.load_state_dict(plain.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, sharded)]
    before = dict(sharded.named_parameters())
    parallel.shard_model(sharded, parallel.shard_targets(sharded, None), init_device_mesh("cpu", (1,)))
    parallel.repoint_optimizer(opts[1], before, dict(sharded.named_parameters()))
    assert all(type(p).__name__ == "DTensor" for p in opts[1].param_groups[0]["params"])
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    for m, opt in zip((plain, sharded), opts, strict=True):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=0, msg=name)  # type: ignore[attr-defined]


# -- 2 ranks: the parity certificate ----------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun of 2 ranks, a sweep of ddp and fsdp2 at two learning rates, activation taps, 3 steps."""
    cwd = tmp_path_factory.mktemp("parity")
    result = gradrunner_torchrun(cwd, "-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=3", ACTIVATIONS,
                      "train.parallel=ddp,fsdp2", "optimizer.lr=0.1,0.2")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    (cwd / "log.txt").write_text(result.stdout + result.stderr)
    return cwd / "sw"


def job(sweep: Path, parallel_mode: str, lr: float) -> Path:
    """The sweep's job dir for (`parallel_mode`, `lr`) (Hydra numbers the jobs in override order)."""
    return sweep / str(["ddp", "fsdp2"].index(parallel_mode) * 2 + [0.1, 0.2].index(lr))


@pytest.mark.slow
def test_fsdp2_shards_every_unit_and_each_rank_holds_half_the_elements(sweep: Path) -> None:
    log = (sweep.parent / "log.txt").read_text()
    held = [line.split("] - ")[-1] for line in log.splitlines() if "this rank holds" in line]
    # MLP 8 -> 32 -> 32 -> 32 -> 1 (depth 3): 288 + 1056 + 1056 + 33 elements; fc* rows split 16 + 16, and head's one
    # row (32 + 1 bias) all on rank 0 (torch.chunk's rule for uneven shards): 1200 + 33 and 1200
    assert sorted(set(held)) == [
        f"[rank {r}] fsdp2: sharded fc1, fc2, fc3, head, then the root; this rank holds {n} of 2433 parameter elements"
        for r, n in ((0, 1233), (1, 1200))
    ], held


@pytest.mark.slow
@pytest.mark.parametrize("lr", [0.1, 0.2])
def test_fsdp2_and_ddp_records_agree(sweep: Path, lr: float) -> None:
    result = compare(job(sweep, "ddp", lr), job(sweep, "fsdp2", lr))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("agree: 18 records and 6 (step, rank) losses (3 steps on 2 ranks)"), result.stdout


@pytest.mark.slow
def test_another_learning_rate_first_differs_at_step_1(sweep: Path) -> None:
    result = compare(job(sweep, "ddp", 0.1), job(sweep, "fsdp2", 0.2))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "first difference: step 1, loss" in result.stdout
    assert "first tap difference: step 1, tap" in result.stdout


@pytest.mark.slow
def test_the_certificate_with_the_experiments_own_taps(tmp_path: Path) -> None:
    """The issue's commands as given (`+experiment=mlp`, weights tapped too), ddp then fsdp2: records agree."""
    for mode in ("ddp", "fsdp2"):
        result = gradrunner_torchrun(tmp_path, "+experiment=mlp", "steps=3", f"train.parallel={mode}", f"hydra.run.dir={mode}")
        assert result.returncode == 0, result.stderr[-3000:]
    result = compare(tmp_path / "ddp", tmp_path / "fsdp2")
    assert result.returncode == 0 and "66 records" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_clip_grad_value_under_fsdp2_clips_as_ddp_does(tmp_path: Path) -> None:
    """`train.clip_grad_value` under fsdp2 (the 1-row head leaves rank 1 an empty piece): the records and `clipped`
    of DDP, whose ranks clip the whole averaged gradients with torch's `clip_grad_value_`. It raised at step 0
    (`max()` of rank 1's empty piece; with even shards, `.tolist()` of a `clipped` that was a DTensor)."""
    for mode in ("ddp", "fsdp2"):
        result = gradrunner_torchrun(tmp_path, "+experiment=mlp", "steps=3", "taps=[fc1:weight,head:weight,fc1:output]",
                                     "train.clip_grad_value=0.05", f"train.parallel={mode}", f"hydra.run.dir={mode}")  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    cmp = compare(tmp_path / "ddp", tmp_path / "fsdp2")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    want, got = (pd.read_parquet(tmp_path / m / "steps.parquet").sort_values(["step", "rank"])
                 for m in ("ddp", "fsdp2"))  # fmt: skip
    assert got["clipped"].tolist() == want["clipped"].tolist()
    assert want["clipped"].all()  # 0.05 is below every step's largest element: each step clipped


@pytest.mark.slow
def test_hsdp_on_four_ranks_with_accumulation_agrees_with_ddp(tmp_path: Path) -> None:
    """4 ranks as 2 replicas x 2 shards, 2 micro-batches per step (reduce-scatter on the second only): the records
    equal DDP's on the same 4 ranks."""
    result = gradrunner_torchrun(tmp_path, "-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=2", ACTIVATIONS,
                      "train.accumulate=2", "train.parallel=ddp,hsdp", world=4)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    held = {
        line.split("] - ")[-1] for line in (result.stdout + result.stderr).splitlines() if "this rank holds" in line
    }
    assert held == {  # each shard group of 2 holds the model as fsdp2 on 2 ranks would
        f"[rank {r}] hsdp: sharded fc1, fc2, fc3, head, then the root; this rank holds {n} of 2433 parameter elements"
        for r, n in ((0, 1233), (1, 1200), (2, 1233), (3, 1200))
    }, held
    cmp = compare(tmp_path / "sw" / "0", tmp_path / "sw" / "1")
    assert cmp.returncode == 0 and cmp.stdout.startswith("agree: 48 records and 8 (step, rank) losses (2 steps on 4 ranks)"), cmp.stdout + cmp.stderr


def test_tensor_parallel_is_refused_naming_the_model() -> None:
    from conftest import compose_cfg

    from gradrunner.config.schema import validate

    with pytest.raises(
        GradrunnerError, match=r"train.tp=2 .* model gradrunner.models.TinyTransformerBlock has no tensor"
    ):
        validate(compose_cfg("+experiment=transformer", "train.tp=2"))
    validate(compose_cfg("+experiment=transformer", "train.tp=1"))
