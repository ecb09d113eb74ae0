"""README's "From your own training code": each Python snippet runs as written and leaves a readable run dir."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import python_script

from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError

README = Path(__file__).resolve().parent.parent / "README.md"


def _snippets() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("## From your own training code")
    section = text[start : text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _run(code: str, cwd: Path) -> None:
    """The snippet as `python snippet.py` runs it, inside this process (`conftest.python_script`: its own argv,
    cwd, logging, warnings and exit status; a fresh interpreter would cost 2 to 3 s of CPU importing)."""
    script = cwd / "snippet.py"
    script.write_text(code, encoding="utf-8")
    done = python_script(cwd, script)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_section_has_the_three_snippets() -> None:
    found = _snippets()
    assert len(found) == 3
    assert "record(" in found[0] and "GradientCapture(" in found[1] and "GradientCaptureCallback(" in found[2]


def test_any_loop_snippet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(_snippets()[0], "README.md", "exec"), {})  # in-process: a fresh interpreter costs seconds
    df = load(tmp_path / "runs" / "mine")
    assert sorted(set(df.step)) == [0, 10] and (tmp_path / "runs" / "mine" / "done.json").is_file()
    assert set(df.tap) == {"0:output", "1:output", "2:output", "0:weight", "2:weight"}
    # the section's promises: the last word in the run dir's log; a second run into the dir is refused naming
    # record()'s own options, before anything is written
    assert "run summary:" in (tmp_path / "runs" / "mine" / "gradrunner.log").read_text()
    with pytest.raises(GradrunnerError, match=r"completed run; .* Pass record\(\) overwrite=True"):
        exec(compile(_snippets()[0], "README.md", "exec"), {})
    assert len(load(tmp_path / "runs" / "mine")) == len(df)


@pytest.mark.slow
def test_lightning_snippet(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _run(_snippets()[1], tmp_path)
    df = load(tmp_path / "runs" / "lightning")
    per_step = df[df.tap == "net.0:weight"].groupby("step").size()
    assert list(per_step.index) == [0, 2, 4, 6] and set(per_step) == {1}  # a parameter: one row per optimiser step
    acts = df[df.tap == "net.0:output"].groupby("step").size()
    assert set(acts) == {2}  # an activation: one row per micro-batch
    steps = load(tmp_path / "runs" / "lightning", table="steps")
    assert (steps.lr == 0.1).all() and steps.grad_norm.gt(0).all() and steps.clipped.notna().all()


@pytest.mark.slow
def test_hf_trainer_snippet(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    _run(_snippets()[2], tmp_path)
    df = load(tmp_path / "runs" / "gpt2")
    assert sorted(set(df.step)) == [0, 1, 2, 3] and df.has_grad.all()
    steps = load(tmp_path / "runs" / "gpt2", table="steps")
    assert len(steps) == 4 and steps.lr.gt(0).all() and steps.clipped.notna().all()


@pytest.mark.parametrize("module, name", [("lightning", "GradientCapture"), ("hf", "GradientCaptureCallback")])
def test_each_callbacks_docstring_names_every_option_it_takes(module: str, name: str, tmp_path: Path) -> None:
    """The callbacks' docstrings listed their options without `anomaly`, which the README says they take and
    which they do take (`anomaly=False` turns spike detection off, as in `record()`)."""
    import importlib

    from gradrunner.run.record_options import CALLBACK_OPTIONS

    pytest.importorskip("lightning" if module == "lightning" else "transformers")
    callback = getattr(importlib.import_module(f"gradrunner.integrations.{module}"), name)
    listed = set(re.findall(r"`(\w+)`", callback.__doc__.split("and the options (", 1)[1].split(")", 1)[0]))
    assert listed == set(CALLBACK_OPTIONS), sorted(set(CALLBACK_OPTIONS) ^ listed)
    callback(taps=["0:output"], dir=tmp_path / "run", anomaly=False)  # taken, checked in the constructor
