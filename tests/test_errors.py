"""Bad input: every case in `CASES` fails with one paragraph that names the problem and the way out.

Each case runs through the Python API (`train(cfg)`) and through the Hydra app in-process (`cli.app.main()`,
exactly what `python -m gradrunner` runs), and checks: the exit status (2, Hydra's own
refusals of the command line included), the message's start and its way out, no
traceback, nothing half-written (no Parquet file, not even a temp one), and that the model has no
hooks left and its original `forward`.

`docs/errors.md` holds the same table; `test_docs_table_is_up_to_date` checks it, and
`python tests/test_errors.py` rewrites it from `CASES`. The options the cases name (`model=raises`,
`data=empty`, ...) live in `tests/conf` (`--config-dir tests/conf`); their code is in `tests/awkward.py`.
"""

from __future__ import annotations

import errno
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import SEARCHPATH, TESTS, leftover_hooks
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from torch import nn

from gradrunner.cli import app as cli
from gradrunner.errors import GradrunnerError
from gradrunner.run import build as job_build
from gradrunner.run import loop as runner

DOCS = TESTS.parent / "docs" / "errors.md"
START, END = "<!-- errors:start -->", "<!-- errors:end -->"


@dataclass(frozen=True)
class Case:
    """One bad input: what the user did, and the message it must get."""

    id: str
    #: What the user did, for the docs.
    what: str
    #: Command-line overrides (after `steps=2`); `--config-dir tests/conf` provides the test options.
    overrides: tuple[str, ...]
    #: How the message starts (`<...>` stands for a part that varies, such as a path).
    message: str
    #: A part of the message that names the way out.
    way_out: str
    exit: int = 2
    #: `api`: train(cfg); `cli`: the Hydra app. Hydra's own refusals happen before train() exists.
    via: tuple[str, ...] = ("api", "cli")
    #: A name in SETUPS: something to break in the environment before the run.
    setup: str = ""
    #: The run stops part-way and keeps what it completed (complete, readable files).
    keeps_records: bool = False


def _case(id: str, what: str, overrides: str, message: str, way_out: str, **kw: Any) -> Case:
    return Case(id, what, tuple(overrides.split()), message, way_out, **kw)


