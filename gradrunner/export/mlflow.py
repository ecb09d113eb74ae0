"""The MLflow target: one MLflow run per job in a tracking store (default: a local file store).

Needs the `mlflow` package only (`gradrunner[mlflow]` installs `mlflow-skinny`), imported when
`to_mlflow` runs. Viewing the store needs the full `mlflow` package, whose UI serves a file store only
with `MLFLOW_ALLOW_FILE_STORE=true`: `view_command` says what to run (and what to install first).

Example::

    to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))
    print(view_command(Path("runs/lightning/mlruns").resolve().as_uri()))
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from collections.abc import Sequence
from pathlib import Path

from gradrunner.export.jobs import Job

#: The tag that marks an exported run with its job's dir and run id: a re-export replaces that run.
SOURCE_TAG = "gradrunner.source"


def to_mlflow(all_jobs: Sequence[Job], out: Path, uri: str | None = None, experiment: str = "gradrunner") -> list[str]:
    """One MLflow run per job (named after it, its overrides as params) in the store at `uri` (default `out`).

    Example::

        ids = to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))   # MLflow run ids, one per job

    Values go in as they are, NaN and Inf included. A run this export wrote before for the same job
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
        params = [Param(_mlflow_key(k), v[:6000]) for k, v in job.params.items()]
        metrics = [Metric(_mlflow_key(t), v, now, s) for t, s, v in job.scalars]
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run.info.run_id, metrics=metrics[i : i + 1000], params=params if i == 0 else [])
        for tag, step, limits, counts in job.histograms:
            client.log_dict(run.info.run_id, {"bucket_limit": limits, "bucket": counts}, f"histograms/{tag}/{step}.json")
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


def _mlflow_key(tag: str) -> str:
    # MLflow keys take alphanumerics, _ - . space : / only; tap names may hold others ("*", "[", "@").
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in tag)
