"""The MLflow target: one MLflow run per job in a tracking store (default: a local file store).

Needs the `mlflow` package only (`gradrunner[mlflow]` installs `mlflow-skinny`), imported when
`to_mlflow` runs. Viewing the store needs the full `mlflow` package, whose UI serves a file store only
with `MLFLOW_ALLOW_FILE_STORE=true`: `view_command` says what to run (and what to install first).

Example::

    to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))
    print(view_command(Path("runs/lightning/mlruns").resolve().as_uri()))
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import posixpath
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from gradrunner.export.jobs import Job

#: The tag that marks an exported run with its job's dir and run id: a re-export replaces that run.
SOURCE_TAG = "gradrunner.source"
#: MLflow's longest metric and param key (`mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH`).
MAX_KEY = 250
#: The characters an MLflow key takes besides letters and digits.
_KEY_CHARS = "_-. :/"
#: The artifact that maps each tag and hyper-parameter whose key had to change to its MLflow key.
KEYS_ARTIFACT = "gradrunner/keys.json"


def to_mlflow(all_jobs: Sequence[Job], out: Path, uri: str | None = None, experiment: str = "gradrunner") -> list[str]:
    """One MLflow run per job (named after it, its overrides as params) in the store at `uri` (default `out`).

    Example::

        ids = to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))   # MLflow run ids, one per job

    Values go in as they are, NaN and Inf included; keys as `metric_keys` and `mlflow_keys` map them (those
    that changed listed in the run's artifact `gradrunner/keys.json`). A run this export wrote before for the same job
    (tag `gradrunner.source`: the job dir and its run id) is deleted first: a re-export replaces it.
    """
    if uri is None:
        uri = out.resolve().as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store the export promises
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    ids = []
    now = int(time.time() * 1000)
    for job in all_jobs:
        source = f"{job.directory.resolve()}#{job.run_id}"
        for old in client.search_runs([exp_id], filter_string=f"tags.`{SOURCE_TAG}` = '{_quoted(source)}'"):
            client.delete_run(old.info.run_id)
        run = client.create_run(exp_id, run_name=job.name, tags={SOURCE_TAG: source})
        param_keys, scalar_keys = mlflow_keys(job.params), metric_keys(t for t, _, _ in job.scalars)
        params = [Param(param_keys[k], v[:6000]) for k, v in job.params.items()]
        metrics = [Metric(scalar_keys[t], v, now, s) for t, s, v in job.scalars]
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run.info.run_id, metrics=metrics[i : i + 1000], params=params if i == 0 else [])
        for tag, step, limits, counts in job.histograms:
            client.log_dict(run.info.run_id, {"bucket_limit": limits, "bucket": counts}, f"histograms/{tag}/{step}.json")
        changed = {space: {k: v for k, v in keys.items() if k != v}
                   for space, keys in (("metrics", scalar_keys), ("params", param_keys))}  # fmt: skip
        if any(changed.values()):
            client.log_dict(run.info.run_id, changed, KEYS_ARTIFACT)
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    return ids


def view_command(uri: str) -> str:
    """The command that shows the store at `uri` in MLflow's UI, with what to install first where needed.

    Example::

        view_command("file:///runs/mlruns")
        # 'MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:///runs/mlruns'   (full mlflow installed)
    """
    env = "MLFLOW_ALLOW_FILE_STORE=true " if uri.startswith("file:") else ""
    command = f"{env}mlflow ui --backend-store-uri {uri}"
    if _full_mlflow():
        return command
    return f"pip install mlflow (mlflow-skinny, installed here, has no UI), then: {command}"


def _full_mlflow() -> bool:
    try:
        importlib.metadata.distribution("mlflow")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


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
