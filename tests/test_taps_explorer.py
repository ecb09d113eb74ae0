"""The tap explorer: `list_taps(model, ...)` and `python -m gradrunner.taps <overrides>`.

The command runs inside the test's process (`conftest.python_m`), except one real subprocess: the
end-to-end smoke of the command (the text listing of the transformer).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import child_python, cli_env, compose_cfg, gradrunner_in_process, leftover_hooks, python_m
from torch import nn

from gradrunner import capture, list_taps
from gradrunner.capturing.explore import TapListing
from gradrunner.capturing.taps import resolve_taps
from gradrunner.cli.explore import listing
from gradrunner.errors import GradrunnerError
from gradrunner.run.build import setup
from gradrunner.run.guards import next_batch

BUILT_IN = ["mlp", "cnn", "transformer", "cosine", "sigmoid2"]


def taps_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m gradrunner.taps *args` from `cwd`, inside this process."""
    return python_m(cwd, "gradrunner.taps", *args)


def taps_process(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m gradrunner.taps *args` from `cwd`, in a real subprocess."""
    return subprocess.run(
        [child_python(), "-m", "gradrunner.taps", *args], cwd=cwd, env=cli_env(), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def by_path(result: TapListing) -> dict[str, Any]:
    return {m.path: m for m in result.modules}


@pytest.mark.parametrize("experiment", BUILT_IN)
def test_every_module_path_of_each_built_in_experiment_is_listed(experiment: str) -> None:
    cfg = compose_cfg(f"+experiment={experiment}")
    result = listing(cfg)
    assert isinstance(result, TapListing)
    model = setup(cfg).model
    assert leftover_hooks(model) == []
    paths = [p for p, _ in model.named_modules(remove_duplicate=False)]
    assert sorted(m.path for m in result.modules) == sorted(paths)
    x, y = next(setup(cfg).batches)
    root = by_path(result)[""]
    assert root.calls == 1 and root.outputs[0].name == "output"
    assert root.outputs[0].shape == list(model(x).shape) and root.inputs[0].shape == list(x.shape)
    # Every listed output/input/parameter name is one the tap resolver accepts on that path.
    for m in result.modules:
        names = [s.name for s in m.outputs + m.inputs + m.parameters + m.locals]
        if names:
            assert len(resolve_taps(model, [f"{m.path}:{n}" for n in names])) == len(set(names))


def test_the_transformer_listing_has_shapes_tuple_elements_and_names_out_proj_as_not_called() -> None:
    result = by_path(listing(compose_cfg("+experiment=transformer")))
    attn = result["attn"]
    # batch 8, sequence 5, d_model 16 (experiment/transformer.yaml); weights (8, 5, 5) averaged over heads
    assert [(s.name, s.shape, s.dtype) for s in attn.outputs] == [
        ("output.0", [8, 5, 16], "float32"), ("output.1", [8, 5, 5], "float32")
    ]  # fmt: skip
    assert [s.name for s in attn.inputs] == ["input.0", "input.1", "input.2"]
    assert [(s.name, s.shape) for s in attn.parameters] == [("in_proj_weight", [48, 16]), ("in_proj_bias", [48])]
    assert result["attn.out_proj"].calls == 0 and result["attn.out_proj"].outputs == []
    assert [s.name for s in result[""].locals] == ["q", "attn_out", "_weights", "h", "ff"]
    assert [(s.shape, s.no_gradient) for s in result[""].locals[:2]] == [([8, 5, 16], None), ([8, 5, 16], None)]
    order = [m.path for m in listing(compose_cfg("+experiment=transformer")).modules]
    assert order == ["", "ln1", "attn", "ln2", "ff1", "act", "ff2", "head", "attn.out_proj"]


class Branchy(nn.Module):
    """A user model: dict output, a submodule called twice, one never called, kwargs, a local."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.shared = nn.Tanh()
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, Any]:
        hidden = self.shared(self.enc(x))
        hidden = self.shared(hidden * (1.0 if scale is None else scale))
        return {"logits": hidden, "pair": (hidden.sum(), None), "note": "text"}


def test_a_user_model_with_dict_output_kwargs_repeated_and_unused_modules() -> None:
    model = Branchy()
    result = list_taps(model, torch.randn(2, 4), scale=torch.ones(1, dtype=torch.float64))
    m = by_path(result)
    assert [(s.name, s.shape, s.kind) for s in m[""].outputs] == [
        ("output.logits", [2, 3], "tensor"), ("output.pair.0", [], "tensor"), ("output.note", None, "str")
    ]  # fmt: skip
    assert [(s.name, s.dtype) for s in m[""].inputs] == [("input.0", "float32"), ("input.scale", "float64")]
    assert m["shared"].calls == 2 and m["enc"].calls == 1 and m["unused"].calls == 0
    assert [(s.name, s.shape, s.dtype) for s in m[""].locals] == [("hidden", [2, 3], "float32")]  # the first assignment
    assert [mm.path for mm in result.modules] == ["", "enc", "shared", "unused"]
    assert "unused (Linear) NOT CALLED" in str(result)
    assert json.loads(json.dumps(result.to_dict()))["modules"][2]["calls"] == 2
    assert leftover_hooks(model) == []


def test_a_forward_without_readable_source_is_listed_not_fatal() -> None:
    namespace: dict[str, Any] = {}
    exec("def forward(self, x):\n    y = x * 2\n    return y\n", namespace)  # no file: no source to read
    Doubler = type("Doubler", (nn.Module,), {"forward": namespace["forward"]})
    model = nn.Sequential(nn.Linear(2, 2), Doubler())
    m = by_path(list_taps(model, torch.randn(1, 2)))
    assert m["1"].calls == 1 and m["1"].locals == [] and "unavailable" in (m["1"].locals_note or "")
    assert m["1"].outputs[0].shape == [1, 2]


def test_hooks_are_removed_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError(f"no {self.lin(x).shape}")

    model = Boom()
    with pytest.raises(ValueError, match="no"):
        list_taps(model, torch.randn(1, 2))
    assert leftover_hooks(model) == []


@pytest.mark.slow
def test_the_command_lists_the_transformer_in_text_and_json_and_writes_nothing(tmp_path: Path) -> None:
    text = taps_process(tmp_path, "+experiment=transformer")  # the end-to-end smoke of the command
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "attn.out_proj (NonDynamicallyQuantizableLinear) NOT CALLED" in text.stdout
    assert any(line.split() == ["output.0", "(8,", "5,", "16)", "float32"] for line in lines)
    as_json = taps_cli(tmp_path, "+experiment=transformer", "--format", "json", "steps=1")
    assert as_json.returncode == 0, as_json.stderr
    modules = {m["path"]: m for m in json.loads(as_json.stdout)["modules"]}
    assert modules["attn.out_proj"]["calls"] == 0 and modules["head"]["outputs"][0]["shape"] == [8, 5, 4]
    assert list(tmp_path.iterdir()) == []  # no outputs/ dir, no log file
    bad = taps_cli(tmp_path, "+experiment=mlp", "--format", "yaml")
    assert bad.returncode == 2 and "allowed: text, json" in bad.stderr and "Traceback" not in bad.stderr
    wrong = taps_cli(tmp_path, "+experiment=mlp", "data.input_shape=[3]")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr and "forward()" in wrong.stderr


def test_a_forward_that_needs_autograd_is_listed_with_grad_enabled() -> None:
    class Score(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.energy = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.requires_grad_(True)
            (force,) = torch.autograd.grad(self.energy(x).sum(), x, create_graph=True)
            return force

    model = Score()
    m = by_path(list_taps(model, torch.randn(2, 3)))
    assert m[""].outputs[0].shape == [2, 3] and m["energy"].outputs[0].shape == [2, 1]
    assert [s.name for s in m[""].locals] == ["x", "force"] and leftover_hooks(model) == []


# -- --match and globs that match nothing ------------------------------------------------------------
def test_matching_keeps_only_the_paths_the_glob_selects() -> None:
    model = nn.Sequential()
    model.add_module("layers", nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)]))
    listed = list_taps(model, torch.randn(2, 4))
    every = [p for p, _ in model.named_modules()]
    assert [m.path for m in listed.matching("layers.0.*").modules] == [p for p in every if p.startswith("layers.0.")]
    assert [m.path for m in listed.matching("").modules] == [""]


@pytest.mark.slow
def test_the_taps_cli_filters_with_match_and_refuses_a_match_of_nothing(tmp_path: Path) -> None:
    ok = taps_cli(tmp_path, "+experiment=mlp", "--match", "relu*")
    assert ok.returncode == 0, ok.stderr
    modules = ok.stdout.split("\n\nThe config's globs")[0]  # the config's globs follow, over the whole model
    paths = [line.split(" ")[0] for line in modules.splitlines()[1:] if not line.startswith(" ")]
    assert paths == ["relu1", "relu2", "relu3"]
    bad = taps_cli(tmp_path, "+experiment=mlp", "--match=zz*")
    assert bad.returncode == 2 and bad.stderr.startswith("gradrunner.taps: error: --match 'zz*' matches no module")


def test_a_glob_that_matches_nothing_names_the_closest_paths() -> None:
    model = nn.Sequential()
    model.add_module("layers", nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(
        GradrunnerError,
        match=r"the glob 'layer\.\*' matches no .* Closest paths: 'layers\.1', 'layers\.0', 'layers'\. Inside a glob, \[\*\]",
    ):
        resolve_taps(model, ["layer.*:output"])


@pytest.mark.parametrize(("args", "option", "takes"), [
    (["+experiment=mlp", "--format"], "--format", "one of text, json"),
    (["+experiment=mlp", "--match"], "--match", "a glob over module paths"),
    (["+experiment=mlp", "--format", "--match", "fc*"], "--format", "one of text, json"),
])  # fmt: skip
def test_an_option_without_its_value_is_one_paragraph_naming_it_and_what_it_takes(
    tmp_path: Path, args: list[str], option: str, takes: str
) -> None:
    bad = taps_cli(tmp_path, *args)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith(f"gradrunner.taps: error: {option} needs a value: {takes}")
    assert bad.stderr.count("\n") == 1 and "usage" not in bad.stderr and "hydra." not in bad.stderr
    assert bad.stdout == ""


def test_match_and_the_glob_counts_take_a_path_with_glob_characters_as_that_path() -> None:
    from gradrunner.capturing.taps import glob_reach

    model = nn.Module()
    model.blocks = nn.ModuleDict({k: nn.Linear(2, 2) for k in ["q?", "qa", "x[0]"]})
    model.forward = lambda x: model.blocks["x[0]"](model.blocks["qa"](model.blocks["q?"](x)))  # type: ignore[method-assign]
    listed = list_taps(model, torch.randn(1, 2))
    assert [m.path for m in listed.matching("blocks.q?").modules] == ["blocks.q?"]
    assert [m.path for m in listed.matching("blocks.x[0]").modules] == ["blocks.x[0]"]
    assert [m.path for m in listed.matching("blocks.[q]?").modules] == ["blocks.q?", "blocks.qa"]
    reach = glob_reach(model, ["blocks.q?:output", "blocks.[q]?:output"])
    assert [(r.spec, r.taps) for r in reach] == [("blocks.[q]?:output", 2)]


class _NamesThatMeanSomethingElse(nn.Module):
    """Locals named `output` and `weight` (the module's output, its parameter); `seq` has a local named `input`."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.weight = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight * 3
        output = self.seq(input) * weight
        output = output * 2
        return output


def test_locals_named_like_the_output_input_or_a_parameter_are_listed_as_the_tap_that_reaches_them() -> None:
    model, x = _NamesThatMeanSomethingElse(), torch.randn(2, 4)
    listed = list_taps(model, x)
    m = by_path(listed)
    names = [s.name for s in m[""].locals], [s.name for s in m["seq"].locals]
    assert names == (["local.weight", "local.output"], ["module", "local.input"])
    assert "    local.output  (2, 4) float32 local\n" in str(listed)
    assert [v["name"] for v in json.loads(json.dumps(listed.to_dict()))["modules"][1]["locals"]] == [
        "module",
        "local.input",
    ]
    assert {t.kind for t in resolve_taps(model, [":local.weight", ":local.output", "seq:local.input"])} == {"local"}
    # what the listed spellings capture: the locals at every assignment, not the output, input or parameter
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda mod, a, o: outs.append(o)) for layer in model.seq]
    weight, output = model.weight * 3, model(x)
    for h in hooks:
        h.remove()
    first = outs[2] * weight
    want = torch.autograd.grad((first * 2).pow(2).sum(), [*outs, first])
    with capture(model, ["seq:local.input", ":local.output", ":local.weight"]) as cap:
        cap.backward(model(x).pow(2).sum())
    assert [torch.allclose(cap.grads["seq:local.input", i], want[i]) for i in range(3)] == [True] * 3
    assert torch.allclose(cap.grads[":local.output", 0], want[3])
    assert torch.allclose(cap.grads[":local.output", 1], 2 * output.detach())  # the returned value: d(sum out^2)/d(out)
    assert torch.allclose(cap.grads[":local.weight"], (want[3] * outs[2]).sum(0))


def test_a_model_without_submodules_is_listed_though_the_default_glob_reaches_nothing() -> None:
    """The default `taps=["*:output"]` matches no module of a stock layer used alone (an LSTM): a run is refused, in
    one paragraph, but the explorer, the tool that shows what to tap instead, refused too (it resolved the taps)."""
    lstm = ("model._target_=torch.nn.LSTM", "~model.in_features", "~model.hidden", "~model.depth", "~model.out_features",
            "~model.inplace", "+model.input_size=8", "+model.hidden_size=4", "+model.batch_first=true",
            "data.input_shape=[5,8]")  # fmt: skip
    cfg = compose_cfg(*lstm)
    with pytest.raises(GradrunnerError, match=r"LSTM has no submodule: tap the root itself"):
        setup(cfg)
    found = listing(cfg)
    assert [r.refused is not None for r in found.reach] == [True]  # type: ignore[attr-defined]
    offered = by_path(found)[""].taps()
    assert ":weight_ih_l0" in offered and ":output.0" in offered, offered
    setup(compose_cfg(*lstm, "taps=[':output.0',':weight_ih_l0']"))  # what it offers, a run takes


class _Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        return self.l2(h)


def test_a_compiled_model_lists_the_eager_taps_that_capture_takes() -> None:
    torch.manual_seed(0)
    m, x = _Compiled(), torch.randn(8, 4)
    eager = [t for mod in list_taps(m, x).modules for t in mod.taps()]
    cm = torch.compile(m, backend="eager")
    listing = list_taps(cm, x)
    assert listing.model == "_Compiled"
    assert [t for mod in listing.modules for t in mod.taps()] == eager
    assert ":h" in eager and "l1:output" in eager
    h = torch.relu(m.l1(x))
    expected = torch.autograd.grad(m.l2(h).sum(), h)[0]  # l2's weight row, broadcast over the batch
    with capture(cm, [":h", "l1:output"]) as cap:
        loss = cm(x).sum()
        cap.backward(loss)
        assert torch.allclose(cap.grads[":h"], expected)
        assert torch.allclose(cap.grads[":h"], m.l2.weight.detach().expand(8, 4))


@pytest.mark.parametrize(("args", "says"), [
    (["+experiment=mlp", "stepz=3"], "stepz is not a config key"),
    (["+experiment=mlp", "model=mpl"], "model=mpl: the config group model has no option 'mpl'"),
    (["+experiment=nope"], "+experiment=nope: the config group experiment has no option 'nope'"),
    (["+experiment=mlp", "steps=many"], "steps"),
    (["+experiment=mlp", "model._target_=nope.Model"], "could not build model from _target_='nope.Model'"),
])  # fmt: skip
def test_a_command_line_mistake_is_one_paragraph_and_status_2_as_the_runner_gives(
    tmp_path: Path, args: list[str], says: str
) -> None:
    """The explorer takes the same overrides as a run, and refuses the same mistakes the same way (not Hydra's
    dozen lines and status 1, nor hydra.utils' log lines before the paragraph)."""
    bad = taps_cli(tmp_path, *args)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("gradrunner.taps: error: ") and says in bad.stderr, bad.stderr
    assert bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stdout == "" and list(tmp_path.iterdir()) == []


def test_match_keeps_the_config_globs_counts_in_text_and_json(tmp_path: Path) -> None:
    """`--match` narrows the module listing, not the config's globs: they count taps over the whole model."""
    config = ["+experiment=mlp", "taps=[fc*:output,relu*:output]"]
    whole = json.loads(taps_cli(tmp_path, *config, "--format", "json").stdout)["globs"]
    matched = json.loads(taps_cli(tmp_path, *config, "--format", "json", "--match", "relu1").stdout)["globs"]
    assert [(g["spec"], g["taps"]) for g in whole] == [("fc*:output", 3), ("relu*:output", 3)]
    assert matched == whole
    text = taps_cli(tmp_path, *config, "--match", "relu1").stdout
    assert "The config's globs" in text and "fc*:output resolves to 3 tap(s)" in text


def test_json_says_why_a_config_glob_is_refused_and_a_path_at_each_depth(tmp_path: Path) -> None:
    """`--format json` gives what the text says: the refusal of a glob that resolves to no tap, a path per depth."""
    config = ["+experiment=mlp", "taps=[fc*:output,zz*:output]"]
    ok, refused = json.loads(taps_cli(tmp_path, *config, "--format", "json").stdout)["globs"]
    text = taps_cli(tmp_path, *config).stdout
    assert ok["taps"] == 3 and ok["refused"] is None and ok["first_path"] == {"1": "fc1"}
    assert refused["taps"] == 0 and refused["first_path"] == {}
    assert "the glob 'zz*' matches no module of MLP" in refused["refused"] and refused["refused"] in text


def test_help_names_the_explorers_own_options_then_the_overrides(tmp_path: Path) -> None:
    """`--help` says what the command does and takes (`--format`, `--match`), then the config groups of a run."""
    result = taps_cli(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    head = result.stdout.split("== Configuration groups ==")[0]
    assert head.startswith("usage: python -m gradrunner.taps [--format text|json] [--match GLOB] [OVERRIDES...]")
    assert "--format: one of text, json" in head and "--match: a glob over module paths" in head
    assert "experiment: cnn, cosine, gpt2" in result.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--help"], ["+experiment=mlp"]])
def test_output_piped_into_head_ends_without_a_traceback(tmp_path: Path, args: list[str]) -> None:
    """`python -m gradrunner.taps --help | head`: the reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([child_python(), "-m", "gradrunner.taps", *args], cwd=tmp_path, env=cli_env(),
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=180)  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 0


def test_the_listing_runs_under_the_configs_autocast_as_a_training_step_does() -> None:
    """`train.autocast=bf16`: a run's taps hold what the forward makes under `torch.autocast` (a Linear's output in
    bfloat16); the listing gives the dtypes a plain forward under the same autocast records."""
    cfg = compose_cfg("+experiment=mlp", "train.autocast=bf16")
    job = setup(cfg, check_taps=False)
    seen: dict[str, str] = {}
    handles = [m.register_forward_hook(lambda m, a, out, name=name: seen.setdefault(name, str(out.dtype)) and None)
               for name, m in job.model.named_modules() if name]  # fmt: skip
    x, _ = next_batch(job.batches, 0, source=str(cfg.data._target_))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        job.model(x)
    for h in handles:
        h.remove()
    assert seen["fc1"] == "torch.bfloat16"  # the reference: autocast changes what the tap holds
    listed = {m.path: m.outputs[0].dtype for m in listing(cfg).modules if m.path}
    assert listed == {name: dtype.removeprefix("torch.") for name, dtype in seen.items()}


def test_an_error_inside_the_listing_is_not_told_as_hydras_before_the_task(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Only what Hydra meets before the task is the command line's: an OSError while listing is never told as
    'cannot write the run dir ... nothing ran' (the explorer writes no run dir)."""
    from gradrunner.cli import explore

    def broken(cfg: object) -> object:
        raise OSError(5, "Input/output error", "/data/shard-0")

    monkeypatch.setattr(explore, "listing", broken)
    result = taps_cli(tmp_path, "+experiment=mlp")
    assert result.returncode != 0 and "Input/output error" in result.stderr
    assert "cannot write the run dir" not in result.stderr and "Hydra could not save" not in result.stderr


def test_hydras_own_options_after_the_overrides_work_as_they_do_before_them(tmp_path: Path) -> None:
    """`+experiment=mlp --cfg job model.depth=1` was refused by argparse naming 'hydra.output_subdir=null ...', the
    settings the explorer adds, which the user never typed (found 2026-11-27); `--config-dir D` after an override too."""
    from gradrunner.run.hydra_adapter import split_options

    assert split_options(["+experiment=mlp", "--cfg", "job", "model.depth=1", "--info"]) == (
        ["+experiment=mlp", "model.depth=1"], ["--cfg", "job", "--info"])  # fmt: skip
    assert split_options(["a=1", "--help", "b=2"]) == (["a=1", "--help", "b=2"], [])  # Hydra prints it, as before
    shown = taps_cli(tmp_path, "+experiment=mlp", "--cfg", "job", "model.depth=1")
    assert shown.returncode == 0 and "hydra." not in shown.stderr, shown.stderr
    assert yaml.safe_load(shown.stdout)["model"]["depth"] == 1  # the job's config, with the override after --cfg
    (tmp_path / "conf").mkdir()
    listed = taps_cli(tmp_path, "+experiment=mlp", "--config-dir", str(tmp_path / "conf"), "model.depth=1")
    assert listed.returncode == 0, listed.stderr
    assert [line.split(" ")[0] for line in listed.stdout.splitlines()[1:] if not line.startswith(" ")][:3] == [
        "''", "fc1", "relu1"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf"]  # nothing written
    runner = gradrunner_in_process(tmp_path, "+experiment=mlp", "--cfg", "job", "steps=2")  # the runner: the same rule
    assert runner.returncode == 0 and yaml.safe_load(runner.stdout)["steps"] == 2, runner.stderr
