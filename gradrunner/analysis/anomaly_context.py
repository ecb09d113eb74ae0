"""The taps' z-scores around each spike of a run: what the report's spike tables show.

Contents:
    z_around(run_dir, before, after, limit)  -- per spike (`anomaly_summary.spikes`), every signal's z over the steps around it

Example::

    for spike, table in z_around("outputs/2026-11-26/01-00-00-000000"):
        print(spike.signal, spike.step)          # loss 40
        print(table)                             # signals x steps (36..42): the z of each value

The z of a value is the detector's rule's (`Detector.score`: against its signal's window just before
it, the flagged values left out), from the run's records fed through a fresh detector with the
settings `anomalies.parquet` was written with, as `detect_run` does. Imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from gradrunner.analysis.anomalies import Detector
from gradrunner.analysis.anomaly_signals import TAP_COLUMNS, run_signals
from gradrunner.analysis.anomaly_summary import Spike, spikes
from gradrunner.analysis.reading import load
from gradrunner.records import rundir
from gradrunner.records.anomalies import read_anomalies_table, settings_of
from gradrunner.records.columns import GRADS_FILE, STEPS_FILE


def z_around(
    run_dir: str | os.PathLike[str], before: int = 5, after: int = 2, limit: int = 5
) -> list[tuple[Spike, pd.DataFrame]]:
    """For each of the first `limit` spikes of the run: a table of every signal's z (rows, loss and
    grad_norm first, then the taps in order of first sight) over steps `S - before .. S + after` (columns).

    Example::

        [(s.step, t.loc["loss", s.step]) for s, t in z_around(run_dir)]      # [(40, 31234.5)]

    A signal absent on a step (a step not captured) is NaN there. [] when the run has no spike.
    """
    directory = Path(run_dir)
    table = read_anomalies_table(directory)
    found = spikes(table.to_pylist())[:limit]
    if not found:
        return []
    det = Detector(**settings_of(table.schema))
    wanted = {step: i for i, s in enumerate(found) for step in range(s.step - before, s.step + after + 1)}
    scores: list[dict[int, dict[str, float]]] = [{} for _ in found]
    steps = rundir.read_verified(directory / STEPS_FILE, rundir.job_state(directory).marker)
    grads = load(directory / GRADS_FILE, columns=TAP_COLUMNS) if (directory / GRADS_FILE).is_file() else None
    for step, values in run_signals(grads, steps):
        for i, s in enumerate(found):
            if s.step - before <= step <= s.step + after:
                scores[i][step] = det.score(values)
        det.observe(step, values)
        if step > max(wanted):
            break
    out = []
    for s, by_step in zip(found, scores, strict=True):
        df = pd.DataFrame(by_step).reindex(columns=range(s.step - before, s.step + after + 1))
        out.append((s, df.dropna(how="all")))
    return out
