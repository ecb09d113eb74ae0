"""The MLflow target: one MLflow run per job in a tracking store (default: a local file store).

Needs the `mlflow` package only (`gradrunner[mlflow]` installs `mlflow-skinny`), imported when
`to_mlflow` runs. Viewing the store needs the full `mlflow` package, whose UI serves a file store only
with `MLFLOW_ALLOW_FILE_STORE=true`: `view_command` says what to run (and what to install first).

Example::

    to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))
    print(view_command(Path("runs/lightning/mlruns").resolve().as_uri()))
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import posixpath
import shlex
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.export.jobs import Job, exclusive, source_of

#: The tag that names an exported run's job: its dir and run id, readable.
SOURCE_TAG = "gradrunner.source"
#: A hex digest of `SOURCE_TAG`'s value (any path, quotes included, is a plain word in MLflow's filter syntax):
#: how a re-export finds the run an older gradrunner wrote for the same records.
SOURCE_ID_TAG = "gradrunner.source_id"
#: The tag a re-export finds the run by: a hex digest of the job dir alone, so that the export of another run the
#: dir held before (`record(overwrite=True)`, a failed run re-run from step 0) is replaced too, as TensorBoard's is.
DIR_ID_TAG = "gradrunner.dir_id"
#: MLflow's longest metric and param key (`mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH`).
MAX_KEY = 250
#: The characters an MLflow key takes besides letters and digits.
_KEY_CHARS = "_-. :/"
#: The artifact that maps each tag and hyper-parameter whose key had to change to its MLflow key.
KEYS_ARTIFACT = "gradrunner/keys.json"
#: What one `log_batch` takes at most: metrics, and params (MLflow's limits).
_METRICS_PER_BATCH, _PARAMS_PER_BATCH = 1000, 100


def to_mlflow(all_jobs: Sequence[Job], out: Path, uri: str | None = None, experiment: str = "gradrunner") -> list[str]:
    """One MLflow run per job (named after it, its overrides as params) in the store at `uri` (default `out`).

    Example::

        ids = to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))   # MLflow run ids, one per job

    Values go in as they are, NaN and Inf included; keys as `metric_keys` and `mlflow_keys` map them (those
    that changed listed in the run's artifact `gradrunner/keys.json`). A run this export
    wrote before for the same job dir (tag `gradrunner.dir_id`), whichever run the dir held then, is deleted once
    the new one is written in full: a re-export replaces it, and one that fails leaves it (the new run deleted). A bad experiment
    name, a store MLflow cannot open or a deleted experiment is a GradrunnerError before anything is written,
    and so is a second export into a local store while one writes there (`jobs.exclusive`), naming it.
    """
    check_experiment(experiment)
    option = "--out" if uri is None else "--uri"
    uri = tracking_uri(out, uri)
    store = local_store(uri)
    if store is not None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store the export promises
    # one export at a time into a local store: two that each find the earlier run before either writes its
    # own would both keep theirs (two runs of one job); a tracking server cannot be locked from here
    with exclusive(store, "MLflow", option) if store is not None else contextlib.nullcontext():
        return _write_all(all_jobs, uri, experiment)


def _write_all(all_jobs: Sequence[Job], uri: str, experiment: str) -> list[str]:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        try:
            client = MlflowClient(tracking_uri=uri)
        except MlflowException as e:
            raise GradrunnerError(f"--uri {uri!r} is not a store MLflow can open ({one_paragraph(e)}); pass a local path "
                                  "or file: URI (a file store), or a tracking server's http(s):// URI.") from None  # fmt: skip
        exp_id = _experiment(client, experiment, uri)
        return [_write_run(client, exp_id, job) for job in all_jobs]
    except (MlflowException, OSError) as e:
        raise GradrunnerError(f"the MLflow export to {uri} failed: {one_paragraph(e)}") from e


def check_experiment(name: str) -> None:
    """Refuse an experiment name MLflow does not take (empty, over 500 characters), before anything is written.

    Example::

        check_experiment("")     # GradrunnerError: --project '' is not an MLflow experiment name; ...
    """
    if not name.strip() or len(name) > 500:
        raise GradrunnerError(f"--project {name!r} is not an MLflow experiment name; allowed: 1 to 500 characters, "
                              "not only spaces (e.g. --project gradrunner, the default).")  # fmt: skip


def tracking_uri(out: Path, uri: str | None) -> str:
    """The store's URI: `uri`, a local path as its `file:` URI; else `out`'s.

    Example::

        tracking_uri(Path("runs/mlruns"), None)     # 'file:///home/me/runs/mlruns'
    """
    if uri is None or not urlparse(uri).scheme:
        return Path(out if uri is None else uri).resolve().as_uri()
    return uri


def local_store(uri: str) -> Path | None:
    """The dir of a `file:` store (a local file store), else None.

    Example::

        local_store("file:///runs/mlruns")     # Path('/runs/mlruns')
    """
    parsed = urlparse(uri)
    return Path(url2pathname(parsed.path)) if parsed.scheme == "file" else None


def _experiment(client: Any, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        return str(client.create_experiment(name))
    if found.lifecycle_stage != "active":
        raise GradrunnerError(
            f"--project {name!r}: the MLflow experiment of that name in {uri} is deleted (id {found.experiment_id}); "
            f"restore it (MlflowClient({uri!r}).restore_experiment({found.experiment_id!r}), or `mlflow experiments "
            f"restore --experiment-id {found.experiment_id}` with MLFLOW_TRACKING_URI={shlex.quote(uri)}) or pass "
            "another --project."
        )
    return str(found.experiment_id)


def _write_run(client: Any, exp_id: str, job: Job) -> str:
    """Write `job` as a new run, in full; then delete the runs an earlier export wrote for it. On an error the new
    run is deleted and the earlier ones are left."""
    from mlflow.entities import Metric, Param

    directory = source_of(job)
    source = f"{directory}#{job.run_id}"
    earlier = _exported_before(client, exp_id, directory, source)
    tags = {SOURCE_TAG: source, SOURCE_ID_TAG: source_id(source), DIR_ID_TAG: source_id(directory)}
    run = client.create_run(exp_id, run_name=job.name, tags=tags)
    rid = run.info.run_id
    try:
        param_keys, scalar_keys = mlflow_keys(job.params), metric_keys(t for t, _, _ in job.scalars)
        params = [Param(param_keys[k], v[:6000]) for k, v in job.params.items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            client.log_batch(rid, params=params[i : i + _PARAMS_PER_BATCH])
        now = int(time.time() * 1000)
        metrics = [Metric(scalar_keys[t], v, now, s) for t, s, v in job.scalars]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            client.log_batch(rid, metrics=metrics[i : i + _METRICS_PER_BATCH])
        for tag, step, limits, counts in job.histograms:
            client.log_dict(rid, {"bucket_limit": limits, "bucket": counts}, f"histograms/{tag}/{step}.json")
        changed = {space: {k: v for k, v in keys.items() if k != v}
                   for space, keys in (("metrics", scalar_keys), ("params", param_keys))}  # fmt: skip
        if any(changed.values()):
            client.log_dict(rid, changed, KEYS_ARTIFACT)
        client.set_terminated(rid)
    except BaseException:
        _discard(client, rid)
        raise
    for old in earlier:
        client.delete_run(old)
    return str(rid)


def _discard(client: Any, rid: str) -> None:
    """Mark a run that failed partway FAILED and delete it (best effort: the error that ended it is the one to say)."""
    for step in (lambda: client.set_terminated(rid, "FAILED"), lambda: client.delete_run(rid)):
        with contextlib.suppress(Exception):  # the store may be what failed
            step()


def source_id(source: str) -> str:
    """The `gradrunner.source_id` tag of a job's export: a hex digest of its source (job dir and run id).

    Example::

        source_id("/runs/it's#3f2a")     # '9c1e...' (32 hex digits)
    """
    return hashlib.sha256(source.encode()).hexdigest()[:32]


def _exported_before(client: Any, exp_id: str, directory: str, source: str) -> list[str]:
    """The active runs an earlier export wrote for the job dir `directory` (`source`: it and its run id), whichever
    run the dir held then: tagged with the dir's id; an older gradrunner's, tagged with the source's id, or with a
    source naming the dir, where the dir is a plain word in MLflow's filter syntax (no quote, no backslash)."""
    filters = [f"tags.`{DIR_ID_TAG}` = '{source_id(directory)}'", f"tags.`{SOURCE_ID_TAG}` = '{source_id(source)}'"]
    if "'" not in directory and "\\" not in directory:  # LIKE's wildcards (% and _) may match more: checked below
        filters.append(f"tags.`{SOURCE_TAG}` LIKE '{directory}#%'")
    found: dict[str, None] = {}
    for f in filters:
        found.update(dict.fromkeys(r.info.run_id for r in client.search_runs([exp_id], filter_string=f)
                                   if r.data.tags.get(SOURCE_TAG, "").rpartition("#")[0] == directory))  # fmt: skip
    return list(found)


def metric_keys(tags: Iterable[str]) -> dict[str, str]:
    """Each tag's MLflow metric key (`mlflow_keys` of its `grads/<tap>` part, its statistic kept as the last part).

    Example::

        metric_keys(["grads/a:output@1/norm", "grads/a:output_1/norm"])
        # {'grads/a:output@1/norm': 'grads/a:output_1.2/norm', 'grads/a:output_1/norm': 'grads/a:output_1/norm'}

    A tap's statistics stay side by side, and every key fits `MAX_KEY`.
    """
    parts = {t: t.rpartition("/") for t in tags}
    assert all(head and _cleaned(stat) == stat for head, _, stat in parts.values()), "tags are <prefix>/<statistic>"
    room = MAX_KEY - 1 - max((len(stat) for _, _, stat in parts.values()), default=0)
    heads = mlflow_keys({head for head, _, _ in parts.values()}, room)
    return {t: f"{heads[head]}/{stat}" for t, (head, _, stat) in parts.items()}


def mlflow_keys(names: Iterable[str], longest: int = MAX_KEY) -> dict[str, str]:
    """Each name's MLflow key: one key per name, the same for the same names, at most `longest` characters.

    Example::

        mlflow_keys(["a@b", "a_b"])      # {'a_b': 'a_b', 'a@b': 'a_b.2'}

    MLflow takes letters, digits and `_-. :/` only, and a key must be a plain path: other characters become
    `_`. A name that needs no change keeps it; the others, in sorted order, take their cleaned key, or, where
    that is taken, the first free of `<key>.2`, `<key>.3`, ...; a key over `longest` characters is cut, with
    8 hex digits of its digest.
    """
    keys: dict[str, str] = {}
    used: set[str] = set()
    for name in sorted(set(names), key=lambda n: (_cleaned(n) != n, n)):
        base = _cleaned(name)
        key, n = _fit(base, longest), 1
        while key in used:
            n += 1
            key = _fit(f"{base}.{n}", longest)
        keys[name] = key
        used.add(key)
    return keys


def _cleaned(name: str) -> str:
    chars = "".join(c if c.isalnum() or c in _KEY_CHARS else "_" for c in name)
    # A key is also a path in a file store: no empty, "." or ".." part, nothing that normalises to another key.
    key = "/".join(p if p not in ("", ".", "..") else p.replace(".", "_") or "_" for p in chars.split("/"))
    key = "_" + key[1:] if key.startswith("..") else key  # MLflow takes no key that starts with ".."
    assert posixpath.normpath(key) == key, key
    return key


def _fit(key: str, longest: int) -> str:
    if len(key) <= longest:
        return key
    return f"{key[: longest - 9]}.{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def view_command(uri: str) -> str:
    """The command that shows the store at `uri` in MLflow's UI, with what to install first where needed.

    Example::

        view_command("file:///runs/mlruns")
        # 'MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:///runs/mlruns'   (full mlflow installed)
    """
    env = "MLFLOW_ALLOW_FILE_STORE=true " if local_store(uri) is not None else ""
    command = f"{env}mlflow ui --backend-store-uri {shlex.quote(uri)}"
    if _full_mlflow():
        return command
    return f"pip install mlflow (mlflow-skinny, installed here, has no UI), then: {command}"


def _full_mlflow() -> bool:
    try:
        importlib.metadata.distribution("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
