"""`python -m gradrunner.autopsy RUN_DIR [--step S] [--horizon H]`: branch from before a loss spike to find what saves it.

From the run's last kept checkpoint at or before the spike step S (default: the first flagged loss
spike; `anomaly.replay=K` keeps it; none: the run's start, step 0 from the seed), one Hydra sweep (`python -m gradrunner -m` of the run's own
stored config, `done.json`'s, not today's config files; into `<run dir>/autopsy/step<S>/`) runs a branch (`train.branch_from`, `run.branch`) per intervention to
step S+H (default H = 20), each an ordinary job (`+autopsy=<name>`: `load()` labels it, a re-run of
the autopsy with the same plan skips the completed ones and resumes the others; another plan, horizon or
interventions, replaces the sweep: `replace_stale`):

| intervention | what the branch changes, from the checkpoint on |
| --- | --- |
| `baseline` | nothing: it must reproduce the spike |
| `skip_batch` | leaves out the batch(es) of step S (`run.branch.skipping`) |
| `lr_half` | `optimizer.lr` halved |
| `clip` | `train.clip_grad_norm` at the median `grad_norm` of the steps before S |
| `zero_tap` | the first-moving tap's gradient zeroed (an edit, `scale: 0`) |
| `reset_moments` | the optimizer's moments dropped (`train.branch_reset_moments`; Adam-like optimizers) |

`--override NAME KEY=VALUE ...` adds an intervention of your own. Then `autopsy.parquet`
(`intervention`, `max_loss`, `final_loss`, `avoided`: the loss stayed below the spike rule's threshold,
mean + z x std of the window before S, over S..S+H; `reproduces`, `job`) and `autopsy.html` (the
interventions ranked, loss curves overlaid) in the sweep dir; the run dir's own `autopsy.parquet`
gathers every autopsy of the run (the same columns and `step`, the spike's). Bad input is one paragraph, exit 2.

Example::

    python -m gradrunner.autopsy outputs/2026-11-26/10-00-00-000000 --horizon 10
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import OmegaConf

from gradrunner.analysis.anomalies import LOSS, Detector
from gradrunner.analysis.anomaly_signals import run_signals
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, did_you_mean, one_paragraph
from gradrunner.records import rundir
from gradrunner.records.atomic import write_atomically
from gradrunner.run import branch
from gradrunner.run.autopsy_source import check_state, source_config
from gradrunner.run.replay import loss_spikes, spike_starts

AUTOPSY_DIR, RESULT_FILE, PAGE_FILE, CONF_DIR = "autopsy", "autopsy.parquet", "autopsy.html", ".autopsy_conf"
#: The plan an autopsy's sweep dir was made with (in `CONF_DIR`): a re-run with another plan replaces the sweep.
PLAN_FILE = "plan.json"


@dataclass
class Spike:
    """What the interventions are made from: the source run, the spike, the branch step and the source's config."""

    run_dir: Path
    step: int
    start: int
    horizon: int
    threshold: float
    config: dict[str, Any]
    first_tap: str | None
    losses: pd.Series = field(repr=False)
    #: Where the branches start, '<dir>:<step>' (default: the run dir at `start`; a branch run without a kept
    #: checkpoint before the spike: the run it branched from).
    origin: str = ""

    def median_grad_norm(self) -> float:
        steps = pd.read_parquet(self.run_dir / "steps.parquet", columns=["step", "grad_norm"])
        before = steps[(steps["step"] < self.step) & steps["grad_norm"].map(math.isfinite)]
        return float(before["grad_norm"].median())


def _skip_batch(s: Spike) -> dict[str, Any]:
    n = int(s.config["train"].get("accumulate", 1))
    return {"data": {"_target_": "gradrunner.run.branch.skipping", "skip_target": s.config["data"]["_target_"],
                     "skip_batches": list(range(s.step * n, s.step * n + n))}}  # fmt: skip


