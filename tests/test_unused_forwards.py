"""A forward with gradients on that no backward of the step uses (a metric computed in eval mode after the
backward, a step skipped on a bad loss before its backward) belongs to that step: it is not carried into the
next step's records, where it used to take call 0 ("takes no part in the loss") and push the next training
forward to call 1. Reference: plain tensor hooks, which number every step's training forward call 0.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import regression_batches as _batches
from conftest import tanh_mlp as _model
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradrunner import capture, record
from gradrunner.analysis import load
from gradrunner.capturing import torch_compat


def _reference(batches: list[tuple[torch.Tensor, torch.Tensor]], skip: int | None = None) -> list[float]:
    """Each trained step's gradient norm of layer 0's output, by a plain tensor hook (no gradrunner)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list[float] = []
    for i, (x, y) in enumerate(batches):
        if i == skip:
            continue
        h = model[0](x)
        h.register_hook(lambda g: norms.append(float(g.norm())))
        nn.functional.mse_loss(model[2](model[1](h)), y).backward()
        opt.step()
        opt.zero_grad()
    return norms


def test_a_metric_forward_after_the_backward_is_not_the_next_steps_call_0(strategy: str) -> None:
    batches = _batches(3)
    expected = _reference(batches)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    with capture(model, ["0:output"], strategy=strategy) as cap:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            model.eval()
            model(x)  # a metric, gradients on, no backward
            model.train()
            opt.step()
            opt.zero_grad()
            recs = cap.records(loss)
            got.append([(r["call"], r["has_grad"], r["norm"]) for r in map(recs.row, range(len(recs)))])
    for step, (rows, norm) in enumerate(zip(got, expected, strict=True)):
        assert [r[:2] for r in rows] == [(0, True)], f"step {step}: {rows}"
        assert rows[0][2] == pytest.approx(norm, rel=1e-6), f"step {step}"


@pytest.mark.parametrize("variant", ["metric_after_backward", "skipped_step"])
def test_record_numbers_each_steps_training_forward_call_0(tmp_path: Path, strategy: str, variant: str) -> None:
    batches = _batches(3)
    skip = 1 if variant == "skipped_step" else None
    expected = _reference(batches, skip)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, ["0:output"], tmp_path / "run", strategy=strategy) as rec:
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            if i == skip:  # a bad batch: its step closes without a backward
                rec.step(loss)
                continue
            rec.backward(loss)
            if skip is None:
                with torch.enable_grad():
                    model(x)  # a metric forward with gradients on
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(tmp_path / "run").sort_values("step")
    trained = [s for s in range(len(batches)) if s != skip]
    assert df.step.tolist() == trained
    assert df.call.tolist() == [0] * len(trained)
    assert df.has_grad.tolist() == [True] * len(trained)
    assert df.norm.tolist() == pytest.approx(expected, rel=1e-6)


def _alive_outputs(module: nn.Module) -> tuple[list[weakref.ref[torch.Tensor]], Any]:
    """Weak references to every output of `module` (the activations a forward's graph holds), and the hook's handle."""
    refs: list[weakref.ref[torch.Tensor]] = []
    return refs, module.register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out)) and None)


def _train(taps: list[str], strategy: str, dropped: int) -> tuple[list[list[Any]], int]:
    """Two SGD steps of `_model`, each after `dropped` forwards with gradients on whose outputs are dropped (an
    evaluation loop without `torch.no_grad()`): each step's records, and the most such forwards' activations alive."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs: list[weakref.ref[torch.Tensor]] = []
    handle = model[0].register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out)) and None)
    steps, held, x_eval = [], 0, torch.randn(5, 4)
    with capture(model, taps, strategy=strategy) as cap:
        for x, y in _batches(2):
            for _ in range(dropped):
                float(model(x_eval).sum())  # a metric, gradients on by mistake
            held = max(held, sum(r() is not None for r in refs))
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            opt.step()
            opt.zero_grad()
            recs = cap.records(loss)
            steps.append([(recs.row(i)["tap"], recs.row(i)["call"], recs.row(i)["norm"]) for i in range(len(recs))])
            refs.clear()
    handle.remove()
    return steps, held


@pytest.mark.parametrize("taps", [["0:output", "2:weight"], ["2:output", ":input"]])
def test_forwards_whose_outputs_were_dropped_hold_nothing_and_add_no_rows(strategy: str, taps: list[str]) -> None:
    """An evaluation loop that forgot `torch.no_grad()` (30 forwards with gradients on, each output dropped), then a
    training step: every forward's slots (and through them its graph, 30 activations of `0:output`) were held until
    the backward, which recorded 30 rows "takes no part in the loss" per tap and the training forward as call 30.
    Plain torch frees each graph once its output is dropped; so does the session now (a forward's slots go as the
    next forward begins; a tap on the model's output holds nothing of it), and each step records what a session that
    saw no such forward records: call 0 only."""
    want, _ = _train(taps, strategy, dropped=0)
    got, held = _train(taps, strategy, dropped=30)
    for step, (rows, fresh) in enumerate(zip(got, want, strict=True)):
        assert [r[:2] for r in rows] == [r[:2] for r in fresh], f"step {step}: {rows}"
        assert [r[2] for r in rows] == pytest.approx([r[2] for r in fresh], rel=1e-6), f"step {step}"
    assert held <= 1, f"{held} dropped forwards' activations held"


class _FrozenEmbedding(nn.Module):
    """A frozen embedding under a trained head: its output requires grad only by `enable_input_require_grads()`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6).requires_grad_(False)
        self.fc = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).tanh()).squeeze(-1).mean(1)


