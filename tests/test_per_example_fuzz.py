"""Per-example norms of random row-separable float64 models (`per_example_rows`' walk): each number matches the
reference, or is null; and the coincidences a fuzz of such models found (2026-11-28).

The reference (`reference`): the whole batch's forward, each row's loss scaled to its share (loss_i / B) backwarded
alone with `torch.autograd.grad`; for a row-separable model (checked: `model(x[i:i+1]) == model(x)[i]`) that is the
per-example loop's (`per_example_reference.loop`), also where a one-row forward cannot run the same ops (B == T).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from per_example_reference import all_params, batched, loop
from torch import nn


def _row_sq(out: torch.Tensor, i: int) -> torch.Tensor:
    target = torch.linspace(-1, 1, out[0].numel(), dtype=out.dtype).view(out.shape[1:]) * (i + 1)
    return (out - target).square().sum()


class HiddenOperand(nn.Module):
    """`lin` on the model's input (B == T) combined elementwise with a parameter broadcast over it: transposed first
    (`x.transpose(0, 1) + p`: dim 0 is the sequence; lin's output transposed back) or not (`x + p`: the batch's rows)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.p, self.lin, self.head = how, nn.Parameter(torch.randn(3)), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.transpose(0, 1) if self.how.startswith("T") else x
        h = {
            "+": lambda: t + self.p, "*": lambda: t * self.p, "-": lambda: self.p - t,
            "tanh(+)": lambda: torch.tanh(t + self.p), "(+).contiguous()": lambda: (t + self.p).contiguous(),
            "where": lambda: torch.where(t > 0, t, self.p),
        }[self.how.removeprefix("T ")]()  # fmt: skip
        y = self.lin(h)
        return self.head(torch.tanh(y.transpose(0, 1) if self.how.startswith("T") else y))  # type: ignore[no-any-return]


HOWS = ["+", "*", "-", "tanh(+)", "(+).contiguous()", "where"]


@pytest.mark.parametrize("how", [f"T {h}" for h in HOWS] + HOWS)
def test_a_layer_on_the_input_combined_with_a_parameter_when_the_batch_size_equals_the_length(how: str) -> None:
    """B == T: `lin(x.transpose(0, 1) + p)` got numbers (found 2026-11-28 with the fuzz: lin's weight 4.88, 1.66, 1.57,
    5.57 for true 0.46, 1.86, 2.39, 2.17; `* p` 2.62, 2.04, 1.14, 4.10 for 0.89, 2.22, 4.65, 2.62): no autograd node
    shows the transposed input. Null now (`*` saves it; `+`'s output has the input's layout, dim 0 not outermost);
    `lin(x + p)`, `x * p`, `p - x`, `where(x > 0, x, p)` stay exact."""
    torch.manual_seed(0)
    model, inputs = HiddenOperand(how).double(), {"x": torch.randn(4, 4, 3, dtype=torch.float64)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    ref = reference(model, inputs, params)
    assert separable(model, inputs)
    for name in ("lin:weight", "lin:bias", "head:weight", "head:bias"):
        if how.startswith("T"):  # (the head too: which dim is the batch's is not tracked through a transpose, README)
            assert got[name] is None and "dim 0" in str(reasons[name]), (name, reasons[name])
            continue
        assert got[name] is not None, (name, reasons[name])
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


class NoHistoryStack(nn.Module):
    """`lin` on the model's input (which needs no grad) stacked or broadcast over a new dim 0 of k == B, summed back: a
    tensor without autograd history, the batch's dim 0 pushed to dim 1."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.lin, self.head = how, nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.stack([x, x * 2], 0) if self.how == "stack" else x.unsqueeze(0).expand(2, -1, -1, -1)
        return self.head(torch.tanh(self.lin(w)).sum(0))  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["stack", "expand"])
def test_a_layer_on_the_input_stacked_over_a_new_dim_0_without_history(how: str) -> None:
    """B == k == 2, T == 5: found 2026-11-28, `lin` got numbers (stack: 4.45, 8.91 for true 2.83, 14.57; expand: the same
    norm for both rows) as its input, made without autograd history, was trusted while B equals no dim of the model's
    input. Null now; the head stays exact."""
    torch.manual_seed(0)
    model, inputs = NoHistoryStack(how).double(), {"x": torch.randn(2, 5, 3, dtype=torch.float64)}
    params = all_params(model)
    got, reasons = batched(model, inputs, _row_sq, params)
    for name in ("lin:weight", "lin:bias"):
        assert got[name] is None and "without autograd history" in str(reasons[name]), (name, reasons[name])
    ref = loop(model, inputs, _row_sq, params)[0]
    got_head = got["head:weight"]
    assert got_head is not None, reasons["head:weight"]
    torch.testing.assert_close(got_head, ref["head:weight"], rtol=1e-9, atol=1e-12)


class AfterTheTranspose(nn.Module):
    """`lin` on the batch's states with dim 0 transposed away (B == T), through an op of one operand that keeps the
    shape, or a pad of the features, or a product by a matrix (`h @ w`); lin's output transposed back."""

    def __init__(self, op: str, transposed: bool) -> None:
        super().__init__()
        self.op, self.transposed, self.w = op, transposed, nn.Parameter(torch.randn(3, 3))
        self.inp, self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not self.transposed:
            return self.head(torch.tanh(self.lin(OPS[self.op](h, self.w))))  # type: ignore[no-any-return]
        t = OPS[self.op](h.transpose(0, 1), self.w)
        return self.head(torch.tanh(self.lin(t).transpose(0, 1)))  # type: ignore[no-any-return]


OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "pow": lambda t, w: t.pow(2), "exp": lambda t, w: t.exp(), "abs": lambda t, w: t.abs(), "neg": lambda t, w: -t,
    "clamp": lambda t, w: t.clamp(-0.5, 0.5), "rsqrt": lambda t, w: (t.abs() + 1).rsqrt(), "erf": lambda t, w: t.erf(),
    "masked_fill": lambda t, w: t.masked_fill(t.abs() < 0.2, 0.0), "layer_norm": lambda t, w: F.layer_norm(t, (3,)),
    "pad": lambda t, w: F.pad(t, (0, 1))[..., 1:], "h @ w": lambda t, w: t @ w,
}  # fmt: skip


