"""Replay (`anomaly.replay=K`): after the run, re-run the K steps before each flagged loss spike, in full detail.

For each loss spike at step S (the run's `anomalies.parquet`, or `detect_run` over its records when the
run was made without the detector wired in), the replay is a branch (`run.branch`) of the run from its
last kept checkpoint at or before S-K (else the run's first step: 0, the config from its seed, or a
branch run's own start, the state it branched from) to S,
with `capture.values=full`, into `<run dir>/replay/step<S>/`: an ordinary run dir (`load()` reads it;
`load(run dir)` reads the run's own records only). Its records are compared with the original's over
the replayed steps, value for value (`gradrunner.compare`'s rule at rtol = atol = 0): equal, the spike
is deterministic (the data or the optimiser state made it, and a branch from the checkpoint reproduces
it: `python -m gradrunner.autopsy`); different, it is transient (non-determinism, hardware).
The checkpoints no replay or autopsy starts from are then removed from `<run dir>/checkpoints/` (each
spike keeps its replay's start; a replay from the run's start keeps the last checkpoint at or before
the spike, for the autopsy).

Example::

    python -m gradrunner +experiment=mlp train.checkpoint_every=10 anomaly.replay=5
    # ... replay of the loss spike at step 40 (steps 30-40 in replay/step40/): replays exactly (deterministic) ...
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from gradrunner.errors import GradrunnerError, one_paragraph
from gradrunner.records.atomic import write_atomically
from gradrunner.run import branch
from gradrunner.run.checkpoint import KEPT_DIR, KEPT_MANIFEST
from gradrunner.run.guards import NonFinite

log = logging.getLogger(__name__)

REPLAY_DIR = "replay"
#: A replay's verdict in its dir.
VERDICT_FILE = "replay.json"


def loss_spikes(run_dir: Path) -> pd.DataFrame:
    """The run's flagged loss values (`step`, `value`, `mean`, `std`, `z`, `first_tap`, `lead`), and the detector's
    settings in `attrs["settings"]` (`Detector(**settings)`: the rule that flagged them): from `anomalies.parquet`,
    else the detector run over the records (`detect_run`).

    Example::

        loss_spikes(run_dir)["step"].tolist()     # [30, 31]
    """
    import pyarrow.parquet as pq

    from gradrunner.analysis.anomalies import anomaly_rows
    from gradrunner.analysis.anomaly_signals import detect_run, read_anomalies
    from gradrunner.records.anomalies import ANOMALIES_FILE, settings_of

    if (run_dir / ANOMALIES_FILE).is_file():
        rows = read_anomalies(run_dir)  # verified: a file of another run is refused before its settings are used
        settings = settings_of(pq.read_schema(run_dir / ANOMALIES_FILE))
    else:
        det = detect_run(run_dir)
        rows, settings = pd.DataFrame(anomaly_rows(det.anomalies, det.window, det.taps())), det.settings()
    spikes = rows[rows["signal"] == "loss"].sort_values("step").reset_index(drop=True) if len(rows) else rows
    spikes.attrs["settings"] = settings
    return spikes


def spike_starts(spikes: pd.DataFrame) -> list[int]:
    """The first step of each run of consecutive flagged loss steps (one spike, however many steps it lasts).

    Example::

        spike_starts(loss_spikes(run_dir))      # [30] for flagged steps 30, 31, 32
    """
    steps = sorted({int(s) for s in spikes["step"]}) if len(spikes) else []
    return [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s - 1]


@dataclass(frozen=True)
class Replayed:
    """One spike's replay: where, from which checkpoint, and whether it reproduced the original exactly."""

    step: int
    start: int
    directory: str
    exact: bool
    records: int
    first_difference: str | None

    @property
    def line(self) -> str:
        how = ("replays exactly (deterministic: the data or the optimiser state; branch from the checkpoint to test "
               "fixes: python -m gradrunner.autopsy)" if self.exact else
               f"does not replay exactly: not exact (transient: non-determinism or hardware); first difference: "
               f"{self.first_difference}")  # fmt: skip
        return (f"replay of the loss spike at step {self.step} (steps {self.start}-{self.step}, capture.values=full, "
                f"in {self.directory}): {how}")  # fmt: skip