#: Refused while Hydra composes the command line (before train() exists): one paragraph, exit 2 as well.
HYDRA = {"exit": 2, "via": ("cli",)}
CASES = [
    # -- config keys, types and values
    _case("misspelled-key", "a misspelled key", "stepz=3", "stepz is not a config key; top-level keys: model,",
          "Did you mean 'steps'?", via=("cli",)),
    _case("misspelled-capture-key", "a misspelled capture key", "capture.stratgy=hook",
          "capture.stratgy is not a config key; capture.* keys: strategy,", "Did you mean 'capture.strategy'?",
          via=("cli",)),
    _case("wrong-type", "a value of the wrong type", "steps=many", "Error merging override steps=many",
          "could not be converted to Integer", **HYDRA),
    _case("taps-not-a-list", "taps given as a string", "taps=fc1:output", "Error merging override taps=fc1:output",
          "is not a ListConfig, list or tuple", **HYDRA),
    _case("group-typo", "a misspelled option of a config group", "model=mpl",
          "model=mpl: the config group model has no option 'mpl'; its options: cnn,", "Did you mean 'mlp'?",
          via=("cli",)),
    _case("experiment-typo", "a misspelled experiment", "+experiment=mpl",
          "+experiment=mpl: the config group experiment has no option 'mpl'", "Did you mean 'mlp'?", via=("cli",)),
    _case("optimizer-typo", "an optimizer option that does not exist", "optimizer=adamm",
          "optimizer=adamm: the config group optimizer has no option 'adamm'; its options: adam, adamw, sgd.",
          "Did you mean 'adam'?", via=("cli",)),
    _case("group-null", "a config group set to null", "model=null",
          "model=null: model is a config group, so its value names one of its options", "e.g. model=cnn",
          via=("cli",)),
    _case("group-list", "a config group given a list of numbers", "loss=[1,2]",
          "loss=[1,2]: loss is a config group, so its value names one of its options", "e.g. loss=", via=("cli",)),
    _case("seed-too-large", "a seed numpy cannot take", "seed=4294967296",
          "seed=4294967296 is not allowed; seed must be an integer from 0 to 4294967295", "seed=10"),
    _case("steps-too-large", "steps that would run for ever", "steps=9223372036854775807",
          "steps=9223372036854775807 is not allowed; steps must be an integer from 0 to 2147483647", "steps=10"),
    # -- the training keys, checked before step 0 (issue 38 items 13-15)
    _case("scheduler-negative-rate", "a negative learning rate for the scheduler",
          "scheduler=onecycle scheduler.max_lr=-1",
          "scheduler.max_lr=-1 is not allowed; scheduler.max_lr must be a number > 0.", "scheduler.max_lr=0.01"),
    _case("scheduler-zero-window", "a scheduler window of zero steps", "scheduler=cosine scheduler.T_max=0",
          "scheduler.T_max=0 is not allowed; scheduler.T_max must be an integer from 1 to 2147483647.",
          "scheduler.T_max=${steps}"),
    _case("scheduler-too-short", "a one-cycle schedule shorter than the run",
          "scheduler=onecycle scheduler.total_steps=1",
          "scheduler.total_steps=1 is less than steps=2: OneCycleLR is stepped once per optimisation step",
          "scheduler.total_steps=${steps}"),
    _case("scheduler-needs-metric", "a scheduler that needs a metric",
          "+scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau +scheduler._partial_=true",
          "scheduler 'torch.optim.lr_scheduler.ReduceLROnPlateau' needs a metric at each step",
          "Pick scheduler=cosine, onecycle"),
    _case("accumulate-forever", "gradient accumulation that would run for ever",
          "train.accumulate=9223372036854775807",
          "train.accumulate=9223372036854775807 is not allowed with steps=2: steps x train.accumulate micro-batches",
          "train.accumulate=4"),
    _case("eval-data-shape", "eval data that does not fit the model",
          "train.eval_every=1 +eval_data._target_=gradrunner.data.Synthetic +eval_data.input_shape=[5]",
          "eval_data does not fit the model (its first batch was checked before step 0; nothing was run)",
          "Fix eval_data.*"),
    _case("forced-key", "a misspelled key forced in with +", "+capture.stratgy=hook",
          "unknown config key capture.stratgy.", "Did you mean capture.strategy?"),
    _case("strategy", "an unknown strategy", "capture.strategy=hooks",
          "capture.strategy='hooks' is not allowed; allowed: retain_grad, hook, autograd_grad.",
          "Did you mean 'hook'?"),
    _case("values", "an unknown values mode", "capture.values=all",
          "capture.values='all' is not allowed; allowed: none, full, sample.", "e.g. capture.values=none"),
    _case("on-nonfinite", "an unknown on_nonfinite mode", "capture.on_nonfinite=skip",
          "capture.on_nonfinite='skip' is not allowed; allowed: record, stop.", "e.g. capture.on_nonfinite=record"),
    _case("device", "an unknown device", "device=tpu",
          "device='tpu' is not allowed; allowed: auto, cpu, cuda, cuda:N, mps.", "e.g. device=auto"),
    _case("dtype", "an unknown dtype", "dtype=int8",
          "dtype='int8' is not allowed; allowed: float32, float64, bfloat16, float16.", "e.g. dtype=float32"),
    _case("steps", "a negative number of steps", "steps=-1",
          "steps=-1 is not allowed; steps must be an integer >= 0.", "e.g. steps=1"),
    _case("every", "capture every 0th step", "capture.every=0",
          "capture.every=0 is not allowed; capture.every must be an integer >= 1.", "e.g. capture.every=1"),
    _case("no-target", "a group without _target_", "~model._target_",
          "model has no _target_ (got {<...>});", "pick an option with model=<option>"),
    _case("bad-target", "a _target_ that does not exist", "model._target_=torch.nn.Nope",
          "could not build model from _target_='torch.nn.Nope': Error locating target 'torch.nn.Nope'",
          "pick another option with model=<option>"),
    _case("bad-kwarg", "a model key the model does not take", "+model.hiden=3",
          "could not build model from _target_='gradrunner.models.MLP': <...>'hiden'", "Check the model.* keys"),
    _case("bad-lr", "an optimizer value the optimizer refuses", "optimizer.lr=-1",
          "could not build optimizer 'torch.optim.SGD' over the model's parameters: Invalid learning rate: -1",
          "Check the optimizer.* keys"),
    # -- tap syntax, paths and names
    _case("tap-no-colon", "a tap without ':'", "taps=[fc1]", "tap 'fc1' has no ':';",
          "write '<module path>:<name>', e.g. 'fc1:output'"),
    _case("tap-empty-name", "a tap with an empty name", "taps=[fc1:]", "tap 'fc1:' has an empty name;",
          "allowed names: output, input"),
    _case("tap-mapping", "a tap mapping with a wrong key", "taps=[{module:fc1,nme:output}]",
          "tap {'module': 'fc1', 'nme': 'output'} must be a mapping with keys 'module' and 'name' only",
          "e.g. {module: fc1, name: output}"),
    _case("unknown-path", "a module path that does not exist", "taps=[fc9:output]",
          "tap 'fc9:output': no module 'fc9' in MLP.", "Closest paths: 'fc2', 'fc1'"),
    _case("unknown-name", "a name the module does not have", "taps=[fc1:outptu]",
          "tap 'fc1:outptu': module 'fc1' (Linear) has no 'outptu'.", "Did you mean 'output'?"),
    _case("glob-no-module", "a glob that matches no module", "taps=['conv*:output']",
          "tap 'conv*:output': the glob 'conv*' matches no module of MLP", "Some paths: 'fc1'"),
    _case("glob-no-name", "a glob whose modules lack the name", "taps=['fc*:gamma']",
          "tap 'fc*:gamma': the glob 'fc*' matches 2 modules ('fc1', 'fc2') but none of them has 'gamma'.",
          "parameters and forward() locals are per module"),
    _case("no-element", "an element a tensor output does not have", "taps=[head:output.3]",
          "tap 'head:output.3': the value has no element 3 (it is a Tensor);", "use output.N for tuple elements"),
    _case("no-input-element", "an input element the call does not have", "taps=[fc1:input.2]",
          "tap 'fc1:input.2': the value has no element 2 (it is a tuple of length 1);",
          "use input.N for the N-th positional argument, input.NAME for a keyword argument"),
    _case("int-local", "an explicit tap on an integer tensor", "model=int_local taps=[:idx]",
          "tap ':idx' cannot carry a gradient: its value is a torch.int64 tensor", "or drop the tap"),
    _case("int-input", "an input tap on integer inputs (token ids)", "model=embedder data=token_ids taps=[:input]",
          "tap ':input' cannot carry a gradient: its value is a torch.int64 tensor", "or drop the tap"),
    _case("no-grad-local", "an explicit tap on a tensor made under torch.no_grad()", "model=gated taps=[:gate]",
          "tap ':gate' cannot carry a gradient: its value is a tensor that does not require grad (made under "
          "torch.no_grad()", "or drop the tap"),
    # -- models
    _case("forward-raises", "a forward() that raises", "model=raises",
          "step 0 failed in the model's forward(): awkward.Raises raised ValueError: inputs must be in [0, 1], "
          "on inputs (32, 8) float32.", "Check the model"),
    _case("input-shape", "inputs that do not fit the model", "data.input_shape=[7]",
          "step 0 failed in the model's forward(): gradrunner.models.MLP raised RuntimeError: mat1 and mat2 "
          "shapes cannot be multiplied", "that the data fits it (data.* shapes)"),
    _case("dict-output", "a dict output given to MSELoss", "model=dict_output",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, a dict with keys "
          "'logits', 'aux', with targets (32, 1) float32: AttributeError", "a loss that takes what the model returns"),
    _case("tuple-output", "a tuple output given to MSELoss", "model=tuple_output",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, a tuple of 2 <...>: "
          "AttributeError", "a loss that takes what the model returns"),
    _case("dataclass-output", "a dataclass output given to MSELoss", "model=dataclass_output",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, a dataclass "
          "Output(logits, aux), with targets (32, 1) float32: AttributeError",
          "a loss that takes what the model returns"),
    _case("loss-not-scalar", "a loss that is not a scalar", "+loss.reduction=none",
          "step 0: the loss torch.nn.MSELoss returned (32, 1) float32, not a scalar tensor;",
          "reduction='mean' or 'sum'"),
    _case("loss-without-grad", "every parameter frozen", "model=frozen",
          "step 0: the loss torch.nn.MSELoss does not require grad, so there is nothing to backpropagate",
          "Unfreeze a parameter"),
    _case("backward-fails", "an in-place op on a tensor autograd saved", "model=inplace_breaks_backward",
          "step 0 failed in backward: RuntimeError: one of the variables needed for gradient computation has been "
          "modified by an inplace operation", "check the model's forward()"),
    _case("scripted", "a TorchScript model", "model=scripted",
          "the model is a TorchScript module (RecursiveScriptModule)", "give it the eager module instead"),
    # -- data
    _case("target-shape", "targets that do not fit the output", "data.target_shape=[3] model.out_features=2",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, (32, 2) float32, with "
          "targets (32, 3) float32: RuntimeError", "check data.* target shapes"),
    _case("empty-source", "a data source that yields nothing", "data=empty",
          "data: awkward.EmptyData ran out of batches at step 0 (it yielded none);", "make its batches() endless"),
    _case("empty-iterable", "an empty iterable as data", "data=empty_list",
          "data: list yielded no batches;", "must yield at least one (inputs, targets) pair"),
    _case("not-pairs", "data that yields inputs alone", "data=not_pairs",
          "data: awkward.NotPairs yielded (4, 8) float32 at step 0, not an (inputs, targets) pair;",
          "yield (inputs, targets) tuples"),
    _case("ragged", "a ragged tensor literal", "data=tensors data.inputs=[[1.0],[1.0,2.0]]",
          "data.inputs=[[1.0], [1.0, 2.0]] is not a tensor literal", "nested lists of numbers with equal lengths"),
    # -- output
    _case("unwritable-dir", "an output directory under a regular file", "", "cannot write records in <...>: [Errno 20] "
          "Not a directory", "choose another output directory", setup="file_in_the_way"),
    _case("disk-full", "the disk filling up (simulated: every Parquet write raises ENOSPC)", "",
          "could not write the records in <...>: [Errno 28] No space left on device.", "free some disk space",
          setup="disk_full"),
    # -- a run that goes non-finite
    _case("nonfinite-stop", "a loss that turns NaN at step 1, with capture.on_nonfinite=stop",
          "loss=nan_after capture.on_nonfinite=stop steps=5",
          "capture.on_nonfinite=stop: stopped at step 1, where the loss is nan and 5 tap(s) have NaN or Inf "
          "gradient elements (first: fc1:output, relu1:output, fc2:output).", "set capture.on_nonfinite=record",
          keeps_records=True),
    # -- added after the table was first numbered: new rows go last, so that a row's number stays its number
    _case("lr-nan", "a learning rate that is not a number (SGD takes it)", "optimizer.lr=nan",
          "optimizer.lr=nan is not allowed; a learning rate must be a finite number >= 0 (torch.optim.SGD has nan in "
          "param group 0 of 1), so nothing was run.", "optimizer.lr=0.001"),
    _case("lr-inf", "an infinite learning rate (Adam takes it)", "optimizer=adam optimizer.lr=inf",
          "optimizer.lr=inf is not allowed; a learning rate must be a finite number >= 0 (torch.optim.Adam has inf "
          "in param group 0 of 1), so nothing was run.", "optimizer.lr=0.001"),
    _case("target-broadcast", "targets an elementwise loss would broadcast against the output", "data.target_shape=[]",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, (32, 1) float32, with targets "
          "(32,) float32: their shapes differ and the loss compares them element by element: torch would broadcast "
          "them to (32, 32) and the loss would be wrong.", "check data.* target shapes"),
    _case("target-rows", "a batch with more rows of inputs than of targets",
          "data=tensors data.inputs=[[1.0],[2.0]] data.targets=[[1.0]] model.in_features=1",
          "step 0 failed in the loss: torch.nn.MSELoss cannot take the model's output, (2, 1) float32, with targets "
          "(1, 1) float32: their shapes differ", "The output has 2 rows (from 2 rows of inputs) but the targets have 1 "
          "row."),
    _case("target-broadcast-warned", "targets torch warns a loss of the user's would broadcast",
          "data.target_shape=[] loss._target_=torch.nn.functional.mse_loss +loss._partial_=true",
          "step 0 failed in the loss: torch.nn.functional.mse_loss cannot take the model's output, (32, 1) float32, "
          "with targets (32,) float32: their shapes differ and torch warned that it would broadcast them to (32, 32)",
          "check data.* target shapes"),
    _case("bool-typo", "a typo in a boolean data setting", "+experiment=cnn data.shuffle=flase",
          "data.shuffle='flase' is not allowed; allowed: false, true. Did you mean 'false'? (gradrunner.data.Digits "
          "takes a boolean there; a string counts as true whatever it says.)", "e.g. data.shuffle=false"),
    _case("bool-word", "a word for a boolean that is not true or false", "data=corrupted data.nan=no",
          "data.nan='no' is not allowed; allowed: false, true. (gradrunner.data.Corrupted takes a boolean there;",
          "e.g. data.nan=false"),
    _case("bool-nested", "a boolean of a nested data source", "data=corrupted +data.inner.shuffle=flase",
          "data.inner.shuffle='flase' is not allowed; allowed: false, true.", "e.g. data.inner.shuffle=false"),
]  # fmt: skip