@pytest.mark.parametrize("transposed", [True, False], ids=["B == T transposed", "B == T kept"])
@pytest.mark.parametrize("op", list(OPS))
def test_the_walk_goes_past_ops_that_keep_the_shape(op: str, transposed: bool) -> None:
    """Found 2026-11-28: the walk ended at any op of one operand outside a short list (`pow`, `exp`, `clamp`,
    `masked_fill`, F.layer_norm without weight, F.pad, `h @ w`), so `lin(op(h.transpose(0, 1)))` with B == T got wrong
    numbers (pow: lin's weight 1.26, 0.71, 0.86, 1.05 for true 0.39, 0.75, 1.55, 1.58). Null now; without the transpose
    every parameter stays exact."""
    torch.manual_seed(0)
    model, inputs = AfterTheTranspose(op, transposed).double(), {"x": torch.randn(4, 4, 3, dtype=torch.float64)}
    params = [p for p in all_params(model) if not p[0].endswith(":w")]
    got, reasons = batched(model, inputs, _row_sq, params)
    ref = reference(model, inputs, params)
    assert separable(model, inputs)
    names = ("lin:weight", "lin:bias", "head:weight", "head:bias") if transposed else ()
    for name in names:  # (the head too: which dim is the batch's is not tracked through the transposes, README)
        assert got[name] is None and "dim 0 was moved there" in str(reasons[name]), (name, reasons[name])
    for name in [n for n, _, _ in params if n not in names]:
        assert got[name] is not None, (name, reasons[name])
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


class PastAProduct(nn.Module):
    """`lin` on the batch's states with dim 0 transposed away (B == T) and then through a product whose output's dim 0 is
    an operand's (a batched matmul, a convolution, `addmm`, `F.bilinear`, a norm with a weight, an upsampling, `glu`,
    `prelu`); lin's output
    transposed back."""

    def __init__(self, op: str, transposed: bool) -> None:
        super().__init__()
        self.op, self.transposed = op, transposed
        self.w, self.b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
        self.k, self.w3 = nn.Parameter(torch.randn(1, 1, 3)), nn.Parameter(torch.randn(3, 3, 3))
        self.inp, self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not self.transposed:
            return self.head(torch.tanh(self.lin(PRODUCTS[self.op](h, self))))  # type: ignore[no-any-return]
        t = PRODUCTS[self.op](h.transpose(0, 1), self)
        return self.head(torch.tanh(self.lin(t).transpose(0, 1)))  # type: ignore[no-any-return]


