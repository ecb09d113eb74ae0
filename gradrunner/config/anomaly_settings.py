"""The spike detector's settings (`anomaly.z`, `anomaly.window`, `anomaly.warmup`): THE rule for allowed values.

Checked by the config (`config.schema.validate`), by `record(..., anomaly=...)` and by the detector itself
(`analysis.anomalies.Detector`), all through `check_settings`; torch-, Hydra- and OmegaConf-free.

Example::

    check_settings(6.0, 128, 20)       # fine
    check_settings(6.0, 10, 20)        # GradrunnerError: anomaly.warmup=20 is not allowed with anomaly.window=10 ...
"""

from __future__ import annotations

import math

from gradrunner.errors import GradrunnerError

#: The defaults: 6 standard deviations of the last 128 values, after 20 values (OLMo-core's rule).
Z, WINDOW, WARMUP = 6.0, 128, 20


def check_settings(z: object, window: object, warmup: object) -> None:
    """Raise one paragraph (`GradrunnerError`) naming a setting the rule cannot use and what is allowed.

    Example::

        check_settings(0, 128, 20)         # GradrunnerError: anomaly.z=0 is not allowed; it must be a number > 0 ...
    """
    if isinstance(z, bool) or not (isinstance(z, int | float) and math.isfinite(z) and z > 0):
        raise GradrunnerError(f"anomaly.z={z!r} is not allowed; it must be a number > 0 (standard deviations), "
                              "e.g. anomaly.z=6")  # fmt: skip
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise GradrunnerError(f"anomaly.window={window!r} is not allowed; it must be an integer >= 2 (values per "
                              "signal), e.g. anomaly.window=128")  # fmt: skip
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2 or warmup > window:
        raise GradrunnerError(
            f"anomaly.warmup={warmup!r} is not allowed with anomaly.window={window}: it must be an integer from 2 to "
            f"the window (a window shorter than the warm-up never fills before the rule starts), e.g. "
            f"anomaly.warmup={min(20, window) if isinstance(window, int) else 20}"
        )
