"""How far a glob reaches (issue 36 item 20): taps per module depth, in the explorer, the run's log and BENCHMARKS.md.

The reference counts come from `named_modules()` by path prefix, not by fnmatch: every module below
`transformer.h.` is what `transformer.h.*` reaches, since `*` matches dots.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from gradrunner.capturing.taps import glob_reach

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _gpt2(n_layer: int = 2) -> object:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=100,
                                                                n_positions=32))  # fmt: skip


def test_a_star_glob_reaches_every_submodule_at_every_depth() -> None:
    model = _gpt2()
    below = [p for p, _ in model.named_modules() if p.startswith("transformer.h.")]
    depths: dict[int, int] = {}
    for p in below:
        depths[p.count(".") + 1] = depths.get(p.count(".") + 1, 0) + 1
    (star, blocks) = glob_reach(model, ["transformer.h.*:output", "transformer.h.?:output", "lm_head:output"])
    assert star.taps == len(below) == 26 and {d: n for d, (n, _) in star.by_depth.items()} == depths == {3: 2, 4: 8, 5: 16}
    assert str(star).startswith("transformer.h.*:output resolves to 26 tap(s): 2 at depth 3 (transformer.h.0, ...), "
                                "8 at depth 4 (transformer.h.0.ln_1, ...)")  # fmt: skip
    assert "also match dots" in str(star)
    assert blocks.taps == 2 and str(blocks) == "transformer.h.?:output resolves to 2 tap(s): 2 at depth 3 (transformer.h.0, ...)"


def test_the_start_of_a_run_logs_each_globs_reach(caplog: pytest.LogCaptureFixture) -> None:
    from gradrunner.run.build import setup

    with caplog.at_level(logging.INFO, logger="gradrunner.run.build"):
        setup(compose_cfg("+experiment=gpt2", "taps=[transformer.h.*:output]", "device=cpu"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("taps: ")]
    assert line.startswith("taps: transformer.h.*:output resolves to 26 tap(s): 2 at depth 3")


def test_the_explorer_says_each_globs_reach() -> None:
    from gradrunner.cli import explore

    found = explore.listing(compose_cfg("+experiment=gpt2", "taps=[transformer.h.*:output,lm_head:output]", "device=cpu"))
    text = explore._text(found)
    assert text.endswith("The config's globs (taps=...):\n  " + str(found.reach[0]))  # type: ignore[attr-defined]
    data = json.loads(json.dumps(explore._with_reach(found)))
    assert data["globs"] == [{"spec": "transformer.h.*:output", "taps": 26, "by_depth": {"3": 2, "4": 8, "5": 16},
                              "first_path": {"3": "transformer.h.0", "4": "transformer.h.0.ln_1",
                                             "5": "transformer.h.0.attn.c_attn"}, "refused": None}]  # fmt: skip


def test_benchmarks_md_states_the_resolved_taps_of_the_integration_rows() -> None:
    spec = importlib.util.spec_from_file_location("integrations_overhead", ROOT / "benchmarks" / "integrations_overhead.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        resolved = bench.resolved_taps(256, 6, tiny=False)  # the sizes BENCHMARKS.md's run used
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert resolved == {"plain": 20, "lightning": 20, "hf": 28}
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text[text.index("## Issue 21") : text.index("## Issue 25")]
    stated = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\| (plain|Lightning|HF Trainer) \| (?:`gradrunner.record`|with `\w+`) \| (\d+) \|", section, re.M)}
    assert stated == {"plain": 20, "Lightning": 20, "HF Trainer": 28}