def _zero_tap(s: Spike) -> dict[str, Any]:
    if s.first_tap is None:
        raise GradrunnerError(f"zero_tap: no tap moved before the loss spike at step {s.step} (no first mover in the "
                              "run's anomalies); leave zero_tap out, or zero a tap of your choice with --override")  # fmt: skip
    return {"edits": [*(s.config.get("edits") or []), {"tap": s.first_tap, "scale": 0.0}]}


def _lr_half(s: Spike) -> dict[str, Any]:
    optimizer = s.config.get("optimizer") or {}
    if optimizer.get("lr") is None:
        raise GradrunnerError(f"lr_half needs optimizer.lr in the run's config (the rate to halve); the run's "
                              f"{optimizer.get('_target_', 'optimizer')} ran at its own default rate, which the config "
                              "does not hold (a branch cannot add optimizer.lr: it scales the run's rates by new/old); "
                              "make the run with optimizer.lr set to try a lower rate")  # fmt: skip
    return {"optimizer": {"lr": float(optimizer["lr"]) / 2}}


def _reset_moments(s: Spike) -> dict[str, Any]:
    target = str(s.config["optimizer"]["_target_"])
    if "adam" not in target.rsplit(".", 1)[-1].lower():
        raise GradrunnerError(f"reset_moments needs an Adam-like optimizer (moments to reset); the run's is {target}")
    return {"train": {"branch_reset_moments": True}}


#: The built-in interventions: the config each one's branch changes (a `# @package _global_` file's content).
INTERVENTIONS: dict[str, Callable[[Spike], dict[str, Any]]] = {
    "baseline": lambda s: {},
    "skip_batch": _skip_batch,
    "lr_half": _lr_half,
    "clip": lambda s: {"train": {"clip_grad_norm": s.median_grad_norm()}},
    "zero_tap": _zero_tap,
    "reset_moments": _reset_moments,
}
#: The interventions run by default (those that do not apply to the run are left out, and said so).
DEFAULT = tuple(INTERVENTIONS)


def find_spike(run_dir: Path, step: int | None, horizon: int) -> Spike:
    """The spike to autopsy in `run_dir` and the kept checkpoint a branch starts from; one paragraph for bad input."""
    config = source_config(run_dir)
    if horizon < 1:
        raise GradrunnerError(f"--horizon {horizon} is not allowed; it must be an integer >= 1 (steps after the spike)")
    spikes = loss_spikes(run_dir)
    starts = spike_starts(spikes)
    if step is None:
        if not starts:
            raise GradrunnerError(f"{run_dir} has no flagged loss spike; pass the step to autopsy with --step S")
        step = starts[0]
    losses = pd.read_parquet(run_dir / "steps.parquet", columns=["step", "loss"]).set_index("step")["loss"]
    first, last = (int(losses.index.min()), int(losses.index.max())) if len(losses) else (0, -1)
    if not first <= step <= last:
        raise GradrunnerError(f"--step {step} is not a step of {run_dir}: its steps are {first} to {last}; pass "
                              f"one of them (its flagged loss spikes: {', '.join(map(str, starts)) or 'none'})")  # fmt: skip
    found = branch.kept(run_dir) if (run_dir / "checkpoints").is_dir() else None
    kept = sorted(found.states) if found is not None else []
    start = max([c for c in kept if c <= step], default=first)  # none kept: the run's start
    if found is not None and start in kept:
        check_state(found, start)
    origin = f"{run_dir}:{start}"
    if start not in kept and start > 0:  # a branch run: where it branched from
        origin = str((config.get("train") or {}).get("branch_from"))
    row = spikes[spikes["step"] == step] if len(spikes) else spikes
    det = Detector(**spikes.attrs["settings"])  # the rule that flagged the run's spikes, its settings
    if len(row):
        threshold = float(row["mean"].iloc[0] + det.z * row["std"].iloc[0])
    else:  # a step that was not flagged: the rule's band just before it, over the run's losses (flagged ones out)
        for at, values in run_signals(None, rundir.read_verified(run_dir / "steps.parquet", None)):
            if at >= step:
                break
            det.observe(at, {LOSS: values[LOSS]} if LOSS in values else {})
        threshold = det.threshold(LOSS)
    tap = row["first_tap"].iloc[0] if len(row) and "first_tap" in row else None
    return Spike(run_dir, step, start, horizon, threshold, config, tap if isinstance(tap, str) else None, losses,
                 origin)  # fmt: skip


