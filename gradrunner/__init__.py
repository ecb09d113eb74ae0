"""gradrunner: see the gradients inside a PyTorch model.

The package follows the data's path; each layer imports only the ones below it (import-linter
checks it, see pyproject.toml):

| where | what it holds |
| --- | --- |
| `errors` | the one user-error type and its exit status |
| `config/` | the config schema and validation, the allowed values, edits and command-line checks (`conf/`: the YAML) |
| `capturing/` | taps resolved against a model, forward locals, the three strategies, statistics |
| `records/` | record column names, the Parquet writers, a run dir's state |
| `analysis/` | records read back into pandas, summaries, the health of a run (no torch) |
| `report/`, `export/` | `python -m gradrunner.report` (figures, the HTML page), `python -m gradrunner.export` (no torch) |
| `run/` | the job built from the config, the step loop, guards, DDP, a run dir's books, `record(...)` in any loop |
| `integrations/` | the Lightning and HF callbacks over `record` |
| `cli/` | the Hydra app (`python -m gradrunner`), the tap explorer (`python -m gradrunner.taps`), the sweep's books |
| `models/`, `data/`, `losses` | built-in options for the config groups |

Example::

    from gradrunner import capture
    with capture(model, ["fc1:output"], strategy="hook") as cap:
        cap.backward(loss_fn(model(x), y))
    cap.grads["fc1:output"]
    print(gradrunner.list_taps(model, x))   # every module path, its shapes and what it offers to tap

The names below are imported on first use, so `import gradrunner.analysis` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradrunner.errors import GradrunnerError

if TYPE_CHECKING:
    from gradrunner.capturing.explore import list_taps
    from gradrunner.capturing.session import Capture, Grads, capture
    from gradrunner.capturing.strategies import STRATEGIES
    from gradrunner.run.recording import Recorder, record

#: `gradrunner.__version__`: the installed distribution's version (pyproject.toml's, its one home), read on first use.
_UNKNOWN_VERSION = "0+unknown"

#: Lazily imported public names: name -> module holding it.
_LAZY = {
    "Capture": "gradrunner.capturing.session",
    "Grads": "gradrunner.capturing.session",
    "capture": "gradrunner.capturing.session",
    "STRATEGIES": "gradrunner.capturing.strategies",
    "list_taps": "gradrunner.capturing.explore",
    "Recorder": "gradrunner.run.recording",
    "record": "gradrunner.run.recording",
}

__all__ = ["STRATEGIES", "Capture", "GradrunnerError", "Grads", "Recorder", "__version__", "capture", "list_taps", "record"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib import metadata

        try:
            version = metadata.version("gradrunner")
        except metadata.PackageNotFoundError:  # run from a source tree that is not installed
            version = _UNKNOWN_VERSION
        globals()["__version__"] = version
        return version
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'gradrunner' has no attribute {name!r}")
