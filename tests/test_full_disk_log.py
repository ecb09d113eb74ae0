"""A disk that fills at the start of a run (issue 38 item 11): the run's log file cannot be written from a
seeded message on. A real write limit (`RLIMIT_FSIZE`) and a `gradrunner.log` already that close to it:
Hydra's `.hydra/` files fit, the log does not. gradrunner says so once; Python's logging never prints its
"--- Logging error ---" traceback; the run ends as it would have (records complete, or one paragraph when
the records do not fit either)."""

from __future__ import annotations

import random
import resource
import subprocess
from pathlib import Path

import pytest
from conftest import child_python, cli_env
from records_check import check_records

from gradrunner.records.rundir import DONE


@pytest.mark.parametrize("seed", range(4))
def test_a_log_file_the_disk_refuses_is_one_line_not_a_logging_traceback(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    records_fit = seed % 2 == 0
    # Files may grow to `limit` bytes: the lock file and .hydra/ fit (about 5 kB), the records only when it is large.
    limit = rng.randint(400_000, 500_000) if records_fit else rng.randint(6_500, 8_000)
    run = tmp_path / "run"
    run.mkdir()
    (run / "gradrunner.log").write_bytes(b"x" * (limit - rng.randint(0, 600)))  # full after 0 to ~5 messages

    def full_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail (EFBIG)

    result = subprocess.run([child_python(), "-m", "gradrunner", "+experiment=cosine", "steps=3", "device=cpu",
                             "hydra.run.dir=run"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                            timeout=180, preexec_fn=full_disk)  # fmt: skip
    assert "Logging error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    said = [x for x in lines if x.startswith("gradrunner: cannot write the log file")]
    assert len(said) == 1 and str(run / "gradrunner.log") in said[0] and "File too large" in said[0], lines
    if records_fit:
        assert result.returncode == 0 and len(lines) == 1, lines
        assert check_records(run) == [0, 1, 2] and (run / DONE).is_file()
    else:
        errors = [x for x in lines if x.startswith("gradrunner: error: ")]
        assert result.returncode == 2 and len(errors) == 1 and len(lines) == 2, lines
        assert f"could not write the records in {run}" in errors[0] and "File too large" in errors[0]
        assert check_records(run) == []