def _check_override(name: str, items: list[str], config: dict[str, Any]) -> None:
    """`--override NAME KEY=VALUE ...`: each item a KEY=VALUE of a key the run's config has (`+KEY=` adds one)."""
    whole = OmegaConf.create(config)
    for item in items:
        key, eq, _ = item.partition("=")
        if not eq or not key.lstrip("+"):
            raise GradrunnerError(f"--override {name} {item!r}: each override is KEY=VALUE, e.g. --override {name} "
                                  "optimizer.lr=0.01")  # fmt: skip
        if not key.startswith("+") and OmegaConf.select(whole, key, default=_MISSING) is _MISSING:
            parent = key.rpartition(".")[0]
            node = OmegaConf.select(whole, parent) if parent else whole
            keys = [f"{parent}.{k!s}" if parent else str(k) for k in node] if OmegaConf.is_dict(node) else []
            raise GradrunnerError(f"--override {name} {item!r}: the run's config has no key {key!r}"
                                  f"{did_you_mean(key, keys)} (add a new one with +{key}=...)")  # fmt: skip


_MISSING = object()


def plan(spike: Spike, names: Sequence[str] | None, custom: dict[str, list[str]]) -> tuple[dict[str, Any], list[str]]:
    """Each intervention's config changes, and the notes on default ones that do not apply to this run."""
    unknown = [n for n in names or () if n not in INTERVENTIONS]
    if unknown:
        raise GradrunnerError(f"unknown intervention {unknown[0]!r}; the interventions: {', '.join(INTERVENTIONS)} "
                              "(or your own: --override NAME KEY=VALUE ...)")  # fmt: skip
    chosen: dict[str, Any] = {}
    notes: list[str] = []
    for name in names if names is not None else DEFAULT:
        try:
            chosen[name] = INTERVENTIONS[name](spike)
        except GradrunnerError as e:
            if names is not None:
                raise
            notes.append(f"{name} left out: {one_paragraph(e)}")
    for name, overrides in custom.items():
        if not name.isidentifier() or name in chosen:
            raise GradrunnerError(f"--override {name!r}: an intervention's name is a new identifier, e.g. "
                                  "--override lr_tenth optimizer.lr=0.01")  # fmt: skip
        _check_override(name, overrides, spike.config)
        chosen[name] = OmegaConf.to_container(OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
    return chosen, notes


#: The sweep's primary config (in `CONF_DIR`): the source run's stored config, as a branch of it.
BASE_CONFIG = "autopsy_run"


def base_config(spike: Spike) -> dict[str, Any]:
    """The config every branch starts from: the source run's own (`done.json`'s `config`, resolved when it ran),
    as a branch from the spike's checkpoint to S+H, not today's config files (an edited YAML, a `--config-dir`
    the command cannot see). The interventions (`+autopsy=<name>`) are merged over it."""
    cfg = copy.deepcopy(spike.config)
    cfg["steps"] = spike.step + spike.horizon + 1
    cfg.setdefault("train", {}).update(branch_from=spike.origin or f"{spike.run_dir}:{spike.start}",
                                       branch_reset_moments=False)  # fmt: skip
    cfg.setdefault("anomaly", {})["replay"] = 0
    cfg.update(resume=False, report=False)
    # a run stopped on its spike (on_nonfinite=stop): its branches run through S..S+H, where a stop would end them
    cfg.setdefault("capture", {})["on_nonfinite"] = "record"
    return cfg


def sweep(spike: Spike, chosen: dict[str, Any], sweep_dir: Path) -> subprocess.CompletedProcess[str]:
    """Write the base config and each intervention as `+autopsy=<name>`; run the branches as one
    `python -m gradrunner -m` sweep."""
    conf = sweep_dir / CONF_DIR
    group = conf / "autopsy"
    group.mkdir(parents=True, exist_ok=True)
    for name, changes in chosen.items():
        (group / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(changes or {}), encoding="utf-8")
    head = {"defaults": ["gradrunner_schema", "_self_", {"override hydra/sweeper": "gradrunner"}]}
    (conf / f"{BASE_CONFIG}.yaml").write_text(yaml.safe_dump({**head, **base_config(spike)}, sort_keys=False),
                                              encoding="utf-8")  # fmt: skip
    args = [sys.executable, "-m", "gradrunner", "-m", "--config-dir", str(conf), "--config-name", BASE_CONFIG,
            f"hydra.sweep.dir={sweep_dir}", f"+autopsy={','.join(chosen)}"]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, env=os.environ.copy())


