"""Sweeps at cluster scale (issue 25): URL run/sweep dirs refused, `load()` of a URL, a changed-config re-run's books.

End to end through the CLI (`python -m gradrunner`, inside the test's process: `conftest.python_m`), on tiny
runs (steps=1).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from conftest import check_ok, python_m

from gradrunner.analysis import load
from gradrunner.cli.sweep_books import MANIFEST
from gradrunner.errors import GradrunnerError
from gradrunner.records.rundir import DONE, FAILED

SEEDS = "seed=0,1,2,3,4"


def run_cli(cwd: Path, *args: str, full_error: bool = False) -> subprocess.CompletedProcess[str]:
    return python_m(cwd, "gradrunner", *args, env={"HYDRA_FULL_ERROR": "1"} if full_error else None)


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# --- object storage: a URL run or sweep dir is refused -------------------------------------------


@pytest.mark.parametrize("url", ["memory://b/r", "s3://bucket/runs/r", "file:///tmp/gradrunner-url-run"])
def test_a_url_run_dir_is_refused_in_one_paragraph_and_nothing_is_written(tmp_path: Path, url: str) -> None:
    result = run_cli(tmp_path, "+experiment=mlp", "steps=1", "device=cpu", f"hydra.run.dir={url}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert url in lines[0] and "hydra.run.dir" in lines[0] and "local path" in lines[0]
    assert tree(tmp_path) == []  # no `memory:/b/r` folder, no outputs/
    assert not Path("/tmp/gradrunner-url-run").exists()


def test_a_url_sweep_dir_is_refused_and_no_job_runs(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "-m", "+experiment=mlp", "steps=1", "device=cpu", "seed=0,1",
                     "hydra.sweep.dir=memory://b/sweep")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "memory://b/sweep" in result.stderr and "hydra.sweep.dir" in result.stderr
    assert "Launching" not in result.stdout + result.stderr
    assert tree(tmp_path) == []


# --- load() of a URL ------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["memory://bucket/sweep", "s3://bucket/sweep", "gs://b/x/grads.parquet"])
def test_load_of_a_url_says_urls_are_not_read(url: str) -> None:
    with pytest.raises(GradrunnerError) as info:
        load(url)
    text = str(info.value)
    assert url in text and "URL" in text and "does not exist" not in text


def test_load_of_a_file_url_reads_the_local_path(tmp_path: Path) -> None:
    check_ok(run_cli(tmp_path, "+experiment=mlp", "steps=1", "device=cpu", "hydra.run.dir=run"))
    local = load(tmp_path / "run")
    via_url = load((tmp_path / "run").as_uri())
    assert len(local) > 0
    assert via_url.equals(local)


def test_load_of_a_file_url_with_a_remote_host_is_refused() -> None:
    with pytest.raises(GradrunnerError, match="remote host"):
        load("file://otherhost/data/sweep")


# --- a sweep re-run with a changed config ---------------------------------------------------------


def digests(job: Path) -> dict[str, str]:
    """Every file of a completed job but its log (a refused job may append its refusal there)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(job.iterdir()) if p.is_file() and p.name != "gradrunner.log"}  # fmt: skip


@pytest.fixture(scope="module")
def five_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("rerun")
    check_ok(run_cli(cwd, "-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=1", "device=cpu", SEEDS))
    return cwd


@pytest.mark.parametrize("full_error", [False, True], ids=["plain", "HYDRA_FULL_ERROR"])
def test_a_rerun_with_a_changed_config_refuses_and_leaves_completed_jobs_and_the_manifest_whole(
    five_jobs: Path, full_error: bool
) -> None:
    sweep_dir = five_jobs / "sw"
    jobs = [sweep_dir / str(n) for n in range(5)]
    before = {j.name: digests(j) for j in jobs}
    assert all(DONE in d for d in before.values())

    result = run_cli(five_jobs, "-m", "hydra.sweep.dir=sw", "+experiment=mlp", "steps=2", "device=cpu", SEEDS,
                     full_error=full_error)  # fmt: skip
    assert result.returncode != 0
    assert "holds a completed run of a different config (steps: 1 -> 2)" in result.stderr
    # the last word does not present the earlier run's jobs as run now
    said = result.stdout + result.stderr
    assert "5 job(s) listed completed did not run now" in said, said[-3000:]
    assert "sweep summary" not in said, said[-3000:]

    for job in jobs:
        assert not (job / FAILED).exists(), f"{job} got {FAILED}"
        assert digests(job) == before[job.name], f"{job} changed"
    manifest = json.loads((sweep_dir / MANIFEST).read_text())
    assert len(manifest["jobs"]) == 5, manifest["jobs"]
    assert manifest["counts"] == {"completed": 5, "failed": 0, "missing": 0}
    assert sorted(j["dir"] for j in manifest["jobs"]) == [str(n) for n in range(5)]
    assert [j["num"] for j in manifest["jobs"]] == list(range(5))
    # the entries name what each dir holds: the first sweep's overrides
    assert all("steps=1" in j["overrides"] for j in manifest["jobs"])
    assert len(load(sweep_dir)) == len(load(sweep_dir / "0")) * 5