def _requires_grad(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
    out.requires_grad_()


def _record_every_2(run_dir: Path, dropped: int) -> tuple[Any, float, int]:
    """Four steps of `record(every=2)` with edited frozen-embedding and head outputs, each after `dropped` forwards with
    gradients on whose outputs are dropped: the records, the head's final weight sum, and the most such forwards'
    embedding outputs alive."""
    model = _FrozenEmbedding()
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 10, (4, 3), generator=g), torch.randn(4, generator=g)
    refs: list[weakref.ref[torch.Tensor]] = []
    held = 0
    with record(model, ["emb:output", "fc:output"], run_dir, strategy="hook", every=2,
                edits=[{"tap": "emb:output", "dropout": 0.5}, {"tap": "fc:output", "dropout": 0.5}]) as rec:  # fmt: skip
        # as transformers' enable_input_require_grads(), called after the session opened: runs after the tap's hook
        turn_on = model.emb.register_forward_hook(_requires_grad)
        watch = model.emb.register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out)) and None)
        for _ in range(4):
            for _ in range(dropped):
                float(model(ids).sum())
            held = max(held, sum(r() is not None for r in refs))
            refs.clear()
            loss = nn.functional.mse_loss(model(ids), y)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
        turn_on.remove()
        watch.remove()
    df = load(run_dir).sort_values(["step", "tap", "call"])
    return df[["step", "tap", "call", "has_grad", "norm", "edited_norm"]], float(model.fc.weight.sum()), held


def test_dropped_forwards_in_captured_and_uncaptured_steps_leave_the_edits_and_records_as_without_them(
    tmp_path: Path,
) -> None:
    """`record(every=2)`, 20 dropped forwards with gradients on before each step, a frozen embedding output turned
    on by a later forward hook and the head's output, both edited (`dropout`): the uncaptured steps held every such
    forward's embedding output (`late_uncaptured`) and the captured ones its slots until the backward, whose records
    had 20 rows without gradient per tap and the training forward as call 20. Now nothing of them is held, the
    captured steps record call 0 with a fresh run's numbers, and the edits draw what a fresh run draws in every step
    (the head's final weights, trained through the uncaptured steps' `fc:output` dropout too, are identical)."""
    want, want_w, _ = _record_every_2(tmp_path / "fresh", dropped=0)
    got, got_w, held = _record_every_2(tmp_path / "dropped", dropped=20)
    keys = ["step", "tap", "call", "has_grad"]
    assert got[keys].values.tolist() == want[keys].values.tolist()
    np.testing.assert_allclose(got[["norm", "edited_norm"]].to_numpy(float), want[["norm", "edited_norm"]].to_numpy(float),
                               rtol=1e-6)  # fmt: skip
    assert got_w == want_w
    assert held <= 2, f"{held} dropped forwards' embedding outputs held"


class _StatefulCell(nn.Module):
    """A recurrent cell that keeps its hidden state between calls (`self.h`), as some RL policies do: each call's
    output may be dropped while the next call's graph still runs through its inner nodes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(7, 3)
        self.h: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 3) if self.h is None else self.h
        self.h = torch.tanh(self.cell(torch.cat([x, h], 1)))
        return self.h * 2


def test_a_forward_whose_output_went_but_whose_state_the_next_forward_reads_keeps_its_rows(strategy: str) -> None:
    """Four calls of a stateful cell, each output dropped but the last, whose loss backpropagates through the kept
    hidden state into every call: each call of `cell:output` gets its gradient, as plain tensor hooks see it, though
    the first three forwards' outputs went before the backward (their inner nodes, still held, keep their slots)."""
    xs = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(3))
    model = _StatefulCell()
    want: list[torch.Tensor] = []
    handle = model.cell.register_forward_hook(lambda _m, _a, out: out.register_hook(want.append) and None)
    for x in xs:
        out = model(x)
    out.pow(2).mean().backward()
    handle.remove()
    want.reverse()  # backward meets the last call first
    model = _StatefulCell()
    with capture(model, ["cell:output"], strategy=strategy) as cap:
        for x in xs:
            out = model(x)
        cap.backward(out.pow(2).mean())
        recs = cap.records()
    assert [recs.row(i)["call"] for i in range(len(recs))] == [0, 1, 2, 3]
    assert [recs.row(i)["norm"] for i in range(len(recs))] == pytest.approx([float(g.norm()) for g in want], rel=1e-6)


def test_a_forgotten_forward_of_an_edited_tap_holds_nothing(strategy: str) -> None:
    """`cap.reset()` after a forward whose tapped value passed an edit node (the session's edit holds the call's slot,
    to read its number as it draws): the slot kept the edited value (`retain_grad`) or its edge (`autograd_grad`), and
    the edit node the slot, a cycle the garbage collector cannot see through. Reset lets go of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    refs: list[weakref.ref[torch.Tensor]] = []
    handle = model[1].register_forward_pre_hook(lambda _m, args: refs.append(weakref.ref(args[0])) and None)
    with capture(model, ["0:output"], strategy=strategy, edits=[{"tap": "0:output", "dropout": 0.5}]) as cap:
        model(torch.randn(5, 4))
        cap.reset()
        gc.collect()
        assert all(r() is None for r in refs), "the edited value of a forgotten forward is still held"
    handle.remove()


def test_a_forward_whose_output_went_keeps_the_gradient_of_a_leaf_input_its_state_still_reaches(strategy: str) -> None:
    """Four calls of a stateful cell on inputs made with `requires_grad=True` (a saliency map), each output dropped but
    the last, whose loss reaches every call's input through the kept state: under `autograd_grad` the first three
    calls' `:input` rows had no gradient ([nan, nan, nan, 0.245] for `.grad`'s [0.004, 0.015, 0.055, 0.245]): their
    leaves, let go of as the outputs went, were read at a pre-hook of their accumulators, which `autograd.grad` never
    runs for a leaf it takes as an input."""
    xs = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(3))
    model = _StatefulCell()
    ins = [x.clone().requires_grad_() for x in xs]
    for x in ins:
        out = model(x)
    out.pow(2).mean().backward()
    want = [float(x.grad.norm()) for x in ins]  # type: ignore[union-attr]
    model = _StatefulCell()
    ins = [x.clone().requires_grad_() for x in xs]
    with capture(model, [":input"], strategy=strategy) as cap:
        for x in ins:
            out = model(x)
        cap.backward(out.pow(2).mean())
        recs = cap.records()
    assert [recs.row(i)["call"] for i in range(len(recs))] == [0, 1, 2, 3]
    assert [recs.row(i)["norm"] for i in range(len(recs))] == pytest.approx(want, rel=1e-6)


class _StatefulFrozenEmbedding(nn.Module):
    """`_StatefulCell` over a frozen embedding whose output requires grad only by a later forward hook (transformers'
    `enable_input_require_grads()`): each call's embedding output is a leaf the next calls' graphs still reach."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4).requires_grad_(False)
        self.cell = nn.Linear(7, 3)
        self.h: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(ids.shape[0], 3) if self.h is None else self.h
        self.h = torch.tanh(self.cell(torch.cat([self.emb(ids), h], 1)))
        return self.h * 2


