"""A session on an FSDP2 model is not refused for FSDP2's own unsharded parameters in the modules' slots.

FSDP2 computes with an unsharded copy of each sharded (DTensor) parameter, which it puts in the module's slot for
the forward and swaps back when it reshards, without a registration. A group that does not reshard after forward
(`reshard_after_forward=False`; the root group by default) keeps the copies there after a forward under no_grad
(evaluation between steps). The check for tapped parameters replaced by the user (at each entry, and in the block
after any module or parameter was registered) took those copies for replacements and refused the session. Each
torchrun (gloo, 2 ranks) runs `fsdp_unsharded_ranks.py`; the reference is the norm of each tapped parameter's whole
`.grad` (`full_tensor()`), taken in the rank without gradrunner.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_unsharded_ranks import PARAM_TAPS, STEPS
from rank_launch import torchrun

pytestmark = pytest.mark.slow

CASES = ["default:reenter", "default:inblock", "false:reenter", "false:inblock"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("unsharded")
    torchrun(2, d, CASES, timeout=300, script="fsdp_unsharded_ranks.py")
    return {
        c: [torch.load(d / f"{c.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in range(2)] for c in CASES
    }


@pytest.mark.parametrize("case", CASES)
def test_unsharded_parameters_left_in_their_slots_are_not_taken_for_replacements(
    results: dict[str, list[dict[str, Any]]], case: str
) -> None:
    for rank, out in enumerate(results[case]):
        assert "refused" not in out, (rank, out["refused"])
        assert len(out["recorded"]) == STEPS
        for step, (got, whole) in enumerate(zip(out["recorded"], out["whole"], strict=True)):
            for tap in PARAM_TAPS:
                assert got[tap] == pytest.approx(whole[tap], rel=1e-12, abs=0), (rank, step, tap)
