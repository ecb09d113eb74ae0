"""A session on an FSDP2 model is not refused for FSDP2's own unsharded parameters in the modules' slots.

FSDP2 computes with an unsharded copy of each sharded (DTensor) parameter, which it puts in the module's slot for
the forward and swaps back when it reshards, without a registration. A group that does not reshard after forward
(`reshard_after_forward=False`; the root group by default) keeps the copies there after a forward under no_grad
(evaluation between steps). The check for tapped parameters replaced by the user (at each entry, and in the block
after any module or parameter was registered) took those copies for replacements and refused the session; so too
the copy sharded on a smaller mesh that `reshard_after_forward=<int>` leaves. Each torchrun (gloo, 2 ranks; 4 for
`int2`) runs `fsdp_unsharded_ranks.py`; the reference is the norm of each tapped parameter's whole `.grad`
(`full_tensor()`), taken in the rank without gradrunner. A tapped parameter really replaced is still refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_unsharded_ranks import PARAM_TAPS, STEPS
from rank_launch import torchrun

pytestmark = pytest.mark.slow

CASES = {
    2: ["default:reenter", "default:inblock", "false:reenter", "false:inblock"],
    4: ["int2:reenter", "int2:inblock"],
}
ALL = [c for cases in CASES.values() for c in cases]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for world, cases in CASES.items():
        d = tmp_path_factory.mktemp(f"unsharded{world}")
        torchrun(world, d, cases, timeout=300, script="fsdp_unsharded_ranks.py")
        for c in cases:
            out[c] = [torch.load(d / f"{c.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in range(world)]
    return out


@pytest.mark.parametrize("case", ALL)
def test_unsharded_parameters_left_in_their_slots_are_not_taken_for_replacements(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    for rank, out in enumerate(results[case]):
        assert "refused" not in out, (rank, out["refused"])
        assert len(out["recorded"]) == STEPS
        for step, (got, whole) in enumerate(zip(out["recorded"], out["whole"], strict=True)):
            for tap in PARAM_TAPS:
                assert got[tap] == pytest.approx(whole[tap], rel=1e-12, abs=0), (rank, step, tap)
        if case.endswith("reenter"):
            assert "its tap 4:weight names parameter 'weight' of module '4', which is another object now" in out.get(
                "replaced_refused", ""
            ), rank
