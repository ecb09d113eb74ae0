"""What the spike detector's flags say: which tap moved first, the rows of `anomalies.parquet`, the last word.

Contents:
    first_mover(anomalies, step, window, order)  -- the tap signal that crossed first before a spike
    anomaly_rows(anomalies, window, order)       -- the rows of `anomalies.parquet` (`records.anomalies`)
    Spike, spikes(rows)                          -- the loss/grad_norm spikes (runs of consecutive flags) of those rows
    spike_lines(rows, window)                    -- the run's last word about its spikes, from the rows
    summary_lines(anomalies, window, order)      -- the same, from a detector's anomalies

Example::

    rows = anomaly_rows(det.anomalies, det.window, det.taps())
    spike_lines(rows, det.window)     # ['loss spike at step 40 (z = 3e4); first to move: fc1:output (lead 0 steps)']

The rule that flags values is `gradrunner.analysis.anomalies`. Imports no torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gradrunner.analysis.anomaly_names import LOSS, SPIKE_SIGNALS, Anomaly, tap_of


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
                     "space": a.space, "streak": a.streak, "through": a.through,
                     "first_tap": mover.tap if mover else None, "lead": mover.lead if mover else None})  # fmt: skip
    return rows


@dataclass(frozen=True)
class Spike:
    """A loss or grad_norm spike: a run of consecutive flagged values of the signal, from `step` to `last`.

    `z`: its first value's; `nonfinite`: the first step of the run with a NaN/Inf value (None: all
    finite); `new_level`: the run lasted `warmup` finite values and became the signal's level;
    `first_tap`/`lead`: the first mover at its first step (None: no tap moved in the window before).
    """

    signal: str
    step: int
    last: int
    rows: int
    value: float
    z: float
    nonfinite: int | None
    new_level: bool
    first_tap: str | None
    lead: int | None


def spikes(rows: Iterable[Mapping[str, Any]]) -> list[Spike]:
    """The loss/grad_norm spikes of `anomalies.parquet`'s rows (dicts), by first step (a step's loss first).

    Example::

        [s.step for s in spikes(read_anomalies(run_dir).to_dict("records"))]      # [40, 52]
    """
    runs: list[list[Mapping[str, Any]]] = []
    for signal in SPIKE_SIGNALS:
        mine = sorted((r for r in rows if r["signal"] == signal), key=lambda r: int(r["step"]))
        for r in mine:
            streak = _int(r.get("streak")) or 1
            if runs and runs[-1][0]["signal"] == signal and streak == (_int(runs[-1][-1].get("streak")) or 1) + 1:
                runs[-1].append(r)
            else:
                runs.append([r])
    out = []
    for run in runs:
        head, tail = run[0], run[-1]
        through = _int(tail.get("through"))
        finite = [math.isfinite(float(r["value"])) for r in run]
        bad = next((int(r["step"]) for r, f in zip(run, finite, strict=True) if not f), None)
        new_level = through is not None and through == int(tail["step"]) and all(finite)
        out.append(Spike(str(head["signal"]), int(head["step"]), through if through is not None else int(tail["step"]),
                         len(run), float(head["value"]), float(head["z"]), bad, new_level,
                         head.get("first_tap") if isinstance(head.get("first_tap"), str) else None,
                         _int(head.get("lead"))))  # fmt: skip
    return sorted(out, key=lambda s: (s.step, s.signal != LOSS))


def _int(v: object) -> int | None:
    """An int from a row's value (a pandas NA or NaN is None)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def spike_lines(rows: Sequence[Mapping[str, Any]], window: int) -> list[str]:
    """The run's last word about spikes, from `anomalies.parquet`'s rows: one line per spike, every one of them.

    Example::

        spike_lines(rows, 128)
        # ['loss spike at step 40 (z = 3e4); first to move: fc1:output (lead 0 steps)',
        #  'grad_norm NaN/Inf at step 52 (flagged through step 60, 9 steps); first to move: none of the taps']

    A spike is named by its first step and z (and, for more than one step, its last step, where it
    turned NaN/Inf, or that it became the signal's new level); the first mover is the one its first
    row names. Tap anomalies with no loss/grad_norm spike in the `window` steps after them get one
    line. [] when nothing was flagged.
    """
    found = spikes(rows)
    lines = [_spike_line(s) for s in found]
    spans = sorted((s.step, s.last) for s in found)
    lone = [r for r in rows if tap_of(str(r["signal"])) is not None and not _spike_within(spans, int(r["step"]), window)]
    if lone:
        first = min(lone, key=lambda r: (int(r["step"]), -float(r["z"])))
        lines.append(f"{len(lone)} tap anomal{'y' if len(lone) == 1 else 'ies'} with no loss or grad_norm spike "
                     f"after them (first: {first['signal']} at step {first['step']}, z = {short(float(first['z']))})")  # fmt: skip
    return lines


def summary_lines(anomalies: Sequence[Anomaly], window: int, order: Sequence[str] | None = None) -> list[str]:
    """`spike_lines` of a detector's anomalies (first movers by `order`, e.g. `Detector.taps()`).

    Example::

        summary_lines(det.anomalies, det.window, det.taps())    # ['loss spike at step 40 (z = 3e4); ...']
    """
    return spike_lines(anomaly_rows(anomalies, window, order), window)


def _spike_within(spans: list[tuple[int, int]], step: int, window: int) -> bool:
    """Whether a spike of `spans` (sorted (first, last) steps) covers a step in `step .. step + window`."""
    i = bisect.bisect_right(spans, (step + window, math.inf))
    return any(last >= step for _, last in spans[:i])


def _spike_line(s: Spike) -> str:
    """`<signal> spike at step S (z = ...; flagged through step E, N steps; NaN/Inf from step F); first to move: ...`."""
    finite = math.isfinite(s.value)
    details = [f"z = {short(s.z)}"] if finite else []
    if s.last > s.step:
        details.append(f"flagged through step {s.last}, {s.last - s.step + 1} steps")
    if finite and s.nonfinite is not None:
        details.append(f"NaN/Inf from step {s.nonfinite}")
    if s.new_level:
        details.append("then taken as its new level")
    line = f"{s.signal} {'spike' if finite else 'NaN/Inf'} at step {s.step}"
    line += f" ({'; '.join(details)})" if details else ""
    lead = s.lead if s.lead is not None else 0
    moved = f"{s.first_tap} (lead {lead} step{'' if lead == 1 else 's'})" if s.first_tap else "none of the taps"
    return f"{line}; first to move: {moved}"


def short(z: float) -> str:
    """A z-score in a few characters: 7.3, 412, 3.1e4, inf.

    Example::

        short(31234.5), short(7.25)      # ('3.1e4', '7.25')
    """
    if not math.isfinite(z):
        return "inf" if z > 0 else str(z)
    if abs(z) < 1000:
        return f"{z:.3g}"
    mantissa, exponent = f"{z:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
