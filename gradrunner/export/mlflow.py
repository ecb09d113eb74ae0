"""The MLflow target: one MLflow run per job in a tracking store (default: a local file store).

Needs the `mlflow` package only (`gradrunner[mlflow]`), imported when `to_mlflow` runs.

Example::

    to_mlflow(jobs("runs/lightning"), Path("runs/lightning/mlruns"))
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradrunner.export.jobs import Job


def to_mlflow(all_jobs: Sequence[Job], out: Path, uri: str | None = None, experiment: str = "gradrunner") -> list[str]:
    """One MLflow run per job (named after it, its overrides as params) in the store at `uri` (default `out`)."""
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
        run = client.create_run(exp_id, run_name=job.name)
        params = [Param(_mlflow_key(k), v[:6000]) for k, v in job.params.items()]
        metrics = [Metric(_mlflow_key(t), v if math.isfinite(v) else (math.copysign(sys.float_info.max, v) if math.isinf(v) else 0.0), now, s)
                   for t, s, v in job.scalars]  # fmt: skip
        for i in range(0, max(len(metrics), 1), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(run.info.run_id, metrics=metrics[i : i + 1000], params=params if i == 0 else [])
        for tag, step, limits, counts in job.histograms:
            client.log_dict(run.info.run_id, {"bucket_limit": limits, "bucket": counts}, f"histograms/{tag}/{step}.json")
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    return ids


def _mlflow_key(tag: str) -> str:
    # MLflow keys take alphanumerics, _ - . space : / only; tap names may hold others ("*", "[", "@").
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in tag)
