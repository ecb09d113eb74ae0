"""Parameter groups for weight decay: `optimizer.no_decay` names the parameters that get none.

Recipes decay the weights of matrix multiplications and embeddings, not biases and normalization
layers (nanoGPT, the HF Trainer's `get_decay_parameter_names`). `optimizer.no_decay` is a list of

- `bias`: every parameter named `bias`;
- `norm`: every parameter of a normalization layer, a module whose class or a base class has `Norm`
  in its name (`LayerNorm`, `RMSNorm`, `GroupNorm`, `BatchNorm2d`, `LlamaRMSNorm`, ...);
- a glob over full parameter names (`transformer.wte.weight`, `*.ln_*`, `*embed*`).

The runner then builds the optimizer over two groups: the rest, with the optimizer's own
`weight_decay`, and those, with `weight_decay: 0.0`. Without `no_decay` (or with `[]`) it is built
over `model.parameters()`, as the optimizer alone would be.

Example::

    groups = decay_groups(model, ["bias", "norm"])        # [{"params": [...]}, {"params": [...], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from gradrunner.capturing.taps import is_glob
from gradrunner.errors import GradrunnerError

#: The selectors `no_decay` knows besides globs.
KINDS = ("bias", "norm")


def is_norm(module: nn.Module) -> bool:
    """Whether `module` is a normalization layer: a class in its MRO has "Norm" in its name.

    Example::

        is_norm(nn.LayerNorm(4)), is_norm(nn.BatchNorm2d(4)), is_norm(nn.Linear(2, 2))   # True, True, False
    """
    return any("Norm" in c.__name__ for c in type(module).__mro__ if issubclass(c, nn.Module))


def no_decay_names(model: nn.Module, no_decay: list[str]) -> set[str]:
    """The full names of the parameters `no_decay` selects (each selector must select one at least).

    Example::

        no_decay_names(gpt2, ["bias", "norm"])    # {'transformer.h.0.ln_1.weight', 'transformer.h.0.attn.c_attn.bias', ...}
    """
    names = [n for n, _ in model.named_parameters()]
    norms = {f"{m}.{p}" if m else p for m, module in model.named_modules() if is_norm(module)
             for p, _ in module.named_parameters(recurse=False)}  # fmt: skip
    chosen: set[str] = set()
    for selector in no_decay:
        if not isinstance(selector, str):
            raise GradrunnerError(f"optimizer.no_decay entry {selector!r} is not allowed; give bias, norm or a glob "
                                  "over parameter names, e.g. optimizer.no_decay=[bias,norm].")  # fmt: skip
        if selector == "bias":
            hit = {n for n in names if n.rsplit(".", 1)[-1] == "bias"}
        elif selector == "norm":
            hit = {n for n in names if n in norms}
        else:
            hit = {n for n in names if fnmatch.fnmatchcase(n, selector)} if is_glob(selector, names) else {selector} & set(names)
        if not hit:
            raise GradrunnerError(
                f"optimizer.no_decay entry {selector!r} selects no parameter of {type(model).__name__}; give bias, "
                f"norm or a glob over its parameter names (e.g. {names[0] if names else 'weight'!r}), "
                "listed by python -m gradrunner.taps."
            )
        chosen |= hit
    return chosen


def decay_groups(model: nn.Module, no_decay: list[str]) -> list[dict[str, Any]]:
    """The model's parameters in two groups: decayed (the optimizer's `weight_decay`), and `no_decay`'s with 0.

    Example::

        torch.optim.AdamW(decay_groups(model, ["bias", "norm"]), weight_decay=0.1)

    A group left empty is left out; parameters keep `model.named_parameters()`'s order within each group.
    """
    skip = no_decay_names(model, no_decay)
    decay = [p for n, p in model.named_parameters() if n not in skip]
    plain = [p for n, p in model.named_parameters() if n in skip]
    groups: list[dict[str, Any]] = [{"params": decay}] if decay else []
    return groups + ([{"params": plain, "weight_decay": 0.0}] if plain else [])
