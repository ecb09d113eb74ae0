"""The `unsharded_*` cases of `tests/test_sharded_edges.py` (a rank of its torchrun runs them through
`sharded_edges_ranks.py`): a session on an FSDP2 model whose modules hold FSDP2's unsharded parameters between
steps (a forward under no_grad, evaluation, leaves them there where the group does not reshard after forward:
`reshard_after_forward=False`, or the root group by default).

A CASE is `unsharded_<reshard>:<entry>` (`default` · `false` · `int2`: resharded after forward on 2 of the 4 ranks;
`reenter`: `with cap:` around each step · `inblock`: one block, a module built between steps). Each rank trains 3
SGD steps, a forward under no_grad after each, and writes `OUT/<case>.rank<r>.pt`: per step the parameter taps'
recorded norms and the norms of the whole `.grad` gathered with `full_tensor()` (the reference, without
gradrunner), a refusal's message, and (`reenter`) the refusal of an entry after a tapped sharded parameter was
really replaced (by a copy on its own mesh).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 3
#: Parameter taps in a sharded block (`0`) and in the root group (`4`, `5`), and an activation tap.
TAPS = ["0:weight", "4:weight", "5:bias", "2:output"]
PARAM_TAPS = TAPS[:3]


def build(reshard: str, world: int) -> nn.Module:
    """Linear layers 0 and 2 sharded each in a group of its own; the LayerNorm 4 and the head 5 in the root group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 2))
    model = model.double()
    mesh = init_device_mesh("cpu", (world,))
    kw: dict[str, Any] = {
        "default": {},
        "false": {"reshard_after_forward": False},
        "int2": {"reshard_after_forward": 2},
    }[reshard]
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def run_case(case: str, out_dir: Path) -> None:
    import torch.distributed as dist

    from gradrunner import capture
    from gradrunner.errors import GradrunnerError

    reshard, entry = case.removeprefix("unsharded_").split(":")
    rank = dist.get_rank()
    model = build(reshard, dist.get_world_size())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"recorded": [], "whole": []}
    cap = capture(model, TAPS, strategy="hook", keep_grads=False)
    try:
        if entry == "inblock":
            cap.__enter__()
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * rank + step)
            x, y = torch.randn(4, 5, generator=g).double(), torch.randn(4, 2, generator=g).double()
            if entry == "reenter":
                cap.__enter__()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            records = cap.records(loss)
            if entry == "reenter":
                cap.close()
            rows = [records.row(i) for i in range(len(records))]
            out["recorded"].append({r["tap"]: r["norm"] for r in rows if r["tap"] in PARAM_TAPS})
            whole = {}
            for tap in PARAM_TAPS:
                module, name = tap.split(":")
                whole[tap] = float(getattr(model.get_submodule(module), name).grad.full_tensor().norm())
            out["whole"].append(whole)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(x)  # evaluation: the unsharded parameters stay in the slots
            if entry == "inblock":
                nn.Linear(2, 2)  # a module built anywhere: the registration hooks ask for the check at the next step
        if entry == "reenter":
            model.reshard()  # type: ignore[operator]  # the sharded parameters back in the slots
            model[4].weight = nn.Parameter(model[4].weight.detach().clone())  # a DTensor on its own mesh
            try:
                cap.__enter__()
            except GradrunnerError as e:
                out["replaced_refused"] = str(e)
    except GradrunnerError as e:
        out["refused"] = str(e)
    finally:
        cap.close()
    torch.save(out, out_dir / f"{case.replace(':', '-')}.rank{rank}.pt")
