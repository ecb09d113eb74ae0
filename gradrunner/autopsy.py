"""`python -m gradrunner.autopsy RUN_DIR [--step S] [--horizon H]`: branch from before a loss spike to find what saves it.

The command's shim; the work is `gradrunner.run.autopsy` (docs/autopsy.md).

Example::

    python -m gradrunner.autopsy outputs/2026-11-26/10-00-00-000000 --horizon 10
"""

from __future__ import annotations

import sys

from gradrunner.run.autopsy import autopsy, main

__all__ = ["autopsy", "main"]

if __name__ == "__main__":
    sys.exit(main())
