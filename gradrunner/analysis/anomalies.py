"""Spike detection: a streaming z-score rule over a run's per-step signals, and what it says about a spike.

Contents:
    Detector(z, window, warmup)       -- `observe(step, values)` once per step; the flagged values
    Anomaly                           -- one flagged value: step, signal, value, mean, std, z
    check_settings(z, window, warmup) -- THE rule for allowed settings (one paragraph for a bad one)
    first_mover(anomalies, step, window, order)  -- the tap signal that crossed first before a spike
    anomaly_rows(anomalies, window, order)       -- the rows of `anomalies.parquet` (`records.anomalies`)
    summary_lines(anomalies, window, order)      -- the run's last word about its spikes
    LOSS, GRAD_NORM, TAP_STATISTICS, tap_of(signal)  -- the signals' names

Example::

    det = Detector()                                     # z=6, window=128, warmup=20
    for step, values in enumerate(per_step_values):      # {"loss": 0.7, "grad_norm": 1.2, "fc1:output:norm": ...}
        det.observe(step, values)
    summary_lines(det.anomalies, det.window)             # ['loss spike at step 40 (z = 3e4); first to move: ...']

Signals are the loss, `grad_norm` and `<tap>:<statistic>` (`fc1:output:norm`, `fc1:weight:update_ratio`;
see `gradrunner.analysis.anomaly_signals` for what the loop feeds). Imports no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gradrunner.errors import GradrunnerError

#: The run's loss and its total gradient norm (before clipping): the signals a spike is reported on.
LOSS = "loss"
GRAD_NORM = "grad_norm"
SPIKE_SIGNALS = (LOSS, GRAD_NORM)
#: The statistics of a tap that are signals: `<tap>:norm` (captured steps) and `<tap>:update_ratio` (parameters).
TAP_STATISTICS = ("norm", "update_ratio")
#: A window whose std is below this share of |mean| is taken to have this std (see `Detector`).
REL_FLOOR = 1e-3


def tap_of(signal: str) -> str | None:
    """The tap of a tap signal, None for `loss` and `grad_norm`.

    Example::

        tap_of("fc1:output:norm"), tap_of(":h:norm"), tap_of("loss")     # ('fc1:output', ':h', None)
    """
    return signal.rsplit(":", 1)[0] if signal.count(":") >= 2 else None


def check_settings(z: float, window: int, warmup: int) -> None:
    """Raise one paragraph (`GradrunnerError`) for settings the rule cannot use.

    Example::

        check_settings(6.0, 128, 20)       # fine
        check_settings(6.0, 10, 20)        # GradrunnerError: anomaly.window=10 is shorter than anomaly.warmup=20 ...
    """
    if not (isinstance(z, int | float) and math.isfinite(z) and z > 0):
        raise GradrunnerError(f"anomaly.z={z!r} is not allowed; it must be a number > 0 (standard deviations), "
                              "e.g. anomaly.z=6")  # fmt: skip
    if not isinstance(window, int) or window < 2:
        raise GradrunnerError(f"anomaly.window={window!r} is not allowed; it must be an integer >= 2 (values per "
                              "signal), e.g. anomaly.window=128")  # fmt: skip
    if not isinstance(warmup, int) or warmup < 2 or warmup > window:
        raise GradrunnerError(
            f"anomaly.warmup={warmup!r} is not allowed with anomaly.window={window}: it must be an integer from 2 to "
            f"the window (a window shorter than the warm-up never fills before the rule starts), e.g. anomaly.warmup=20"
        )


@dataclass(frozen=True, slots=True)
class Anomaly:
    """One flagged value: `z = (value - mean) / std`, against the last accepted values of its signal.

    `mean`, `std`: the window's (std floored, see `Detector`); NaN when the window was empty.
    `z` is +inf for a NaN or infinite value (always flagged).
    """

    step: int
    signal: str
    value: float
    mean: float
    std: float
    z: float

    @property
    def tap(self) -> str | None:
        """The tap of a tap signal (`fc1:output` of `fc1:output:norm`); None for loss and grad_norm."""
        return tap_of(self.signal)


class Detector:
    """Flags a value beyond `z` standard deviations above the mean of its signal's last `window` accepted values.

    Example::

        det = Detector(z=6.0, window=128, warmup=20)
        new = det.observe(40, {"loss": 3e4, "grad_norm": 1.0})     # [Anomaly(step=40, signal='loss', ...)]
        det.anomalies                                              # every flagged value so far

    The rule, per signal (a signal absent from a step's `values` is simply not observed):

    - A NaN or infinite value is always flagged (even in warm-up), with z = +inf.
    - Otherwise, once the signal has `warmup` accepted values, a value is flagged when
      `(value - mean) / std > z`, mean and std (population) over its last `window` accepted values.
    - A flagged value is not added to the window, so a spike does not widen the band it is judged by.
      Everything else is accepted (warm-up values too: a huge early value widens the band until it
      leaves the window, `window` values later).
    - One-sided: only upward moves are spikes. A loss, a gradient norm, a tap's norm or update ratio
      that jumps up is a blow-up; one that drops is learning (or vanishing gradients, which the health
      summary reports with its own rule). A signal that decays steadily (a loss going down) sits below
      its window's mean, so its z is negative and never alarms; one that grows steadily has z about
      sqrt(3) (linear growth) or sqrt((a^2 - 1) * window) (growth by a factor `a` per value: at window
      128 only a > 1.13, 13% a step sustained, passes z = 6, which is an explosion).
    - The std is floored at `rel_floor` x |mean|: a constant signal (std 0) or one still to float
      rounding would otherwise make the next ulp of change infinitely many sigma. So a move smaller than
      z x rel_floor (0.6% by default) of the mean is never a spike. A window that is exactly 0
      throughout has no floor: any positive value there is z = +inf (a dead signal coming to life).

    Cost: O(1) amortised per value, vectorised over a step's signals: running sums of each signal's
    deviations from a shift (its window's mean at the last exact pass) over a ring buffer, recomputed
    exactly every `window` values, and at once when the mean has moved far from the shift (a big value
    left the window, or the signal drifted: the sums would cancel). Windows whose squares overflow
    (values near 1e154 and above) are summed with scaling on every value (O(window), for them only).
    """

    def __init__(self, z: float = 6.0, window: int = 128, warmup: int = 20, rel_floor: float = REL_FLOOR) -> None:
        check_settings(z, window, warmup)
        assert rel_floor >= 0, rel_floor
        self.z, self.window, self.warmup, self.rel_floor = float(z), window, warmup, float(rel_floor)
        #: Every value flagged so far, in order of observation.
        self.anomalies: list[Anomaly] = []
        self._index: dict[str, int] = {}
        self._last_key: tuple[str, ...] = ()
        self._last_idx = np.zeros(0, np.intp)
        self._ring = np.zeros((16, window))  # each signal's accepted values, oldest overwritten
        # Per signal, one row (gathered and written back in one go): values accepted ever, accepted since
        # the last exact pass, the shift, sum of (x - shift) and of (x - shift)^2 over the window. A
        # non-finite sum of squares marks a window whose squares overflow: its stats are exact, scaled.
        self._state = np.zeros((16, _FIELDS))

    @property
    def signals(self) -> list[str]:
        """Every signal seen so far, in order of first sight."""
        return list(self._index)

    def taps(self) -> list[str]:
        """The taps of the tap signals seen so far, in order of first sight (a tie-break order for `first_mover`)."""
        return list(dict.fromkeys(t for s in self._index if (t := tap_of(s)) is not None))

    def _rows(self, names: tuple[str, ...]) -> np.ndarray:
        if names == self._last_key:  # the same signals as the last step (the usual case): no lookups
            return self._last_idx
        idx = np.empty(len(names), np.intp)
        for i, name in enumerate(names):
            j = self._index.get(name)
            if j is None:
                j = len(self._index)
                if j == len(self._state):
                    self._ring = np.concatenate([self._ring, np.zeros_like(self._ring)])
                    self._state = np.concatenate([self._state, np.zeros_like(self._state)])
                self._index[name] = j
            idx[i] = j
        self._last_key, self._last_idx = names, idx
        return idx

    def observe(self, step: int, values: Mapping[str, float]) -> list[Anomaly]:
        """Judge each of the step's values against its signal's window, then add the accepted ones; the flagged ones.

        Example::

            det.observe(7, {"loss": 0.41, "grad_norm": 2.3, "fc1:output:norm": 0.02})    # [] on a quiet step
        """
        if not values:
            return []
        names = tuple(values)
        idx = self._rows(names)
        x = np.fromiter(values.values(), np.float64, len(names))
        state = self._state[idx]
        with np.errstate(all="ignore"):  # empty windows (NaN), std 0 (inf z), overflowing squares: handled
            mean, std = self._stats(idx, state)
            z = (x - mean) / std
            z[np.isnan(z)] = 0.0  # 0/0 (a window of zeros), or no window yet
            finite = np.isfinite(x)
            z[~finite] = np.inf
            flag = ~finite | ((state[:, _ACC] >= self.warmup) & (z > self.z))
            if not flag.all():
                keep = ~flag
                self._add(idx[keep], x[keep], state[keep])
        if not flag.any():
            return []
        new = [Anomaly(int(step), names[i], float(x[i]), float(mean[i]), float(std[i]), float(z[i]))
               for i in np.flatnonzero(flag)]  # fmt: skip
        self.anomalies.extend(new)
        return new

    def _stats(self, idx: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and floored std of each row's window (NaN for an empty window)."""
        n = np.minimum(state[:, _ACC], self.window)
        d = state[:, _S] / n
        mean = state[:, _SHIFT] + d
        std = np.sqrt(np.maximum(state[:, _Q] / n - d * d, 0.0))
        slow = ~np.isfinite(state[:, _Q])
        if slow.any():
            mean[slow], std[slow] = _exact(self._ring[idx[slow]], n[slow])
        return mean, np.maximum(std, self.rel_floor * np.abs(mean))

    def _add(self, rows: np.ndarray, v: np.ndarray, state: np.ndarray) -> None:
        """Put accepted values `v` into the windows of `rows` (distinct; `state`: theirs), keeping the running sums."""
        acc, since, shift, s, q = state.T  # views: updated in place, then written back in one go
        first = acc == 0
        shift[first] = v[first]
        pos = (acc % self.window).astype(np.intp)
        old = np.where(acc >= self.window, self._ring[rows, pos] - shift, 0.0)
        new = v - shift
        self._ring[rows, pos] = v
        s += new - old
        q += new * new - old * old
        acc += 1
        since += 1
        self._state[rows] = state
        n = np.minimum(acc, self.window)
        d = s / n
        floor = self.rel_floor * (shift + d)
        # Exact every `window` values; at once when the mean has moved far from the shift (a big value left
        # the window, or the signal drifted): var = q/n - d^2 would lose more than 8 of its 16 digits.
        redo = (since >= self.window) | ~np.isfinite(q) | (d * d > 1e8 * np.maximum(q / n - d * d, floor * floor))
        if redo.any():
            self._recompute(rows[redo])

    def _recompute(self, rows: np.ndarray) -> None:
        """Exact sums for `rows`: shift to the window's mean, sums of the deviations from it."""
        n = np.minimum(self._state[rows, _ACC], self.window)
        vals = self._ring[rows]
        mean, _ = _exact(vals, n)
        dev = np.where(np.arange(self.window) < n[:, None], vals - mean[:, None], 0.0)
        q = (dev * dev).sum(axis=1)
        self._state[rows, _SINCE] = 0
        self._state[rows, _SHIFT], self._state[rows, _S] = mean, dev.sum(axis=1)
        self._state[rows, _Q] = np.where(np.isfinite(mean), q, np.inf)  # inf: exact, scaled stats from now on

    def state_dict(self) -> dict[str, Any]:
        """The detector's whole state (plain Python and numpy: picklable, torch-free), for a checkpoint.

        Example::

            again = Detector(); again.load_state_dict(det.state_dict())    # judges the next step as `det` would
        """
        n = len(self._index)
        return {"settings": (self.z, self.window, self.warmup, self.rel_floor), "signals": list(self._index),
                "ring": self._ring[:n].copy(), "state": self._state[:n].copy(),
                "anomalies": [dataclasses.astuple(a) for a in self.anomalies]}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; its settings must be this detector's."""
        assert tuple(state["settings"]) == (self.z, self.window, self.warmup, self.rel_floor), state["settings"]
        self._index = {s: i for i, s in enumerate(state["signals"])}
        self._last_key, self._last_idx = (), np.zeros(0, np.intp)
        self._ring, self._state = np.array(state["ring"]), np.array(state["state"])
        self.anomalies = [Anomaly(*row) for row in state["anomalies"]]


#: Columns of `Detector._state`.
_ACC, _SINCE, _SHIFT, _S, _Q = range(5)
_FIELDS = 5


def _exact(vals: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of the first `n[i]` values of each row of `vals`, scaled so that no square overflows."""
    valid = np.arange(vals.shape[1]) < n[:, None]
    with np.errstate(all="ignore"):  # empty rows: NaN
        v = np.where(valid, vals, 0.0)
        scale = np.abs(v).max(axis=1)
        scale = np.where(scale > 0, scale, 1.0)
        mean = scale * ((v / scale[:, None]).sum(axis=1) / n)
        dev = np.where(valid, v - mean[:, None], 0.0)
        dscale = np.abs(dev).max(axis=1)
        dscale = np.where(dscale > 0, dscale, 1.0)
        std = dscale * np.sqrt(((dev / dscale[:, None]) ** 2).sum(axis=1) / n)
    return mean, std


class FirstMover(NamedTuple):
    """The tap signal that crossed first before a spike: its tap, signal, step, lead (spike step - its step) and z."""

    tap: str
    signal: str
    step: int
    lead: int
    z: float


class _Movers:
    """The tap anomalies by step, built once: `first_mover` for many spikes in O(log n) each."""

    def __init__(self, anomalies: Iterable[Anomaly], order: Sequence[str] | None) -> None:
        rank = {t: i for i, t in enumerate(order or ())}
        by_step: dict[int, tuple[tuple[float, int, str], Anomaly]] = {}
        for a in anomalies:
            tap = a.tap
            if tap is None:
                continue
            key = (-a.z, rank.get(tap, len(rank)), a.signal)
            if a.step not in by_step or key < by_step[a.step][0]:
                by_step[a.step] = (key, a)
        self.steps = sorted(by_step)
        self.best = [by_step[s][1] for s in self.steps]

    def at(self, spike_step: int, window: int) -> FirstMover | None:
        i = bisect.bisect_left(self.steps, spike_step - window)
        if i == len(self.steps) or self.steps[i] > spike_step:
            return None
        a = self.best[i]
        return FirstMover(str(a.tap), a.signal, a.step, spike_step - a.step, a.z)


def first_mover(
    anomalies: Iterable[Anomaly], spike_step: int, window: int, order: Sequence[str] | None = None
) -> FirstMover | None:
    """For a loss or grad_norm spike at `spike_step`: the tap signal flagged first in the `window` steps up to it.

    Example::

        first_mover(det.anomalies, 40, det.window)     # FirstMover(tap='fc1:output', signal='fc1:output:norm', step=38, lead=2, z=51.0)

    Candidates: tap signals flagged at a step from `spike_step - window` to `spike_step` (a tap
    that moved in the same step counts, lead 0). The earliest wins; among those of one step, the
    larger z (a NaN/Inf: +inf), then the tap earlier in `order` (taps, e.g. `Detector.taps()` or
    the records' forward order; taps not in it come after), then the signal's name. None when no
    tap signal was flagged in that span.
    """
    return _Movers(anomalies, order).at(spike_step, window)


def anomaly_rows(anomalies: Sequence[Anomaly], window: int, order: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The rows of `anomalies.parquet`: each anomaly, and for loss/grad_norm ones the first mover and its lead.

    Example::

        write_anomalies(run_dir, anomaly_rows(det.anomalies, det.window, det.taps()), run_id)
    """
    movers = _Movers(anomalies, order)
    rows = []
    for a in anomalies:
        mover = movers.at(a.step, window) if a.signal in SPIKE_SIGNALS else None
        rows.append({"step": a.step, "signal": a.signal, "value": a.value, "mean": a.mean, "std": a.std, "z": a.z,
                     "first_tap": mover.tap if mover else None, "lead": mover.lead if mover else None})  # fmt: skip
    return rows


def summary_lines(
    anomalies: Sequence[Anomaly], window: int, order: Sequence[str] | None = None, limit: int = 5
) -> list[str]:
    """The run's last word about spikes: one line per loss/grad_norm spike (a run of flagged steps), at most `limit`.

    Example::

        summary_lines(det.anomalies, det.window)
        # ['loss spike at step 40 (z = 3e4); first to move: fc1:output (lead 0 steps)',
        #  'grad_norm NaN/Inf at step 52 (flagged through step 60, 9 steps); first to move: none of the taps']

    A spike is a run of consecutive flagged steps of one signal, named by its first step and z (and,
    for more than one step, its last step and where it turned NaN/Inf); the first mover is
    `first_mover`'s at its first step. Tap anomalies with no loss/grad_norm spike in the `window` steps after them get one line.
    [] when nothing was flagged.
    """
    spikes: list[list[Anomaly]] = []
    for signal in SPIKE_SIGNALS:
        for a in sorted((a for a in anomalies if a.signal == signal), key=lambda a: a.step):
            if spikes and spikes[-1][0].signal == signal and a.step == spikes[-1][-1].step + 1:
                spikes[-1].append(a)
            else:
                spikes.append([a])
    spikes.sort(key=lambda run: (run[0].step, run[0].signal != LOSS))
    movers = _Movers(anomalies, order)
    lines = [_spike_line(run, movers.at(run[0].step, window)) for run in spikes[:limit]]
    if len(spikes) > limit:
        lines.append(f"... and {len(spikes) - limit} more spike(s): anomalies.parquet lists them all")
    flagged = sorted({a.step for run in spikes for a in run})
    lone = [a for a in anomalies if a.tap is not None and not _spike_within(flagged, a.step, window)]
    if lone:
        first = min(lone, key=lambda a: (a.step, -a.z))
        lines.append(f"{len(lone)} tap anomal{'y' if len(lone) == 1 else 'ies'} with no loss or grad_norm spike "
                     f"after them (first: {first.signal} at step {first.step}, z = {_short(first.z)})")  # fmt: skip
    return lines


def _spike_within(flagged: list[int], step: int, window: int) -> bool:
    """Whether a loss/grad_norm step of `flagged` (sorted) lies in `step .. step + window`."""
    i = bisect.bisect_left(flagged, step)
    return i < len(flagged) and flagged[i] <= step + window


def _spike_line(run: list[Anomaly], mover: FirstMover | None) -> str:
    """`<signal> spike at step S (z = ...; flagged through step E, N steps; NaN/Inf from step F); first to move: ...`."""
    head = run[0]
    finite = math.isfinite(head.value)
    details = [f"z = {_short(head.z)}"] if finite else []
    if len(run) > 1:
        details.append(f"flagged through step {run[-1].step}, {len(run)} steps")
    bad = next((a.step for a in run if not math.isfinite(a.value)), None)
    if finite and bad is not None:
        details.append(f"NaN/Inf from step {bad}")
    line = f"{head.signal} {'spike' if finite else 'NaN/Inf'} at step {head.step}"
    line += f" ({'; '.join(details)})" if details else ""
    moved = f"{mover.tap} (lead {mover.lead} step{'' if mover.lead == 1 else 's'})" if mover else "none of the taps"
    return f"{line}; first to move: {moved}"


def _short(z: float) -> str:
    """A z-score in a few characters: 7.3, 412, 3.1e4, inf."""
    if not math.isfinite(z):
        return "inf" if z > 0 else str(z)
    if abs(z) < 1000:
        return f"{z:.3g}"
    mantissa, exponent = f"{z:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