def test_a_forward_whose_output_went_keeps_a_leaf_a_later_hook_turned_on_that_its_state_still_reaches(
    strategy: str,
) -> None:
    """Four calls of a stateful cell over a frozen embedding turned on by a later forward hook, each output dropped but
    the last, whose loss reaches every call's embedding output through the kept state: the first three forwards were
    dropped whole (their tapped leaf, hooked only as the backward begins, counted as holding nothing), and the one row
    left was the last call's gradient as call 0 ([0.259] for plain hooks' [0.002, 0.009, 0.044, 0.259])."""
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(3))
    model = _StatefulFrozenEmbedding()
    want: list[torch.Tensor] = []
    on = model.emb.register_forward_hook(_requires_grad)
    watch = model.emb.register_forward_hook(lambda _m, _a, out: out.register_hook(want.append) and None)
    for x in ids:
        out = model(x)
    out.pow(2).mean().backward()
    on.remove()
    watch.remove()
    want.reverse()  # backward meets the last call first
    model = _StatefulFrozenEmbedding()
    with capture(model, ["emb:output"], strategy=strategy) as cap:
        on = model.emb.register_forward_hook(_requires_grad)  # after the session opened: runs after the tap's hook
        for x in ids:
            out = model(x)
        cap.backward(out.pow(2).mean())
        recs = cap.records()
        on.remove()
    assert [recs.row(i)["call"] for i in range(len(recs))] == [0, 1, 2, 3]
    assert [recs.row(i)["norm"] for i in range(len(recs))] == pytest.approx([float(g.norm()) for g in want], rel=1e-6)


def test_forwards_whose_tapped_output_became_the_models_output_in_place_hold_nothing(strategy: str) -> None:
    """A model whose last layer is `ReLU(inplace=True)`: the tapped `2:output` tensor is then the model's output. Under
    `retain_grad` and `autograd_grad` its slot held that tensor, and through it the output's node: 10 forwards whose
    outputs were dropped kept their graphs (10 activations of `0:output`) and the backward recorded 10 rows without
    gradient per tap and the training forward as call 10. Now as without them (`hook`'s, plain torch's)."""

    def train(dropped: int) -> tuple[list[tuple[str, int, float]], int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.ReLU(inplace=True))
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        refs: list[weakref.ref[torch.Tensor]] = []
        watch = model[0].register_forward_hook(lambda _m, _a, out: refs.append(weakref.ref(out)) and None)
        with capture(model, ["0:output", "2:output"], strategy=strategy) as cap:
            for _ in range(dropped):
                float(model(x).sum())
            held = sum(r() is not None for r in refs)
            loss = nn.functional.mse_loss(model(x), y)
            cap.backward(loss)
            recs = cap.records(loss)
        watch.remove()
        return [(recs.row(i)["tap"], recs.row(i)["call"], recs.row(i)["norm"]) for i in range(len(recs))], held

    want, _ = train(0)
    got, held = train(10)
    assert [r[:2] for r in got] == [r[:2] for r in want] == [("0:output", 0), ("2:output", 0)]
    assert [r[2] for r in got] == pytest.approx([r[2] for r in want], rel=1e-6)
    assert held <= 1, f"{held} dropped forwards' activations held"


class _Checkpointed(nn.Module):
    """`_model`'s shape with its middle layer run in `checkpoint(..., use_reentrant=True)`: an edited call inside it is
    edited as backward recomputes it (`Firing.deferred_calls`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.b(t)), self.a(x), use_reentrant=True)
        return self.c(h)


def _every_2_rebinding(run_dir: Path, metric: bool, checkpointed: bool) -> tuple[Any, torch.Tensor]:
    """Four steps of `record(every=2)` with a layer's output edited (`dropout`), each after a metric forward with
    gradients on whose output is dropped only as the training forward's result is bound to the same name: the records
    and the first layer's final weight."""
    model: nn.Module = _Checkpointed() if checkpointed else _model()
    tap = "b:output" if checkpointed else "0:output"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, [tap], run_dir, strategy="hook", every=2, edits=[{"tap": tap, "dropout": 0.5}]) as rec:
        for x, y in _batches(4):
            if metric:
                out = model(x)
                float(out.sum())
            out = model(x)  # the metric forward's graph goes here, after this forward fired
            loss = nn.functional.mse_loss(out, y)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    df = load(run_dir).sort_values(["step", "call"])
    first = model.a if checkpointed else model[0]  # type: ignore[index]
    return df[["step", "call", "has_grad", "norm", "edited_norm"]], first.weight.detach().clone()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_metric_forward_dropped_after_the_next_forward_fired_leaves_an_uncaptured_steps_edits_as_without_it(
    tmp_path: Path, checkpointed: bool
) -> None:
    """`out = model(x)` for a metric, then `out = model(x)` again for the loss: the metric forward's graph goes as the
    second result is bound, after that forward's edited tap fired. A captured step then numbers the training call 0
    and its dropout draws with 0; an uncaptured step (`every=2`) drew with the call counted as it fired, 1 (inside a
    reentrant checkpoint too): other masks than a run without the metric forward, so step 2's records (norm 0.2886
    for 0.2916) and the final weights (by 0.086) differed. The call an uncaptured step's edit draws with is now moved
    down as a captured slot's is."""
    want, want_w = _every_2_rebinding(tmp_path / "fresh", metric=False, checkpointed=checkpointed)
    got, got_w = _every_2_rebinding(tmp_path / "metric", metric=True, checkpointed=checkpointed)
    keys = ["step", "call", "has_grad"]
    assert got[keys].values.tolist() == want[keys].values.tolist() == [[0, 0, True], [2, 0, True]]
    np.testing.assert_allclose(got[["norm", "edited_norm"]].to_numpy(float), want[["norm", "edited_norm"]].to_numpy(float),
                               rtol=1e-6)  # fmt: skip
    assert torch.equal(got_w, want_w)


