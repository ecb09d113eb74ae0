"""`python -m gradrunner.compare RUN_A RUN_B [--rtol R] [--atol A]`: do two runs' records agree?

Exit 0 when they agree, 1 when not (the first difference and the worst taps printed), 2 on bad input
(one paragraph). The work is `gradrunner.analysis.compare` (no torch).

Example::

    python -m gradrunner.compare outputs/fsdp2 outputs/ddp --rtol 1e-5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gradrunner.analysis.compare import ATOL, RTOL, Comparison, compare_runs
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph

__all__ = ["Comparison", "compare_runs", "main"]

#: Exit status when the runs differ (0: they agree; `EXIT_USER_ERROR`: bad input).
EXIT_DIFFER = 1


def main(argv: Sequence[str] | None = None) -> int:
    """The command: compare RUN_A (the reference) with RUN_B, print the verdict, return the exit status.

    Example::

        main(["runs/a", "runs/b", "--rtol", "1e-4"])     # 0, 1 or 2
    """
    parser = argparse.ArgumentParser(
        prog="python -m gradrunner.compare",
        description="Compare two runs' gradient records (same taps): exit 0 when they agree, 1 when not, 2 on bad "
        "input. A value b agrees with run A's a when |a - b| <= atol + rtol * |a| (both finite), or both are NaN, or "
        "both are the same infinity.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="the reference run dir (holding grads.parquet, steps.parquet)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run dir compared with it")
    parser.add_argument("--rtol", default=str(RTOL), help=f"relative tolerance (default {RTOL:g})")
    parser.add_argument("--atol", default=str(ATOL), help=f"absolute tolerance (default {ATOL:g})")
    args = parser.parse_args(argv)
    try:
        result = compare_runs(args.run_a, args.run_b, rtol=args.rtol, atol=args.atol)
    except GradrunnerError as e:
        print(f"gradrunner.compare: error: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        print(result.summary(), flush=True)
    except BrokenPipeError:  # `| head -1`: the reader has what it wanted; the exit status is still the verdict
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if result.agree else EXIT_DIFFER


if __name__ == "__main__":
    sys.exit(main())
