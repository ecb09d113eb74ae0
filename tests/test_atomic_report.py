"""`report=true` on a nearly full disk: every report file is whole or absent (temp name, then rename), a
warning says so, and no temp file is left."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import child_python, cli_env, compose_cfg

from gradrunner.records.columns import TEMP_SUFFIX
from gradrunner.run.job import run

#: Each limit is a file size the disk refuses to go past (RLIMIT_FSIZE: writes beyond it fail, EFBIG).
CODE = """
import json, resource, sys, logging
from pathlib import Path
from gradrunner.report.write import try_report
logging.basicConfig(level=logging.WARNING)
for limit, job in json.loads(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    print(json.dumps([limit, str(try_report(Path(job)))]), flush=True)
"""


@pytest.mark.slow
def test_report_files_on_a_nearly_full_disk_are_whole_or_absent(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    run(compose_cfg("+experiment=cosine", "steps=2"), out_dir=clean)
    rng = random.Random(19)
    trials = []
    for i, limit in enumerate([rng.randint(1_000, 60_000) for _ in range(4)]):
        job = tmp_path / f"t{i}"
        shutil.copytree(clean, job)
        trials.append((limit, str(job)))
    result = subprocess.run([child_python(), "-c", CODE, json.dumps(trials)], env=cli_env(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "could not write the report" in result.stderr  # at least one limit was too small, and said so
    for _, job in trials:
        d = Path(job)
        assert not [p.name for p in d.iterdir() if p.name.endswith(TEMP_SUFFIX)]
        for png in d.glob("report-*.png"):
            assert png.read_bytes().endswith(b"IEND\xaeB`\x82"), png  # a PNG's last chunk: whole
        page = d / "report.html"
        if page.exists():
            assert page.read_text().rstrip().endswith("</html>")
