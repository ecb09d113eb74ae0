"""The command line of `python -m gradrunner.export <target> <dir>`: the records where people look.

Example::

    python -m gradrunner.export tensorboard multirun/2024-05-01/12-00-00
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.export.jobs import Job, jobs
from gradrunner.export.mlflow import to_mlflow, tracking_uri, view_command
from gradrunner.export.tensorboard import to_tensorboard
from gradrunner.export.wandb import to_wandb

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
    parser.add_argument("--out", help="where to write (default: <dir>/<target>, for mlflow <dir>/mlruns)")
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
        for note in notes:
            print(f"gradrunner.export: warning: {note}", file=sys.stderr)
        print(_write(args, found))
    except GradrunnerError as e:
        print(f"gradrunner.export: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _write(args: argparse.Namespace, found: list[Job]) -> str:
    """Write `found` to the target; the line saying where, and how to look at it."""
    out = Path(args.out) if args.out else Path(args.dir) / ("mlruns" if args.target == "mlflow" else args.target)
    if args.target == "tensorboard":
        where = to_tensorboard(found, out)
        names = ", ".join(p.relative_to(out).as_posix() for p in where)
        return f"wrote {len(where)} run(s) to {out} ({names}); view with: tensorboard --logdir {shlex.quote(str(out))}"
    if args.target == "mlflow":
        to_mlflow(found, out, args.uri, args.project)
        uri = tracking_uri(out, args.uri)
        return f"wrote {len(found)} run(s) to {uri}; view with: {view_command(uri)}"
    to_wandb(found, out, args.project)
    return f"wrote {len(found)} offline run(s) to {out / 'wandb'}; upload with: wandb sync {out / 'wandb'}/offline-run-*"


_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _check_library(target: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_EXTRAS[target]) is None:
        raise GradrunnerError(f"exporting to {target} needs the {_EXTRAS[target]} package, which is not installed; "
                              f"pip install 'gradrunner[{target}]' and run the export again.")  # fmt: skip
