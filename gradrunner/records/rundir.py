"""A job dir's bookkeeping: the completion marker, the failure record, and what a rerun may do there.

Contents:
    DONE, FAILED, RECORD_NAMES   -- `done.json` (written last), `failed.json`, the record files
    JobState, job_state(dir)     -- "completed", "failed" or "missing", read from the dir's files alone
    mark_complete(dir, ...)      -- write `done.json` once the records are closed
    mark_failed(dir, error)      -- write `failed.json` (the sweep callback does, for a failed job)
    prepare(dir, cfg, resume)    -- before a job writes: "run" (after removing partial records) or "skip"
    unfinished_jobs(root, dirs)  -- the jobs of a sweep that did not complete (for `analysis.load`)

Status comes from files in the job dir, so it is the same whichever launcher ran the job and
in whichever process or machine: `done.json` is written by the runner after every record file is
closed (so its presence means the records are whole), `failed.json` by the sweep callback when the
job raised. Neither means the job never ran, was killed, or is still running: "missing".

Example::

    job_state("multirun/2024-05-01/12-00-00-123456/3").status     # 'completed'
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from gradrunner.errors import GradrunnerError

log = logging.getLogger(__name__)

#: Completion marker: the last file a job writes, after its records are closed.
DONE = "done.json"
#: Failure record of a job that raised (its error message), written by the sweep callback.
FAILED = "failed.json"
#: Record files a job writes; each is first written under the hidden temp name `.<name>.tmp`.
RECORD_NAMES = ("grads.parquet", "steps.parquet")
#: Config keys that do not change the records: a rerun may differ in them and still resume.
NEUTRAL_KEYS = ("resume", "report")

Status = Literal["completed", "failed", "missing"]


@dataclass
class JobState:
    """What a job dir says about its job.

    Example::

        state = job_state(job_dir)
        state.status, state.error, state.files     # 'failed', "capture.strategy='bogus' ...", []
    """

    directory: Path
    status: Status
    #: Record files present under their final names (partial ones too, for a job that did not complete).
    files: list[str] = field(default_factory=list)
    #: The error message of a failed job.
    error: str | None = None
    #: The content of `done.json` of a completed job.
    marker: dict[str, Any] | None = None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically: a reader sees the whole file or none.

    Example::

        write_json(sweep_dir / "manifest.json", {"jobs": []})
    """
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(temp, path)
    return path


def _present(directory: Path) -> list[str]:
    """Record files of `directory`, final and hidden temp names, that exist."""
    names = [n for name in RECORD_NAMES for n in (name, f".{name}.tmp")]
    return [n for n in names if (directory / n).exists()]


def job_state(directory: str | os.PathLike[str]) -> JobState:
    """The job's status from its dir alone: failed (`failed.json`), completed (`done.json`), or missing.

    Example::

        job_state("outputs/2024-05-01/12-00-00-123456").status   # 'completed'
    """
    d = Path(directory)
    files = [n for n in RECORD_NAMES if (d / n).is_file()]
    failed = _read_json(d / FAILED) if (d / FAILED).exists() else None
    if failed is not None or (d / FAILED).exists():
        return JobState(d, "failed", files, error=str((failed or {}).get("error", "unknown error")))
    marker = _read_json(d / DONE)
    if marker is not None:
        return JobState(d, "completed", [str(f) for f in marker.get("files", files)], marker=marker)
    return JobState(d, "missing", files)


def config_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved job config as plain containers, without the `hydra` node.

    Example::

        config_dict(cfg)["capture"]["strategy"]   # 'hook'
    """
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict), data
    return {str(k): v for k, v in data.items() if k != "hydra"}


def mark_complete(
    directory: Path, cfg: DictConfig, *, files: list[str], run_id: str, world_size: int, overrides: list[str]
) -> Path:
    """Write `done.json`: the job's records (`files`) are closed and whole. Call it last.

    Example::

        mark_complete(job_dir, cfg, files=["grads.parquet", "steps.parquet"], run_id=rid, world_size=1, overrides=[])
    """
    return write_json(
        directory / DONE,
        {
            "status": "completed",
            "run_id": run_id,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "world_size": world_size,
            "overrides": overrides,
            "config": config_dict(cfg),
        },
    )


def mark_failed(directory: Path, error: str) -> Path:
    """Write `failed.json` with the job's error message (one paragraph).

    Example::

        mark_failed(job_dir, "capture.strategy='bogus' is not allowed; ...")
    """
    return write_json(directory / FAILED, {"status": "failed", "error": " ".join(error.split())})


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every leaf that differs, the keys of `NEUTRAL_KEYS` left out.

    Example::

        config_diff({"steps": 2, "resume": False}, {"steps": 3, "resume": True})   # ['steps: 2 -> 3']
    """
    a, b = _flatten(old), _flatten(new)
    missing = object()
    keys = [k for k in sorted(set(a) | set(b)) if k.split(".")[0] not in NEUTRAL_KEYS]
    return [
        f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
        for k in keys
        if a.get(k, missing) != b.get(k, missing)
    ]