class _CheckpointedCell(_StatefulCell):
    """`_StatefulCell` whose layer runs in `checkpoint(..., use_reentrant=True)`: its taps fire without grad in the
    forward and are attached only as the backward recomputes them (`Firing.deferred`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 3) if self.h is None else self.h
        self.h = checkpoint(lambda t: torch.tanh(self.cell(t)), torch.cat([x, h], 1), use_reentrant=True)
        return self.h * 2


@pytest.mark.parametrize("strategy", ["hook", "retain_grad"])  # autograd_grad refuses reentrant checkpoints
def test_a_forward_whose_output_went_keeps_its_reentrant_checkpoints_calls_while_its_state_reaches_them(
    strategy: str,
) -> None:
    """`_CheckpointedCell` called four times, each output dropped but the last, whose loss reaches every call through
    the kept state: a call waiting for its checkpoint's recomputation hooks nothing yet, so the first three forwards
    were taken for gone. `hook` recorded four rows all numbered call 0, `retain_grad` one (call 3's gradient as call
    0). Each call now has its own row, as plain hooks see it."""
    xs = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    model = _CheckpointedCell()
    want: dict[int, float] = {}
    calls = iter(range(8))

    def hook(_m: nn.Module, _a: object, out: torch.Tensor) -> None:
        call = next(calls)  # the forward pass's first, no-grad call, then its recomputation in backward
        if out.requires_grad:
            out.register_hook(lambda g: want.setdefault(call, float(g.norm())) and None)

    handle = model.cell.register_forward_hook(hook)
    for x in xs:
        out = model(x)
    out.pow(2).mean().backward()
    handle.remove()
    assert len(want) == 4
    model = _CheckpointedCell()
    with capture(model, ["cell:output"], strategy=strategy) as cap:
        for x in xs:
            out = model(x)
        cap.backward(out.pow(2).mean())
        recs = cap.records()
    rows = sorted((recs.row(i)["call"], recs.row(i)["norm"]) for i in range(len(recs)))
    assert [c for c, _ in rows] == [0, 1, 2, 3]
    # the recomputations run last call first: the k-th recomputed is call 3 - k
    assert [n for _, n in rows] == pytest.approx([want[k] for k in sorted(want, reverse=True)], rel=1e-6)


@pytest.mark.parametrize("cell", [_StatefulCell, _CheckpointedCell])
def test_a_rollout_with_gradients_on_whose_state_was_reset_adds_no_rows(strategy: str, cell: type[nn.Module]) -> None:
    """Four calls of a stateful cell with gradients on (a rollout, a decoding loop keeping its cache: each output
    dropped, the state kept for the next call), then the state reset and a training step. The first three forwards,
    kept while the next one's state still reached them, were never looked at again once it went: the step recorded
    them as rows without gradient and its training forward as call 3 (a greedy GPT-2 decoding loop under grad: the
    same). Now they go with the state, and the step records what a step without the rollout records."""
    if strategy == "autograd_grad" and cell is _CheckpointedCell:
        pytest.skip("autograd_grad refuses reentrant checkpoints")
    xs = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()  # a checkpoint's inputs

    def step(rollout: bool) -> list[tuple[int, bool, float]]:
        model = cell()
        with capture(model, ["cell:output"], strategy=strategy) as cap:
            if rollout:
                for x in xs:
                    float(model(x).sum())
            model.h = None  # type: ignore[assignment]
            out = model(xs[0])
            cap.backward(out.pow(2).mean())
            recs = cap.records()
        return [(recs.row(i)["call"], recs.row(i)["has_grad"], recs.row(i)["norm"]) for i in range(len(recs))]

    want, got = step(rollout=False), step(rollout=True)
    assert [r[:2] for r in got] == [r[:2] for r in want] == [(0, True)]
    assert got[0][2] == pytest.approx(want[0][2], rel=1e-6)


@pytest.mark.parametrize("own", [False, True], ids=["cap_backward", "loss_backward"])
def test_a_metric_forward_dropped_between_two_backwards_through_one_graph_leaves_the_second_recorded(
    strategy: str, own: bool
) -> None:
    """`backward(retain_graph=True)`, then a metric's forward (gradients on) whose output is dropped, then a second
    backward through the first forward's graph (`(2 * loss).backward()`): the second backward's gradient of
    `0:output` (0.265) got no row at all, as the metric's forward let go of the first forward's slots as it began
    (before anyone could know it would be dropped). It is `micro_step` 1, as without the metric's forward (plain
    tensor hooks); the session holds nothing of the graph (it goes with the user's `loss`), and the next step's
    forward and backward are recorded as without any of it."""
    if own and strategy == "autograd_grad":
        pytest.skip("refuses every backward it did not run: test_engine.py")
    (x, y), (x2, y2) = _batches(2)

    def reference() -> list[float]:
        model, norms = _model(), []

        def tapped(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: norms.append(float(g.norm())))

        model[0].register_forward_hook(tapped)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        (2 * loss).backward()
        model.zero_grad()
        nn.functional.mse_loss(model(x2), y2).backward()
        return norms

    expected = reference()
    model = _model()
    held: list[weakref.ref[torch.Tensor]] = []

    def saved(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        held.append(weakref.ref(out))  # Tanh saves its output for its backward

    model[1].register_forward_hook(saved)
    with capture(model, ["0:output"], strategy=strategy) as cap:

        def backward(loss: torch.Tensor, retain: bool = False) -> None:
            loss.backward(retain_graph=retain) if own else cap.backward(loss, retain_graph=retain)

        loss = nn.functional.mse_loss(model(x), y)
        backward(loss, retain=True)
        model(x)  # a metric: its output dropped at once
        backward(2 * loss)
        recs = cap.records(loss)
        rows = [(r["call"], r["micro_step"], r["has_grad"]) for r in map(recs.row, range(len(recs)))]
        assert rows == [(0, 0, True), (0, 1, True)], rows
        np.testing.assert_allclose(recs.stats["norm"], expected[:2], rtol=1e-6)
        del loss, recs
        gc.collect()
        assert held[0]() is None  # the first forward's graph went with the user's `loss`
        model.zero_grad()
        backward(nn.functional.mse_loss(model(x2), y2))
        recs = cap.records()
        assert [(r["call"], r["has_grad"]) for r in map(recs.row, range(len(recs)))] == [(0, True)]
        np.testing.assert_allclose(recs.stats["norm"], expected[2:], rtol=1e-6)
        # a forward still held, whose slots a `records()` let go of before its backward: not the retained forward's
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss, retain=True)
        out = model(x2)
        cap.records()
        backward(out.pow(2).mean())
        assert cap.backward_index == 0



@pytest.mark.parametrize("then", ["older", "both", "older_then_held"])
@pytest.mark.parametrize("own", [False, True], ids=["cap_backward", "loss_backward"])
def test_a_forward_held_between_two_backwards_through_one_graph_leaves_the_second_the_older_forwards(
    strategy: str, own: bool, then: str
) -> None:
    """`backward(retain_graph=True)`, a forward whose output is held (`out = model(x2)`), then a second backward:
    through the first graph (`2 * loss`), through both (`2 * loss + out.pow(2).sum()`), or through the first and then a
    third through the held one's. The second backward took the held forward's slots: rows without gradient, and none
    for the first forward's taps, whose gradients (0.981) were lost; after a `cap.backward` that freed the first graph,
    the third backward's rows said 'no forward since the last backward, which freed the graph' where the held one's
    graph gave 1.262. Now the first forward's calls are the second backward's (call 0) and the held one's come after
    them (call 1), as plain tensor hooks see them (forward 0 and 1); `micro_step` numbers the backwards."""
    if own and strategy == "autograd_grad":
        pytest.skip("refuses every backward it did not run: test_engine.py")
    (x, y), (x2, _) = _batches(2)

    def run(model: nn.Sequential, backward: Any) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        backward(loss, True)
        out = model(x2)  # held to the end
        if then == "both":
            backward(2 * loss + out.pow(2).sum(), False)
        else:
            backward(2 * loss, False)
        if then == "older_then_held":
            backward(out.pow(2).sum(), False)
        return loss

    plain, forwards, seen = _model(), [0], []

    def tapped(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        f = forwards[0]
        forwards[0] += 1
        out.register_hook(lambda g: seen[-1].append((f, float(g.norm()))))

    plain[0].register_forward_hook(tapped)
    run(plain, lambda loss, retain: seen.append([]) or loss.backward(retain_graph=retain))
    expected = [(micro, f, True) for micro, got in enumerate(seen) for f, _ in sorted(got)]
    model = _model()
    with capture(model, ["0:output"], strategy=strategy) as cap:
        loss = run(model, lambda loss, retain: loss.backward(retain_graph=retain) if own else cap.backward(loss, retain_graph=retain))  # fmt: skip
        recs = cap.records(loss)
    rows = [(r["micro_step"], r["call"], r["has_grad"]) for r in map(recs.row, range(len(recs)))]
    assert [r for r in rows if r[2]] == expected, rows
    np.testing.assert_allclose([recs.row(i)["norm"] for i, r in enumerate(rows) if r[2]],
                               [n for got in seen for _, n in sorted(got)], rtol=1e-6)  # fmt: skip
    # the rest: the held forward's call in the second backward, where it took no part (none of the first's is lost)
    assert [r for r in rows if not r[2]] == [(1, 1, False)] * (then != "both") + [(2, 0, False)] * (own and then == "older_then_held")



def test_an_edited_forward_held_between_two_backwards_through_both_graphs_is_recorded_edited(strategy: str) -> None:
    """`0:output` clipped to norm 0.1; `backward(retain_graph=True)`, `out = model(x2)` held, then a backward through
    both graphs: the edit clipped both calls' gradients, but the edited norms were kept by record key, the same
    (call 0) for both until the backward ended: the held forward's row said `edited` False, `edited_norm` NaN. Each
    row is now edited, `edited_norm` min(norm, 0.1) of the plain tensor hooks' norm."""
    (x, y), (x2, _) = _batches(2)
    plain, seen = _model(), []  # (backward, forward, norm)

    def tapped(_m: nn.Module, _a: Any, out: torch.Tensor, forward: int) -> None:
        out.register_hook(lambda g: seen.append((len(seen) > 0, forward, float(g.norm()))))

    handle = plain[0].register_forward_hook(lambda m, a, out: tapped(m, a, out, 0))
    loss = nn.functional.mse_loss(plain(x), y)
    loss.backward(retain_graph=True)
    handle.remove()
    plain[0].register_forward_hook(lambda m, a, out: tapped(m, a, out, 1))
    out = plain(x2)
    (2 * loss + out.pow(2).sum()).backward()
    norms = [n for _, _, n in sorted(seen)]  # backward 0's call, then backward 1's: the first forward's, the held one's
    model = _model()
    with capture(model, ["0:output"], strategy=strategy, edits=[{"tap": "0:output", "clip_norm": 0.1}]) as cap:
        loss = nn.functional.mse_loss(model(x), y)
        cap.backward(loss, retain_graph=True)
        out = model(x2)
        cap.backward(2 * loss + out.pow(2).sum())
        recs = cap.records(loss)
    assert [(r["micro_step"], r["call"], r["edited"]) for r in map(recs.row, range(len(recs)))] == [
        (0, 0, True), (1, 0, True), (1, 1, True)
    ]  # fmt: skip
    np.testing.assert_allclose(recs.stats["norm"], norms, rtol=1e-6)
    np.testing.assert_allclose(recs.edited_norm, np.minimum(norms, 0.1), rtol=1e-5)

class _Gan(nn.Module):
    """A generator and a critic, called one by one (no forward of the root)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
        self.D = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))


@pytest.mark.parametrize("critic", ["detached", "retained"])
@pytest.mark.parametrize("own", [False, True], ids=["cap_backward", "loss_backward"])
def test_a_gan_steps_generator_backward_records_the_generators_call(strategy: str, own: bool, critic: str) -> None:
    """`fake = G(z)`; the critic's backward through `D(real)` and `D(fake.detach())` (or `D(fake)` with
    `retain_graph=True`); then the generator's, through a new `D(fake)` and the same `G(z)`. The generator's backward
    recorded G's output as 'module not called in this step', no gradient, where plain tensor hooks see 0.0766: the
    critic's backward had let go of G's slot (a `cap.backward` freeing a graph that never reached it, or a new forward
    of D beginning). Now each backward has a row with gradient for every call a plain hook sees it reach, same norm."""
    if own and strategy == "autograd_grad":
        pytest.skip("refuses every backward it did not run: test_engine.py")
    g = torch.Generator().manual_seed(2)
    z, real = torch.randn(6, 3, generator=g), torch.randn(6, 4, generator=g)

    def run(gan: _Gan, backward: Any) -> None:
        fake = gan.G(z)
        backward(gan.D(real).mean() - gan.D(fake.detach() if critic == "detached" else fake).mean(), critic == "retained")
        backward(-gan.D(fake).mean(), False)

    plain, seen = _Gan(), []
    for name, module in (("G.0:output", plain.G[0]), ("D.0:output", plain.D[0])):
        module.register_forward_hook(lambda _m, _a, out, name=name: out.register_hook(lambda g: seen[-1].append((name, float(g.norm())))) and None)  # fmt: skip
    run(plain, lambda loss, retain: seen.append([]) or loss.backward(retain_graph=retain))
    gan = _Gan()
    with capture(gan, ["G.0:output", "D.0:output"], strategy=strategy) as cap:
        run(gan, lambda loss, retain: loss.backward(retain_graph=retain) if own else cap.backward(loss, retain_graph=retain))  # fmt: skip
        recs = cap.records()
    rows = [(r["micro_step"], r["tap"], r["norm"]) for r in map(recs.row, range(len(recs))) if r["has_grad"]]
    for micro, want in enumerate(seen):
        got = sorted((tap, norm) for m, tap, norm in rows if m == micro)
        assert [t for t, _ in got] == [t for t, _ in sorted(want)], (micro, rows)
        np.testing.assert_allclose([n for _, n in got], [n for _, n in sorted(want)], rtol=1e-6)
    assert ("G.0:output", "module not called in this step") not in [(recs.row(i)["tap"], recs.row(i)["reason"]) for i in range(len(recs))]

class _HiddenStates(nn.Module):
    """Three layers returning the logits and every layer's hidden state (transformers' `output_hidden_states=True`):
    the hidden states before the last layer are upstream of the later layers' outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        states = [x]
        for layer in self.layers:
            states.append(torch.tanh(layer(states[-1])))
        return self.head(states[-1]), states


