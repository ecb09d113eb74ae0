"""A disk already full when the run starts (Hydra saving `.hydra/` fails): one paragraph, exit 2, nothing run."""

from __future__ import annotations

import random
import resource
import subprocess
from pathlib import Path

from conftest import child_python, cli_env


def test_a_full_disk_while_hydra_saves_its_files_is_one_paragraph_and_exit_2(tmp_path: Path) -> None:
    limit = random.Random(19).randint(64, 512)  # bytes a file may reach: Hydra's config.yaml is larger

    def full_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # writes past it fail (EFBIG)

    result = subprocess.run([child_python(), "-m", "gradrunner", "+experiment=cosine", "steps=1", "hydra.run.dir=run"],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
                            preexec_fn=full_disk)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"gradrunner: error: cannot write the run dir {tmp_path / 'run'}")
    assert "nothing ran" in lines[0]
    assert not list((tmp_path / "run").glob("*.parquet"))
