"""The export: `python -m gradrunner.export tensorboard|wandb|mlflow <run or sweep dir>`: the records where people look.

Each job (a run dir, or every job of a sweep) becomes one run of the target, its overrides as
hyper-parameters; each tap's statistics become scalars over steps, one value per step (`grads/<tap>/<stat>`,
a tap's later calls `grads/<tap>@<call>/...`, other ranks `rank<N>/grads/...`; under gradient
accumulation the micro-batches combined, `analysis.micro`), NaN and Inf as they are;
`steps.parquet`'s numeric columns `steps/<column>`, and `hist_counts` (with `capture.histogram=true`)
histograms (`grads/<tap>/hist`, the records' own bins). The records are read through
`gradrunner.analysis.load`: a damaged, foreign or partial job is refused by name (exit 2, nothing
written), or left out with a warning (`--on-damaged skip`). Exporting again replaces what the last
export of a job wrote; one export at a time writes a target dir or local MLflow store (a second is refused, naming the first). Reading the records needs no torch; each target needs its library only
(extras `gradrunner[tensorboard]`, `[wandb]`, `[mlflow]`).

| target | written to (default) | read back with |
| --- | --- | --- |
| `tensorboard` | `<dir>/tensorboard/<job>/events.out.tfevents.*` (`<job>-<8 hex>` where another run's export holds `<job>`) | TensorBoard, `EventAccumulator` |
| `wandb` | `<dir>/wandb/offline-run-*` (`--out` X: `X/wandb/`; `wandb sync` uploads them) | `wandb sync`, the `.wandb` files |
| `mlflow` | the MLflow local file store `<dir>/mlruns` (or `--uri`) | `MLFLOW_ALLOW_FILE_STORE=true mlflow ui` (full `mlflow`), `MlflowClient` |

Example::

    python -m gradrunner.export tensorboard multirun/2024-05-01/12-00-00
    tensorboard --logdir multirun/2024-05-01/12-00-00/tensorboard

| module | what it holds |
| --- | --- |
| `jobs` | `jobs(dir)`: each job's name, hyper-parameters, scalars and histograms read from its records |
| `tensorboard`, `mlflow`, `wandb` | `to_tensorboard` (and `LiveTensorBoard` for `record(log_to=...)`), `to_mlflow` (and `view_command`), `to_wandb` |
| `command` | `main`: the command line (`python -m gradrunner.export`, in `__main__`) |
"""

from gradrunner.export.command import TARGETS, main
from gradrunner.export.jobs import Job, jobs
from gradrunner.export.mlflow import to_mlflow
from gradrunner.export.tensorboard import LiveTensorBoard, to_tensorboard
from gradrunner.export.wandb import to_wandb

__all__ = ["TARGETS", "Job", "LiveTensorBoard", "jobs", "main", "to_mlflow", "to_tensorboard", "to_wandb"]