def _metric_then_step(strategy: str) -> tuple[list[tuple[int, bool, float]], float]:
    """`_HiddenStates` with `layers.1:output` tapped: a metric forward (gradients on, its output dropped at once), then
    a training step. Returns the step's rows (call, has_grad, norm) and the tap's gradient norm by a plain tensor hook."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model = _HiddenStates()
    want: list[float] = []
    handle = model.layers[1].register_forward_hook(
        lambda _m, _a, out: out.register_hook(lambda g: want.append(float(g.norm()))) and None
    )
    model(x)[0].sum().backward()
    handle.remove()
    model = _HiddenStates()
    with capture(model, ["layers.1:output"], strategy=strategy) as cap:
        float(model(x)[0].sum())  # a metric, gradients on by mistake
        out, _states = model(x)
        cap.backward(out.sum())
        recs = cap.records()
    return [(recs.row(i)["call"], recs.row(i)["has_grad"], recs.row(i)["norm"]) for i in range(len(recs))], want[0]


def test_a_dropped_forward_that_returned_its_inner_hidden_states_goes_too(strategy: str) -> None:
    """A metric forward (gradients on) of a model that returns its hidden states, dropped at once, then a training
    step: the tap's own slot held the node of the hidden state before it (upstream of the tap), one of the nodes the
    forward returned, so the forward never looked dropped: the step recorded it as a row without gradient and its
    training forward as call 1 (GPT-2 with `output_hidden_states=True`: the same). Reference: a plain tensor hook."""
    rows, want = _metric_then_step(strategy)
    assert [r[:2] for r in rows] == [(0, True)], rows
    assert rows[0][2] == pytest.approx(want, rel=1e-6)


def test_without_node_order_a_forward_that_returned_its_hidden_states_is_kept_not_lost(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torch_compat.sequence_nr`'s fallback (a torch whose nodes do not say their order: 0 for all) finds no returned
    node upstream of a tap: the dropped metric forward of the model above is kept, as every forward was before
    `pending` (a row without gradient, the training forward as call 1), and the training forward's gradient is the
    plain hook's: nothing lost, nothing wrong."""
    monkeypatch.setitem(torch_compat.FEATURES, "sequence_nr", False)
    rows, want = _metric_then_step(strategy)
    assert [r[:2] for r in rows] == [(0, False), (1, True)], rows
    assert rows[1][2] == pytest.approx(want, rel=1e-6)


