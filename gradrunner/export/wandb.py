"""The W&B target: one offline W&B run per job (`wandb sync` uploads them).

Needs the `wandb` package only (`gradrunner[wandb]`), imported when `to_wandb` runs.

Example::

    to_wandb(jobs("runs/gpt2"), Path("runs/gpt2"))
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.export.jobs import MARKER, Job, exclusive, source_of
from gradrunner.records.atomic import write_atomically

#: The characters a W&B project name cannot hold.
_NOT_IN_PROJECT = "/\\#?%:"


def run_id_of(job: Job) -> str:
    """The W&B run id of a job's export: fixed by its records' run id, so a re-export is the same W&B run.

    Example::

        run_id_of(job)     # 'gr-3f2a9c0d1e4b5a67'
    """
    return "gr-" + hashlib.sha256(f"{source_of(job)}#{job.run_id}".encode()).hexdigest()[:16]


def check_project(name: str) -> None:
    """Refuse a project name W&B does not take, before anything is written (W&B's own check, `wandb_settings`).

    Example::

        check_project("a:b")     # GradrunnerError: --project 'a:b' is not a W&B project name; ...
    """
    bad = sorted(set(name) & set(_NOT_IN_PROJECT))
    if not name.strip() or len(name) > 128 or bad:
        raise GradrunnerError(f"--project {name!r} is not a W&B project name{f' (it holds {bad})' if bad else ''}; "
                              f"allowed: 1 to 128 characters, none of {' '.join(_NOT_IN_PROJECT)} "
                              "(e.g. --project gradrunner, the default).")  # fmt: skip


def to_wandb(all_jobs: Sequence[Job], out: Path, project: str = "gradrunner") -> list[Path]:
    """One offline W&B run per job under `out/wandb` (upload later with `wandb sync`).

    Example::

        to_wandb(jobs("runs/gpt2"), Path("runs/gpt2"))    # [Path('runs/gpt2/wandb/offline-run-...-gr-...')]

    Each step is one `run.log` call holding every value of that step (NaN and Inf as they are). A
    job's run id is `run_id_of(job)`; the offline run dirs an earlier export wrote for its job dir (each names
    it in its `MARKER`), whichever run the dir held then, are removed first, so `wandb sync out/wandb/offline-run-*`
    uploads the dir's records once, as they are now. A W&B error is a GradrunnerError, and so is
    a second export into `out/wandb` while one writes there (`jobs.exclusive`), naming it.
    """
    check_project(project)
    import wandb

    try:
        with exclusive(out / "wandb", "W&B"):  # one export at a time: another's offline runs are not removed mid-write
            return _write(wandb, all_jobs, out, project)
    except wandb.errors.Error as e:
        raise GradrunnerError(f"the W&B export to {out / 'wandb'} failed: {one_paragraph(e)}") from e


def _write(wandb: Any, all_jobs: Sequence[Job], out: Path, project: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    exported = _exported(out / "wandb")
    dirs = []
    for job in all_jobs:
        rid, source = run_id_of(job), source_of(job)
        for old in {*exported.get(source, []), *(out / "wandb").glob(f"offline-run-*-{rid}")}:
            shutil.rmtree(old)
        run = wandb.init(project=project, name=job.name, id=rid, config=job.params, dir=str(out), mode="offline",
                         reinit="create_new")  # fmt: skip
        written = Path(run.dir).parent
        # named before anything is logged: a killed export's half-written run is the dir's, removed by the next
        write_atomically(written / MARKER, json.dumps({"source": source, "run_id": job.run_id}))
        try:
            by_step: dict[int, dict[str, Any]] = {}
            for tag, step, value in job.scalars:
                by_step.setdefault(step, {})[tag] = value
            for tag, step, limits, counts in job.histograms:
                edges = [limits[0] - 1e-30, *limits]  # wandb takes edges: one more than counts
                by_step.setdefault(step, {})[tag] = wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))
            for step in sorted(by_step):
                run.log(by_step[step], step=step)
        finally:
            run.finish()
        dirs.append(written)
    return dirs


def _exported(runs: Path) -> dict[str, list[Path]]:
    """The offline run dirs in `runs` by the job dir each was exported from (its `MARKER`; none: an older export)."""
    found: dict[str, list[Path]] = {}
    for d in runs.glob("offline-run-*"):
        try:
            source = json.loads((d / MARKER).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(source, str):
            found.setdefault(source, []).append(d)
    return found
