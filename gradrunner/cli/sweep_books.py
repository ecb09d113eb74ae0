"""The Hydra callback that keeps a sweep's books: failure records, `manifest.json`, the sweep's report.

Registered in `conf/config.yaml` under `hydra.callbacks.gradrunner`. Its methods run where Hydra
runs them, whichever launcher: `on_job_end` in the job's process (a joblib worker, a Slurm task, a
Ray actor), `on_multirun_start`/`on_multirun_end` in the process that launched the sweep.

- `on_job_end`: a job that raised gets `<job dir>/failed.json` with its error message.
- as the sweep starts (`write_planned`, called by gradrunner's sweeper once the up-front check passed):
  `<sweep dir>/manifest.json` lists every job of the sweep (`"ended": false`): its number and overrides,
  status `completed` (with its dir) where the catalogue shows it complete, else `pending`. A sweep whose
  launcher is killed (SIGKILL) keeps this one, so its readers still know the jobs that never started.
- at the end of the sweep: `<sweep dir>/manifest.json` lists every job (its dir, overrides, status
  `completed` / `failed` / `missing`, record files, error), a summary is logged, and with
  `report=true` the sweep's report is written. Hydra skips `on_multirun_end` when a job failed, so
  this also runs at exit (`atexit`) in that case.

Example::

    python -m gradrunner -m +experiment=mlp dtype=float16 optimizer.lr=0.01,1e6 steps=2 device=cpu
    cat multirun/*/*/manifest.json      # job 1: "status": "failed", "error": "step 0 failed in the optimizer step ..."
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gradrunner.analysis.labels import YAML_LOADER, job_overrides
from gradrunner.errors import one_paragraph
from gradrunner.records import catalogue
from gradrunner.records.rundir import MANIFEST, job_dirs_below, job_state, read_marker, write_json
from gradrunner.run.books import Refused, mark_failed
from gradrunner.run.hydra_adapter import JobFailed, JobRefused, job_error, sweep_jobs

log = logging.getLogger(__name__)


def expected_jobs(config: DictConfig) -> list[list[str]] | None:
    """The override list of every job of the sweep, in job order; None unless Hydra's basic sweeper ran it.

    Example::

        expected_jobs(cfg)   # [['capture.strategy=hook', 'seed=0'], ['capture.strategy=hook', 'seed=1'], ...]
    """
    try:
        return sweep_jobs(config)
    except Exception as e:  # private API, or a sweep the parser needs the config loader for
        log.debug("could not list the sweep's jobs (%s); listing the job dirs found", e)
        return None


def _job_dirs(sweep_dir: Path) -> dict[Path, list[str]]:
    """Job dirs below `sweep_dir` (`rundir.job_dirs_below`, the one rule) and their overrides (`labels.job_overrides`)."""
    found: dict[Path, list[str]] = {}
    for job in job_dirs_below(sweep_dir):
        marker, _ = read_marker(job)  # a completed job's own overrides; .hydra/ is Hydra's to rewrite
        found[job] = job_overrides(job, None, marker)
    return found


#: `hydra.job.num` as Hydra writes `.hydra/hydra.yaml` (OmegaConf's block style): the `job:` block's `num:` line.
_JOB_NUM = re.compile(r"^  job:\n(?:    .*\n)*?    num: (\d+)$", re.M)


def _job_num(job_dir: Path) -> int | None:
    """`hydra.job.num` of the job dir, read from the text Hydra wrote (parsing 10,000 of them costs 25 s), else parsed."""
    try:
        text = (job_dir / ".hydra" / "hydra.yaml").read_text()
    except OSError:
        return None
    found = _JOB_NUM.search(text)
    if found:
        return int(found.group(1))
    try:
        num = yaml.load(text, Loader=YAML_LOADER)["hydra"]["job"]["num"]
    except (KeyError, TypeError, yaml.YAMLError):
        return None
    return int(num) if isinstance(num, int) else None


def _entry(sweep_dir: Path, job_dir: Path | None, overrides: list[str], num: int | None) -> dict[str, Any]:
    if job_dir is None or not job_dir.is_dir():
        return {"num": num, "dir": None, "overrides": overrides, "status": "missing", "files": [], "error": None}
    state = job_state(job_dir)
    return {
        "num": _job_num(job_dir) if num is None else num,
        "dir": job_dir.relative_to(sweep_dir).as_posix(),
        "overrides": overrides,
        "status": state.status,
        "files": state.files,
        "error": state.error,
    }


def build_manifest(
    sweep_dir: Path, expected: list[list[str]] | None, before: frozenset[str] | None = None
) -> dict[str, Any]:
    """The manifest of `sweep_dir`: every expected job (or every job dir found), with its status.

    Example::

        build_manifest(Path("multirun/2024-05-01/12-00-00-123456"), None)["counts"]   # {'completed': 6, ...}

    A view of the sweep catalogue (`records.catalogue`) when it lists every expected job with its
    dir still holding that job's marker; otherwise the job dirs are read (`rundir.job_dirs_below`)
    and the catalogue is completed from what they hold. `before`: the run ids of the runs complete when
    the sweep started (None: not known); an expected job whose dir holds any other run of another config
    (another process's, which held the dir while this sweep ran) did not run: it is listed failed, without a dir.
    """
    rows = catalogue.read_jobs(sweep_dir)
    jobs = _from_catalogue(sweep_dir, expected, rows) if rows and expected else None
    if jobs is None:
        jobs = _from_job_dirs(sweep_dir, expected, before)
        _complete_catalogue(sweep_dir, jobs, rows or [])
    counts = {s: sum(j["status"] == s for j in jobs) for s in ("completed", "failed", "missing")}
    return {"sweep_dir": str(sweep_dir.resolve()), "written": _now(), "ended": True, "counts": counts, "jobs": jobs}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_planned(sweep_dir: Path, jobs: list[list[str]], complete: Mapping[int, catalogue.JobRow]) -> None:
    """`manifest.json` as the sweep starts: every job of it, `completed` where the catalogue row `complete` says so,
    else `pending`; `"ended": false`. Written atomically, once; the end of the sweep replaces it.

    Example::

        write_planned(p.sweep_dir, p.jobs, p.rows)    # p = sweep_plan.plan(cfg), in gradrunner's sweeper

    Cheap at any size (no config composed, no job dir read: 10,000 jobs cost milliseconds). A failure to
    write it is logged, never raised: the jobs do not depend on it. Under torchrun, rank 0 writes it.
    """
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return
    entries: list[dict[str, Any]] = []
    for num, overrides in enumerate(jobs):
        row = complete.get(num)
        entries.append({"num": num, "dir": row.dir if row else None, "overrides": overrides,
                        "status": "completed" if row else "pending", "files": row.files if row else [],
                        "error": None})  # fmt: skip
    counts = {"completed": len(complete), "failed": 0, "missing": 0, "pending": len(jobs) - len(complete)}
    manifest = {"sweep_dir": str(sweep_dir.resolve()), "written": _now(), "ended": False, "counts": counts,
                "jobs": entries}  # fmt: skip
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_json(sweep_dir / MANIFEST, manifest)
    except OSError as e:
        log.error("could not write the sweep manifest %s as the sweep starts: %s; the jobs run all the same, and "
                  "it is written again when the sweep ends", sweep_dir / MANIFEST, one_paragraph(e))  # fmt: skip


def _from_catalogue(
    sweep_dir: Path, expected: list[list[str]], rows: list[catalogue.JobRow]
) -> list[dict[str, Any]] | None:
    """The manifest's entries from the catalogue's rows; None when a job has no row, or its dir disagrees."""
    by_key = {(r.key(), r.num): r for r in rows}
    jobs: list[dict[str, Any]] = []
    used: set[str] = set()
    for num, overrides in enumerate(expected):
        row = by_key.get((tuple(sorted(overrides)), num))
        if row is None:
            return None
        used.add(row.dir)
        if row.status != "completed":
            jobs.append(_entry(sweep_dir, sweep_dir / row.dir, overrides, num))  # failed: its files, as they are
            continue
        if catalogue.still_complete(sweep_dir, row, files=False) is not None:  # the one rule, on the markers
            return None
        jobs.append({"num": num, "dir": row.dir, "overrides": overrides, "status": "completed", "files": row.files,
                     "error": None})  # fmt: skip
    for row in rows:  # jobs of the dir that this sweep does not list (an earlier sweep's overrides)
        if row.dir not in used:
            jobs.append(_entry(sweep_dir, sweep_dir / row.dir, row.overrides, row.num))
    return jobs


def _complete_catalogue(sweep_dir: Path, jobs: list[dict[str, Any]], rows: list[catalogue.JobRow]) -> None:
    """Rows for the completed and failed jobs found in their dirs that the catalogue lacks (fingerprint unknown)."""
    known = {(r.dir, r.status, r.run_id if r.status == "completed" else None) for r in rows}
    new: list[catalogue.JobRow] = []
    for job in jobs:
        if job["dir"] is None or job["status"] not in ("completed", "failed"):
            continue
        marker = job_state(sweep_dir / job["dir"]).marker if job["status"] == "completed" else None
        if job["status"] == "completed" and marker is None:
            continue
        run_id = str(marker["run_id"]) if marker else None
        if (job["dir"], job["status"], run_id) in known:
            continue
        new.append(catalogue.JobRow(
            dir=job["dir"], num=job["num"], overrides=job["overrides"], status=job["status"], run_id=run_id,
            rows=sum(int(n) for n in (marker.get("rows") or {}).values()) if marker else None, files=job["files"],
            error=job["error"], finished=str(marker.get("finished")) if marker and marker.get("finished") else None,
        ))  # fmt: skip
    try:
        catalogue.record_jobs(sweep_dir, new)
    except Exception as e:  # sqlite3.Error, OSError: the manifest does not depend on it
        log.warning("could not complete the sweep catalogue %s: %s", sweep_dir / catalogue.CATALOGUE, one_paragraph(e))


def _from_job_dirs(
    sweep_dir: Path, expected: list[list[str]] | None, before: frozenset[str] | None = None
) -> list[dict[str, Any]]:
    """The manifest's entries from the job dirs found below `sweep_dir`, matched to the expected jobs."""
    found = _job_dirs(sweep_dir)
    by_overrides: dict[tuple[str, ...], list[Path]] = {}
    for d, o in found.items():  # several dirs may carry the same overrides (runs outside a sweep): keep each
        by_overrides.setdefault(tuple(sorted(o)), []).append(d)
    matched: list[Path | None] = []
    for overrides in expected or []:
        same = by_overrides.get(tuple(sorted(overrides))) or []
        matched.append(same.pop(0) if same else None)
    rest = [d for dirs in by_overrides.values() for d in dirs]
    # A job whose dir holds another config's completed run (a rerun with changed overrides, refused) is
    # that dir, found by job number: one entry per job, never a "missing" job plus a stray dir. A run that
    # was not complete when the sweep started is another process's: the job did not run, the dir is not its.
    nums = {d: _job_num(d) for d in rest}  # each hydra.yaml parsed once, not once per use
    by_num = {n: d for d, n in nums.items() if n is not None} if None in matched else {}
    taken: set[Path] = set()
    jobs: list[dict[str, Any]] = []
    for num, overrides in enumerate(expected or []):
        job_dir = matched[num]
        if job_dir is None and num in by_num and by_num[num] not in taken:
            if before is not None and _run_id(by_num[num]) not in before:
                jobs.append(_not_run(sweep_dir, by_num[num], overrides, found[by_num[num]], num))
                continue
            job_dir = by_num[num]
            taken.add(job_dir)
            overrides = found[job_dir]  # what its records hold, not what the refused rerun asked for
        jobs.append(_entry(sweep_dir, job_dir, overrides, num))
    rest = [d for d in rest if d not in taken]
    for job_dir in sorted(rest, key=lambda d: (nums[d] is None, nums[d] or 0, str(d))):
        jobs.append(_entry(sweep_dir, job_dir, found[job_dir], nums[job_dir]))
    return jobs


def _not_run(sweep_dir: Path, held: Path, overrides: list[str], theirs: list[str], num: int) -> dict[str, Any]:
    """The entry of a job that did not run because another process's run of another config held its dir."""
    state = job_state(held).status
    error = (f"did not run: its dir {held.relative_to(sweep_dir).as_posix()} holds a run of another config "
             f"({' '.join(theirs) or 'no overrides'}, {'not complete' if state == 'missing' else state}) that was not "
             "there complete when this sweep started: another process held that dir")  # fmt: skip
    return {"num": num, "dir": None, "overrides": overrides, "status": "failed", "files": [], "error": error}


def _run_id(job_dir: Path) -> str | None:
    marker, _ = read_marker(job_dir)
    return str(marker["run_id"]) if marker and marker.get("run_id") else None


def _completed_runs(sweep_dir: Path) -> frozenset[str]:
    """The run ids of the completed runs below `sweep_dir`: from the catalogue, else from the job dirs' markers."""
    if not sweep_dir.is_dir():
        return frozenset()
    rows = catalogue.read_jobs(sweep_dir)
    if rows is not None:
        return frozenset(r.run_id for r in rows if r.status == "completed" and r.run_id)
    return frozenset(i for i in map(_run_id, job_dirs_below(sweep_dir)) if i is not None)


def _summary(manifest: dict[str, Any]) -> str:
    counts = manifest["counts"]
    text = ", ".join(f"{n} {s}" for s, n in counts.items())
    bad = [j for j in manifest["jobs"] if j["status"] != "completed"]
    details = "; ".join(f"job {j['dir'] or j['num']}: {j['status']}" + (f" ({j['error']})" if j["error"] else "")
                        for j in bad[:5])  # fmt: skip
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"sweep {manifest['sweep_dir']}: {text}" + (f" -- {details}{more}" if bad else "")


def _catalogue(config: DictConfig, status: str, error: str | None) -> None:
    """The job's row in its sweep's catalogue (a sweep job on rank 0 only); a failure to write it is logged, never raised."""
    if not str(OmegaConf.select(config, "hydra.mode", default="")).endswith("MULTIRUN"):
        return
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return
    from gradrunner.run.sweep_plan import catalogue_row  # the run package imports torch; the job has it already

    try:
        row = catalogue_row(config, status=status, error=error)
        if row is not None:
            catalogue.record_job(str(config.hydra.sweep.dir), row)
    except Exception as e:  # sqlite3.Error, OSError: the job's records do not depend on its row
        log.warning("could not write this job's row of the sweep catalogue (%s): %s; the manifest reads the job "
                    "dirs instead", catalogue.CATALOGUE, one_paragraph(e))  # fmt: skip


class SweepBookkeeping(Callback):
    """Failure records per job, and the manifest (and report) of the sweep; see the module doc.

    Example (conf/config.yaml)::

        hydra:
          callbacks:
            gradrunner:
              _target_: gradrunner.cli.sweep_books.SweepBookkeeping
    """

    def __init__(self) -> None:
        self._config: DictConfig | None = None
        self._before: frozenset[str] = frozenset()  # run ids of the completed runs the sweep dir held at its start

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status != JobStatus.FAILED:
            _catalogue(config, "completed", None)
            return
        error = job_error(job_return)  # `return_value` would re-raise it
        if isinstance(error, (JobRefused, Refused)):  # Refused itself under HYDRA_FULL_ERROR=1 (`cli.app._fail`)
            return  # refused because of its dir (a live run, another config): that dir is not this job's to mark
        message = str(error) if isinstance(error, JobFailed) else f"{type(error).__name__}: {error}"
        out = Path(str(OmegaConf.select(config, "hydra.runtime.output_dir")))
        if out.is_dir():
            try:
                mark_failed(out, message)
            except OSError as e:
                log.error("could not write %s: %s", out / "failed.json", one_paragraph(e))
                return
            _catalogue(config, "failed", " ".join(message.split()))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._config = config
        self._before = _completed_runs(Path(str(config.hydra.sweep.dir)))
        atexit.register(self._finish)  # Hydra skips on_multirun_end when a job failed

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._finish)
        self._config = config
        self._finish()

    def _finish(self) -> None:
        config, self._config = self._config, None
        if config is None or int(os.environ.get("RANK", "0") or 0) != 0:
            return  # done already, or a torchrun rank other than 0 (rank 0 keeps the books)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        wanted = expected_jobs(config)
        manifest = build_manifest(sweep_dir, wanted, self._before)
        try:
            path = write_json(sweep_dir / MANIFEST, manifest)
        except OSError as e:
            log.error("could not write the sweep manifest %s: %s; the jobs' records and done.json files are not "
                      "affected", sweep_dir / MANIFEST, one_paragraph(e))  # fmt: skip
            return
        bad = manifest["counts"]["failed"] + manifest["counts"]["missing"]
        (log.warning if bad else log.info)("%s; manifest: %s", _summary(manifest), path)
        from gradrunner.analysis.health import sweep_word
        from gradrunner.run.sweep_plan import plan  # the run package imports torch: only once a sweep ends

        decided = plan(config)
        skipped = decided.complete if decided is not None else frozenset()
        ours = None if wanted is None else {tuple(sorted(o)) for o in wanted}  # another sweep's job is not ours
        expected = [j for j in manifest["jobs"] if j["status"] == "completed" and j["num"] not in skipped]
        earlier = [j for j in expected if _run_id(sweep_dir / j["dir"]) in self._before]
        done = [(j["dir"], j["overrides"]) for j in expected
                if j not in earlier and (ours is None or tuple(sorted(j["overrides"])) in ours)]  # fmt: skip
        if skipped:
            log.info("%d jobs completed in an earlier run of this sweep were skipped (their summary was logged then)",
                     len(skipped))  # fmt: skip
        if earlier:  # refused (a dir holding another config's run) or skipped by their dirs (`books.job_dir`)
            log.warning("%d job(s) listed completed did not run now: their records are from an earlier run of this "
                        "sweep (each was skipped as complete, or refused where its dir holds another config's run: "
                        "the log above says which): %s",
                        len(earlier), "; ".join(f"job {j['dir']} ({' '.join(j['overrides'])})" for j in earlier[:5])
                        + (f"; and {len(earlier) - 5} more" if len(earlier) > 5 else ""))  # fmt: skip
        failed = [(j["dir"] or str(j["num"]), j["overrides"], str(j.get("error") or "no reason recorded"))
                  for j in manifest["jobs"] if j["status"] == "failed"]  # fmt: skip
        sweep_word(sweep_dir, done, failed)  # one line per job run now: its loss, NaN/Inf, vanishing/exploding taps
        if OmegaConf.select(config, "report", default=False):
            if manifest["counts"]["completed"]:
                from gradrunner.report.write import try_report  # pandas and matplotlib only when asked

                try_report(sweep_dir)
            else:
                log.warning("report=true: no job of the sweep completed, so no report was written")
