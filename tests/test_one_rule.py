"""One home per rule (issue 33 item 6): each test fails when a second copy of the rule drifts from the first.

- the reserved column names come from the record schema: an override named after every column of
  both tables never takes a record's column, in `load` of either table;
- which jobs of a sweep are complete: the job dir's markers, the manifest (from the catalogue and from
  the dirs), `load` and the sweep plan's shortcut agree on every state a job dir can be in;
- a job's overrides: the manifest and `load` read them the same way (`labels.job_overrides`), `~key` parsed once;
- the version: one, the installed distribution's, and the sweep fingerprint follows the package's code;
- exit codes: the user-error status is defined once (`errors.EXIT_USER_ERROR`), no module defines its own.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from omegaconf import OmegaConf

import gradrunner
from gradrunner.analysis import load
from gradrunner.analysis.labels import RESERVED_COLUMNS, job_overrides, parse_overrides
from gradrunner.capturing.stats import Collector
from gradrunner.cli.sweep_books import build_manifest
from gradrunner.records import catalogue
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE, TapKey
from gradrunner.records.rundir import DONE, FAILED, job_state
from gradrunner.records.schema import STEPS_SCHEMA, grads_schema
from gradrunner.records.writer import RecordWriter, StepsWriter
from gradrunner.run import sweep_plan
from gradrunner.run.books import mark_complete

PACKAGE = Path(gradrunner.__file__).resolve().parent


def write_job(job_dir: Path, run_id: str, overrides: list[str], seed: int = 0, hydra: list[str] | None = None) -> None:
    """A completed job: both tables, `done.json` with `overrides`, and Hydra's `.hydra/overrides.yaml` (`hydra`)."""
    consts = {"run_id": run_id, "experiment": "mlp", "strategy": "hook", "device": "cpu", "dtype": "float32"}
    gen = torch.Generator().manual_seed(seed)
    with RecordWriter(job_dir, constants=consts, metadata={}) as w, StepsWriter(job_dir, constants=consts, metadata={}) as s:
        for step in range(2):
            col = Collector()
            col.add(TapKey("fc1", "output", 0), torch.randn(3, 4, generator=gen))
            w.write_step(step, col.finish(torch.tensor(0.5 + step)))
            s.write(step, True, 0.5 + step, 0.1, 0.01, None)
    mark_complete(job_dir, OmegaConf.create({"seed": seed}), files=[GRADS_FILE, STEPS_FILE], run_id=run_id,
                  world_size=1, overrides=overrides)  # fmt: skip
    (job_dir / ".hydra").mkdir(exist_ok=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(hydra if hydra is not None else overrides))


# --- reserved columns ------------------------------------------------------------------------------

SCHEMA_COLUMNS = sorted({*grads_schema(per_example=True, histogram=True).names, *STEPS_SCHEMA.names})


def test_an_override_named_after_every_schema_column_never_takes_a_records_column(tmp_path: Path) -> None:
    assert set(SCHEMA_COLUMNS) <= RESERVED_COLUMNS
    for n in range(2):
        write_job(tmp_path / str(n), f"run-{n}", [f"{c}={10 + n}" for c in [*SCHEMA_COLUMNS, "job", "seed"]], seed=n)
    for table in ("grads", "steps"):
        df = load(tmp_path, table=table, values=True)
        for n in range(2):
            own = pd.read_parquet(tmp_path / str(n) / f"{table}.parquet")
            rows = df[df.job == str(n)].reset_index(drop=True)
            pd.testing.assert_frame_equal(rows[list(own.columns)], own, check_dtype=False)  # the records' own columns
        for column in SCHEMA_COLUMNS:  # every schema column's override, the other table's columns too
            assert df[f"override.{column}"].tolist() == [10 + int(j) for j in df.job], (table, column)
            assert column not in df.columns or column in pd.read_parquet(tmp_path / "0" / f"{table}.parquet").columns
        assert df.seed.tolist() == [10 + int(j) for j in df.job]  # a key no column has keeps its name


# --- which jobs are complete -----------------------------------------------------------------------


def _damage(job: Path, state: str) -> None:
    if state == "failed":
        (job / DONE).unlink()
        (job / FAILED).write_text(json.dumps({"status": "failed", "error": "boom"}))
    elif state == "done and failed":
        (job / FAILED).write_text(json.dumps({"status": "failed", "error": "boom"}))
    elif state == "marker not gradrunner's":
        (job / DONE).write_text("{}")
    elif state == "no marker":
        (job / DONE).unlink()
    elif state == "file gone":
        (job / GRADS_FILE).unlink()
    elif state == "file swapped":
        shutil.copy2(job.parent / "1" / GRADS_FILE, job / GRADS_FILE)
    elif state == "another run":  # run again by hand since the catalogue's row was written
        for name in (DONE, GRADS_FILE, STEPS_FILE):
            (job / name).unlink()
        write_job(job, "run-again", ["seed=0"])
    else:
        assert state == "completed"


STATES = ["completed", "failed", "done and failed", "marker not gradrunner's", "no marker", "file gone", "file swapped",
          "another run"]  # fmt: skip


