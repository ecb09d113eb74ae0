"""Which jobs of a sweep are complete already, decided once per sweep before any job's config is composed.

Contents:
    config_fingerprint(config)   -- a hash of everything a job's config is composed from, besides its overrides
    SweepPlan, plan(config)      -- the sweep's jobs and which of them the catalogue shows complete (cached per sweep)
    catalogue_row(config, ...)   -- the catalogue row of a job that just ended (`cli.sweep_books.SweepBookkeeping`)

A re-run of a sweep into the same dir used to compose every job's config three times (the up-front
check, Hydra's batch check and the job itself) only for the job to find `done.json` and skip: at
10,000 jobs, half an hour. `plan` reads the sweep catalogue (`records.catalogue`) once: a job is
complete when its row has the same overrides, the same job number, status `completed`, the same
config fingerprint, and `catalogue.still_complete` (its dir still holds that run's `done.json`, no
`failed.json`, and each record file unchanged: size, modification time, footer). Those jobs are
neither composed by the up-front check (`cli.app.SweepCheck`) nor launched (`gradrunner`'s sweeper,
`hydra_plugins/gradrunner_sweeper`); every other job goes the usual way, where `books.prepare` still
decides from the dir itself, so the shortcut can only skip work, never hide a difference: a changed
config file, a changed gradrunner, a config that reads the environment (`${oc.env:...}`, custom
resolvers) give no fingerprint match, and those jobs are composed and checked one by one.

Example::

    p = plan(cfg)                      # in on_multirun_start, or the sweeper
    len(p.jobs), len(p.complete)       # (10000, 9990): 10 jobs to launch
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import gradrunner
from gradrunner.records import catalogue
from gradrunner.records.rundir import read_marker
from gradrunner.run.hydra_adapter import sweep_jobs

log = logging.getLogger(__name__)

#: Resolvers whose value depends only on the config: a source using any other one (`oc.env`, `now` outside
#: `hydra:`, a user's own) may compose differently with the same files, so it gets no fingerprint.
PURE_RESOLVERS = frozenset({"oc.select", "oc.dict.keys", "oc.dict.values", "oc.create", "oc.deprecated"})
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:")


def _source_files(source: dict[str, Any]) -> list[tuple[str, bytes]] | None:
    """(relative path, bytes) of every YAML file of one config source; None if it cannot be read."""
    scheme, where = source.get("schema"), str(source.get("path") or "")
    if scheme == "structured":
        return []  # the schema's dataclasses: their module's source is in `code_digest`
    try:
        if scheme == "pkg":
            root: Any = importlib.resources.files(where.replace("/", "."))
            base = Path(str(root))
        elif scheme == "file":
            base = Path(where)
        else:
            return None
        return [(p.relative_to(base).as_posix(), p.read_bytes()) for p in sorted(base.rglob("*.yaml"))]
    except (OSError, ModuleNotFoundError, TypeError, ValueError):
        return None


def _impure(text: bytes) -> bool:
    """A resolver other than the pure ones appears outside the `hydra:` block (where `${now:...}` names dirs)."""
    body = text.decode("utf-8", "replace").split("\nhydra:", 1)[0]
    return any(m.group(1) not in PURE_RESOLVERS for m in _RESOLVER.finditer(body))


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of every source file (Python, and the C of the fused statistics) of the installed gradrunner package
    (the schema's among them), by relative path.

    Example::

        code_digest()     # 'c0ffee...': changes with any edit of gradrunner's code, released or not

    gradrunner's version alone says nothing of an editable install or a patched copy; the files do.
    Read once per process (about 150 files, a few milliseconds).
    """
    root = Path(gradrunner.__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        if "__pycache__" not in f.parts:
            data = f.read_bytes()
            digest.update(f"{f.relative_to(root).as_posix()} {len(data)}\n".encode() + data)
    return digest.hexdigest()


def config_fingerprint(config: DictConfig) -> str | None:
    """A hash of the config sources (every YAML file), gradrunner's version and code (`code_digest`) and the sweep's
    subdir pattern; None when those cannot determine a job's config (a source unreadable, or reading the environment).

    Example::

        config_fingerprint(cfg)     # 'sha256:5f1c...'; the same in the launching process and in every job
    """
    sources = OmegaConf.select(config, "hydra.runtime.config_sources", default=None)
    if not sources:
        return None
    digest = hashlib.sha256()
    digest.update(f"gradrunner {gradrunner.__version__} {code_digest()}\n".encode())
    sweep = OmegaConf.to_container(config.hydra.sweep, resolve=False) if "sweep" in config.hydra else {}
    digest.update(f"subdir {sweep.get('subdir') if isinstance(sweep, dict) else None}\n".encode())
    for source in OmegaConf.to_container(sources, resolve=True):  # type: ignore[union-attr]
        files = _source_files(dict(source))  # type: ignore[arg-type]
        if files is None:
            return None
        digest.update(f"source {source!r}\n".encode())
        for name, data in files:
            if not name.startswith("hydra/") and _impure(data):  # Hydra's own settings name dirs by `${now:}`
                return None
            digest.update(f"{name} {len(data)}\n".encode() + data)
    return "sha256:" + digest.hexdigest()


@dataclass(frozen=True)
class SweepPlan:
    """A sweep's jobs (override lists, in job order) and the numbers of those complete already, with their rows."""

    sweep_dir: Path
    jobs: list[list[str]]
    complete: frozenset[int] = field(default_factory=frozenset)
    fingerprint: str | None = None
    #: The catalogue row of each complete job, by job number.
    rows: dict[int, catalogue.JobRow] = field(default_factory=dict)

    def to_run(self) -> list[int]:
        """The numbers of the jobs still to run, in order."""
        return [n for n in range(len(self.jobs)) if n not in self.complete]


#: `plan`'s answer per sweep dir, with the sweep's config object: the up-front check, the sweeper and the end of
#: the sweep (handed the same object by Hydra) share one decision; another sweep in this process decides anew.
_PLANS: dict[str, tuple[DictConfig, SweepPlan | None]] = {}


def plan(config: DictConfig) -> SweepPlan | None:
    """The sweep's plan (see the module doc); None unless Hydra's basic sweeper (or gradrunner's) lists its jobs.

    Example::

        plan(cfg).to_run()       # [17, 18] when jobs 0-16 and 19 completed before
    """
    key = str(config.hydra.sweep.dir)
    if key not in _PLANS or _PLANS[key][0] is not config:
        _PLANS[key] = (config, _decide(config))
    return _PLANS[key][1]


def _decide(config: DictConfig) -> SweepPlan | None:
    try:
        jobs = sweep_jobs(config)
    except Exception:  # a sweep Hydra's own parser reports better
        return None
    if jobs is None:
        return None
    sweep_dir = Path(str(config.hydra.sweep.dir))
    rows = catalogue.read_jobs(sweep_dir) if sweep_dir.is_dir() else None
    fingerprint = config_fingerprint(config)
    if not rows or fingerprint is None:
        return SweepPlan(sweep_dir, jobs, frozenset(), fingerprint)
    by_key = {r.key(): r for r in rows if r.status == "completed" and r.fingerprint == fingerprint}
    complete: dict[int, catalogue.JobRow] = {}
    changed: list[str] = []
    for num, overrides in enumerate(jobs):
        row = by_key.get(tuple(sorted(overrides)))
        if row is None or row.num != num:
            continue
        why = catalogue.still_complete(sweep_dir, row)  # the one rule: the dir, its markers and its files
        if why is None:
            complete[num] = row
        else:
            changed.append(f"job {row.dir}: {why}")
    if changed:
        log.warning("sweep %s: %d job(s) the catalogue lists completed no longer are, so they run again (each verifies "
                    "its files first): %s%s", sweep_dir, len(changed), "; ".join(changed[:10]),
                    f"; and {len(changed) - 10} more" if len(changed) > 10 else "")  # fmt: skip
    if complete:
        log.info("sweep %s: %d of %d jobs completed before with this config (%s): skipped without composing them; "
                 "%d to run", sweep_dir, len(complete), len(jobs), catalogue.CATALOGUE, len(jobs) - len(complete))  # fmt: skip
    return SweepPlan(sweep_dir, jobs, frozenset(complete), fingerprint, complete)


def catalogue_row(config: DictConfig, *, status: str, error: str | None) -> catalogue.JobRow | None:
    """The catalogue row of the job whose config is `config` (a job of a sweep, as it ends); None outside a sweep dir.

    Example::

        catalogue_row(cfg, status="completed", error=None)    # in SweepBookkeeping.on_job_end

    A completed job's row comes from its `done.json` (run id, overrides, files, rows); a job that
    ended without one (skipped as complete by `books.prepare` reads it the same way) is "completed"
    only when `done.json` is there.
    """
    out = Path(str(OmegaConf.select(config, "hydra.runtime.output_dir")))
    sweep_dir = Path(str(config.hydra.sweep.dir))
    try:
        relative = out.resolve().relative_to(sweep_dir.resolve()).as_posix()
    except ValueError:
        return None
    num = OmegaConf.select(config, "hydra.job.num", default=None)
    overrides = [str(o) for o in (OmegaConf.select(config, "hydra.overrides.task", default=None) or [])]
    if status == "completed":
        marker, _ = read_marker(out)
        if marker is None:
            return None
        rows = marker.get("rows") or {}
        files = [str(f) for f in marker["files"]]
        return catalogue.JobRow(
            dir=relative, num=num, overrides=[str(o) for o in marker.get("overrides", overrides)],
            status="completed", run_id=str(marker["run_id"]), rows=sum(int(n) for n in rows.values()),
            files=files, fingerprint=config_fingerprint(config), stamps=catalogue.stamps(out, files),
            finished=str(marker.get("finished")) if marker.get("finished") else None,
        )  # fmt: skip
    return catalogue.JobRow(dir=relative, num=num, overrides=overrides, status=status, error=error)


#: The configs of the sweeps whose every job the up-front check (`cli.app.SweepCheck`) composed and validated.
_VALIDATED: list[DictConfig] = []


def mark_validated(config: DictConfig) -> None:
    """The up-front check composed and validated every job of this sweep: the sweeper need not compose them again."""
    _VALIDATED[:] = [config]  # one sweep at a time per process


def validated(config: DictConfig) -> bool:
    """Whether `mark_validated` was called with this very config object (this sweep, in this process)."""
    return any(c is config for c in _VALIDATED)
