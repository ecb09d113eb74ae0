"""Each job's own overrides travel in its records; `load()` and the manifest label from them, and a job
dir that another run holds (live, or completed with another config) is left as it was, `.hydra/` included."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import SEARCHPATH, check_ok, gradrunner_in_process

from gradrunner.analysis import IncompleteSweepWarning, load
from gradrunner.records.columns import GRADS_FILE, OVERRIDES_KEY, STEPS_FILE
from gradrunner.records.rundir import DONE
from gradrunner.run.books import RunLock


def hydra_files(job: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((job / ".hydra").iterdir())}


@pytest.mark.slow
def test_labels_come_from_the_records_and_a_held_or_completed_dir_is_not_touched(tmp_path: Path) -> None:
    sweep = ["-m", SEARCHPATH, "+experiment=cosine", "steps=1", "hydra.sweep.dir=sw"]
    check_ok(gradrunner_in_process(tmp_path, *sweep, "seed=0,1"))
    sw = tmp_path / "sw"
    for i in (0, 1):
        own = ["+experiment=cosine", "steps=1", f"seed={i}"]
        for name in (GRADS_FILE, STEPS_FILE):
            assert json.loads(pq.read_schema(sw / str(i) / name).metadata[OVERRIDES_KEY.encode()]) == own
        assert json.loads((sw / str(i) / DONE).read_text())["overrides"] == own
    before = {i: hydra_files(sw / str(i)) for i in (0, 1)}

    # A second sweep into the same dir: job 0's dir is held by a live run (this test), job 1's holds a
    # completed run of another config. Hydra writes both jobs' .hydra/ before either can refuse.
    with RunLock(sw / "0", "the-live-run"):
        second = gradrunner_in_process(tmp_path, *sweep, "seed=5,6")
    assert "Traceback" not in second.stderr and second.returncode == 1, second.stderr
    # The live run (this test) holds seed=0's dir: it will never run seed=5, so that job is refused, not skipped.
    assert f"the run dir {sw / '0'} is in use by a live run" in second.stderr
    assert "That run is of another config (+experiment=cosine steps=1 seed=0), not this job's" in second.stderr
    assert {i: hydra_files(sw / str(i)) for i in (0, 1)} == before

    # Even with .hydra/ rewritten behind gradrunner's back, labels come from the records.
    (sw / "0" / ".hydra" / "overrides.yaml").write_text("- +experiment=cosine\n- steps=1\n- seed=5\n")
    # The second sweep's jobs never ran, but their dirs (found by job number) hold the first sweep's
    # completed jobs: one manifest entry per job, each what its dir holds (issue 25), so nothing is missing.
    with warnings.catch_warnings():
        warnings.simplefilter("error", IncompleteSweepWarning)
        df = load(sw)
    assert df.groupby("job")["seed"].unique().map(list).to_dict() == {"0": [0], "1": [1]}
    manifest = json.loads((sw / "manifest.json").read_text())
    on_disk = {j["dir"]: (j["status"], j["overrides"][-1]) for j in manifest["jobs"] if j["dir"]}
    assert on_disk == {"0": ("completed", "seed=0"), "1": ("completed", "seed=1")}
    assert len(manifest["jobs"]) == 2 and manifest["counts"] == {"completed": 2, "failed": 0, "missing": 0}