def test_a_forward_whose_tips_went_is_kept_while_an_inner_hidden_state_it_returned_is_held(strategy: str) -> None:
    """The same model, the metric forward's logits dropped but the hidden state before the tapped layer kept until
    after the training step's backward began: a backward may still start there, so the forward is that backward's
    (README: an output you still hold), its row without gradient before the training forward's, as before."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model = _HiddenStates()
    with capture(model, ["layers.1:output"], strategy=strategy) as cap:
        kept = model(x)[1][1]  # layers.0's hidden state: upstream of the tap
        out, _ = model(x)
        cap.backward(out.sum())
        recs = cap.records()
    del kept
    rows = [(recs.row(i)["call"], recs.row(i)["has_grad"]) for i in range(len(recs))]
    assert rows == [(0, False), (1, True)]


class _WithInput(nn.Module):
    """Returns its output and its input unchanged (a model handing back `inputs_embeds` among its hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return (self.fc(x), x) if mask is None else (self.fc(x) * mask, x, mask)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_dropped_forward_that_returned_its_input_unchanged_goes_while_the_caller_keeps_the_input(
    strategy: str, by_keyword: bool
) -> None:
    """A metric forward (gradients on) given the caller's own non-leaf embeddings, which the model returns unchanged,
    its outputs dropped at once while the caller keeps the embeddings for the training forward: the input's node,
    the caller's, was watched as one of the forward's, so the forward never looked dropped (a row without gradient,
    the training forward as call 1). Reference: a plain tensor hook on the layer's output."""
    emb = nn.Linear(4, 4)
    x = emb(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))
    kwargs = {"mask": torch.ones(5, 2)} if by_keyword else {}
    model = _WithInput()
    want: list[float] = []
    handle = model.fc.register_forward_hook(lambda _m, _a, out: out.register_hook(lambda g: want.append(float(g.norm()))) and None)  # fmt: skip
    model(x, **kwargs)[0].pow(2).sum().backward(retain_graph=True)
    handle.remove()
    with capture(model, ["fc:output"], strategy=strategy) as cap:
        float(model(x, **kwargs)[0].sum())  # a metric, gradients on by mistake
        out = model(x, **kwargs)[0]
        cap.backward(out.pow(2).sum())
        recs = cap.records()
    rows = [(recs.row(i)["call"], recs.row(i)["has_grad"], recs.row(i)["norm"]) for i in range(len(recs))]
    assert [r[:2] for r in rows] == [(0, True)], rows
    assert rows[0][2] == pytest.approx(want[0], rel=1e-6)


