"""`gradrunner.capturing.taps`: tap specs parsed and resolved against a model, before any forward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradrunner import GradrunnerError, capture
from gradrunner.capturing.taps import Tap, parse_spec, resolve_taps
from gradrunner.models import MLP, CosineRegression, SmallCNN, TinyTransformerBlock


def _taps(model: nn.Module, specs: object) -> list[tuple[str, str, str]]:
    return [(t.module, t.name, t.kind) for t in resolve_taps(model, specs)]  # type: ignore[arg-type]


@pytest.fixture
def mlp() -> MLP:
    return MLP(in_features=3, hidden=4, depth=2, out_features=2)


# -- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("fc1:output", ("fc1", "output")),
        (":mul_x", ("", "mul_x")),
        ("attn:output.0", ("attn", "output.0")),
        ("block.fc1:weight", ("block.fc1", "weight")),
        ({"module": "fc1", "name": "weight"}, ("fc1", "weight")),
        ({"module": "", "name": "input"}, ("", "input")),
    ],
)
def test_parse_spec(spec: object, expected: tuple[str, str]) -> None:
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("fc1", "has no ':'"),
        ("fc1:", "empty name"),
        ({"module": "fc1"}, "missing name"),
        ({"module": "fc1", "name": "output", "call": 1}, "unexpected call"),
        ({"path": "fc1", "name": "output"}, "unexpected path"),
        (42, "is a int"),
        (None, "is a NoneType"),
        (("fc1", "output"), "is a tuple"),
    ],
)
def test_malformed_spec(mlp: MLP, spec: object, fragment: str) -> None:
    with pytest.raises(GradrunnerError, match=fragment):
        resolve_taps(mlp, [spec])  # type: ignore[list-item]


def test_missing_colon_suggests_the_fix(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match=r"'fc1:output'.*':fc1'"):
        resolve_taps(mlp, ["fc1"])


def test_taps_that_are_not_a_list(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match="list of tap specs"):
        resolve_taps(mlp, 5)  # type: ignore[arg-type]


# -- kinds -----------------------------------------------------------------------------------------
def test_single_spec_and_mapping_spec(mlp: MLP) -> None:
    assert _taps(mlp, "fc1:output") == [("fc1", "output", "output")]
    assert _taps(mlp, {"module": "fc1", "name": "bias"}) == [("fc1", "bias", "param")]


def test_root_taps() -> None:
    model = CosineRegression()
    assert _taps(model, [":input", ":output", ":mul_x", ":a", {"module": "", "name": "sum_x"}]) == [
        ("", "input", "input"),
        ("", "output", "output"),
        ("", "mul_x", "local"),
        ("", "a", "param"),
        ("", "sum_x", "local"),
    ]
    assert resolve_taps(model, [":output"])[0].tap == ":output"


def test_element_paths() -> None:
    model = TinyTransformerBlock()
    taps = resolve_taps(model, ["attn:output.0", "attn:output.1", "attn:input.2", "head:output.logits"])
    assert [(t.kind, t.path) for t in taps] == [("output", (0,)), ("output", (1,)), ("input", (2,)),
                                                ("output", ("logits",))]
    assert [t.tap for t in taps] == ["attn:output.0", "attn:output.1", "attn:input.2", "head:output.logits"]


def test_nested_module_path() -> None:
    model = nn.Sequential(MLP(in_features=3, hidden=4, depth=1), nn.ReLU())
    assert _taps(model, ["0.fc1:weight", "0.relu1:output"]) == [("0.fc1", "weight", "param"),
                                                               ("0.relu1", "output", "output")]


def test_locals_of_a_submodule() -> None:
    model = nn.Sequential(CosineRegression(), CosineRegression())
    assert _taps(model, ["*:mul_x"]) == [("0", "mul_x", "local"), ("1", "mul_x", "local")]


def test_tap_dataclass() -> None:
    assert Tap("fc1", "output", "output").tap == "fc1:output"
    assert Tap("", "h", "local").tap == ":h"


# -- globs -----------------------------------------------------------------------------------------
def test_glob_over_layers(mlp: MLP) -> None:
    assert _taps(mlp, ["fc*:output"]) == [("fc1", "output", "output"), ("fc2", "output", "output")]
    assert _taps(mlp, ["relu?:input"]) == [("relu1", "input", "input"), ("relu2", "input", "input")]
    assert _taps(mlp, ["[fh]*:output"]) == [("fc1", "output", "output"), ("fc2", "output", "output"),
                                             ("head", "output", "output")]


def test_star_output_excludes_the_root(mlp: MLP) -> None:
    assert [m for m, _, _ in _taps(mlp, ["*:output"])] == ["fc1", "relu1", "fc2", "relu2", "head"]


def test_glob_with_a_parameter_only_applies_to_modules_that_have_it() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))
    assert _taps(model, ["*:weight"]) == [("0", "weight", "param"), ("2", "weight", "param")]
    assert _taps(model, ["*:bias"]) == [("0", "bias", "param")]


def test_glob_with_a_local_only_applies_to_modules_that_assign_it() -> None:
    model = nn.Sequential(CosineRegression(), SmallCNN())
    assert _taps(model, ["*:features"]) == [("1", "features", "local")]


def test_glob_matching_nothing_names_the_glob(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match=r"glob 'conv\*' matches no module") as err:
        resolve_taps(mlp, ["conv*:output"])
    assert "fc1" in str(err.value)


def test_glob_whose_modules_lack_the_name(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match=r"'relu\*' matches 2 modules .* none of them has 'weight'"):
        resolve_taps(mlp, ["relu*:weight"])


def test_duplicates_are_dropped_first_wins(mlp: MLP) -> None:
    taps = _taps(mlp, ["fc2:output", "fc1:output", "fc*:output", {"module": "fc1", "name": "output"}])
    assert taps == [("fc2", "output", "output"), ("fc1", "output", "output")]


# -- unknown modules and names ---------------------------------------------------------------------
def test_unknown_module_lists_closest_paths(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match="no module 'fc3'") as err:
        resolve_taps(mlp, ["fc3:output"])
    message = str(err.value)
    assert "Closest paths" in message and "'fc1'" in message and "'fc2'" in message


def test_unknown_nested_module_lists_closest_paths() -> None:
    model = TinyTransformerBlock()
    with pytest.raises(GradrunnerError, match="attn.out_proj") as err:
        resolve_taps(model, ["attn.outproj:output"])
    assert "closest" in str(err.value).lower()


def test_unknown_name_lists_parameters_and_locals() -> None:
    with pytest.raises(GradrunnerError) as err:
        resolve_taps(CosineRegression(), [":mul"])
    message = str(err.value)
    assert "':mul'" in message and "Did you mean 'mul_x'" in message
    assert "parameters: a, b" in message
    assert "mul_x, sum_x" in message
    assert "output" in message and "input" in message


def test_unknown_name_on_a_library_module_lists_its_parameters(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match="Did you mean 'weight'") as err:
        resolve_taps(mlp, ["fc1:wieght"])
    assert "weight, bias" in str(err.value)


def test_parameter_of_a_child_is_not_a_parameter_of_the_parent(mlp: MLP) -> None:
    with pytest.raises(GradrunnerError, match="has no 'fc1.weight'"):
        resolve_taps(mlp, [":fc1.weight"])


def test_resolution_happens_when_the_capture_is_created(mlp: MLP) -> None:
    calls = []
    mlp.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(GradrunnerError, match="fc3"):
        capture(mlp, ["fc1:output", "fc3:output"])
    assert calls == []  # no forward pass was needed to find the mistake


def test_capture_uses_the_resolved_names(mlp: MLP) -> None:
    mlp = mlp.double()
    with capture(mlp, ["fc*:output", {"module": "head", "name": "weight"}]) as cap:
        cap.backward(mlp(torch.randn(2, 3, dtype=torch.float64)).sum())
    assert list(cap.grads) == ["fc1:output", "fc2:output", "head:weight"]
    assert [k.tap for k in cap.records().keys] == ["fc1:output", "fc2:output", "head:weight"]


# -- module paths that hold glob characters (nn.ModuleDict keys) -----------------------------------
class _Keys(nn.Module):
    """Module paths with '[', '*' and '?' in them, next to paths their glob reading would also match."""

    def __init__(self) -> None:
        super().__init__()
        names = ["x[0]", "x0", "a*b", "aXYb", "q?", "qa"]
        self.blocks = nn.ModuleDict({k: nn.Linear(2, 2) for k in names})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


@pytest.mark.parametrize("path", ["blocks.x[0]", "blocks.a*b", "blocks.q?"])
def test_a_path_with_glob_characters_is_that_path_and_gets_its_gradient(path: str) -> None:
    model = _Keys()
    (tap,) = resolve_taps(model, [f"{path}:output"])
    assert (tap.module, tap.from_glob) == (path, False)  # an explicit tap: errors are not softened as a glob's
    x = torch.randn(3, 2)
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, a, o: seen.append(o))
    (want,) = torch.autograd.grad(model(x).pow(2).sum(), seen)
    handle.remove()
    with capture(model, [f"{path}:output"]) as cap:
        cap.backward(model(x).pow(2).sum())
    assert torch.equal(cap.grads[f"{path}:output"], want)


def test_the_glob_reading_of_such_a_path_is_written_with_a_bracketed_character() -> None:
    model = _Keys()
    assert [t.module for t in resolve_taps(model, ["blocks.[q]?:output"])] == ["blocks.q?", "blocks.qa"]
    assert [t.module for t in resolve_taps(model, ["blocks.a*b:output", "blocks.[a]*b:output"])] == [
        "blocks.a*b", "blocks.aXYb"
    ]  # fmt: skip
    assert [t.module for t in resolve_taps(model, ["blocks.x[[]*:output"])] == ["blocks.x[0]"]
    assert all(t.from_glob for t in resolve_taps(model, ["blocks.[q]?:output"]))


def test_a_glob_that_matches_nothing_never_suggests_itself_and_says_how_to_escape() -> None:
    model = _Keys()
    with pytest.raises(GradrunnerError) as err:
        resolve_taps(model, ["blocks.x[1]:output"])
    message = str(err.value)
    assert "the glob 'blocks.x[1]' matches no module" in message
    assert "Closest paths: 'blocks.x[0]'" in message and "'blocks.x[1]'," not in message.split("Closest")[1]
    assert "[*], [?] and [[] match those characters" in message
