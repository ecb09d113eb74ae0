"""The command line of `python -m gradrunner.export <target> <dir>`: the records where people look.

Example::

    python -m gradrunner.export tensorboard multirun/2024-05-01/12-00-00
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.export.jobs import Job, jobs
from gradrunner.export.mlflow import check_experiment, local_store, to_mlflow, tracking_uri, view_command
from gradrunner.export.tensorboard import to_tensorboard
from gradrunner.export.wandb import check_project, to_wandb

TARGETS = ("tensorboard", "wandb", "mlflow")
_DESCRIPTION = "`python -m gradrunner.export tensorboard|wandb|mlflow <run or sweep dir>`: the records where people look."


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gradrunner.export <target> <dir> [--out DIR] [--uri URI] [--on-damaged raise|skip]`.

    Example::

        main(["tensorboard", "runs/mine"])      # 0; 2 on a user mistake or records that do not verify

    Exit 0 when every job it read was exported (a warning on stderr for each left out); 2 when it
    refuses (a bad value, no records, records that do not verify under `--on-damaged raise`).
    """
    parser = argparse.ArgumentParser(prog="python -m gradrunner.export", description=_DESCRIPTION)
    parser.add_argument("target", help=f"one of {', '.join(TARGETS)}")
    parser.add_argument("dir", help="a run dir or a sweep dir")
    parser.add_argument("--out", help="where to write (default: <dir>/tensorboard; mlflow: <dir>/mlruns; wandb: <dir>, "
                                       "its offline runs in <out>/wandb)")  # fmt: skip
    parser.add_argument("--uri", help="mlflow: a tracking URI instead of the local file store")
    parser.add_argument("--project", default="gradrunner", help="wandb project / mlflow experiment name")
    parser.add_argument("--on-damaged", default="raise", dest="on_damaged",
                        help="records that do not verify (damaged, foreign, partial): raise (refuse, the default) "
                             "or skip (export the rest, a warning naming each)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.target not in TARGETS:
            raise GradrunnerError(f"target {args.target!r} is not an export target; allowed: {', '.join(TARGETS)} "
                                  "(e.g. python -m gradrunner.export tensorboard runs/mine).")  # fmt: skip
        notes: list[str] = []
        found = jobs(args.dir, on_damaged=args.on_damaged, notes=notes)
        _check_library(args.target)
        out = Path(args.out) if args.out else Path(args.dir) / _DEFAULT_OUT[args.target]
        _check_target(args, out)  # before anything is written
        for note in notes:
            print(f"gradrunner.export: warning: {note}", file=sys.stderr)
        print(_write(args, out, found))
    except GradrunnerError as e:
        print(f"gradrunner.export: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


#: Where each target writes below the dir it exports, without --out (W&B puts its runs in `<out>/wandb`).
_DEFAULT_OUT = {"tensorboard": "tensorboard", "mlflow": "mlruns", "wandb": "."}


def _check_target(args: argparse.Namespace, out: Path) -> None:
    """Refuse what the target cannot write to (a bad --out, --project or --uri), before anything is written."""
    if args.target == "mlflow":
        check_experiment(args.project)
        store = local_store(tracking_uri(out, args.uri))
        if store is not None:
            _check_dir(store, "--uri" if args.uri else "--out")
        return
    if args.target == "wandb":
        check_project(args.project)
    _check_dir(out, "--out")


def _check_dir(path: Path, option: str) -> None:
    """Refuse a dir that cannot be written in: it, or its nearest parent that exists, is not a writable directory."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    why = "is not a directory" if not existing.is_dir() else "is not writable" if not os.access(existing, os.W_OK | os.X_OK) else ""
    if why:
        raise GradrunnerError(f"{option} {str(path)!r}: {existing} {why}; allowed: a directory that can be written, "
                              "or a path below one (it is created).")  # fmt: skip


def _write(args: argparse.Namespace, out: Path, found: list[Job]) -> str:
    """Write `found` to the target; the line saying where, and how to look at it."""
    try:
        if args.target == "tensorboard":
            where = to_tensorboard(found, out)
            names = ", ".join(p.relative_to(out).as_posix() for p in where)
            return f"wrote {len(where)} run(s) to {out} ({names}); view with: tensorboard --logdir {shlex.quote(str(out))}"
        if args.target == "mlflow":
            to_mlflow(found, out, args.uri, args.project)
            uri = tracking_uri(out, args.uri)
            return f"wrote {len(found)} run(s) to {uri}; view with: {view_command(uri)}"
        to_wandb(found, out, args.project)
    except OSError as e:  # a full disk, a dir that went away: what no check before could see
        raise GradrunnerError(f"writing the {args.target} export to {out} failed: {one_paragraph(e)}") from e
    runs = out / "wandb"
    return f"wrote {len(found)} offline run(s) to {runs}; upload with: wandb sync {shlex.quote(str(runs))}/offline-run-*"


_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _check_library(target: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_EXTRAS[target]) is None:
        raise GradrunnerError(f"exporting to {target} needs the {_EXTRAS[target]} package, which is not installed; "
                              f"pip install 'gradrunner[{target}]' and run the export again.")  # fmt: skip
