"""`python -m gradrunner.export tensorboard|wandb|mlflow <run or sweep dir>`: the records where people look.

Each job (a run dir, or every job of a sweep) becomes one run of the target, its overrides as
hyper-parameters; each tap's statistics become scalars over steps (`grads/<tap>/<stat>`, a tap's
later calls `grads/<tap>@<call>/...`, other ranks `rank<N>/grads/...`), `steps.parquet`'s numeric
columns `steps/<column>`, and `hist_counts` (with `capture.histogram=true`) histograms
(`grads/<tap>/hist`, the records' own bins). Reading the records needs no torch; each target needs
its library only (extras `gradrunner[tensorboard]`, `[wandb]`, `[mlflow]`).

| target | written to (default) | read back with |
| --- | --- | --- |
| `tensorboard` | `<dir>/tensorboard/<job>/events.out.tfevents.*` | TensorBoard, `EventAccumulator` |
| `wandb` | `<dir>/wandb/` in offline mode (`wandb sync` uploads it) | `wandb sync`, the `.wandb` files |
| `mlflow` | the MLflow local file store `<dir>/mlruns` (or `--uri`) | `mlflow ui`, `MlflowClient` |

Example::

    python -m gradrunner.export tensorboard multirun/2024-05-01/12-00-00
    tensorboard --logdir multirun/2024-05-01/12-00-00/tensorboard
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.columns import COUNT_COLUMNS, EXTRA_FLOAT_COLUMNS, HIST_COLUMN, HIST_EDGES_KEY, STAT_COLUMNS

TARGETS = ("tensorboard", "wandb", "mlflow")
#: Per-record columns exported as scalars, in this order.
SCALAR_COLUMNS = (*STAT_COLUMNS, *COUNT_COLUMNS, *EXTRA_FLOAT_COLUMNS)
#: `steps.parquet` columns that are not a scalar over steps.
_STEPS_SKIP = frozenset({"step", "rank", "run_id", "experiment", "strategy", "device", "dtype", "captured"})
#: Exit code of a user mistake (as the CLI's).
USAGE_EXIT = 2


@dataclass
class Job:
    """One job's records, ready for a target: its name, hyper-parameters, scalars and histograms."""

    name: str
    directory: Path
    params: dict[str, str]
    #: (tag, step, value), in step order.
    scalars: list[tuple[str, int, float]] = field(default_factory=list)
    #: (tag, step, bin right edges, counts), bins as the records count them (non-finite left out).
    histograms: list[tuple[str, int, list[float], list[int]]] = field(default_factory=list)


def jobs(path: str | os.PathLike[str]) -> list[Job]:
    """The jobs below `path` (a run dir or a sweep dir), each with what a target writes.

    Example::

        [j.name for j in jobs("multirun/2024-05-01/12-00-00")]     # ['0', '1', '2']
    """
    root = Path(path)
    if not root.is_dir():
        raise GradrunnerError(f"{root} is not a directory; pass a run dir (holding grads.parquet) or a sweep dir.")
    dirs = [root] if (root / "grads.parquet").is_file() else [d for d in rundir.job_dirs_below(root) if (d / "grads.parquet").is_file()]
    if not dirs:
        raise GradrunnerError(
            f"no grads.parquet found in {root} or its job dirs; pass a run dir (holding grads.parquet) or a sweep dir "
            "(holding job dirs 0/, 1/, ...). A job that is still running has not closed its records yet."
        )
    return [_job(root, d) for d in dirs]