def test_a_dropped_call_outside_the_roots_forward_goes_too(strategy: str) -> None:
    """Taps fired outside the root's forward (`model[:3](x)`, a framework that calls submodules): a metric call with
    gradients on, its output dropped at once, was never watched: the next backward recorded it as rows without
    gradient and the training call as call 1. Reference: a plain tensor hook on layer 0's output."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    model = _model()
    want: list[float] = []
    handle = model[0].register_forward_hook(lambda _m, _a, out: out.register_hook(lambda g: want.append(float(g.norm()))) and None)  # fmt: skip
    model[:2](x).pow(2).sum().backward()
    handle.remove()
    model = _model()
    with capture(model, ["0:output"], strategy=strategy) as cap:
        float(model[:2](x).sum())  # a metric, gradients on by mistake
        cap.backward(model[:2](x).pow(2).sum())
        recs = cap.records()
    rows = [(recs.row(i)["call"], recs.row(i)["has_grad"], recs.row(i)["norm"]) for i in range(len(recs))]
    assert [r[:2] for r in rows] == [(0, True)], rows
    assert rows[0][2] == pytest.approx(want[0], rel=1e-6)


@pytest.mark.parametrize("other_strategy", ["hook", "retain_grad"])
def test_another_models_dropped_forward_through_a_shared_module_adds_no_row(other_strategy: str) -> None:
    """Two sessions on two models sharing their first layer: the other model's metric forward (gradients on, output
    dropped at once) fired this session's tap on the shared layer, outside this session's root forward: a row without
    gradient, and the training forward recorded as call 1. Reference: the same session without that forward."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))

    def rows(metric: bool) -> list[tuple[int, bool, float]]:
        torch.manual_seed(0)
        shared = nn.Linear(4, 8)
        model, other = nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 3)), nn.Sequential(shared, nn.ReLU())
        with capture(model, ["0:output"], strategy=other_strategy) as cap, capture(other, ["1:output"]):
            if metric:
                float(other(x).sum())
            cap.backward(model(x).sum())
            recs = cap.records()
        return [(recs.row(i)["call"], recs.row(i)["has_grad"], recs.row(i)["norm"]) for i in range(len(recs))]

    want, got = rows(metric=False), rows(metric=True)
    assert [r[:2] for r in got] == [r[:2] for r in want] == [(0, True)], got
    assert got[0][2] == pytest.approx(want[0][2], rel=1e-6)


def _sliced_run(run_dir: Path, metric: bool) -> float:
    """Four steps of `record(every=2)` with layer 0's output's gradient edited (dropout), each step's model called as
    `model[:3](x)`, after a metric call of it whose output is dropped where `metric`: layer 0's final weight sum."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(
        model, ["0:output"], run_dir, strategy="hook", every=2, edits=[{"tap": "0:output", "dropout": 0.5}]
    ) as rec:
        for x, y in _batches(4):
            if metric:
                float(model[:3](x).sum())
            loss = nn.functional.mse_loss(model[:3](x), y)
            rec.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    return float(model[0].weight.sum())


def test_a_dropped_call_outside_the_roots_forward_leaves_an_uncaptured_steps_edits_as_without_it(
    tmp_path: Path,
) -> None:
    """The same metric calls outside the root's forward in a run whose steps `every=2` leaves uncaptured: the
    uncaptured steps' edits drew with the training call's number moved up by the metric call (1 for 0), the captured
    steps' with 0: the run's weights differed from a run without the metric calls."""
    assert _sliced_run(tmp_path / "with", metric=True) == pytest.approx(
        _sliced_run(tmp_path / "without", metric=False), abs=1e-7
    )


class _FlatTokens(nn.Module):
    """A layer on the batch's tokens flattened to (B * T, d): per-example norms mark its output's node as such tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return self.head(torch.tanh(self.first(x.reshape(b * t, d)))).view(b, t).sum(1)