@pytest.mark.parametrize("state", STATES)
def test_every_reader_agrees_which_jobs_are_complete(tmp_path: Path, state: str) -> None:
    """Job 0 in `state`, job 1 intact; each listed in the catalogue as it completed."""
    jobs = [[f"seed={n}"] for n in range(2)]
    for n, overrides in enumerate(jobs):
        write_job(tmp_path / str(n), f"run-{n}", overrides, seed=n)
    rows = [catalogue.JobRow(dir=str(n), num=n, overrides=o, status="completed", run_id=f"run-{n}", files=[GRADS_FILE,
            STEPS_FILE], stamps=catalogue.stamps(tmp_path / str(n), [GRADS_FILE, STEPS_FILE]))
            for n, o in enumerate(jobs)]  # fmt: skip
    catalogue.record_jobs(tmp_path, rows)
    _damage(tmp_path / "0", state)

    status = job_state(tmp_path / "0").status  # the rule: the dir's markers
    view, scanned = build_manifest(tmp_path, jobs), build_manifest(tmp_path, None)
    assert [j["status"] for j in view["jobs"]] == [j["status"] for j in scanned["jobs"]] == [status, "completed"]
    intact = state == "completed"
    assert (catalogue.still_complete(tmp_path, rows[0]) is None) == intact  # the re-run's shortcut
    by_markers = catalogue.still_complete(tmp_path, rows[0], files=False) is None
    assert by_markers == (status == "completed" and state != "another run")
    with warnings.catch_warnings():  # the job left out is named in a warning: what is checked is that it is left out
        warnings.simplefilter("ignore")
        df = load(tmp_path, on_damaged="skip")
    assert ("0" in set(df.job)) == (status == "completed" and state not in ("file gone", "file swapped"))


# --- a job's overrides -----------------------------------------------------------------------------


def test_the_manifest_and_load_read_a_jobs_overrides_alike(tmp_path: Path) -> None:
    """done.json holds what the job ran with; Hydra rewrote .hydra/ for a later refused run: both readers keep the job's."""
    write_job(tmp_path / "0", "run-0", ["+experiment=mlp", "seed=1", "~taps"], hydra=["seed=9"])
    write_job(tmp_path / "1", "run-1", ["+experiment=mlp", "seed=2"], seed=1)
    manifest = build_manifest(tmp_path, None)
    assert [j["overrides"] for j in manifest["jobs"]] == [job_overrides(tmp_path / "0"), job_overrides(tmp_path / "1")]
    assert job_overrides(tmp_path / "0") == ["+experiment=mlp", "seed=1", "~taps"]
    df = load(tmp_path)
    assert df.groupby("job").seed.first().to_dict() == {"0": 1, "1": 2}
    assert parse_overrides(["~taps", "~seed=3", "++optimizer.lr=0.1", "+x=1"]) == {
        "taps": None, "seed": None, "optimizer.lr": "0.1", "x": "1"}  # fmt: skip


# --- the version -----------------------------------------------------------------------------------


def test_the_version_is_the_installed_distributions_and_nowhere_written_twice() -> None:
    assert gradrunner.__version__ == importlib.metadata.version("gradrunner")
    literal = f'"{gradrunner.__version__}"'
    copies = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if literal in p.read_text()]
    assert copies == [], copies  # pyproject.toml is its one home


def test_the_sweep_fingerprint_follows_gradrunners_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = OmegaConf.create({"hydra": {"sweep": {"subdir": "${hydra.job.num}"}, "runtime": {"config_sources": [
        {"path": "gradrunner.conf", "schema": "pkg", "provider": "main"}]}}})  # fmt: skip
    sweep_plan.code_digest.cache_clear()
    before = sweep_plan.config_fingerprint(cfg)
    copy = tmp_path / "gradrunner"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(gradrunner, "__file__", str(copy / "__init__.py"))
    sweep_plan.code_digest.cache_clear()
    assert sweep_plan.config_fingerprint(cfg) == before  # the same code, elsewhere: the same fingerprint
    loop = copy / "run" / "loop.py"
    loop.write_text(loop.read_text() + "\n# a changed gradrunner, same version\n")
    sweep_plan.code_digest.cache_clear()
    assert sweep_plan.config_fingerprint(cfg) not in (None, before)
    monkeypatch.undo()
    sweep_plan.code_digest.cache_clear()


# --- exit codes ------------------------------------------------------------------------------------

#: The exit statuses the package may define, each once: a user mistake, an interrupt, runs that differ.
EXIT_CONSTANTS = {("errors.py", "EXIT_USER_ERROR"), ("run/signals.py", "EXIT_INTERRUPTED"), ("compare.py", "EXIT_DIFFER")}


def test_exit_statuses_are_defined_once_and_never_written_as_numbers() -> None:
    defined, literal_exits = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and "EXIT" in t.id.upper():
                    defined.add((where, t.id))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value not in (0, None)):
                literal_exits.append(f"{where}:{node.lineno}")  # fmt: skip
    # `python -m gradrunner` interrupted while importing: nothing of gradrunner can be imported to name 130 with.
    assert defined == EXIT_CONSTANTS and literal_exits == ["__main__.py:18"]
