"""The spike detector's vocabulary: the signals' names, their scales, and `Anomaly` (one flagged value).

Contents:
    LOSS, GRAD_NORM, SPIKE_SIGNALS, TAP_STATISTICS   -- the signals' names
    tap_of(signal), space_of(signal)                 -- a signal's tap; THE rule for which signals are judged on a log scale
    Anomaly                                          -- one flagged value (`analysis.anomalies.Detector` makes them)

Split from `analysis.anomalies` so that `analysis.anomaly_summary` needs no detector (no import cycle:
`anomalies` re-exports all of these). Imports no torch.

Example::

    space_of("grad_norm"), tap_of("fc1:output:norm")      # ('log', 'fc1:output')
"""

from __future__ import annotations

from dataclasses import dataclass

#: The run's loss and its total gradient norm (before clipping): the signals a spike is reported on.
LOSS = "loss"
GRAD_NORM = "grad_norm"
SPIKE_SIGNALS = (LOSS, GRAD_NORM)
#: The statistics of a tap that are signals: `<tap>:norm` (captured steps) and `<tap>:update_ratio` (parameters).
TAP_STATISTICS = ("norm", "update_ratio")
#: A window whose std is below this (x |mean| on the linear scale; as is, on the log scale) is taken to have it.
REL_FLOOR = 1e-3
#: The scales a signal is judged on (`space_of`); `anomalies.parquet`'s `space` column says which.
LINEAR, LOG = "linear", "log"


def tap_of(signal: str) -> str | None:
    """The tap of a tap signal, None for `loss` and `grad_norm`.

    Example::

        tap_of("fc1:output:norm"), tap_of(":h:norm"), tap_of("loss")     # ('fc1:output', ':h', None)
    """
    return signal.rsplit(":", 1)[0] if signal.count(":") >= 2 else None


def space_of(signal: str) -> str:
    """`log` for the scale signals (`grad_norm`, a tap's norm or update ratio: never negative), else `linear`.

    Example::

        space_of("loss"), space_of("grad_norm"), space_of("fc1:output:norm")     # ('linear', 'log', 'log')

    A norm moves by factors: while a model leaves a plateau its gradient norm may jump 3-10x from one
    step to the next and back, which on the linear scale is tens of sigma of a quiet window (the cnn
    experiment flags 2-15 such jumps per run); on the log scale those are a few sigma, while a
    corrupted batch (x1e3) or a NaN is still far beyond. The loss stays linear: it may be negative (a
    log-likelihood), and a loss spike of x2 over a converged loss is what the rule must catch.
    """
    return LOG if signal == GRAD_NORM or tap_of(signal) is not None else LINEAR


@dataclass(frozen=True, slots=True)
class Anomaly:
    """One flagged value: `z = (x - mean) / std` against the last accepted values of its signal.

    `x` is the value on its signal's scale (`space`: the value itself, or its natural log); `mean` and
    `std` are the window's on that scale (std floored, see `Detector`), NaN when the window was empty;
    `z` is +inf for a NaN or infinite value (always flagged). `streak`: its place in the run of
    consecutive flagged values of its signal (1, 2, ...); `through`: set on the last value written of a
    run that reached `warmup` values, the run's last flagged step (see `Detector`).
    """

    step: int
    signal: str
    value: float
    mean: float
    std: float
    z: float
    space: str = LINEAR
    streak: int = 1
    through: int | None = None

    @property
    def tap(self) -> str | None:
        """The tap of a tap signal (`fc1:output` of `fc1:output:norm`); None for loss and grad_norm."""
        return tap_of(self.signal)