def results(spike: Spike, sweep_dir: Path, names: Sequence[str]) -> pd.DataFrame:
    """One row per intervention from its job's steps (in the sweep's job order), ranked: avoided first, then by max loss."""
    rows = []
    for job, name in enumerate(names):
        path = sweep_dir / str(job) / "steps.parquet"
        losses = pd.read_parquet(path, columns=["step", "loss"]).set_index("step")["loss"] if path.is_file() else None
        span = losses.loc[spike.step:spike.step + spike.horizon] if losses is not None else pd.Series(dtype=float)
        worst = float("inf") if span.empty or not span.map(math.isfinite).all() else float(span.max())
        rows.append({"intervention": name, "max_loss": worst, "final_loss": float(span.iloc[-1]) if len(span) else math.nan,
                     "avoided": bool(worst < spike.threshold), "job": str(job),
                     "reproduces": bool(losses is not None and spike.step in losses.index
                                        and _same(losses[spike.step], spike.losses.get(spike.step)))})  # fmt: skip
    table = pd.DataFrame(rows)
    return table.sort_values(["avoided", "max_loss"], ascending=[False, True], kind="stable").reset_index(drop=True)


def replace_stale(spike: Spike, chosen: dict[str, Any], sweep_dir: Path) -> list[str]:
    """Remove `sweep_dir` when it holds an autopsy of another plan (horizon, branch step, interventions or their
    changes, base config); the note saying so. The same plan again keeps it: its completed branches are skipped.

    Its jobs are numbered by intervention (`0/`, `1/`, ...): another plan's jobs are runs of other configs, which
    the sweep would refuse. The plan is `<sweep dir>/.autopsy_conf/plan.json`, written before the branches run.
    """
    plan_file = sweep_dir / CONF_DIR / PLAN_FILE
    now = json.dumps({"start": spike.start, "horizon": spike.horizon, "base": base_config(spike),
                      "jobs": [[name, changes] for name, changes in chosen.items()]}, sort_keys=True)  # fmt: skip
    notes = []
    if sweep_dir.exists():
        try:
            before = plan_file.read_text(encoding="utf-8")
        except OSError:
            before = None
        if before == now:
            return []
        shutil.rmtree(sweep_dir)
        notes.append(f"the earlier autopsy of step {spike.step} in {sweep_dir} (another horizon, interventions or "
                     "overrides) was replaced by this one")  # fmt: skip
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(plan_file, now)
    return notes


def _tail(text: str, limit: int = 2000) -> str:
    """The end of a child's output on one line, at most about `limit` characters, cut between words."""
    words = one_paragraph(text)
    if len(words) <= limit:
        return words
    return "... " + words[-limit:].split(" ", 1)[-1]


def _same(a: object, b: object) -> bool:
    """Whether two losses are the same value: equal, or both NaN (a NaN spike reproduced is NaN again)."""
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return False
    return float(a) == float(b) or (math.isnan(a) and math.isnan(b))


