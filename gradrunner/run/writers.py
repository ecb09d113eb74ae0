"""The run's two writers: where a run writes (`RunFiles`) and its grads and steps writers, opened together.

Example::

    files = RunFiles(run_dir, {"run_id": "r", "experiment": "mlp", ...}, run_metadata(yaml, seed=0))
    grads, steps = open_writers(stack, files)      # closed together by `stack`

The step engine (`run.engine`) opens them; a DDP rank's are `GatheredWriter`s (rank 0 writes every rank's rows).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradrunner.records.columns import GRADS_FILE, STEPS_FILE
from gradrunner.run import distributed

if TYPE_CHECKING:
    from gradrunner.records.writer import RecordWriter, StepsWriter
    from gradrunner.run.distributed import Distributed, GatheredWriter


@dataclass(frozen=True)
class RunFiles:
    """What every writer of one run is made with: where, the constant columns, the metadata, the optional columns.

    Example::

        files = RunFiles(run_dir, {"run_id": "r", "experiment": "mlp", ...}, run_metadata(yaml, seed=0))
        files.grads_writer()          # run_dir/grads.parquet; files.grads_writer(path): a segment file
    """

    directory: Path
    constants: dict[str, str]
    metadata: dict[str, str]
    per_example: bool = False
    histogram: bool = False

    @property
    def run_id(self) -> str:
        return self.constants["run_id"]

    def grads_writer(self, path: Path | None = None) -> RecordWriter:
        from gradrunner.records.writer import RecordWriter  # pyarrow: imported once writing starts

        return RecordWriter(path or self.directory / GRADS_FILE, constants=self.constants, metadata=self.metadata,
                            per_example=self.per_example, histogram=self.histogram)  # fmt: skip

    def steps_writer(self, path: Path | None = None) -> StepsWriter:
        from gradrunner.records.writer import StepsWriter

        return StepsWriter(path or self.directory / STEPS_FILE, constants=self.constants, metadata=self.metadata)


def open_writers(
    stack: contextlib.ExitStack, files: RunFiles, dist: Distributed | None = None
) -> tuple[RecordWriter | GatheredWriter, StepsWriter | GatheredWriter]:
    """The run's grads and steps writers, closed together by `stack` (both kept, with the same steps, or both dropped).

    Example::

        grads, steps = open_writers(stack, files)          # under DDP (dist): every rank calls, rank 0 writes

    Under DDP each rank gets a `GatheredWriter`; rank 0's gathers every rank's rows into the real files.
    """
    from gradrunner.records.table_writer import closing_together

    main = dist is None or dist.is_main
    grads = files.grads_writer() if main else None
    steps = files.steps_writer() if main else None
    if grads is not None and steps is not None:
        stack.enter_context(closing_together(grads, steps))
    if dist is None:
        assert grads is not None and steps is not None
        return grads, steps
    pending: list[tuple[GatheredWriter, str, list[Any]]] = []
    gathered = distributed.GatheredWriter
    return gathered(dist, grads, pending), gathered(dist, steps, pending, completes_step=True)