def _job(root: Path, d: Path) -> Job:
    name = "run" if d == root else d.relative_to(root).as_posix()
    job = Job(name, d, _params(d))
    grads = pq.read_table(d / "grads.parquet", columns=[c for c in pq.read_schema(d / "grads.parquet").names
                                                        if c != "values"]).to_pandas()  # fmt: skip
    for row in grads.itertuples(index=False):
        prefix = _prefix(str(row.tap), int(row.call), int(row.rank))
        for c in SCALAR_COLUMNS:
            v = getattr(row, c, None)
            if v is not None and not pd.isna(v):
                job.scalars.append((f"{prefix}/{c}", int(row.step), float(v)))
    if HIST_COLUMN in grads.columns:
        edges = json.loads(pq.read_schema(d / "grads.parquet").metadata[HIST_EDGES_KEY.encode()])
        limits = [0.0, *edges, sys.float_info.max]  # exact zeros, (0, e0), ..., [e_last, inf)
        for row in grads.itertuples(index=False):
            counts = getattr(row, HIST_COLUMN)
            if counts is not None and len(counts):
                job.histograms.append((f"{_prefix(str(row.tap), int(row.call), int(row.rank))}/hist", int(row.step),
                                       limits, [int(c) for c in counts[: len(limits)]]))  # fmt: skip
    if (d / "steps.parquet").is_file():
        steps = pq.read_table(d / "steps.parquet").to_pandas()
        for col in steps.columns:
            if col in _STEPS_SKIP or not pd.api.types.is_numeric_dtype(steps[col]) or pd.api.types.is_bool_dtype(steps[col]):
                continue
            for step, rank, v in zip(steps.step, steps["rank"], steps[col], strict=True):
                if not pd.isna(v):
                    job.scalars.append((f"{'' if rank == 0 else f'rank{rank}/'}steps/{col}", int(step), float(v)))
    job.scalars.sort(key=lambda s: s[1])
    return job


def _prefix(tap: str, call: int, rank: int) -> str:
    return f"{'' if rank == 0 else f'rank{rank}/'}grads/{tap}{'' if call == 0 else f'@{call}'}"


def _params(d: Path) -> dict[str, str]:
    """The job's overrides (Hydra's, or `done.json`'s), else the capture settings `record` wrote."""
    marker = rundir.read_json(d / rundir.DONE) or {}
    overrides = marker.get("overrides") or []
    f = d / ".hydra" / "overrides.yaml"
    if not overrides and f.is_file():
        import yaml

        overrides = yaml.safe_load(f.read_text()) or []
    params = {}
    for o in overrides:
        key, _, value = str(o).partition("=")
        params[key.lstrip("+~")] = value
    if not params and isinstance(marker.get("config"), dict):
        cfg = marker["config"]
        params = {f"capture.{k}": str(v) for k, v in (cfg.get("capture") or {}).items()}
        params["experiment"] = str(cfg.get("experiment", ""))
    return params


# -- targets ---------------------------------------------------------------------------------------
def to_tensorboard(all_jobs: Sequence[Job], out: Path) -> list[Path]:
    """One event file per job under `out/<job>`; scalars, histograms and the hparams plugin's records."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    written = []
    for job in all_jobs:
        writer = EventFileWriter(str(out / job.name))
        now = time.time()
        for s in _hparams_summaries(job.params):
            writer.add_event(Event(wall_time=now, step=0, summary=s))
        for tag, step, value in job.scalars:
            writer.add_event(Event(wall_time=now, step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
        for tag, step, limits, counts in job.histograms:
            nz = [(lim, c) for lim, c in zip(limits, counts, strict=True) if c]
            histo = HistogramProto(min=0.0, max=max((lim for lim, _ in nz), default=0.0), num=float(sum(counts)),
                                   bucket_limit=limits, bucket=[float(c) for c in counts])  # fmt: skip
            writer.add_event(Event(wall_time=now, step=step, summary=Summary(value=[Summary.Value(tag=tag, histo=histo)])))
        writer.close()
        written.append(Path(writer.get_logdir()))
    return written


def _hparams_summaries(params: dict[str, str]) -> Iterator[Any]:
    """The hparams plugin's experiment and session-start records (what `SummaryWriter.add_hparams` writes)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    for k, v in params.items():
        start.hparams[k].string_value = v
    experiment = api_pb2.Experiment(hparam_infos=[api_pb2.HParamInfo(name=k, type=api_pb2.DATA_TYPE_STRING) for k in params])
    for tag, content in (("_hparams_/experiment", plugin_data_pb2.HParamsPluginData(experiment=experiment, version=0)),
                         ("_hparams_/session_start_info", plugin_data_pb2.HParamsPluginData(session_start_info=start, version=0))):  # fmt: skip
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString()))
        yield Summary(value=[Summary.Value(tag=tag, metadata=meta)])


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


