"""Every fenced block of README.md and docs/*.md runs, so that a doc cannot drift from the code.

What a block is, and how it runs (in a fresh temp dir per doc, blocks in the doc's order):

| block | runs as |
| --- | --- |
| ```` ```python ```` with `>>>` prompts | a doctest (ELLIPSIS, NORMALIZE_WHITESPACE): the shown output is checked |
| ```` ```python ```` without prompts | `exec`, one namespace per doc (later blocks see earlier names) |
| ```` ```bash ```` or a bare ```` ``` ```` of commands | each command (`\\` continuations joined, comments dropped) in bash; exit 0, or 2 when its comment starts `gradrunner: error:` |
| (either kind of command) | a plain `python -m gradrunner...` (no pipe, redirection, variable, glob) runs inside the test's process (`conftest.python_m`, the same command without a process's start-up); a plain `torchrun FLAGS -m gradrunner...` runs torchrun with the doc's flags and ranks forked warm (`conftest.torchrun_command`); anything else in bash |
| a bare ```` ``` ```` whose lines start with `$ ` | the command, its output checked: each shown line in order, `...` skips, a line ending in `...` is a prefix; a shown `gradrunner: error:` means exit 2 |
| a bare ```` ``` ```` of anything else (a dir tree, a traceback) | nothing: it is not code |

A marker comment on the line(s) just before a block changes that (the doc says so in its source):

    <!-- doc-test: skip (needs a GPU) -->              the block does not run; the reason is required
    <!-- doc-test: before python -m gradrunner ... --> a command run first (creates the records a block reads)
    <!-- doc-test: no-output-check (timings) -->      a doctest block runs, its output is not compared
    <!-- doc-test: error -->                          each command of the block must exit 2 (a user error)
    <!-- doc-test: overrides steps=5 -->              appended to each `gradrunner` run of the block (shorter runs)
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, child_python, cli_env, python_m, torchrun_argv, warm_python

pytestmark = pytest.mark.slow

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<kind>[a-z-]+)\s*(?P<arg>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
EXIT_USER_ERROR = 2


@dataclass
class Block:
    """One fenced block of a doc and the markers before it."""

    doc: str
    line: int
    lang: str
    text: str
    markers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    def marked(self, kind: str) -> list[str]:
        return [arg for k, arg in self.markers if k == kind]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of `path`, with the doc-test markers on the lines just before each."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        markers: list[tuple[str, str]] = []
        j = i - 1
        while j >= 0 and (MARKER.search(lines[j]) or not lines[j].strip()) and j >= i - 6:
            for mk in MARKER.finditer(lines[j]):
                markers.insert(0, (mk["kind"], mk["arg"]))
            j -= 1
        end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
        out.append(Block(path.name, i + 1, m["lang"], "\n".join(lines[i + 1 : end]), markers))
        i = end + 1
    return out


def commands(text: str) -> list[tuple[str, str]]:
    """Shell commands of a block and their trailing comments: continuations joined, comment lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        code, _, comment = line.partition(" #")
        if code.strip() and not code.strip().startswith("#"):
            out.append((code.strip(), comment.strip()))
    return out


def kind_of(block: Block) -> str:
    if block.lang == "python":
        return "doctest" if block.text.lstrip().startswith(">>>") else "python"
    if block.lang in ("bash", "sh", "shell"):
        return "shell"
    if block.lang:
        return "other"  # yaml, json: configuration shown, not run
    first = next((line for line in block.text.splitlines() if line.strip()), "")
    if first.startswith("$ "):
        return "transcript"
    if re.match(r"(python|gradrunner|pip|torchrun)\b", first.strip()):
        return "shell"
    return "other"


def run_shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # never from a test: installing packages, or the test suite itself (mark such a block skip)
    assert not re.search(r"\bpip install\b|\bpytest\b", command), f"`{command}` must be in a doc-test: skip block"
    argv = plain_python_m(command)
    if argv is not None:  # what bash would run, without a process's start-up (2-3 s a command)
        executable, sys.executable = sys.executable, child_python()  # its own children (the autopsy's) start warm
        try:
            return python_m(cwd, *argv)
        finally:
            sys.executable = executable
    ranks = warm_torchrun(command)
    return subprocess.run(["bash", "-c", command] if ranks is None else ranks, cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


#: gradrunner or one of its modules, as a `-m` names it
GRADRUNNER_MODULE = re.compile(r"gradrunner(\.\w+)*")


def plain_words(command: str) -> list[str] | None:
    """The words bash would pass on word for word (quotes removed), or None: anything with a pipe,
    redirection, `;`/`&&`, variable, command substitution, glob, brace or tilde expansion."""
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", command)
    if re.search(r"[$`]", command) or re.search(r"[*?{}~]", unquoted):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: bash's to report
        return None
    return None if any(set(w) <= set("();<>|&") for w in words) else words


def plain_python_m(command: str) -> list[str] | None:
    """`[module, *args]` of a plain (`plain_words`) `python -m gradrunner...` command, or None."""
    words = plain_words(command)
    if words is None or words[:2] != ["python", "-m"] or len(words) < 3:
        return None
    return words[2:] if GRADRUNNER_MODULE.fullmatch(words[2]) else None


def warm_torchrun(command: str) -> list[str] | None:
    """A plain (`plain_words`) `torchrun FLAGS -m gradrunner ARGS` as torchrun with the same FLAGS whose ranks
    are forked warm (`conftest.torchrun_command`: each rank `python -u -m gradrunner ARGS` without paying its
    imports), or None (then bash runs it as written)."""
    words = plain_words(command)
    if words is None or words[:1] != ["torchrun"] or "-m" not in words:
        return None
    at = words.index("-m")
    if warm_python() is None or at + 1 >= len(words) or not GRADRUNNER_MODULE.fullmatch(words[at + 1]):
        return None
    return torchrun_argv(words[1:at], words[at:])


def with_overrides(command: str, overrides: list[str]) -> str:
    """`command` with `overrides` appended when it runs a job (`python -m gradrunner ...`): later overrides win."""
    if overrides and re.search(r"-m gradrunner(?![.\w])", command):
        return " ".join([command, *overrides])
    return command


def expect_ok(result: subprocess.CompletedProcess[str], command: str, where: str) -> None:
    assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}:\n{result.stderr[-3000:]}"