class _ChannelsAsBatch(nn.Module):
    """A convolution whose input's channels number the batch's rows (B == C): per-example norms mark the output's node
    of a call on a tensor without autograd history as one whose rows may not be the batch's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.head = nn.Conv2d(2, 3, 1), nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x).mean((2, 3)))


@pytest.mark.parametrize("drop", ["root", "call"])
@pytest.mark.parametrize("make", [_FlatTokens, _ChannelsAsBatch])
def test_a_dropped_forward_the_per_example_walk_marked_goes_too(
    strategy: str, make: type[nn.Module], drop: str
) -> None:
    """`per_example=True`: the walk that judges a layer call's rows marked its output's autograd node in a dict and a
    set it held until the next root forward: a forward (or a tapped layer's call outside it) whose output was dropped
    between the training forward and its backward kept its graph (the dropped batch alive) and was recorded as a row
    "takes no part in the loss". References: a plain tensor hook on the layer's output, and the same session without
    the dropped forward (the head's per-example norms included)."""
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, 4) if make is _FlatTokens else (2, 2, 3, 3)
    x, other = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    plain = make()
    want: list[float] = []
    plain.first.register_forward_hook(lambda _m, _a, out: out.register_hook(lambda g: want.append(float(g.norm()))) and None)  # fmt: skip
    plain(x).pow(2).sum().backward()

    def rows(dropped: bool) -> tuple[list[tuple[str, int, bool, float, Any]], bool]:
        model = make()
        with capture(model, ["first:output", "head:weight"], strategy=strategy, per_example=True) as cap:
            loss = model(x).pow(2).sum()
            alive = None
            if dropped:
                batch = other.clone()
                alive = weakref.ref(batch)
                call = model if drop == "root" else model.first
                float(call(batch if drop == "root" or make is _ChannelsAsBatch else batch.reshape(-1, 4)).sum())
                del batch
            cap.backward(loss)
            gc.collect()
            recs = cap.records(loss)
        got = [recs.row(i) for i in range(len(recs))]
        return [(r["tap"], r["call"], r["has_grad"], r["norm"], r["per_example_norm"]) for r in got], alive is not None and alive() is not None  # fmt: skip

    without, _ = rows(dropped=False)
    got, held = rows(dropped=True)
    assert [r[:3] for r in got] == [("first:output", 0, True), ("head:weight", 0, True)], got
    assert got[0][3] == pytest.approx(want[0], rel=1e-6)
    assert [r[:4] for r in got] == [r[:4] for r in without]
    np.testing.assert_array_equal(got[1][4], without[1][4])
    assert not held, "the dropped forward's batch is still held once the backward began"


@pytest.mark.parametrize("own", [False, True], ids=["cap_backward", "loss_backward"])
def test_a_dropped_call_outside_the_roots_forward_between_two_backwards_through_one_graph_leaves_the_second_recorded(
    strategy: str, own: bool
) -> None:
    """`backward(retain_graph=True)`, then metric calls of `model[:2]` (gradients on, outputs dropped at once), then a
    second backward through the first forward's graph: the second backward got no row at all (0.981 lost), as the
    metric's slots, not yet let go of as it began, made it look like a backward through a new forward. It is
    `micro_step` 1 of the first forward's call 0, as without the metric calls. Reference: plain tensor hooks."""
    if own and strategy == "autograd_grad":
        pytest.skip("refuses every backward it did not run: test_engine.py")
    ((x, y),) = _batches(1)

    def reference() -> list[float]:
        model, norms = _model(), []
        model[0].register_forward_hook(lambda _m, _a, out: out.register_hook(lambda g: norms.append(float(g.norm()))) and None)  # fmt: skip
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        (2 * loss).backward()
        return norms

    expected = reference()
    model = _model()
    with capture(model, ["0:output", "2:input"], strategy=strategy) as cap:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True) if own else cap.backward(loss, retain_graph=True)
        for _ in range(2):
            float(model[:2](x).sum())  # a metric through the first layers only
        (2 * loss).backward() if own else cap.backward(2 * loss)
        recs = cap.records(loss)
    rows = [(r["tap"], r["call"], r["micro_step"], r["has_grad"]) for r in map(recs.row, range(len(recs)))]
    assert rows == [("0:output", 0, 0, True), ("2:input", 0, 0, True), ("0:output", 0, 1, True), ("2:input", 0, 1, True)]
    np.testing.assert_allclose(recs.stats["norm"][[0, 2]], expected, rtol=1e-6)


def test_a_tap_whose_only_calls_were_dropped_keeps_its_not_called_row(strategy: str) -> None:
    """A metric through a head the training forward does not call (`model.aux(x)`, gradients on, its output dropped),
    then a training step: the head's tap got no row at all, where without the metric it is a row without gradient
    ('module not called in this step'): its count of calls, moved down to 0 as the metric's call went, still named it
    as fired. Reference: the same step without the metric; the body's norm against a plain tensor hook."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body, self.aux = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).pow(2).sum()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    plain = Net()
    want = plain.body(x)
    want.retain_grad()
    want.pow(2).sum().backward()

    def rows(metric: bool) -> list[tuple[str, int, bool, Any, float]]:
        model = Net()
        with capture(model, ["body:output", "aux:output"], strategy=strategy) as cap:
            if metric:
                float(model.aux(x).sum())
            cap.backward(model(x))
            recs = cap.records()
        return [(r["tap"], r["call"], r["has_grad"], r["reason"], r["norm"]) for r in map(recs.row, range(len(recs)))]

    without, got = rows(metric=False), rows(metric=True)
    assert [r[:4] for r in got] == [r[:4] for r in without] == [
        ("body:output", 0, True, None), ("aux:output", 0, False, "module not called in this step")
    ], got  # fmt: skip
    assert got[0][4] == pytest.approx(float(want.grad.norm()), rel=1e-6)
