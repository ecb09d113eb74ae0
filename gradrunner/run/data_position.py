"""Where a job's data streams are, so that a resumed job takes them up at exactly the batch it left.

A resume rebuilds the data source from its seed and replays the batches the checkpoint had consumed.
A source whose order depends on torch's global generator would replay differently: a
`DataLoader(shuffle=True)` draws each epoch's order from it when the epoch starts (and a
`DataLoader(num_workers>0)` its workers' seeds), while between batches the training step (dropout,
seeded edits) and evaluation move it on. `Watched` notes the generator's state before each batch
that drew from it; `replay` sets that state before the same batch, so every epoch starts as it did
in the first run (the job's generators are restored from the checkpoint afterwards).

Scope, measured by the test of issue 36 item 3 against an uninterrupted run: what a source draws
from torch's CPU generator (samplers, worker seeds, torch-based random transforms in the main
process). numpy's and Python's global generators are restored at the checkpoint but not watched
batch by batch: a sampler that draws its order from them is not replayed exactly. Batches that drew
are at most `MAX_DRAWS` (an epoch start draws once; a random transform in the main process draws
for every batch): beyond that a checkpoint cannot be resumed exactly, and `overflow` says so.

Example::

    job.batches = batches = Watched(job.batches)
    ...; saved = batches.state()         # into the checkpoint
    Watched(rebuilt).replay(saved)       # the next batch is the one the first run took next
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gradrunner.errors import GradrunnerError

#: Batches whose draw from torch's generator a checkpoint keeps (5 kB each).
MAX_DRAWS = 1024


class Watched:
    """An iterator over `inner` that counts its batches and notes the generator's state before each that drew."""

    def __init__(self, inner: Iterator[Any], name: str = "data") -> None:
        self.inner, self.name = inner, name
        self.consumed = 0
        self.draws: list[tuple[int, torch.Tensor]] = []
        self.overflow = False

    def __iter__(self) -> Watched:
        return self

    def __next__(self) -> Any:
        before = torch.get_rng_state()
        item = next(self.inner)
        if not torch.equal(before, torch.get_rng_state()):
            if len(self.draws) < MAX_DRAWS:
                self.draws.append((self.consumed, before))
            else:
                self.overflow = True
        self.consumed += 1
        return item

    def state(self) -> dict[str, Any]:
        """What `replay` needs (tensors and plain values: a checkpoint loads it with `weights_only=True`)."""
        return {"consumed": self.consumed, "draws": list(self.draws), "overflow": self.overflow}

    def replay(self, state: dict[str, Any]) -> None:
        """Take `state["consumed"]` batches as the first run took them; a source that draws elsewhere is refused.

        Raises `GradrunnerError` when the rebuilt source draws from torch's generator at other batches
        than the first run did (a source that is not the same sequence when rebuilt from its seed).
        """
        recorded = {int(i): s for i, s in state["draws"]}
        for i in range(int(state["consumed"])):
            if i in recorded:
                torch.set_rng_state(recorded[i])
            before = torch.get_rng_state()
            next(self.inner)
            drew = not torch.equal(before, torch.get_rng_state())
            if drew != (i in recorded) and not state["overflow"]:
                raise GradrunnerError(
                    f"resume: the {self.name} source, rebuilt from its seed, "
                    f"{'drew' if drew else 'did not draw'} from torch's random generator at batch {i}, where the first "
                    f"run {'did not' if drew else 'did'}: "
                    "it is not the same sequence of batches again, so the job cannot be resumed exactly. Make the "
                    "data source deterministic given the seed, or delete the .checkpoint folder of the run dir and "
                    "run with resume=true to run the job again from step 0."
                )
        self.consumed = int(state["consumed"])
        self.draws, self.overflow = list(recorded.items()), bool(state["overflow"])