def replay_config(cfg: DictConfig, origin: str, end: int, **changes: Any) -> DictConfig:
    """`cfg` as a branch from `origin` (`'<run dir>:<step>'`) that runs to step `end` (inclusive), `changes` (dotted
    keys) applied."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    plain.pop("hydra", None)
    out = OmegaConf.create(plain)
    sets = {"steps": end + 1, "train.branch_from": origin, "train.checkpoint_every": 0,
            "anomaly.replay": 0, "report": False, "resume": True, **changes}  # fmt: skip
    with open_dict(out):
        for key, value in sets.items():
            OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


#: `run.job.run` (passed in: the job calls the replay, the replay runs jobs).
Runner = Callable[..., Path]


def replay_spike(run: Runner, cfg: DictConfig, run_dir: Path, step: int, k: int, start: int,
                 origin: str | None = None) -> Replayed:  # fmt: skip
    """Re-run steps `start`..`step` of `run_dir` with full values into `replay/step<step>/`; compare with the original.

    `origin`: where the replay branches from (default `'<run_dir>:<start>'`: a kept checkpoint, or 0: the seed)."""
    from gradrunner.analysis.compare import KEY, compare_runs

    out = run_dir / REPLAY_DIR / f"step{step}"
    full = {"capture.values": "full", "capture.every": 1}
    try:
        # every replayed step in full, whatever the run's capture.every (its own captured steps are compared)
        run(replay_config(cfg, origin or f"{run_dir}:{start}", step, **full), out_dir=out)
    except NonFinite:
        pass  # capture.on_nonfinite=stop: the replay stops where the run did; its records are compared as they are
    c = compare_runs(run_dir, out, rtol=0.0, atol=0.0)
    span = (c.values["step"] >= start) & (c.values["step"] <= step)
    differs = c.values[span & c.values["differs"]]
    missing = c.missing[(c.missing["step"] >= start) & (c.missing["step"] <= step)]
    # a record only the replay has, of a step the run did not capture (its capture.every), is what the replay adds
    ran = c.missing[c.missing["only_in"] == "a"]
    captured = set(c.values.loc[c.values["tap"].notna(), "step"]) | set(ran.loc[ran["tap"].notna(), "step"])
    missing = missing[~((missing["only_in"] == "b") & missing["tap"].notna() & ~missing["step"].isin(captured))]
    first = None
    if not differs.empty or not missing.empty:
        row = pd.concat([differs, missing]).sort_values(["step", "tap_order", "stat_order"], kind="stable").iloc[0]
        tap = row["tap"] if isinstance(row["tap"], str) else "the step"
        first = (f"step {int(row['step'])}, {tap}, {row['stat']}: {_plain(row['a'])} vs {_plain(row['b'])}"
                 if "a" in row.index and not pd.isna(row.get("a"))
                 else f"step {int(row['step'])}, {tap}: only in one run")  # fmt: skip
    taps = c.values[span & c.values["tap"].notna()]
    records = int(taps[[k for k in KEY if k in taps.columns]].drop_duplicates().shape[0])  # step x tap x call x ...
    result = Replayed(step, start, str(out), differs.empty and missing.empty, records, first)
    write_atomically(out / VERDICT_FILE, json.dumps({**asdict(result), "k": k}, indent=1) + "\n")
    return result


def _plain(value: object) -> str:
    """A compared value as a plain number, every digit kept (the replay's rule is exact equality): `0.1234567891`,
    not `np.float64(0.1234567891)`."""
    if isinstance(value, bool | np.bool_):
        return str(bool(value))
    return repr(float(value)) if isinstance(value, int | float | np.number) else str(value)


def after_run(run_dir: Path, cfg: DictConfig, run: Runner) -> list[Replayed]:
    """Replay every flagged loss spike of the finished run in `run_dir` (`anomaly.replay=K`); prune the checkpoints.

    Example::

        after_run(job_dir, cfg, run.job.run)     # [Replayed(step=30, start=25, exact=True, ...)]; each said in the log

    A replay that fails is told (one paragraph) and the others go on: the run itself is complete. A spike
    whose replay wrote its verdict (`replay/step<N>/replay.json`) is not replayed again: a completed job
    re-run (`resume=true`, a sweep re-run) replays only the spikes a killed or interrupted replay left.
    """
    k = int(OmegaConf.select(cfg, "anomaly.replay", default=0) or 0)
    if k <= 0:
        return []
    try:
        spikes = spike_starts(loss_spikes(run_dir))
    except GradrunnerError as e:
        log.warning("replay: the run's loss spikes could not be read, nothing replayed: %s", one_paragraph(e))
        return []
    states = _kept_steps(run_dir)
    first = _first_step(run_dir)
    starts = {s: replay_start(states, first, s, k) for s in spikes}
    # the replay's start; one that is not a kept checkpoint (the seed) keeps the autopsy's: the last at or before S
    seeded = [s for s, c in starts.items() if c not in states and states and states[0] <= s]
    autopsy = {max(c for c in states if c <= s) for s in seeded}
    prune(run_dir, set(starts.values()) | autopsy)
    done = []
    for s, start in starts.items():
        if (run_dir / REPLAY_DIR / f"step{s}" / VERDICT_FILE).is_file():
            continue  # replayed before (the job re-run after its replays, or after one killed midway: the rest)
        # a branch run with no kept state before the spike: its own start, from where it branched
        origin = str(cfg.train.branch_from) if start == first > 0 and start not in states else None
        try:
            done.append(replay_spike(run, cfg, run_dir, s, k, start, origin))
            log.warning("%s", done[-1].line)
        except GradrunnerError as e:
            log.warning("replay of the loss spike at step %d failed: %s", s, one_paragraph(e))
    if not spikes:
        log.info("replay: no loss spike flagged in %s; nothing to replay", run_dir)
    return done


def replay_start(kept: list[int], first: int, step: int, k: int) -> int:
    """Where the replay of the spike at `step` starts: the last kept checkpoint at or before `step - k`, else the
    run's first step (0: the config from its seed; a branch run's start: the state it branched from).

    Example::

        replay_start([25, 30], 0, 30, 3)     # 25
        replay_start([25, 30], 0, 27, 6)     # 0 (no checkpoint at or before 21)
        replay_start([30], 25, 30, 6)        # 25: a branch run from step 25
    """
    return max((c for c in kept if first <= c <= step - k), default=first)


def _first_step(run_dir: Path) -> int:
    """The run's first step (0; a branch run's: where it branched)."""
    steps = pd.read_parquet(run_dir / "steps.parquet", columns=["step"])["step"]
    return int(steps.min()) if len(steps) else 0


def _kept_steps(run_dir: Path) -> list[int]:
    try:
        return sorted(branch.kept(run_dir).states)
    except GradrunnerError:
        return []


def prune(run_dir: Path, needed: set[int]) -> None:
    """Keep only the kept checkpoints of `needed` steps (the rest are removed; the folder too when none is needed)."""
    try:
        k = branch.kept(run_dir)
    except GradrunnerError:
        return
    folder = run_dir / KEPT_DIR
    for step in sorted(set(k.states) - needed):
        k.path(step).unlink(missing_ok=True)
    states = [k.states[s] for s in sorted(set(k.states) & needed)]
    if not states:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        return
    body = {"run_id": k.run_id, "config": k.config, "states": states}
    write_atomically(folder / KEPT_MANIFEST, json.dumps(body, indent=1) + "\n")