# -- running a case ------------------------------------------------------------------------------


def _file_in_the_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file" / "job"


def _disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    def no_space(self: pq.ParquetWriter, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", no_space)
    return tmp_path / "job"


SETUPS: dict[str, Callable[[Path, pytest.MonkeyPatch], Path]] = {
    "": lambda tmp_path, monkeypatch: tmp_path / "job",
    "file_in_the_way": _file_in_the_way,
    "disk_full": _disk_full,
}


def forwards(model: nn.Module) -> dict[str, object]:
    """Every module's `forward`: the class's (read statically: TorchScript's is a descriptor) and the instance's."""
    found: dict[str, object] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        found[f"{path}:class"] = inspect.getattr_static(type(m), "forward", None)
        found[f"{path}:instance"] = m.__dict__.get("forward")  # torch.compile sets one of its own
    return found


def check_model_untouched(model: nn.Module, before: dict[str, object]) -> None:
    left = [h for h in leftover_hooks(model) if "instance attribute forward" not in h]
    assert left == []
    assert forwards(model) == before


@pytest.fixture
def built_models(monkeypatch: pytest.MonkeyPatch) -> list[tuple[nn.Module, dict[str, object]]]:
    """Keeps a reference to every model `build` builds, with its `forward`s as built."""
    models: list[tuple[nn.Module, dict[str, object]]] = []
    real_build = job_build.build

    def build(cfg: Any, group: str) -> Any:
        built = real_build(cfg, group)
        if group == "model" and isinstance(built, nn.Module):
            models.append((built, forwards(built)))
        return built

    monkeypatch.setattr(job_build, "build", build)
    return models


@pytest.fixture
def clean_hydra() -> Iterator[None]:
    """The in-process app leaves Hydra's global state set: clear it for the tests that follow."""
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]
    GlobalHydra.instance().clear()


