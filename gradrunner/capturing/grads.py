"""`Grads`: the gradients a `Capture` kept for the last step, by tap and call.

Example::

    cap.grads["fc1:output"]          # call 0's gradient (None: no gradient, or the tap did not fire)
    cap.grads.calls("act:output")    # every call's, in firing order

A session made with `keep_grads=False` keeps none: reading one is a `GradrunnerError`, never a None that would
read as "no gradient".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from gradrunner.errors import GradrunnerError
from gradrunner.records.columns import TapKey


class Grads(Mapping[str, "torch.Tensor | None"]):
    """Gradients of the last captured step: `grads[tap]` (call 0), `grads[tap, n]`, `grads.calls(tap)`.

    Example::

        cap.grads["relu1:output"]        # tensor or None (the tap took no part in the loss)
        cap.grads.calls("act:output")    # [call 0's gradient, call 1's, ...]
    """

    def __init__(
        self, taps: Sequence[str], slots: Sequence[tuple[TapKey, torch.Tensor | None]], kept: bool = True
    ) -> None:
        self._kept = kept  # False: the session keeps no gradients (`keep_grads=False`)
        self._calls: dict[str, list[torch.Tensor | None]] = {t: [] for t in taps}
        for key, grad in slots:
            self._calls.setdefault(key.tap, []).append(grad)

    def calls(self, tap: str) -> list[torch.Tensor | None]:
        """Every call's gradient for `tap`, in firing order (empty if the tap never fired)."""
        self._check(tap)
        return list(self._calls[tap])

    def _check(self, tap: str) -> None:
        if tap not in self._calls:
            raise KeyError(f"{tap!r} is not a tap of this capture; taps: {', '.join(self._calls) or 'none'}")
        if not self._kept:
            raise GradrunnerError(
                f"cap.grads[{tap!r}]: this session was made with keep_grads=False, which keeps no gradients, only their "
                "statistics (cap.records()); make it with keep_grads=True (the default) to read cap.grads"
            )

    def __getitem__(self, item: str | tuple[str, int]) -> torch.Tensor | None:
        tap, call = (item, 0) if isinstance(item, str) else item
        self._check(tap)
        calls = self._calls[tap]
        if call >= len(calls):
            if call == 0:
                return None  # the tap never fired (its module was not called)
            raise KeyError(f"tap {tap!r} fired {len(calls)} time(s) in the last step; there is no call {call}")
        return calls[call]

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)
