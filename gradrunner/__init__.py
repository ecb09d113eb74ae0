"""gradrunner: see the gradients inside a PyTorch model.

| module | what it holds |
| --- | --- |
| `taps` | tap specs (`"<module>:<name>"`) resolved against a model |
| `forward_locals` | local variables of a `forward()`, tapped without editing the model |
| `strategies` | `retain_grad`, `hook`, `autograd_grad`: one file each, one registry |
| `capturing` | `capture(model, taps, strategy=...)`, the context manager |
| `stats` | statistics on the gradient's device, one host transfer per step |
| `records` | the Parquet records (`grads.parquet`, `steps.parquet`) |
| `runner`, `cli` | the Hydra app: `python -m gradrunner +experiment=mlp` |
| `job`, `rundir`, `callbacks` | a job's books: resume, `done.json`, `failed.json`, the sweep's `manifest.json` |
| `distributed` | DDP inside a job under `torchrun` |
| `analysis` | reading records back into pandas |

Example::

    from gradrunner import capture
    with capture(model, ["fc1:output"], strategy="hook") as cap:
        cap.backward(loss_fn(model(x), y))
    cap.grads["fc1:output"]
"""

from gradrunner.capturing.session import Capture, Grads, capture
from gradrunner.errors import GradrunnerError
from gradrunner.capturing.strategies import STRATEGIES

__version__ = "0.1.0"

__all__ = ["Capture", "Grads", "GradrunnerError", "STRATEGIES", "capture", "__version__"]
