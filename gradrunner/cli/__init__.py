"""The Hydra glue: the app, the tap explorer and the callback that keeps a sweep's books.

| module | what it holds |
| --- | --- |
| `app` | the Hydra app of `python -m gradrunner` (`main`), the checks before a run or sweep (`OutputDirCheck`, `SweepCheck`) |
| `explore` | `python -m gradrunner.taps <overrides>`: the taps a config's model offers, with shapes |
| `sweep_books` | `SweepBookkeeping`, the Hydra callback writing `failed.json`, `manifest.json` and the sweep's report |

Example::

    python -m gradrunner +experiment=mlp steps=10
    python -m gradrunner.taps +experiment=mlp
"""