def _restore_hydra_files(directory: Path, marker: dict[str, Any]) -> None:
    """Hydra rewrote `.hydra/` for the refused job: put back the completed job's overrides and config."""
    hydra_dir = directory / ".hydra"
    if not hydra_dir.is_dir():
        return
    OmegaConf.save(OmegaConf.create(marker.get("overrides", [])), hydra_dir / "overrides.yaml")
    if isinstance(marker.get("config"), dict):
        OmegaConf.save(OmegaConf.create(marker["config"]), hydra_dir / "config.yaml")


def _clean(directory: Path) -> list[str]:
    """Remove a job's partial records, failure record and report; return the names removed."""
    names = [*_present(directory), FAILED, f".{DONE}.tmp", "report.html"]
    names += sorted(p.name for p in directory.glob("report-*.png"))
    removed = []
    for name in names:
        path = directory / name
        if path.exists():
            path.unlink()
            removed.append(name)
    return removed


def prepare(directory: str | os.PathLike[str], cfg: DictConfig, *, resume: bool) -> Literal["run", "skip"]:
    """Decide what a job does with its dir before writing: "run" (the dir is clean), or "skip" (done).

    Example::

        prepare(job_dir, cfg, resume=True)    # 'skip' when job_dir/done.json holds the same config

    Without records there, "run". With records and `resume=False`, a GradrunnerError (records are
    never overwritten). With `resume=True`: a completed job of the same config is skipped; of a
    different config, a GradrunnerError naming the differences; anything else (partial records, no
    completion marker, a failure) is removed and the job runs again from step 0.
    """
    d = Path(directory)
    present = _present(d)
    marker = _read_json(d / DONE)
    if not present and marker is None:
        _clean(d)  # a stale failure record of a job that failed before writing anything
        return "run"
    if not resume:
        what = "a completed run" if marker else "a run that did not complete (interrupted, failed or still running)"
        way = "skip it" if marker else "delete its partial records and run it again from step 0"
        raise GradrunnerError(
            f"the run dir {d} already holds records ({', '.join(present) or DONE}) of {what}; gradrunner never "
            f"overwrites records. Run into a new dir (drop hydra.run.dir=... or choose another), or pass "
            f"resume=true to {way}."
        )
    if marker is not None:
        diff = config_diff(marker.get("config") or {}, config_dict(cfg))
        if diff:
            _restore_hydra_files(d, marker)
            raise GradrunnerError(
                f"{d} holds a completed run of a different config ({'; '.join(diff)}); its records are kept and "
                "this job did not run. Use a new dir for the new config (hydra.sweep.dir=... or hydra.run.dir=...), "
                "or run the original config there to resume."
            )
        (d / FAILED).unlink(missing_ok=True)  # a failure record left by an earlier attempt, if any
        log.info("%s already completed (%s): skipped; its records are kept", d, DONE)
        return "skip"
    removed = _clean(d)
    log.warning("%s held partial records of an earlier attempt (%s): removed; running again", d, ", ".join(removed))
    return "run"


def unfinished_jobs(job_dirs: list[Path]) -> list[JobState] | None:
    """The jobs among `job_dirs` that did not complete, or None when none of them carries a marker.

    Example::

        unfinished_jobs([sweep / "0", sweep / "1"])   # [JobState(.../1, 'failed', error=...)]

    None means the records predate completion markers (or were written outside the CLI): every
    job is then taken as it is.
    """
    states = [job_state(d) for d in job_dirs]
    if not any((d / DONE).exists() or (d / FAILED).exists() for d in job_dirs):
        return None
    return [s for s in states if s.status != "completed"]


def describe_unfinished(root: Path, unfinished: list[JobState], total: int) -> str:
    """One paragraph naming the jobs of the sweep at `root` that did not complete, and what to do.

    Example::

        describe_unfinished(sweep, unfinished_jobs(dirs), len(dirs))  # '1 of 6 jobs in ... job 3 failed: ...'
    """
    parts = []
    for s in unfinished[:10]:
        name = s.directory.relative_to(root).as_posix()
        parts.append(f"job {name} failed: {(s.error or '').rstrip('.')}" if s.status == "failed"
                     else f"job {name} has no {DONE} (killed, or still running)")  # fmt: skip
    more = f"; and {len(unfinished) - 10} more" if len(unfinished) > 10 else ""
    partial = [s.directory / f for s in unfinished for f in s.files]
    example = f", or read a job's partial records directly, e.g. pd.read_parquet('{partial[0]}')" if partial else ""
    return (
        f"{len(unfinished)} of {total} jobs in {root} did not complete and are left out: {'; '.join(parts)}{more}. "
        f"Re-run the sweep into the same dir (hydra.sweep.dir={root}) to complete them{example}."
    )


def job_dirs_below(root: Path) -> list[Path]:
    """Dirs below `root` (not hidden) that hold a job's marker or a record file, final or temp.

    Example::

        job_dirs_below(Path("multirun/2024-05-01/12-00-00-123456"))   # [.../0, .../1, ...]
    """
    names = [DONE, FAILED] + [n for name in RECORD_NAMES for n in (name, f".{name}.tmp")]
    found = {f.parent for name in names for f in root.rglob(name) if f.parent != root}
    return sorted(d for d in found if not any(p.startswith((".", "_")) for p in d.relative_to(root).parts))