def to_wandb(all_jobs: Sequence[Job], out: Path, project: str = "gradrunner") -> list[Path]:
    """One offline W&B run per job under `out/wandb` (upload later with `wandb sync`)."""
    import wandb

    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for job in all_jobs:
        run = wandb.init(project=project, name=job.name, config=job.params, dir=str(out), mode="offline", reinit="create_new")
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
        dirs.append(Path(run.dir).parent)
    return dirs


class LiveTensorBoard:
    """Live logging from `record(..., log_to="tensorboard")`: each captured step's statistics as it is written.

    Example::

        live = LiveTensorBoard(run_dir / "tensorboard")
        live.write(step, records)      # the host-side StepRecords the writer just took: no device sync
        live.close()

    Tags are the export's (`grads/<tap>/<stat>`, `steps/loss`), so a live log and a later export agree.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(logdir))

    def write(self, step: int, recs: Any, loss: float | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for i, key in enumerate(recs.keys):
            prefix = _prefix(key.tap, key.call, 0)
            for c in STAT_COLUMNS:
                if recs.has_grad[i]:
                    values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(recs.stats[c][i])))
            for c in COUNT_COLUMNS:
                values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(recs.counts[c][i])))
            for c in EXTRA_FLOAT_COLUMNS:
                col = getattr(recs, c)
                if col is not None and math.isfinite(float(col[i])):
                    values.append(Summary.Value(tag=f"{prefix}/{c}", simple_value=float(col[i])))
        if loss is not None and math.isfinite(loss):
            values.append(Summary.Value(tag="steps/loss", simple_value=float(loss)))
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self) -> None:
        self.writer.close()


# -- command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gradrunner.export <target> <dir> [--out DIR] [--uri URI]`; exit 2 on a user mistake."""
    parser = argparse.ArgumentParser(prog="python -m gradrunner.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help=f"one of {', '.join(TARGETS)}")
    parser.add_argument("dir", help="a run dir or a sweep dir")
    parser.add_argument("--out", help="where to write (default: <dir>/<target>, for mlflow <dir>/mlruns)")
    parser.add_argument("--uri", help="mlflow: a tracking URI instead of the local file store")
    parser.add_argument("--project", default="gradrunner", help="wandb project / mlflow experiment name")
    args = parser.parse_args(argv)
    try:
        if args.target not in TARGETS:
            raise GradrunnerError(f"target {args.target!r} is not an export target; allowed: {', '.join(TARGETS)} "
                                  "(e.g. python -m gradrunner.export tensorboard runs/mine).")  # fmt: skip
        found = jobs(args.dir)
        _check_library(args.target)
        out = Path(args.out) if args.out else Path(args.dir) / ("mlruns" if args.target == "mlflow" else args.target)
        if args.target == "tensorboard":
            where = to_tensorboard(found, out)
            print(f"wrote {len(where)} run(s) to {out}; view with: tensorboard --logdir {out}")
        elif args.target == "mlflow":
            to_mlflow(found, out, args.uri, args.project)
            print(f"wrote {len(found)} run(s) to {args.uri or out}; view with: mlflow ui --backend-store-uri {args.uri or out}")
        else:
            to_wandb(found, out, args.project)
            print(f"wrote {len(found)} offline run(s) to {out / 'wandb'}; upload with: wandb sync {out / 'wandb'}/offline-run-*")
    except GradrunnerError as e:
        print(f"gradrunner.export: {one_paragraph(e)}", file=sys.stderr)
        return USAGE_EXIT
    return 0


_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _check_library(target: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_EXTRAS[target]) is None:
        raise GradrunnerError(f"exporting to {target} needs the {_EXTRAS[target]} package, which is not installed; "
                              f"pip install 'gradrunner[{target}]' and run the export again.")  # fmt: skip


