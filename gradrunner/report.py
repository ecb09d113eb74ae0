"""`python -m gradrunner.report <run or sweep dir>`: the report lives in `gradrunner.analysis.report`.

Example::

    python -m gradrunner.report multirun/2026-11-23/10-00-00
"""

from gradrunner.analysis.report import main, write_report

__all__ = ["main", "write_report"]

if __name__ == "__main__":
    raise SystemExit(main())
