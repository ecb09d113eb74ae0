"""What one Hydra composition of the app's config costs, with and without `hydra_adapter.yaml_parsed_once`.

    python benchmarks/compose.py                 # about 20 s
    python benchmarks/compose.py --tiny          # CI smoke run
    python benchmarks/compose.py --cpu-time      # this thread's CPU time (a shared machine)

Each step composes `config` with `+experiment=mlp` (and the `hydra.*` node, as the app composes it)
through `hydra.compose` in a fresh Hydra context. `hydra`: as Hydra composes, every config file parsed
again; `yaml_parsed_once`: inside the block, each file's text parsed once in this process (blocks
interleaved with Hydra's, their first step untimed, so the texts are parsed by then). Milliseconds
per composition, medians, and the ratio to `hydra`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, no_context, parse_args, report
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from gradrunner.run.hydra_adapter import yaml_parsed_once


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-time", action="store_true", help="time by this thread's CPU time, not wall time")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _options)
    repeats = args.repeats or (2 if args.tiny else 12)
    overrides = ["+experiment=mlp"]

    def step() -> None:
        with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
            compose("config", overrides=overrides, return_hydra_config=True)

    with initialize_config_module(config_module="gradrunner.conf", version_base="1.3"):
        reference = OmegaConf.to_yaml(compose("config", overrides=overrides, return_hydra_config=True))
        with yaml_parsed_once():
            compose("config", overrides=overrides, return_hydra_config=True)
            again = OmegaConf.to_yaml(compose("config", overrides=overrides, return_hydra_config=True))
    assert again == reference, "yaml_parsed_once composed another config"
    clock = time.thread_time if args.cpu_time else time.perf_counter
    times = interleaved({"hydra": (no_context, step), "yaml_parsed_once": (yaml_parsed_once, step)},
                        repeats, clock=clock)  # fmt: skip
    base = statistics.median(times["hydra"])
    rows: list[dict[str, Any]] = [
        {"variant": name, "compositions": len(ts), "median_ms": statistics.median(ts) * 1e3,
         "min_ms": min(ts) * 1e3, "ratio": statistics.median(ts) / base}
        for name, ts in times.items()
    ]  # fmt: skip
    report("compose", rows, ["variant", "compositions", "median_ms", "min_ms", "ratio"], args.out,
           clock="thread CPU" if args.cpu_time else "wall")  # fmt: skip


if __name__ == "__main__":
    main()
