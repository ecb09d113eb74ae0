"""One rank of `tests/test_ddp.py`'s accumulation check: the runner's job under DDP with `train.accumulate=2`.

Run by torchrun (gloo, CPU): `python -m torch.distributed.run --standalone --nproc_per_node=2 ddp_sync_count.py
OUT STRATEGY[,STRATEGY...]`: one job per strategy, one after the other in the one process group (as a sweep's
jobs share it). DDP's model gets a communication hook that counts the buckets it all-reduces (and all-reduces
them as DDP's default does); for each strategy each rank writes `OUT/<strategy>/sync.rank<r>.json` (that job's
count) and rank 0 the job's records in `OUT/<strategy>/run`. The test checks one all-reduce per optimisation
step and the parameter rows against a reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gradrunner.run import distributed


def main(out: Path, strategies: list[str]) -> None:
    from conftest import compose_cfg

    from gradrunner.run.loop import train

    counted = [0]
    wrap = distributed.wrap

    def counting_wrap(job: Any, d: Any) -> Any:
        job = wrap(job, d)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks annotations against its own types)
            counted[0] += 1
            return allreduce_hook(state, bucket)

        job.model.register_comm_hook(None, hook)
        return job

    distributed.wrap = counting_wrap  # type: ignore[assignment]
    for strategy in strategies:
        counted[0] = 0
        (out / strategy).mkdir(parents=True, exist_ok=True)  # every rank writes its count there
        cfg = compose_cfg("+experiment=mlp", "steps=3", "train.accumulate=2", f"capture.strategy={strategy}",
                          "taps=[fc1:output,fc1:weight,head:output,head:bias]", "capture.values=full", "model.depth=1")  # fmt: skip
        with distributed.session(cfg) as d:
            assert d is not None
            train(cfg, out_dir=out / strategy / "run", run_id=d.run_id, dist=d)
            (out / strategy / f"sync.rank{d.rank}.json").write_text(json.dumps({"all_reduces": counted[0]}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]), sys.argv[2].split(","))