def autopsy(run_dir: str | os.PathLike[str], step: int | None = None, horizon: int = 20,
            names: Sequence[str] | None = None, custom: dict[str, list[str]] | None = None) -> pd.DataFrame:  # fmt: skip
    """Run the autopsy of `run_dir` (see the module's docstring); the ranked table (also in `autopsy.parquet`).

    Example::

        autopsy("outputs/a", horizon=10)[["intervention", "max_loss", "avoided"]]
    """
    from gradrunner.run.autopsy_page import write_page

    spike = find_spike(Path(run_dir).resolve(), step, horizon)
    chosen, notes = plan(spike, names, custom or {})
    sweep_dir = spike.run_dir / AUTOPSY_DIR / f"step{spike.step}"
    notes += replace_stale(spike, chosen, sweep_dir)
    done = sweep(spike, chosen, sweep_dir)
    if done.returncode != 0:
        raise GradrunnerError(f"the autopsy's sweep in {sweep_dir} failed (exit {done.returncode}): "
                              f"{_tail(done.stderr or done.stdout)}")  # fmt: skip
    table = results(spike, sweep_dir, list(chosen))
    table.to_parquet(sweep_dir / RESULT_FILE, index=False)
    gather(spike.run_dir, spike.step, table)
    write_page(sweep_dir / PAGE_FILE, spike, table, notes)
    table.attrs.update(notes=notes, sweep_dir=str(sweep_dir), spike=spike)
    return table


def gather(run_dir: Path, step: int, table: pd.DataFrame) -> None:
    """`<run dir>/autopsy.parquet`: every autopsy of the run, a `step` column naming its spike; this step's rows
    replace an earlier autopsy's of the same step (written to a temp name, then renamed: whole or absent)."""
    path = run_dir / RESULT_FILE
    rows = table.assign(step=step)
    if path.is_file():
        earlier = pd.read_parquet(path)
        if "step" in earlier.columns:
            rows = pd.concat([earlier[earlier["step"] != step], rows], ignore_index=True)
    temp = path.with_name(f".{RESULT_FILE}.tmp")
    rows.to_parquet(temp, index=False)
    os.replace(temp, path)


def last_word(table: pd.DataFrame) -> str:
    """What the command prints: the spike, whether the baseline reproduced it, each intervention ranked."""
    s: Spike = table.attrs["spike"]
    base = table[table["intervention"] == "baseline"]
    repro = ("" if base.empty else "; baseline reproduces the spike" if bool(base["reproduces"].iloc[0])
             else "; baseline does NOT reproduce the spike (the run is not deterministic: see anomaly.replay)")  # fmt: skip
    lines = [f"autopsy of the loss spike at step {s.step} (loss {float(s.losses.get(s.step, math.nan)):.6g}, threshold {s.threshold:.6g}), "
             f"branches from the checkpoint before step {s.start} to step {s.step + s.horizon}{repro}:"]  # fmt: skip
    for r in table.itertuples():
        lines.append(f"  {r.intervention:<14} {'avoided' if r.avoided else 'not avoided':<12} max loss {r.max_loss:.6g}"
                     f"  final loss {r.final_loss:.6g}")  # fmt: skip
    lines += [f"  note: {n}" for n in table.attrs.get("notes", [])]
    lines.append(f"  {table.attrs['sweep_dir']}/{RESULT_FILE}, {PAGE_FILE}; the branches: load('{table.attrs['sweep_dir']}')")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command; exit 0, or 2 with one paragraph on bad input."""
    p = argparse.ArgumentParser(prog="python -m gradrunner.autopsy", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="the spike's step (default: the first flagged loss spike)")
    p.add_argument("--horizon", type=int, default=20, help="steps after the spike each branch runs (default 20)")
    p.add_argument("--interventions", default=None, help=f"comma-separated, of: {', '.join(INTERVENTIONS)}")
    p.add_argument("--override", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="an intervention of your own: its name and the config overrides of its branch")
    args = p.parse_args(argv)
    try:
        names = args.interventions.split(",") if args.interventions else None
        custom = {o[0]: list(o[1:]) for o in args.override}
        print(last_word(autopsy(args.run_dir, args.step, args.horizon, names, custom)))
    except GradrunnerError as e:
        print(f"gradrunner.autopsy: error: {one_paragraph(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0
