"""The package's layers: what each import costs, the one source of each allowed value, and the folders' shape."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gradrunner
from gradrunner.capturing.strategies import STRATEGIES
from gradrunner.config.choices import STRATEGY_NAMES


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "statement",
    ["import gradrunner.analysis", "import gradrunner.report", "import gradrunner.export", "import gradrunner.compare", "import gradrunner.records.writer",
     "import gradrunner"],
)
def test_reading_side_imports_no_torch(statement: str) -> None:
    loaded = _modules_after(statement)
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith(("gradrunner.capturing", "gradrunner.run"))}


def test_the_runner_starts_without_pandas_and_every_public_analysis_name_resolves() -> None:
    """`gradrunner.analysis` imports its modules on first use: the CLI (every rank, every bad-input error)
    does not pay for pandas before it reads records, and every name of `__all__` is still there."""
    import gradrunner.analysis as analysis

    assert "pandas" not in _modules_after("import gradrunner.cli.app")
    assert sorted(analysis.__all__) == sorted(analysis._HOME)
    typed = {  # the names mypy sees (the `if TYPE_CHECKING:` imports) are those imported on first use, from the same modules
        (a.name, node.module.rsplit(".", 1)[1])
        for node in ast.walk(ast.parse(Path(analysis.__file__).read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradrunner.analysis.")
        for a in node.names
    }
    assert typed == set(analysis._HOME.items())
    for name in analysis.__all__:
        value = getattr(analysis, name)
        assert name.isupper() or value.__module__.startswith("gradrunner.analysis.")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        analysis.nope  # noqa: B018


def test_the_documented_capture_import_gives_the_function() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import gradrunner.run.loop\nfrom gradrunner import capture, Capture\n"
         "print(callable(capture), capture.__module__, Capture.__name__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "gradrunner.capturing.session", "Capture"]


def test_strategy_names_are_the_registry_keys_in_order() -> None:
    assert tuple(STRATEGIES) == STRATEGY_NAMES


PACKAGE = Path(gradrunner.__file__).parent
#: At most this many modules at the package root: the entry points, errors and losses (issue 33).
ROOT_MODULES_AT_MOST = 8
#: Lines a file under gradrunner/ may have.
MAX_LINES = 450
#: Files still over MAX_LINES (none since the step engine split session.py and loop.py). Do not add to it:
#: split the file instead.
KNOWN_LONG: set[str] = set()


def test_the_package_root_holds_at_most_eight_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


def test_no_file_is_longer_than_450_lines() -> None:
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(lengths) > 50  # the walk found the package
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in KNOWN_LONG}
    assert not too_long, too_long
    assert KNOWN_LONG <= lengths.keys()  # a known file that was moved or renamed leaves the list


def test_no_test_module_imports_another() -> None:
    """Shared test helpers live in conftest or in a helper module beside it (not named test_*): a test module
    importing another runs that module's import-time code, and its helpers change with its tests."""
    tests = Path(__file__).parent
    found = {}
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []  # fmt: skip
            found.update({f"{path.name}:{node.lineno}": n for n in names if n.split(".")[0].startswith("test_")})
    assert len(list(tests.glob("test_*.py"))) > 50  # the walk found the tests
    assert not found, found


#: Folders the layout table names as a whole (one file per model, per strategy), not file by file.
NAMED_AS_A_FOLDER = ("models/", "capturing/strategies/", "conf/")


def test_every_module_is_in_the_readmes_layout_table() -> None:
    """The README's layout table names each module (README true: `run/writers.py` and eight more were missing)."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    modules = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) > 50
    missing = [m for m in modules if not m.startswith(NAMED_AS_A_FOLDER) and f"`{m.rsplit('/', 1)[-1]}`" not in table
               and f"`{m}`" not in table]  # fmt: skip
    assert not missing, missing
