"""Awkward models, data sources and losses for the robustness tests, importable as `_target_: awkward.<Name>`.

Every model takes `(batch, 8)` float inputs (or int64 token ids for `Embedder`) and returns `(batch, 1)`,
so it fits the `mlp` experiment's synthetic data; each exists to break one assumption.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from gradrunner.models import MLP


class Raises(nn.Module):
    """A forward() that raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("inputs must be in [0, 1]")


class Pair(NamedTuple):
    logits: torch.Tensor
    aux: torch.Tensor


@dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor


class Structured(nn.Module):
    """Returns a dict, a tuple, a namedtuple or a dataclass of (logits, aux)."""

    def __init__(self, kind: str = "dict") -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.lin(x)
        aux = torch.tanh(logits)
        if self.kind == "dict":
            return {"logits": logits, "aux": aux}
        if self.kind == "tuple":
            return logits, aux
        if self.kind == "namedtuple":
            return Pair(logits, aux)
        return Output(logits, aux)


class IntLocal(nn.Module):
    """A forward() with an integer local `idx`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        idx = x.argmax(-1)
        return h + 0 * idx.unsqueeze(-1)


class Gated(nn.Module):
    """`gate` is computed under torch.no_grad(), so it cannot carry a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.gate_lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gate = torch.sigmoid(self.gate_lin(x))
        out = self.lin(x) * gate
        return out


class GatedNet(nn.Module):
    """`Gated` as a submodule, so a glob (`*:gate`) can select its no-grad local."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Gated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Embedder(nn.Module):
    """Takes int64 token ids `(batch, tokens)`: its input cannot carry a gradient."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


class FrozenBackbone(nn.Module):
    """A head trained over a frozen block the model keeps in eval mode (BatchNorm and Dropout), as fine-tuning does."""

    def __init__(self, in_features: int = 8, hidden: int = 16, **ignored: Any) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.5)
        )
        self.backbone.requires_grad_(False)
        self.backbone.eval()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def two_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A finite list of exactly two (inputs, targets) batches of 4 rows, the first with targets x 10."""
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(4, 8, generator=g), 10 * torch.randn(4, 1, generator=g)),
            (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))]  # fmt: skip


def frozen_mlp(**kwargs: Any) -> nn.Module:
    """An MLP with every parameter frozen: its loss does not require grad."""
    model = MLP(**kwargs)
    model.requires_grad_(False)
    return model


def compiled_mlp(**kwargs: Any) -> nn.Module:
    """An MLP that compiles itself with torch.compile (compilation itself happens at the first call)."""
    return torch.compile(MLP(**kwargs))  # type: ignore[return-value]


def scripted_mlp(**kwargs: Any) -> nn.Module:
    """An MLP scripted with TorchScript."""
    return torch.jit.script(MLP(**kwargs))  # type: ignore[no-any-return]


class EmptyData:
    """A data source whose batches() yields nothing."""

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(())


class NotPairs:
    """A data source that yields inputs alone, not (inputs, targets) pairs."""

    def batches(self, device: torch.device, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        while True:
            yield torch.randn(4, 8, device=device, dtype=dtype)


class NaNAfter(nn.Module):
    """Mean squared error that turns NaN from its `after`-th call on (a run diverging part-way)."""

    def __init__(self, after: int = 2) -> None:
        super().__init__()
        self.after = after
        self.calls = 0

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = torch.nn.functional.mse_loss(output, target)
        return loss * float("nan") if self.calls > self.after else loss


class SqrtAtZero(nn.Module):
    """A finite loss (0) whose gradient is infinite: sqrt'(0) = inf."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(output - output.detach()).sum()


class InPlaceBreaksBackward(nn.Module):
    """Multiplies sigmoid's output in place, though sigmoid saved it for backward: backward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.lin(x))
        h.mul_(2)
        return h


def dead_relu_mlp(depth: int = 3, dead: int = 2) -> nn.Module:
    """The built-in MLP (8 -> 32 ... -> 1) whose `fc{dead}` bias is -1000: `relu{dead}` outputs 0 for any input."""
    model = MLP(in_features=8, hidden=32, depth=depth, out_features=1)
    with torch.no_grad():
        getattr(model, f"fc{dead}").bias.fill_(-1000.0)
    return model


class DictDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """`n` seeded examples as dicts `{"x": (8,), "labels": (1,)}`: a DataLoader over it yields dict batches."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class KwargsModel(nn.Module):
    """A linear layer called with keyword arguments: `model(x=..., labels=..., scale=...)` (labels unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale
