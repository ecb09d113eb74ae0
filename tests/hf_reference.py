"""The HF Trainer tests' tiny random-init GPT-2 and `Seen`, the callback that keeps what the Trainer fed the model
(test_integration_hf, test_per_example_runs). Import it after `pytest.importorskip("transformers")`.

Example::

    model = tiny_gpt2(); seen = Seen(model)   # seen.batches, seen.grad_norms, seen.losses after trainer.train()
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


class Seen(transformers.TrainerCallback):
    """Keeps the Trainer's micro-batches (as the model saw them) and its logged grad_norm."""

    def __init__(self, model: nn.Module) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []
        self.grad_norms: list[float] = []
        self.losses: list[float] = []
        model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            self.batches.append({k: kwargs[k].clone() for k in ("input_ids", "labels")})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "grad_norm" in logs:
            self.grad_norms.append(float(logs["grad_norm"]))
            self.losses.append(float(logs["loss"]))
