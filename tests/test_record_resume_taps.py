"""`record(..., resume=True)` continues only records of the same taps: the specs resolved against the model.

The options' config holds the tap specs as given (`*:output`); the same specs resolve to other tensors
in another model. A resume whose resolved taps (names; a parameter's shape) differ from the kept
records' is refused in one paragraph naming the difference, as the runner refuses a changed model config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradrunner
from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError


def _session(run: Path, model: nn.Module, taps: list[str], steps: int, fail: bool = False, **options: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, taps, run, **options) as rec:
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702  # fmt: skip
            rec.step(loss)
        if fail:
            raise RuntimeError("the first session fails")


def _failed_first(run: Path, model: nn.Module, taps: list[str]) -> None:
    with pytest.raises(RuntimeError, match="first session fails"):
        _session(run, model, taps, 3, fail=True)


def test_a_resume_of_another_models_records_is_refused_naming_the_taps(tmp_path: Path) -> None:
    """3 modules, then 5: '*:output' resolves to 3 taps, then 5 (before: the dir marked complete holding steps of 3
    taps and steps of 5, '2:output' a Linear's gradient at steps 0..2 and a Sigmoid's after)."""
    torch.manual_seed(0)
    run = tmp_path / "run"
    _failed_first(run, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), ["*:output"])
    other = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 1))
    with pytest.raises(GradrunnerError, match=r"holds records of other taps \(only this session has 3:output, "
                                              r"4:output\).*overwrite=True"):  # fmt: skip
        _session(run, other, ["*:output"], 3, resume=True)
    kept = load(run)
    assert sorted(kept.step.unique()) == [0, 1, 2] and sorted(kept.tap.unique()) == ["0:output", "1:output", "2:output"]
    assert not (run / "done.json").exists()


def test_a_resume_whose_parameter_has_another_shape_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    run = tmp_path / "run"
    _failed_first(run, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), ["0:weight", "*:output"])
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    with pytest.raises(GradrunnerError, match=r"other taps \(0:weight has the shape \[16, 8\] there, \[32, 8\] here\)"):
        _session(run, wider, ["0:weight", "*:output"], 3, resume=True)
    assert sorted(load(run).step.unique()) == [0, 1, 2]
    same = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # the same model resumes
    _session(run, same, ["0:weight", "*:output"], 3, resume=True)
    assert sorted(load(run).step.unique()) == [0, 1, 2, 3, 4, 5] and (run / "done.json").is_file()
