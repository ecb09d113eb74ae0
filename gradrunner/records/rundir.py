"""A job dir's bookkeeping: the completion marker, the failure record, and what a rerun may do there.

Contents:
    DONE, FAILED, RECORD_NAMES   -- `done.json` (written last), `failed.json`, the record files
    JobState, job_state(dir)     -- "completed", "failed" or "missing", read from the dir's files alone
    RunLock(dir, run_id)         -- the exclusive lock a run holds on its run dir for its whole life
    Refused, LiveRun             -- a run refused because of what its dir holds, or because a live run holds it
    mark_complete(dir, ...)      -- write `done.json` (with row counts) once the records are closed
    mark_failed(dir, error)      -- write `failed.json` (the CLI and the sweep callback do, for a failed job)
    verify_job(dir, marker)      -- why a "completed" job's files cannot be trusted, or None
    prepare(dir, cfg, resume)    -- before a job writes: "run" (after removing partial records) or "skip"
    job_dirs_below(root)         -- THE rule for which folders below a sweep dir are jobs
    unfinished_jobs(root, dirs)  -- the jobs of a sweep that did not complete (for `analysis.load`)

Status comes from files in the job dir, so it is the same whichever launcher ran the job and
in whichever process or machine: `done.json` is written by the runner after every record file is
closed (with their run id and row counts, which a resume checks), `failed.json` when the job raised.
Neither means the job never ran, was killed, or is still running: "missing".

Example::

    job_state("multirun/2024-05-01/12-00-00-123456/3").status     # 'completed'
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import LOCK_FILE, RECORD_FILES, is_temp_of, temp_name

log = logging.getLogger(__name__)

#: Completion marker: the last file a job writes, after its records are closed.
DONE = "done.json"
#: Failure record of a job that raised (its error message), written by the sweep callback.
FAILED = "failed.json"
#: Record files a job writes; each is first written under a hidden temp name (`columns.temp_name`).
RECORD_NAMES = RECORD_FILES
#: Config keys that do not change the records: a rerun may differ in them and still resume.
NEUTRAL_KEYS = ("resume", "report")
#: Config keys added after records were first written, with the value that means "as before": a run
#: recorded without the key matches a config that has it at this value (its records are the same).
ADDED_KEYS: dict[str, Any] = {"capture.per_example": False, "capture.histogram": False}
# The training options (issue 20) at their defaults train as before they existed.
ADDED_KEYS.update({"train.clip_grad_norm": None, "train.clip_grad_value": None, "train.autocast": "off",
                   "train.accumulate": 1, "train.checkpoint_every": 0, "train.eval_every": 0,
                   "train.eval_batches": 1, "eval_data": None})  # fmt: skip

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


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
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
    temp = path.with_name(temp_name(path.name, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))
    try:
        temp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)  # never leave a temp file behind (a full disk, a read-only dir)
        raise
    return path


def _temps(directory: Path, name: str) -> list[str]:
    """Temp files of `name` in `directory`, of any run."""
    try:
        return sorted(e.name for e in os.scandir(directory) if is_temp_of(e.name, name))
    except OSError:
        return []


def _present(directory: Path) -> list[str]:
    """Record files of `directory`, final and hidden temp names (of any run), that exist."""
    return [n for name in RECORD_NAMES for n in ([name] if (directory / name).exists() else []) + _temps(directory, name)]


def job_state(directory: str | os.PathLike[str]) -> JobState:
    """The job's status from its dir alone: failed (`failed.json`), completed (`done.json`), or missing.

    Example::

        job_state("outputs/2024-05-01/12-00-00-123456").status   # 'completed'
    """
    d = Path(directory)
    files = [n for n in RECORD_NAMES if (d / n).is_file()]
    failed = read_json(d / FAILED) if (d / FAILED).exists() else None
    if failed is not None or (d / FAILED).exists():
        return JobState(d, "failed", files, error=str((failed or {}).get("error", "unknown error")))
    marker = read_json(d / DONE)
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

    It records each file's row count (from its footer), which `verify_job` checks on a resume.
    """
    return write_json(
        directory / DONE,
        {
            "status": "completed",
            "run_id": run_id,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
            "rows": {f: pq.read_metadata(directory / f).num_rows for f in files},
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

    A key of `ADDED_KEYS` missing on one side counts as its as-before value (records written before
    the key existed match a config that leaves it at that value).
    """
    a, b = _flatten(old), _flatten(new)
    missing = object()
    keys = [k for k in sorted(set(a) | set(b)) if k.split(".")[0] not in NEUTRAL_KEYS]
    return [
        f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
        for k in keys
        if a.get(k, missing) != b.get(k, missing) and not _added_as_before(k, a, b)
    ]


def _added_as_before(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """`key` is one of `ADDED_KEYS`, unset on one side and at its as-before value on the other."""
    if key not in ADDED_KEYS:
        return False
    values = [d[key] for d in (old, new) if key in d]
    return len(values) == 1 and values[0] == ADDED_KEYS[key]


def _restore_hydra_files(directory: Path, marker: dict[str, Any]) -> None:
    """Hydra rewrote `.hydra/` for the refused job: put back the completed job's overrides and config."""
    hydra_dir = directory / ".hydra"
    if not hydra_dir.is_dir():
        return
    OmegaConf.save(OmegaConf.create(marker.get("overrides", [])), hydra_dir / "overrides.yaml")
    if isinstance(marker.get("config"), dict):
        OmegaConf.save(OmegaConf.create(marker["config"]), hydra_dir / "config.yaml")


def _clean(directory: Path) -> list[str]:
    """Remove a job's records, markers, temp files and report; return the names removed.

    Only called with the dir's `RunLock` held: any temp file here belongs to a run that is dead.
    """
    names = [DONE, *_present(directory), FAILED, *_temps(directory, DONE), *_temps(directory, FAILED), "report.html"]
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
    marker = read_json(d / DONE)
    if not present and marker is None:
        _clean(d)  # a stale failure record of a job that failed before writing anything
        return "run"
    if not resume:
        what = "a completed run" if marker else "a run that did not complete (interrupted, failed or killed)"
        way = "skip it" if marker else (
            "delete its partial records and run it again (from its last mid-run checkpoint if it has one, else "
            "from step 0)"
        )
        raise Refused(
            f"the run dir {d} already holds records ({', '.join(present) or DONE}) of {what}; gradrunner never "
            f"overwrites records. Run into a new dir (drop hydra.run.dir=... or choose another), or pass "
            f"resume=true to {way}."
        )
    if marker is not None:
        diff = config_diff(marker.get("config") or {}, config_dict(cfg))
        if diff:
            _restore_hydra_files(d, marker)
            raise Refused(
                f"{d} holds a completed run of a different config ({'; '.join(diff)}); its records are kept and "
                "this job did not run. Use a new dir for the new config (hydra.sweep.dir=... or hydra.run.dir=...), "
                "or run the original config there to resume."
            )
        problem = verify_job(d, marker)
        if problem is None:
            (d / FAILED).unlink(missing_ok=True)  # a failure record left by an earlier attempt, if any
            log.info("%s already completed (%s): skipped; its records are kept", d, DONE)
            return "skip"
        removed = _clean(d)
        log.warning("%s is marked completed but %s: its records are not trusted (removed: %s); running again",
                    d, problem, ", ".join(removed))  # fmt: skip
        return "run"
    removed = _clean(d)
    log.warning("%s held partial records of an earlier attempt (%s): removed; running again", d, ", ".join(removed))
    return "run"


def verify_job(directory: Path, marker: dict[str, Any]) -> str | None:
    """Why the completed job in `directory` (its `done.json` is `marker`) cannot be trusted, or None.

    Example::

        verify_job(job_dir, json.loads((job_dir / "done.json").read_text()))  # 'grads.parquet is missing'

    Each record file `marker` names must open, its footer and every page (CRC checksums) must read,
    its `run_id` column must hold only the marker's run id, and its row count must match the
    marker's (markers written before row counts were recorded skip that check).
    """
    recorded = marker.get("rows")
    rows: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    run_id = marker.get("run_id")
    names = marker.get("files")
    if not isinstance(names, list) or not names:
        return f"{DONE} names no record files"
    for name in names:
        path = directory / str(name)
        if not path.is_file():
            return f"{name} is missing"
        try:
            f = pq.ParquetFile(path, page_checksum_verification=True)
            ids: set[str] = set()
            for i in range(f.num_row_groups):  # one row group at a time: memory stays bounded
                group = f.read_row_group(i)
                if "run_id" in group.column_names:
                    ids.update(str(v) for v in pc.unique(group.column("run_id")).to_pylist())
            n = f.metadata.num_rows
        except Exception as e:  # ArrowInvalid, OSError: a damaged footer or page
            return f"{name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
        if run_id is not None and ids - {run_id}:
            return f"{name} holds rows of run(s) {', '.join(sorted(ids - {run_id}))}, not of run {run_id} ({DONE})"
        if str(name) in rows and rows[str(name)] != n:
            return f"{name} has {n} rows where {DONE} recorded {rows[name]}"
    return None


class Refused(GradrunnerError):
    """A run refused because of what its run dir holds; the dir is left as it was."""


class LiveRun(Refused):
    """A run refused because another run, still alive, holds the run dir's lock."""


class RunLock:
    """The exclusive lock a run holds on its run dir, from before it looks at the dir to after `done.json`.

    Example::

        with RunLock(job_dir, run_id):     # LiveRun if another live process holds job_dir
            prepare(job_dir, cfg, resume=True); train(...); mark_complete(...)

    An `fcntl.flock` on `<dir>/.gradrunner.lock`, which holds the owner's host, pid, start time and run
    id for messages. The kernel drops the lock when its process dies (SIGKILL, a preempted node's
    processes), so a dead owner never blocks a resume. It works between processes of one machine;
    on NFS, Linux emulates `flock` with byte-range locks that every client sees (given a working lock
    manager); on a filesystem without locks (Lustre mounted `noflock`) the run goes on unlocked,
    with a warning; Lustre mounted `localflock` locks per node only.
    """

    def __init__(self, directory: str | os.PathLike[str], run_id: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.run_id = run_id
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._created = True
            except FileExistsError:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                self._created = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._read_owner(fd)
                os.close(fd)
                raise LiveRun(self._refusal(owner)) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    os.close(fd)
                    raise
                log.warning("%s: this filesystem has no file locks (%s); running without the run-dir lock, so "
                            "nothing stops a second run into this dir", self.path, os.strerror(e.errno or 0))  # fmt: skip
            try:  # the file we locked may have been replaced meanwhile: lock the one that is there
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id,
                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except OSError:
            pass  # the owner's name only serves messages; a full disk must not stop the lock
        return self

    def leave_no_trace(self) -> None:
        """Remove the lock file if this run created it (a refused run leaves its dir as it found it)."""
        if self._fd is not None and self._created:
            self.path.unlink(missing_ok=True)  # still locked: a run that opened it meanwhile retries (inode check)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race with a waiting run)
            self._fd = None

    @staticmethod
    def _read_owner(fd: int) -> dict[str, Any]:
        try:
            data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _refusal(self, owner: dict[str, Any]) -> str:
        who = (f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started {owner.get('started', '?')}, "
               f"run id {owner.get('run_id', '?')}")  # fmt: skip
        return (
            f"the run dir {self.directory} is in use by a live run ({who}); gradrunner lets one run at a time "
            f"write a run dir, and this one did not run and changed nothing there. Wait for that run to end, "
            f"stop it (kill {owner.get('pid', '<pid>')} on {owner.get('host', 'its host')}), or run into another dir "
            f"(hydra.run.dir=... or hydra.sweep.dir=...). The lock ({self.path}) is held only while that process "
            "lives, so a killed run never blocks resume=true."
        )


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
    """THE rule for which folders are jobs: dirs below `root`, none of their parts hidden (`.`, `_`),
    that hold Hydra's `.hydra/overrides.yaml`, a marker (`done.json`, `failed.json`) or a record file,
    final or temp. The sweep manifest, `resume` and `analysis.load` all use it.

    Example::

        job_dirs_below(Path("multirun/2024-05-01/12-00-00-123456"))   # [.../0, .../1, ...]
    """
    found = {f.parent.parent for f in root.rglob(".hydra/overrides.yaml")}
    found |= {f.parent for name in (DONE, FAILED, *RECORD_NAMES) for f in root.rglob(name)}
    found |= {f.parent for name in RECORD_NAMES for f in root.rglob(f".{name}.*.tmp") if is_temp_of(f.name, name)}
    found.discard(root)
    return sorted(d for d in found if not any(p.startswith((".", "_")) for p in d.relative_to(root).parts))