def check_transcript(block: Block, cwd: Path) -> None:
    """`$ command` lines and the output shown under each."""
    chunks: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            chunks.append((line[2:], []))
        elif chunks:
            chunks[-1][1].append(line.rstrip())
    for command, shown in chunks:
        result = run_shell(command, cwd)
        actual = [a.rstrip() for a in (result.stdout + result.stderr).splitlines()]
        error = any(s.startswith("gradrunner: error:") for s in shown)
        want = EXIT_USER_ERROR if error else 0
        assert result.returncode == want, f"{block.where}: `{command}` exited {result.returncode}, the doc shows {want}:\n{result.stderr[-3000:]}"
        at = 0
        for s in shown:
            if s.strip() in ("", "..."):
                continue
            prefix = s.endswith("...")
            needle = s[:-3].rstrip() if prefix else s
            hit = next((k for k in range(at, len(actual))
                        if (actual[k].startswith(needle) if prefix else actual[k] == needle)), None)  # fmt: skip
            assert hit is not None, f"{block.where}: `{command}` does not print (in this order) {s!r}; it prints:\n" + "\n".join(actual[:80])
            at = hit + 1


def run_doctest(block: Block, namespace: dict[str, object], check_output: bool) -> None:
    test = doctest.DocTestParser().get_doctest(block.text, namespace, block.where, block.doc, block.line)
    if not check_output:  # run for the errors only: the shown output (timings) varies
        for example in test.examples:
            exec(compile(example.source, block.where, "exec"), namespace)
        return
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=False)
    namespace.update(test.globs)  # the DocTest ran in a copy: later blocks see its names
    assert runner.failures == 0, f"{block.where}: the doc's output differs:\n" + "".join(out)


def run_doc(path: Path, cwd: Path) -> list[str]:
    """Run every block of `path` in `cwd`; return what ran (for the test's own check)."""
    namespace: dict[str, object] = {"__name__": "__doc__"}
    ran: list[str] = []
    for block in blocks(path):
        kind = kind_of(block)
        if block.marked("skip") or kind == "other":
            assert not block.marked("skip") or block.marked("skip")[0].startswith("("), (
                f"{block.where}: a skip marker needs its reason in parentheses"
            )
            continue
        for command in block.marked("before"):
            expect_ok(run_shell(command, cwd), command, block.where)
        if kind == "transcript":
            check_transcript(block, cwd)
        elif kind == "shell":
            for command, comment in commands(block.text):
                result = run_shell(with_overrides(command, block.marked("overrides")), cwd)
                if block.marked("error") or comment.startswith("gradrunner: error:"):
                    assert result.returncode == EXIT_USER_ERROR, f"{block.where}: `{command}` exited {result.returncode}"
                else:
                    expect_ok(result, command, block.where)
        elif kind == "doctest":
            run_doctest(block, namespace, check_output=not block.marked("no-output-check"))
        else:
            exec(compile(block.text, block.where, "exec"), namespace)
        ran.append(f"{block.where} {kind}")
    return ran


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_block_of_the_doc_runs(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="the docs' plots need the extra gradrunner[report]")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ran = run_doc(doc, tmp_path)
    code = [b for b in blocks(doc) if kind_of(b) != "other" and not b.marked("skip")]
    assert len(ran) == len(code)


def test_blocks_are_found_and_classified(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(
        "```\n$ gradrunner x\ngradrunner: error: bad\n```\n\n<!-- doc-test: skip (needs a GPU) -->\n"
        "```bash\npython -m gradrunner a \\\n    b=1   # comment\n# only a comment\n```\n"
        "```python\n>>> 1 + 1\n2\n```\n```\nmultirun/\n  0/\n```\n"
    )
    found = blocks(doc)
    assert [kind_of(b) for b in found] == ["transcript", "shell", "doctest", "other"]
    assert found[1].marked("skip") == ["(needs a GPU)"] and found[0].markers == []
    assert with_overrides("python -m gradrunner -m a=1,2", ["steps=5"]) == "python -m gradrunner -m a=1,2 steps=5"
    assert with_overrides("python -m gradrunner.report d", ["steps=5"]) == "python -m gradrunner.report d"
    assert commands(found[1].text) == [("python -m gradrunner a b=1", "comment")]


def test_a_plain_torchrun_command_keeps_its_flags_and_forks_its_ranks_warm() -> None:
    client = warm_python()
    argv = warm_torchrun("torchrun --standalone --nproc_per_node=2 -m gradrunner +experiment=mlp 'taps=[fc1:output]'")
    if client is None:  # GRADRUNNER_TEST_COLD=1, or no pidfd: bash runs it as written
        assert argv is None
        return
    assert argv == [str(client), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    f"--log-dir={client.parent / 'torchrun-logs'}", "--no-python", str(client), "-u", "-m", "gradrunner",
                    "+experiment=mlp", "taps=[fc1:output]"]  # fmt: skip
    for shell in ("torchrun --nproc_per_node=2 -m gradrunner steps=$N", "torchrun -m gradrunner | tee log",
                  "torchrun --nproc_per_node=2 train.py", "torchrun -m other_module"):  # fmt: skip
        assert warm_torchrun(shell) is None, shell
