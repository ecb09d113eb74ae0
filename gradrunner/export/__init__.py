"""`python -m gradrunner.export tensorboard|wandb|mlflow <run or sweep dir>`: the records where people look."""

from gradrunner.export.jobs import TARGETS, Job, LiveTensorBoard, jobs, main, to_mlflow, to_tensorboard, to_wandb

__all__ = ["TARGETS", "Job", "LiveTensorBoard", "jobs", "main", "to_mlflow", "to_tensorboard", "to_wandb"]