def run_api(case: Case, out_dir: Path) -> tuple[int, str]:
    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        cfg = compose("config", overrides=[SEARCHPATH, "steps=2", *case.overrides])
    try:
        runner.train(cfg, out_dir=out_dir)
    except GradrunnerError as e:
        assert "\n" not in str(e), "a message is one paragraph"
        return 2, str(e)
    raise AssertionError(f"{case.id}: train() did not fail")


def run_cli(
    case: Case, out_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    argv = ["gradrunner", SEARCHPATH, "steps=2", *case.overrides, f"hydra.run.dir={out_dir}"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main()
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    lines = [line for line in out.err.splitlines() if line.strip()]
    if case.exit == 2:  # one line, the last (a library's warning may come before it)
        errors = [line for line in lines if line.startswith("gradrunner: error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0], out.err
        return int(info.value.code or 0), errors[0].removeprefix("gradrunner: error: ")
    return int(info.value.code or 0), out.err


def pattern(text: str) -> str:
    """A message start with `<...>` as a wildcard, as a regex."""
    return ".*?".join(re.escape(part) for part in text.split("<...>"))


def check_records(case: Case, root: Path) -> None:
    found = sorted(p.name for p in root.rglob("*.parquet*"))
    if not case.keeps_records:
        assert found == [], f"{case.id} left records behind: {found}"
        return
    assert found == ["anomalies.parquet", "grads.parquet", "steps.parquet"], found  # complete files, no temp file
    (grads,) = root.rglob("grads.parquet")
    assert len(pd.read_parquet(grads)) > 0


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_paragraph_and_leaves_nothing_behind(
    case: Case, via: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    built_models: list[tuple[nn.Module, dict[str, object]]], clean_hydra: None,
) -> None:  # fmt: skip
    if via not in case.via:
        pytest.skip(f"{case.id} is refused on the command line (by gradrunner or Hydra) before train() runs")
    monkeypatch.chdir(tmp_path)
    out_dir = SETUPS[case.setup](tmp_path, monkeypatch)
    status, message = run_api(case, out_dir) if via == "api" else run_cli(case, out_dir, monkeypatch, capsys)
    assert status == case.exit
    assert re.match(pattern(case.message), message), f"{message!r}\n does not start with {case.message!r}"
    assert case.way_out in message
    check_records(case, tmp_path)
    for model, before in built_models:
        check_model_untouched(model, before)


def test_there_are_at_least_twenty_cases_with_distinct_ids() -> None:
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


# -- the docs table ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The table of `docs/errors.md`, from `CASES`."""
    rows = [
        "| # | what | command line | exit | the message starts | the way out it names |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, c in enumerate(CASES, 1):
        command = f"`{_cell(' '.join(c.overrides))}`" if c.overrides else "(see what)"
        rows.append(
            f"| {n} | {_cell(c.what)} | {command} | {c.exit} | `{_cell(c.message)}` | `{_cell(c.way_out)}` |"
        )
    return "\n".join(rows)


def docs_block(text: str) -> str:
    assert START in text and END in text, f"{DOCS} has no {START} ... {END} block"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_docs_table_is_up_to_date() -> None:
    assert docs_block(DOCS.read_text()) == render_table(), "run: python tests/test_errors.py"


def write_docs() -> None:
    """Rewrite the table in docs/errors.md from CASES."""
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOCS.write_text(f"{head}{START}\n{render_table()}\n{END}{tail}")


if __name__ == "__main__":
    write_docs()
    print(f"wrote {DOCS}")
