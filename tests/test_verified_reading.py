"""`analysis.load` verifies what it reads: page checksums, each file's footer and row count against
`done.json`, and the run id; a damaged or foreign file is refused (or skipped with a warning), never
returned quietly."""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from gradrunner.analysis import load
from gradrunner.analysis.reading import DamagedRecordsWarning
from gradrunner.capturing.stats import Collector
from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, TapKey
from gradrunner.records.writer import RecordWriter, StepsWriter
from gradrunner.run.books import mark_complete


def write_completed_job(job_dir: Path, run_id: str, seed: int, steps: int = 6) -> None:
    """A job as the runner leaves it: both tables (several row groups) and its done.json."""
    consts = {"run_id": run_id, "experiment": "mlp", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    gen = torch.Generator().manual_seed(seed)
    with RecordWriter(job_dir, constants=consts, metadata={}, rows_per_group=4) as w, StepsWriter(
        job_dir, constants=consts, metadata={}
    ) as s:
        for step in range(steps):
            col = Collector(values="full")
            col.add(TapKey("fc1", "output", 0), torch.randn(3, 4, generator=gen))
            col.add(TapKey("fc2", "weight", 0), torch.randn(2, 5, generator=gen))
            col.add(TapKey("fc3", "output", 0), None)
            w.write_step(step, col.finish(torch.tensor(0.5 + step)))
            s.write(step, True, 0.5 + step, 0.1, 0.01, None)
    cfg = OmegaConf.create({"seed": seed, "steps": steps})
    mark_complete(job_dir, cfg, files=[GRADS_FILE, STEPS_FILE], run_id=run_id, world_size=1,
                         overrides=[f"seed={seed}"])  # fmt: skip


@pytest.mark.parametrize("table", ["grads", "steps"])
def test_random_byte_flips_are_refused_or_change_nothing_load_returns(tmp_path: Path, table: str) -> None:
    clean = tmp_path / "clean"
    write_completed_job(clean, "run-a", seed=0)
    name = f"{table}.parquet"
    original = (clean / name).read_bytes()
    references = {v: load(clean, table=table, values=v) for v in (False, True)}
    rng = random.Random(19)
    refused = 0
    trials = 150
    for trial in range(trials):
        job = tmp_path / f"t{trial}"
        shutil.copytree(clean, job)
        damaged = bytearray(original)
        at = rng.randrange(len(damaged))
        damaged[at] ^= rng.randrange(1, 256)
        (job / name).write_bytes(bytes(damaged))
        for values in (False, True):
            try:
                df = load(job, table=table, values=values)
            except GradrunnerError as e:
                assert str(job / name) in str(e) and len(str(e).splitlines()) == 1, (trial, at, str(e))
                refused += 1
                continue
            # Not refused: only possible when the flip lies in bytes this read does not use (the
            # `values` pages when values=False); the rows must then be exactly the undamaged ones.
            pd.testing.assert_frame_equal(df, references[values], obj=f"flip at byte {at} of {len(original)}")
        shutil.rmtree(job)
    assert refused > trials  # most flips are caught on both reads


def test_a_file_swapped_in_from_another_run_is_refused_naming_it(tmp_path: Path) -> None:
    write_completed_job(tmp_path / "0", "run-a", seed=0)
    write_completed_job(tmp_path / "1", "run-b", seed=1)
    (tmp_path / "0" / GRADS_FILE).unlink()
    shutil.copy(tmp_path / "1" / GRADS_FILE, tmp_path / "0" / GRADS_FILE)
    with pytest.raises(GradrunnerError) as info:
        load(tmp_path)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert str(tmp_path / "0" / GRADS_FILE) in message and "run-b" in message and "run-a" in message
    assert "on_damaged='skip'" in message


def test_skip_leaves_damaged_files_out_with_one_warning_naming_each(tmp_path: Path) -> None:
    for i in range(3):
        write_completed_job(tmp_path / str(i), f"run-{i}", seed=i)
    path = tmp_path / "1" / GRADS_FILE
    norm = pq.ParquetFile(path).metadata.row_group(0).column(pq.read_schema(path).get_field_index("norm"))
    data = bytearray(path.read_bytes())
    data[norm.data_page_offset + norm.total_compressed_size - 2] ^= 0xFF  # in a page of a column load() reads
    path.write_bytes(bytes(data))
    with pytest.warns(DamagedRecordsWarning) as caught:
        df = load(tmp_path, on_damaged="skip")
    assert sorted(df.job.unique()) == ["0", "2"] and sorted(df.run_id.unique()) == ["run-0", "run-2"]
    (message,) = [str(w.message) for w in caught if issubclass(w.category, DamagedRecordsWarning)]
    assert str(tmp_path / "1" / GRADS_FILE) in message and len(message.splitlines()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load(tmp_path / "0", on_damaged="skip")) == len(df) // 2


def test_on_damaged_takes_only_raise_or_skip(tmp_path: Path) -> None:
    write_completed_job(tmp_path, "run-a", seed=0)
    with pytest.raises(GradrunnerError, match=r"on_damaged='ignore'.*allowed: 'raise', 'skip'"):
        load(tmp_path, on_damaged="ignore")