PRODUCTS: dict[str, Callable[[torch.Tensor, PastAProduct], torch.Tensor]] = {
    "conv1d": lambda t, m: F.conv1d(t.reshape(-1, 1, 3), m.k, padding=1).view(t.shape),
    "bmm": lambda t, m: torch.bmm(t, m.w.expand(t.shape[0], 3, 3)),
    "baddbmm": lambda t, m: torch.baddbmm(t, t, m.w.expand(t.shape[0], 3, 3)),
    "matmul 3-D": lambda t, m: t @ m.w.expand(t.shape[0], 3, 3),
    "einsum bij": lambda t, m: torch.einsum("btd,bde->bte", t, m.w.expand(t.shape[0], 3, 3)),
    "addmm": lambda t, m: torch.addmm(m.b, t.reshape(-1, 3), m.w).view(t.shape),
    "bilinear": lambda t, m: F.bilinear(t, t, m.w3),
    "layer_norm(w)": lambda t, m: F.layer_norm(t, (3,), m.b, m.b),
    "interpolate": lambda t, m: F.interpolate(t, size=6)[..., ::2], "glu": lambda t, m: F.glu(torch.cat([t, 2 * t], -1)),
    "prelu": lambda t, m: F.prelu(t, m.b[:1]),
}  # fmt: skip


@pytest.mark.parametrize("transposed", [True, False], ids=["B == T transposed", "B == T kept"])
@pytest.mark.parametrize("op", list(PRODUCTS))
def test_the_walk_finds_a_transpose_past_a_product(op: str, transposed: bool) -> None:
    """Found 2026-11-28: the walk ended at a batched matmul or a convolution (README's 'not detected' list), so
    `lin(bmm(h.transpose(0, 1), w))` with B == T got wrong numbers (lin's weight 2.79, 1.65, 2.09, 1.31 for true 0.66,
    1.58, 1.26, 0.53; conv1d 2.54, 0.26, 0.33, 2.58 for 0.85, 0.74, 1.13, 0.94). Null now, the reason naming the product;
    without the transpose every parameter stays exact."""
    torch.manual_seed(0)
    model, inputs = PastAProduct(op, transposed).double(), {"x": torch.randn(4, 4, 3, dtype=torch.float64)}
    params = [p for p in all_params(model) if p[0].split(":")[0] in ("inp", "lin", "head")]
    got, reasons = batched(model, inputs, _row_sq, params)
    ref = reference(model, inputs, params)
    assert separable(model, inputs)
    names = ("lin:weight", "lin:bias", "head:weight", "head:bias") if transposed else ()
    for name in names:
        assert got[name] is None and "dim 0 was moved there" in str(reasons[name]), (name, reasons[name])
    assert not transposed or "whose output's dim 0 is that operand's" in str(reasons["lin:weight"])
    for name in [n for n, _, _ in params if n not in names]:
        assert got[name] is not None, (name, reasons[name])
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


class StackedProduct(nn.Module):
    """`lin` on a batched matmul of the batch's two summaries stacked over a new dim 0 (k == 2: the batch pushed to dim
    1), or broadcast there, or stacked along dim 1 (the batch's rows kept); summed over the stack."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.w, self.b = how, nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
        self.inp, self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        at = 1 if self.how == "stack(1)" else 0
        s = torch.stack([h.mean(1), h.amax(1)], at) if self.how != "expand" else h.mean(1)[None].expand(2, -1, -1)
        w = self.w.expand(s.shape[0], 3, 3)
        p = torch.baddbmm(self.b, s, w) if self.how == "baddbmm" else torch.bmm(s, w)
        return self.head(torch.tanh(self.lin(p).sum(at)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["stack(0)", "expand", "baddbmm", "stack(1)"])
def test_a_stack_over_a_new_dim_0_of_the_batch_size_past_a_batched_matmul(how: str) -> None:
    """k == B == 2, found 2026-11-28: `lin(bmm(torch.stack([a, b]), w))` got numbers (lin's weight 2.46, 3.45 for true
    0.30, 1.12), its dim 0 the stack's. Null now; stacked along dim 1 the rows are the batch's: exact."""
    torch.manual_seed(0)
    model, inputs = StackedProduct(how).double(), {"x": torch.randn(2, 5, 3, dtype=torch.float64)}
    params = [p for p in all_params(model) if p[0].split(":")[0] in ("inp", "lin", "head")]
    got, reasons = batched(model, inputs, _row_sq, params)
    ref = loop(model, inputs, _row_sq, params)[0]
    names = ("lin:weight", "lin:bias") if how != "stack(1)" else ()
    for name in names:
        assert got[name] is None and "pushed to dim 1" in str(reasons[name]), (name, reasons[name])
    for name in [n for n, _, _ in params if n not in names]:
        assert got[name] is not None, (name, reasons[name])
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def reference(model: nn.Module, inputs: dict[str, torch.Tensor], params) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Each row's share: the whole batch's forward, row i's loss / B backwarded alone (`torch.autograd.grad`); norms."""
    out = model(**inputs)
    rows, tensors = out.shape[0], [p for _, _, p in params]
    norms: dict[str, list[float]] = {n: [] for n, _, _ in params}
    for i in range(rows):
        grads = torch.autograd.grad(_row_sq(out[i : i + 1], i) / rows, tensors, retain_graph=True, allow_unused=True)
        for (name, _, _), g in zip(params, grads, strict=True):
            norms[name].append(0.0 if g is None else float(g.double().norm()))
    return {n: torch.tensor(v, dtype=torch.float64) for n, v in norms.items()}


