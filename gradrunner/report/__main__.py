"""`python -m gradrunner.report <run or sweep dir>`: the command line of `gradrunner.report.write`.

Example::

    python -m gradrunner.report multirun/2026-11-23/10-00-00
"""

from gradrunner.report.write import main

if __name__ == "__main__":
    raise SystemExit(main())
