"""Spike detection: a streaming z-score rule over a run's per-step signals.

Contents:
    Detector(z, window, warmup)       -- `observe(step, values)` once per step; the flagged values
    Anomaly                           -- one flagged value: step, signal, value, mean, std, z, space, streak, through
    check_settings(z, window, warmup) -- the allowed settings (`gradrunner.config.anomaly_settings`, re-exported)
    space_of(signal)                  -- THE rule for which signals are judged on a log scale
    LOSS, GRAD_NORM, TAP_STATISTICS, tap_of(signal)  -- the signals' names

What a spike says (first movers, the rows of `anomalies.parquet`, the last word) is
`gradrunner.analysis.anomaly_summary`.

Example::

    det = Detector()                                     # z=6, window=128, warmup=20
    for step, values in enumerate(per_step_values):      # {"loss": 0.7, "grad_norm": 1.2, "fc1:output:norm": ...}
        det.observe(step, values)
    det.anomalies                                        # [Anomaly(step=40, signal='loss', ...)]

Signals are the loss, `grad_norm` and `<tap>:<statistic>` (`fc1:output:norm`, `fc1:weight:update_ratio`;
see `gradrunner.analysis.anomaly_signals` for what the loop feeds). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gradrunner.analysis.anomaly_names import (
    GRAD_NORM,
    LINEAR,
    LOG,
    LOSS,
    REL_FLOOR,
    SPIKE_SIGNALS,
    TAP_STATISTICS,
    Anomaly,
    space_of,
    tap_of,
)
from gradrunner.config.anomaly_settings import WARMUP, WINDOW, Z, check_settings

__all__ = ["GRAD_NORM", "LINEAR", "LOG", "LOSS", "REL_FLOOR", "SPIKE_SIGNALS", "TAP_STATISTICS", "Anomaly", "Detector",
           "check_settings", "space_of", "tap_of"]  # fmt: skip

class Detector:
    """Flags a value beyond `z` standard deviations above the mean of its signal's last `window` accepted values.

    Example::

        det = Detector(z=6.0, window=128, warmup=20)
        new = det.observe(40, {"loss": 3e4, "grad_norm": 1.0})     # [Anomaly(step=40, signal='loss', ...)]
        det.anomalies                                              # every flagged value so far

    The rule, per signal (a signal absent from a step's `values` is simply not observed):

    - Each signal is judged on its scale (`space`, default `space_of`): the loss as it is, the norms
      and update ratios by their natural log (a jump x10 is the same number of sigma at any size). On
      the log scale a value of 0 (or below) has no place: it is not observed (a tap whose gradient is
      exactly zero on a step, an edit that zeroes it).
    - A NaN or infinite value is always flagged (even in warm-up), with z = +inf.
    - Otherwise, once the signal has `warmup` accepted values, a value is flagged when
      `(x - mean) / std > z`, mean and std (population) over its last `window` accepted values.
    - A flagged value is not added to the window, so a spike does not widen the band it is judged by.
      Everything else is accepted (warm-up values too: a huge early value widens the band until it
      leaves the window, `window` values later).
    - One-sided: only upward moves are spikes. A loss, a gradient norm, a tap's norm or update ratio
      that jumps up is a blow-up; one that drops is learning (or vanishing gradients, which the health
      summary reports with its own rule). A signal that decays steadily sits below its window's mean,
      so its z is negative and never alarms.
    - The std is floored: at `rel_floor` x |mean| on the linear scale, at `rel_floor` on the log scale
      (the same relative move): a constant signal (std 0) or one still to float rounding would
      otherwise make the next ulp of change infinitely many sigma. So a move smaller than z x
      rel_floor (0.6% by default) is never a spike. A linear window that is exactly 0 throughout has
      no floor: any positive value there is z = +inf (a dead signal coming to life).
    - A level shift is bounded: `warmup` consecutive flagged finite values of a signal are its new
      level: its window becomes those values (they were kept out while flagged) and the next values
      are judged against them, so a permanent shift writes `warmup` rows, not one per later step. A run
      of consecutive flagged values writes its first `warmup` values only (a NaN loss for the rest of a
      run is `warmup` rows); the last of them carries `through`: the run's last flagged step.

    Cost: O(1) amortised per value, vectorised over a step's signals: running sums of each signal's
    deviations from a shift (its window's mean at the last exact pass) over a ring buffer, recomputed
    exactly every `window` values, and at once when the mean has moved far from the shift (a big value
    left the window, or the signal drifted: the sums would cancel). Windows whose squares overflow
    (values near 1e154 and above) are summed with scaling on every value (O(window), for them only).
    """

    def __init__(self, z: float = Z, window: int = WINDOW, warmup: int = WARMUP, rel_floor: float = REL_FLOOR,
                 space: Callable[[str], str] = space_of) -> None:  # fmt: skip
        check_settings(z, window, warmup)
        assert rel_floor >= 0, rel_floor
        self.z, self.window, self.warmup, self.rel_floor = float(z), window, warmup, float(rel_floor)
        self.space = space
        #: Every value flagged so far (a run's first `warmup`), in order of observation.
        self.anomalies: list[Anomaly] = []
        self._index: dict[str, int] = {}
        self._last_key: tuple[str, ...] = ()
        self._last_idx = np.zeros(0, np.intp)
        self._ring = np.zeros((16, window))  # each signal's accepted values, oldest overwritten
        # Per signal, one row (gathered and written back in one go): values accepted ever, accepted since
        # the last exact pass, the shift, sum of (x - shift) and of (x - shift)^2 over the window. A
        # non-finite sum of squares marks a window whose squares overflow: its stats are exact, scaled.
        self._state = np.zeros((16, _FIELDS))
        self._log = np.zeros(16, bool)  # judged on the log scale
        self._streak = np.zeros(16, np.int64)  # consecutive flagged values so far
        self._run: dict[int, list[float]] = {}  # row -> its trailing consecutive flagged finite values (its scale)
        self._held: dict[int, int] = {}  # row -> index in `anomalies` of the last row written of its run

    @property
    def signals(self) -> list[str]:
        """Every signal seen so far, in order of first sight."""
        return list(self._index)

    def taps(self) -> list[str]:
        """The taps of the tap signals seen so far, in order of first sight (a tie-break order for `first_mover`)."""
        return list(dict.fromkeys(t for s in self._index if (t := tap_of(s)) is not None))

    def score(self, values: Mapping[str, float]) -> dict[str, float]:
        """The z each value would get now, on its signal's scale, without observing it (NaN: not judged yet).

        Example::

            det.score({"loss": 0.9, "fc1:output:norm": 2.0})     # {'loss': 1.3, 'fc1:output:norm': -0.4}

        +inf for a NaN or infinite value (flagged always, in warm-up too); otherwise NaN for a signal in
        warm-up or never seen, and for a value with no place on its scale (0 on the log scale). The report's spike tables use it (`anomaly_context`).
        """
        out = {}
        for name, x in values.items():
            if not math.isfinite(x):  # always flagged, warm-up or not (`observe`)
                out[name] = math.inf
                continue
            j = self._index.get(name)
            if j is None or self._state[j, _ACC] < self.warmup:
                out[name] = math.nan
                continue
            log = bool(self._log[j])
            if log and x <= 0:
                out[name] = math.nan
                continue
            rows, logs = np.array([j], np.intp), np.array([log])
            with np.errstate(all="ignore"):
                mean, std = self._stats(rows, self._state[rows], logs)
                z = ((math.log(x) if log else x) - mean[0]) / std[0]
            out[name] = 0.0 if math.isnan(z) else float(z)
        return out

    def settings(self) -> dict[str, Any]:
        """The detector's settings, as `anomalies.parquet` keeps them: `Detector(**det.settings())` is a fresh copy."""
        return {"z": self.z, "window": self.window, "warmup": self.warmup, "rel_floor": self.rel_floor}

    def threshold(self, name: str) -> float:
        """The value of `name` above which its next value would be flagged: mean + z x (floored) std of its window,
        on its scale (exp of that on the log scale); +inf in warm-up or for a signal never seen (only a NaN or
        infinite value is flagged there).

        Example::

            det.threshold("loss")     # 2.78: a loss above it at the next step is a spike
        """
        j = self._index.get(name)
        if j is None or self._state[j, _ACC] < self.warmup:
            return math.inf
        rows, logs = np.array([j], np.intp), self._log[[j]]
        mean, std = self._stats(rows, self._state[rows], logs)
        band = float(mean[0] + self.z * std[0])
        return math.exp(band) if logs[0] else band

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
                    self._log = np.concatenate([self._log, np.zeros_like(self._log)])
                    self._streak = np.concatenate([self._streak, np.zeros_like(self._streak)])
                self._index[name] = j
                self._log[j] = self.space(name) == LOG
            idx[i] = j
        self._last_key, self._last_idx = names, idx
        return idx

    def observe(self, step: int, values: Mapping[str, float]) -> list[Anomaly]:
        """Judge each of the step's values against its signal's window, then add the accepted ones; the flagged ones.

        Example::

            det.observe(7, {"loss": 0.41, "grad_norm": 2.3, "fc1:output:norm": 0.02})    # [] on a quiet step

        Returns the values flagged at this step that were written (a run's first `warmup`).
        """
        if not values:
            return []
        names = tuple(values)
        idx = self._rows(names)
        x = np.fromiter(values.values(), np.float64, len(names))
        logs = self._log[idx]
        y = x
        if logs.any():
            with np.errstate(all="ignore"):  # 0 and negative values: left out below
                y = np.where(logs, np.log(np.where(logs, x, 1.0)), x)
            there = ~(logs & (x <= 0) & np.isfinite(x))
            if not there.all():  # no logarithm: not observed (-inf is, as a NaN)
                x, y, idx, logs = x[there], y[there], idx[there], logs[there]
                names = tuple(n for n, t in zip(names, there.tolist(), strict=True) if t)
        state = self._state[idx]
        with np.errstate(all="ignore"):  # empty windows (NaN), std 0 (inf z), overflowing squares: handled
            mean, std = self._stats(idx, state, logs)
            z = (y - mean) / std
            z[np.isnan(z)] = 0.0  # 0/0 (a window of zeros), or no window yet
            finite = np.isfinite(y)
            z[~finite] = np.inf
            flag = ~finite | ((state[:, _ACC] >= self.warmup) & (z > self.z))
            if not flag.all():
                keep = ~flag
                self._add(idx[keep], y[keep], state[keep], logs[keep])
                ended = idx[keep][self._streak[idx[keep]] > 0]
                for row in ended.tolist():  # a run of flagged values ends (rare): forget it
                    self._end_run(row)
        if not flag.any():
            return []
        new = []
        for i in np.flatnonzero(flag).tolist():
            a = self._flagged(step, names[i], int(idx[i]), float(x[i]), float(y[i]), float(mean[i]), float(std[i]),
                              float(z[i]), bool(logs[i]))  # fmt: skip
            if a is not None:
                new.append(a)
        return new

    def _flagged(self, step: int, name: str, row: int, x: float, y: float, mean: float, std: float, z: float,
                 log: bool) -> Anomaly | None:  # fmt: skip
        """One flagged value: written while its run is at most `warmup` long; a level held `warmup` times re-baselines."""
        streak = int(self._streak[row]) + 1
        self._streak[row] = streak
        run = self._run.setdefault(row, [])
        if math.isfinite(y):
            run.append(y)
        else:
            run.clear()
        out = None
        if streak <= self.warmup:
            out = Anomaly(int(step), name, x, mean, std, z, LOG if log else LINEAR, streak,
                          int(step) if streak == self.warmup else None)  # fmt: skip
            self.anomalies.append(out)
            if streak == self.warmup:
                self._held[row] = len(self.anomalies) - 1
        else:
            j = self._held[row]
            self.anomalies[j] = dataclasses.replace(self.anomalies[j], through=int(step))
        if len(run) >= self.warmup:  # the signal held this level for `warmup` flagged values: its new level
            self._rebaseline(row, run[-self.warmup :])
            self._end_run(row)
        return out

    def _end_run(self, row: int) -> None:
        self._streak[row] = 0
        self._run.pop(row, None)
        self._held.pop(row, None)

    def _rebaseline(self, row: int, values: list[float]) -> None:
        """The window of `row` becomes `values` (its new level), as if it had accepted only them."""
        n = len(values)
        self._ring[row] = 0.0
        self._ring[row, :n] = values
        self._state[row] = 0.0
        self._state[row, _ACC] = n
        self._recompute(np.array([row], np.intp))

    def _floor(self, mean: np.ndarray, logs: np.ndarray) -> np.ndarray:
        """The std's floor: `rel_floor` x |mean| on the linear scale, `rel_floor` on the log scale."""
        return np.where(logs, self.rel_floor, self.rel_floor * np.abs(mean))

    def _stats(self, idx: np.ndarray, state: np.ndarray, logs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and floored std of each row's window (NaN for an empty window)."""
        n = np.minimum(state[:, _ACC], self.window)
        d = state[:, _S] / n
        mean = state[:, _SHIFT] + d
        std = np.sqrt(np.maximum(state[:, _Q] / n - d * d, 0.0))
        slow = ~np.isfinite(state[:, _Q])
        if slow.any():
            mean[slow], std[slow] = _exact(self._ring[idx[slow]], n[slow])
        return mean, np.maximum(std, self._floor(mean, logs))

    def _add(self, rows: np.ndarray, v: np.ndarray, state: np.ndarray, logs: np.ndarray) -> None:
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
        floor = self._floor(shift + d, logs)
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
                "ring": self._ring[:n].copy(), "state": self._state[:n].copy(), "log": self._log[:n].copy(),
                "streak": self._streak[:n].copy(), "run": {r: list(v) for r, v in self._run.items()},
                "held": dict(self._held), "anomalies": [dataclasses.astuple(a) for a in self.anomalies]}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; its settings must be this detector's."""
        assert tuple(state["settings"]) == (self.z, self.window, self.warmup, self.rel_floor), state["settings"]
        self._index = {s: i for i, s in enumerate(state["signals"])}
        self._last_key, self._last_idx = (), np.zeros(0, np.intp)
        self._ring, self._state = np.array(state["ring"]), np.array(state["state"])
        self._log, self._streak = np.array(state["log"], bool), np.array(state["streak"], np.int64)
        self._run = {int(r): list(v) for r, v in state["run"].items()}
        self._held = {int(r): int(j) for r, j in state["held"].items()}
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


def __getattr__(name: str) -> Any:
    """`first_mover`, `anomaly_rows`, `summary_lines`, `FirstMover`: moved to `anomaly_summary`, still importable here."""
    if name in ("first_mover", "anomaly_rows", "summary_lines", "FirstMover"):
        from gradrunner.analysis import anomaly_summary

        return getattr(anomaly_summary, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