def separable(model: nn.Module, inputs: dict[str, torch.Tensor]) -> bool:
    """Whether each row's output is the model's on that row alone (then `reference` is the per-example loop's)."""
    with torch.no_grad():
        full = model(**inputs)
        for i in range(full.shape[0]):
            one = model(**{k: v[i : i + 1] for k, v in inputs.items()})
            if one.shape != full[i : i + 1].shape or not torch.allclose(one, full[i : i + 1], rtol=1e-10, atol=1e-12):
                return False
    return True


class Random(nn.Module):
    """1 to 3 steps drawn by `rnd`, each a Linear on the states (B, T, 3) or on their dim 0 moved away (transpose,
    permute), after an op of `OPS`, or a parameter added or multiplied (broadcast), a stack over a new dim 0 (summed
    back), flattened tokens; the first step on the model's input itself (no autograd history) or on a Linear of it."""

    STEPS = ("plain", "transpose", "permute", "+ p", "* p", "stack", "flat", *OPS)

    def __init__(self, rnd: random.Random) -> None:
        super().__init__()
        self.raw = rnd.random() < 0.5
        self.steps = [rnd.choice(self.STEPS) for _ in range(rnd.randint(1, 3))]
        self.moved = [rnd.random() < 0.5 for _ in self.steps]
        self.inp, self.w, self.p = nn.Linear(3, 3), nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
        self.lins, self.head = nn.ModuleList(nn.Linear(3, 3) for _ in self.steps), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.raw else torch.tanh(self.inp(x))
        for step, moved, lin in zip(self.steps, self.moved, self.lins, strict=True):
            t = h.permute(1, 0, 2) if step == "permute" else h.transpose(0, 1) if moved or step == "transpose" else h
            back = step in ("permute", "transpose") or moved
            if step == "stack":
                y = lin(torch.stack([t, t * 2], 0)).sum(0)
            elif step == "flat":
                y = lin(t.reshape(-1, 3)).view(t.shape)
            elif step in ("+ p", "* p"):
                y = lin(t + self.p if step == "+ p" else t * self.p)
            else:
                y = lin(OPS[step](t, self.w) if step in OPS else t)
            h = torch.tanh(y.transpose(0, 1) if back else y)
        return self.head(h)  # type: ignore[no-any-return]


def test_random_models_get_the_reference_norms_or_null() -> None:
    """A seeded slice of the fuzz (/tmp/hunt_pexfuzz2/fuzz.py, 2026-11-28: 3000 models of 43 kinds of op, none wrong
    after these fixes): every number matches the reference (1e-9 relative, float64); before these fixes seeds 23, 35 and others got wrong ones."""
    table: list[tuple[int, str, str]] = []
    numbers = nulls = 0
    for seed in range(40):
        rnd = random.Random(seed)
        torch.manual_seed(seed)
        rows = rnd.choice([1, 2, 3, 4])
        length = rnd.choice([rows, rows, 2, 3, 5])
        model, inputs = Random(rnd).double(), {"x": torch.randn(rows, length, 3, dtype=torch.float64)}
        params = [p for p in all_params(model) if p[0] not in (":w", ":p")]
        got, reasons = batched(model, inputs, _row_sq, params)
        if not separable(model, inputs):
            continue
        ref = reference(model, inputs, params)
        for name, expected in ref.items():
            actual = got[name]
            if actual is None:
                nulls += 1
            elif not torch.allclose(actual, expected, rtol=1e-9, atol=1e-12 * float(expected.max())):
                table.append((seed, f"{model.steps} raw={model.raw} B={rows} T={length}", name))
            else:
                numbers += 1
    assert not table, table
    assert numbers > 100 and nulls > 0, (numbers, nulls)  # (148 and 164: half the steps move dim 0 away)
