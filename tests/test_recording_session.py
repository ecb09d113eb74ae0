"""`record()`'s session (issue 36 items 11, 12, 14, 16): the last word, options checked up front, `edits=`,
`resume=`/`overwrite=` into a used dir; each checked against plain torch or the loop's own values."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import python_script
from conftest import regression_batches as _batches
from conftest import tanh_mlp as _model
from torch import nn

import gradrunner
from gradrunner.analysis import load
from gradrunner.errors import GradrunnerError
from gradrunner.run.session_log import LOG_FILE


def _loss_line(text: str) -> tuple[float, float, int]:
    m = re.search(r"loss: (\S+) at the first step, (\S+) at the last \((\d+) steps\)", text)
    assert m, text
    return float(m[1]), float(m[2]), int(m[3])


SCRIPT = """
import torch
from torch import nn
from gradrunner import record
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
with record(model, ["0:output", "0:weight"], {dir!r}) as rec:
    for s in range(4):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if s == {nan_at}:
            loss = loss * float("nan")
        loss.backward(); opt.step(); opt.zero_grad()
        rec.step(loss)
        print("LOSS", repr(float(loss)))
"""


@pytest.mark.parametrize("nan_at", [-1, 2])
def test_a_plain_script_ends_with_the_runners_last_word_on_the_console_and_in_the_log(tmp_path: Path, nan_at: int) -> None:
    """A user's script (no logging configured): the health summary on stderr and in <run dir>/gradrunner.log,
    its losses the script's own; with a NaN loss at step 2 it says so."""
    run = tmp_path / "run"
    script = tmp_path / "script.py"  # run as `python script.py` would, inside this process (`conftest.python_script`)
    script.write_text(SCRIPT.format(dir=str(run), nan_at=nan_at))
    out = python_script(tmp_path, script)
    assert out.returncode == 0, out.stderr
    losses = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 4
    log_text = (run / LOG_FILE).read_text()
    for text in (out.stderr, log_text):
        assert "run summary:" in text and f"records: {run}" in text
        first, last, n = _loss_line(text)
        assert n == 4 and first == pytest.approx(losses[0], rel=1e-5)
        if nan_at < 0:
            assert last == pytest.approx(losses[-1], rel=1e-5) and "healthy: no NaN/Inf" in text
        else:
            assert "NaN/Inf: the loss from step 2" in text and "healthy" not in text
    assert (run / "done.json").is_file()


def test_a_session_that_recorded_nothing_says_so(tmp_path: Path) -> None:
    with gradrunner.record(_model(), ["0:output"], tmp_path / "run"):
        pass
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "run summary:" in text and "loss: no step completed" in text and "taps=[]" not in text
    held = [n for n in ("grads.parquet", "steps.parquet") if (tmp_path / "run" / n).is_file()]
    assert f"records: {tmp_path / 'run'} ({', '.join(held)}; read the dir" in text, held  # only what is there


def test_a_session_that_failed_before_its_first_step_names_no_records_it_did_not_write(tmp_path: Path) -> None:
    """Before, the last word said 'records: <dir> (grads.parquet, steps.parquet; ...)', 'the records of 0 completed
    step(s) are kept' and 'no tap was captured (taps=[], ...)' though taps were given and the dir held no record."""
    model = _model()
    with pytest.raises(RuntimeError, match="bad batch"), gradrunner.record(model, ["0:output"], tmp_path / "run"):
        model(torch.randn(2, 4)).sum().backward()
        raise RuntimeError("bad batch")
    held = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert not {"grads.parquet", "steps.parquet"} & set(held), held
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "ended by RuntimeError before its first step; no records were kept in" in text
    assert f"records: none in {tmp_path / 'run'}" in text and "loss: no step completed" in text
    for claim in ("grads.parquet", "steps.parquet", "taps=[]", "completed step(s) are kept", "continues them"):
        assert claim not in text, claim


@pytest.mark.parametrize("with_loss", [(), (1,)], ids=["never", "at_step_1"])
def test_a_loss_not_recorded_is_not_called_nan(tmp_path: Path, with_loss: tuple[int, ...]) -> None:
    """`rec.step()` without a loss (a Trainer's custom compute_loss leaves it null too): the last word says the loss
    was not recorded, and a healthy run stays healthy (a null loss read as NaN called it "NaN/Inf from step 0")."""
    model, batches = _model(), _batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output"], tmp_path / "run") as rec:
        for s, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            rec.step(loss if s in with_loss else None)
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "NaN/Inf:" not in text and "healthy: no NaN/Inf" in text, text
    if with_loss:
        assert "(3 steps, the loss recorded at 1)" in text, text
    else:
        assert "loss: not recorded (3 steps, each with a null loss)" in text, text


def test_a_session_ended_by_an_error_keeps_its_steps_and_says_what_happened(tmp_path: Path) -> None:
    model, batches = _model(), _batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GradrunnerError, match="non-finite"), gradrunner.record(
        model, ["0:output"], tmp_path / "run", on_nonfinite="stop"
    ) as rec:
        for s, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y) * (float("inf") if s == 1 else 1.0)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            rec.step(loss)
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "ended by NonFinite; the records of 2 completed step(s) are kept" in text
    assert "resume=True continues them" in text and "NaN/Inf: the loss from step 1" in text


def test_a_non_finite_stop_names_records_own_argument_and_dir(tmp_path: Path) -> None:
    """Before, record(on_nonfinite="stop")'s error named the runner's config (`capture.on_nonfinite=stop`,
    `optimizer.lr`) and no dir; the steps it says are kept are those on disk, the script's own losses."""
    model, batches, losses = _model(), _batches(3), []
    run = tmp_path / "run"
    with pytest.raises(GradrunnerError) as e, gradrunner.record(model, ["0:output"], run, on_nonfinite="stop") as rec:
        for s, (x, y) in enumerate(batches):
            loss = nn.functional.mse_loss(model(x), y) * (float("nan") if s == 1 else 1.0)
            loss.backward()
            losses.append(float(loss.detach()))
            rec.step(loss)
    message = str(e.value)
    assert message.startswith("record(..., on_nonfinite='stop'): stopped at step 1, where the loss is nan"), message
    assert f"(through step 1) are kept in {run}." in message, message
    assert "set record(..., on_nonfinite='record') to record every step" in message, message
    assert "capture." not in message and "optimizer.lr" not in message, message
    steps = pd.read_parquet(run / "steps.parquet")
    assert steps["step"].tolist() == [0, 1] and steps["loss"][0] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize(
    ("options", "says"),
    [({"every": 0}, "every=0"), ({"seed": "1"}, "seed='1'"), ({"histogram": "yes"}, "histogram='yes'"),
     ({"live_every": -1}, "live_every=-1"), ({"resume": True, "overwrite": True}, "together"),
     ({"edits": [{"tap": "0:output", "scal": 0.5}]}, "edits")],
)  # fmt: skip
def test_bad_options_are_one_paragraph_before_anything_is_written(tmp_path: Path, options: dict, says: str) -> None:
    with pytest.raises(GradrunnerError, match=re.escape(says)) as e:
        gradrunner.record(_model(), ["0:output"], tmp_path / "run", **options)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_edits_equal_plain_hooks(tmp_path: Path) -> None:
    """`edits=` is the runner's: the first layer's output gradient scaled by 0.5 changes training exactly as a plain
    tensor hook does; the records hold the gradient before the edit (`norm`) and after it (`edited_norm`)."""
    model, batches = _model(), _batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run",
                           edits=[{"tap": "0:output", "scale": 0.5}]) as rec:  # fmt: skip
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            rec.step(loss)
    ref, ref_batches = _model(), _batches(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out_norms, weight_norms = [], []
    for x, y in ref_batches:
        h = ref[0](x)
        kept: list[torch.Tensor] = []
        h.register_hook(lambda g, kept=kept: (kept.append(g.detach().clone()), g * 0.5)[1])
        nn.functional.mse_loss(ref[2](ref[1](h)), y).backward()
        out_norms.append(float(kept[0].norm()))
        weight_norms.append(float(ref[0].weight.grad.norm()))
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(model[0].weight, ref[0].weight, rtol=0, atol=0)
    df = load(tmp_path / "run").sort_values("step")
    out = df[df.tap == "0:output"]
    assert list(out.norm) == pytest.approx(out_norms, rel=1e-5)
    assert list(out.edited_norm) == pytest.approx([0.5 * n for n in out_norms], rel=1e-5)
    assert list(df[df.tap == "0:weight"].norm) == pytest.approx(weight_norms, rel=1e-5)


def _train(run: Path, steps: range, model: nn.Module, opt: torch.optim.Optimizer, crash_at: int = -1,
           saved: dict | None = None, **options: object) -> None:  # fmt: skip
    """The loop from `steps.start`: Ctrl-C in step `crash_at` (before its `rec.step`); `saved`: the model at step 3."""
    batches = _batches(6)
    with gradrunner.record(model, ["0:output", "0:weight"], run, **options) as rec:
        rec.start_at(steps.start)
        for s in steps:
            if s == 3 and saved is not None:
                saved.update({k: v.clone() for k, v in model.state_dict().items()})  # a checkpoint before step 3
            x, y = batches[s]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            if s == crash_at:
                raise KeyboardInterrupt
            rec.step(loss)


def test_a_used_dir_is_refused_naming_records_options(tmp_path: Path) -> None:
    model = _model()
    _train(tmp_path / "run", range(2), model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GradrunnerError) as e:
        _train(tmp_path / "run", range(2), model, torch.optim.SGD(model.parameters(), lr=0.1))
    msg = str(e.value)
    assert "record() overwrite=True" in msg and "of a completed run" in msg and "hydra" not in msg
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "cut", range(3), model, torch.optim.SGD(model.parameters(), lr=0.1), crash_at=1)
    with pytest.raises(GradrunnerError) as e:
        _train(tmp_path / "cut", range(3), model, torch.optim.SGD(model.parameters(), lr=0.1))
    msg = str(e.value)
    assert "record() with resume=True" in msg and "or overwrite=True" in msg and "hydra" not in msg
    with pytest.raises(GradrunnerError, match="overwrite=True instead of resume=True"):
        _train(tmp_path / "run", range(2), model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True)


def test_overwrite_records_again_from_step_0(tmp_path: Path) -> None:
    model = _model()
    _train(tmp_path / "a", range(3), model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = _model()
    _train(tmp_path / "b", range(2), _model(), torch.optim.SGD(model.parameters(), lr=0.1))
    _train(tmp_path / "b", range(3), model, torch.optim.SGD(model.parameters(), lr=0.1), overwrite=True)
    log_text = (tmp_path / "b" / LOG_FILE).read_text()
    assert log_text.count("run summary:") == 1 and "(3 steps)" in log_text  # the deleted run's log went with it
    _same(load(tmp_path / "a"), load(tmp_path / "b"))


def test_a_recorder_entered_again_is_refused_and_leaves_the_first_entrys_records(tmp_path: Path) -> None:
    """`with rec:` a second time (overwrite=True) logged "recording from step 0", deleted the first entry's records
    and wrote steps 3, 4, 5 under its run_id. Refused now, before the dir is looked at: the records are the first
    entry's, as a fresh run's of those steps; `record(...)` made again records from step 0 with a new run_id."""
    model = _model()
    opt, batches = torch.optim.SGD(model.parameters(), lr=0.1), _batches(6)
    reference = _model()
    _train(tmp_path / "ref", range(3), reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    rec = gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", overwrite=True)
    for entry in range(2):
        with contextlib.ExitStack() as stack:
            if entry:
                stack.enter_context(pytest.raises(GradrunnerError, match=r"^this record\(\) into '.*' was entered befo"))
            stack.enter_context(rec)
            for s in range(3):
                x, y = batches[s]
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                rec.step(loss)
    first = load(tmp_path / "run")
    assert sorted(first["step"].unique()) == [0, 1, 2] and first["run_id"].nunique() == 1
    assert json.loads((tmp_path / "run" / "done.json").read_text())["run_id"] == first["run_id"].iloc[0]
    _same(load(tmp_path / "ref"), first)
    _train(tmp_path / "run", range(3), model, opt, overwrite=True)
    again = load(tmp_path / "run")
    assert sorted(again["step"].unique()) == [0, 1, 2] and set(again["run_id"]).isdisjoint(first["run_id"])


def test_a_recorder_entered_inside_its_own_block_is_refused_and_the_open_session_goes_on(tmp_path: Path) -> None:
    """`with rec:` inside its own block was refused, but the refusal closed the open session: its files committed
    with step 0 alone, its lock and log let go, and the block's next `rec.step()` failed with an internal
    AssertionError ('steps.parquet: write after closed'). The refusal now touches nothing: the loop goes on and the
    run dir holds every step, as a run without the refused entry does."""
    model = _model()
    opt, batches = torch.optim.SGD(model.parameters(), lr=0.1), _batches(6)
    reference = _model()
    _train(tmp_path / "ref", range(3), reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run") as rec:
        for s in range(3):
            x, y = batches[s]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
            if s == 0:
                with pytest.raises(GradrunnerError, match=r"^this record\(\) into '.*' was entered before"), rec:
                    pass
    got = load(tmp_path / "run")
    assert sorted(got["step"].unique()) == [0, 1, 2] and (tmp_path / "run" / "done.json").exists()
    _same(load(tmp_path / "ref"), got)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    skip = {"run_id", "step_time_s", "capture_time_s", "peak_memory_bytes"}
    cols = [c for c in a.columns if c not in skip]
    key = [c for c in ("step", "tap", "call", "micro_step") if c in a.columns]
    pd.testing.assert_frame_equal(a[cols].sort_values(key).reset_index(drop=True),
                                  b[cols].sort_values(key).reset_index(drop=True))  # fmt: skip


def _whole_and_interrupted(tmp_path: Path) -> tuple[nn.Module, dict]:
    """An uninterrupted 6-step run in `whole`, and the same run in `run` ended by Ctrl-C in step 4: its model and
    the state saved at step 3."""
    model = _model()
    _train(tmp_path / "whole", range(6), model, torch.optim.SGD(model.parameters(), lr=0.1))
    model, saved = _model(), {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", range(6), model, opt, crash_at=4, saved=saved)
    return model, saved


def test_resume_from_a_checkpoint_gives_the_uninterrupted_records(tmp_path: Path) -> None:
    """Ctrl-C in step 4 (steps 0..3 recorded), the training resumed from its checkpoint before step 3 with
    resume=True: the run dir's records equal an uninterrupted run's (step 3's first records replaced)."""
    _, saved = _whole_and_interrupted(tmp_path)
    assert sorted(set(load(tmp_path / "run", table="steps").step)) == [0, 1, 2, 3]
    assert not (tmp_path / "run" / "done.json").exists()
    model = _model()
    model.load_state_dict(saved)
    _train(tmp_path / "run", range(3, 6), model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True)
    assert (tmp_path / "run" / "done.json").is_file()
    _same(load(tmp_path / "whole"), load(tmp_path / "run"))
    _same(load(tmp_path / "whole", table="steps"), load(tmp_path / "run", table="steps"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".resumed")) == []


def test_resume_with_a_seeded_edit_draws_what_the_uninterrupted_run_drew(tmp_path: Path) -> None:
    """`dropout` draws per backward: before, the resumed session drew from backward 0 again (its step 3 had the
    uninterrupted run's step 0's mask), so its records and the trained parameters differed."""
    edits = [{"tap": "0:output", "dropout": 0.5}]
    whole = _model()
    _train(tmp_path / "whole", range(6), whole, torch.optim.SGD(whole.parameters(), lr=0.1), edits=edits)
    model, saved = _model(), {}
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", range(6), model, torch.optim.SGD(model.parameters(), lr=0.1), crash_at=4, saved=saved,
               edits=edits)  # fmt: skip
    model = _model()
    model.load_state_dict(saved)
    _train(tmp_path / "run", range(3, 6), model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True, edits=edits)
    _same(load(tmp_path / "whole"), load(tmp_path / "run"))
    for p, q in zip(whole.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_resume_by_default_continues_after_the_last_recorded_step(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", range(6), model, opt, crash_at=2)
    with pytest.raises(GradrunnerError, match=r"other options \(capture.histogram: False -> True\)"):
        gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True, histogram=True).__enter__()
    with gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True) as rec:
        assert rec.step_index == 2  # the step after the last recorded one
    assert sorted(set(load(tmp_path / "run", table="steps").step)) == [0, 1]


def test_a_resumed_session_that_fails_before_its_first_step_loses_nothing(tmp_path: Path) -> None:
    """The interrupted session's files stay (hidden) until the resumed one's files are closed: a resume that fails
    at once and a second resume still give the uninterrupted records."""
    model, saved = _whole_and_interrupted(tmp_path)
    with pytest.raises(RuntimeError, match="at once"), gradrunner.record(model, ["0:output", "0:weight"],
                                                                         tmp_path / "run", resume=True):  # fmt: skip
        raise RuntimeError("failed at once")
    model = _model()
    model.load_state_dict(saved)
    _train(tmp_path / "run", range(3, 6), model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True)
    _same(load(tmp_path / "whole"), load(tmp_path / "run"))


def test_files_a_killed_process_left_are_not_resumed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".grads.parquet.dead.tmp").write_bytes(b"PAR1 no footer")  # what a SIGKILL leaves
    with pytest.raises(GradrunnerError, match="cannot be continued: grads.parquet does not read") as e:
        gradrunner.record(_model(), ["0:output"], run, resume=True).__enter__()
    assert "overwrite=True" in str(e.value) and (run / ".grads.parquet.dead.tmp").exists()
    with gradrunner.record(_model(), ["0:output"], run, overwrite=True):
        pass
    assert not (run / ".grads.parquet.dead.tmp").exists() and (run / "done.json").is_file()


def test_a_resumed_session_interrupted_before_its_first_step_keeps_the_earlier_records(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM) while the resumed session's first step runs: the earlier session's records stay as they
    were (they were deleted: both new files closed empty, the kept copies dropped), and a second resume ends as
    an uninterrupted run."""
    model, saved = _whole_and_interrupted(tmp_path)
    before = load(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt), gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run",
                                                             resume=True):  # fmt: skip
        raise KeyboardInterrupt
    _same(before, load(tmp_path / "run"))
    assert not any(p.name.startswith(".resumed") for p in (tmp_path / "run").iterdir())
    model = _model()
    model.load_state_dict(saved)
    _train(tmp_path / "run", range(3, 6), model, torch.optim.SGD(model.parameters(), lr=0.1), resume=True)
    _same(load(tmp_path / "whole"), load(tmp_path / "run"))


def test_start_at_before_the_block_opens_is_where_a_resumed_session_starts(tmp_path: Path) -> None:
    model, saved = _whole_and_interrupted(tmp_path)
    model = _model()
    model.load_state_dict(saved)
    opt, batches = torch.optim.SGD(model.parameters(), lr=0.1), _batches(6)
    rec = gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True)
    rec.start_at(3)  # the training's checkpoint was before step 3 (steps 0..3 are recorded)
    with rec:
        for s in range(3, 6):
            x, y = batches[s]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            rec.step(loss)
    _same(load(tmp_path / "whole"), load(tmp_path / "run"))


def test_a_resume_refuses_records_that_differ_in_update_norms(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", range(6), model, torch.optim.SGD(model.parameters(), lr=0.1), crash_at=2)
    with pytest.raises(GradrunnerError, match=r"other options \(capture.update_norms: False -> True\)"):
        gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True, update_norms=True).__enter__()


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_resume_refuses_damaged_or_foreign_files_and_keeps_them(tmp_path: Path) -> None:
    """Interrupted records whose pages fail their checksums, or a table of another run copied in, are not
    carried into the resumed run (which would mark them complete and `load` would trust them)."""
    import pyarrow.parquet as pq

    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "run", range(6), model, torch.optim.SGD(model.parameters(), lr=0.1), crash_at=3)
    grads = tmp_path / "run" / "grads.parquet"
    meta = pq.ParquetFile(grads).metadata
    column = meta.row_group(0).column(meta.schema.names.index("norm"))  # a data page of the norms
    intact = grads.read_bytes()
    _flip(grads, column.data_page_offset + column.total_compressed_size - 2)
    damaged = grads.read_bytes()
    with pytest.raises(GradrunnerError, match="cannot be continued: grads.parquet does not read"):
        gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True).__enter__()
    assert grads.read_bytes() == damaged and not (tmp_path / "run" / "done.json").exists()
    # another run's grads.parquet (same options) in place of this one's
    grads.write_bytes(intact)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "other", range(6), _model(), torch.optim.SGD(model.parameters(), lr=0.1), crash_at=3)
    grads.write_bytes((tmp_path / "other" / "grads.parquet").read_bytes())
    with pytest.raises(GradrunnerError, match="one of them is another run's"):
        gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run", resume=True).__enter__()
    assert not (tmp_path / "run" / "done.json").exists()


def _second_session(run: Path, **mode: bool) -> BaseException | None:
    """What a second `record(...)` into `run` meets: the exception its block's entry raised, or None (it got in;
    its block is then left by an error, so that it marks nothing complete)."""
    second = gradrunner.record(_model(), ["0:output", "0:weight"], run, **mode)
    try:
        second.__enter__()
    except GradrunnerError as e:
        return e
    second.__exit__(RuntimeError, RuntimeError("the second session got in"), None)
    return None


@pytest.mark.parametrize("ending", ["normal", "error", "ctrl-c"])
def test_the_lock_is_held_until_the_books_are_written_however_the_block_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    """The files of the block are closed, `done.json` (or the last word of a block that did not complete) not yet
    written: a second session, resume=True or overwrite=True, is refused naming the first one, and the first
    session's records and marker stay its own (not relabelled, not overwritten, not taken for interrupted ones)."""
    import gradrunner.analysis.health as health
    from gradrunner.run.books import LiveRun
    from gradrunner.run.recording import Recorder

    run, met, armed = tmp_path / "run", [], [True]

    def pause() -> None:  # the pause point: the second session runs inside the first one's books, once
        if armed and armed.pop():
            met.extend([_second_session(run, resume=True), _second_session(run, overwrite=True)])

    if ending == "normal":  # after the files closed, before done.json
        mark = Recorder._mark_complete
        monkeypatch.setattr(Recorder, "_mark_complete", lambda self: (pause(), mark(self))[1])
    else:  # a block that did not complete: its last word
        word = health.last_word
        monkeypatch.setattr(health, "last_word", lambda d: (pause(), word(d))[1])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised = {"normal": None, "error": RuntimeError, "ctrl-c": KeyboardInterrupt}[ending]
    with contextlib.ExitStack() as outside:
        if raised is not None:
            outside.enter_context(pytest.raises(raised))
        with gradrunner.record(model, ["0:output", "0:weight"], run) as first:
            for x, y in _batches(3):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
                first.step(loss)
            if raised is not None:
                raise raised("the block ends by this")
    assert len(met) == 2
    for refusal in met:
        assert isinstance(refusal, LiveRun), refusal
        assert f"pid {os.getpid()}," in str(refusal) and f"run id {first.run_id})" in str(refusal)
    steps = load(run, table="steps") if ending == "normal" else pd.read_parquet(run / "steps.parquet")
    assert sorted(steps.step) == [0, 1, 2] and set(steps.run_id) == {first.run_id}
    assert set(pd.read_parquet(run / "grads.parquet").run_id) == {first.run_id}
    done = run / "done.json"
    assert json.loads(done.read_text())["run_id"] == first.run_id if ending == "normal" else not done.exists()
    assert not any(p.name.startswith(".resumed") for p in run.iterdir())


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_a_session_whose_files_fail_to_close_is_not_marked_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resumed: bool
) -> None:
    """A full disk as the block ends: the error propagates, and no done.json claims the records are whole
    (it was written over a dir holding no record); a resumed session's earlier records are kept for the next."""
    import errno

    from gradrunner.records import table_writer

    model, batches = _model(), _batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def session(steps: range) -> None:
        with gradrunner.record(model, ["0:output"], tmp_path / "run", resume=resumed) as rec:
            for s in steps:
                x, y = batches[s]
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
                rec.step(loss)
            monkeypatch.setattr(table_writer.ParquetTableWriter, "finish_temp", full_disk)  # the disk fills as the block ends

    def full_disk(self: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if resumed:  # a first session interrupted after 2 steps: its records are what a resume continues
        with pytest.raises(KeyboardInterrupt), gradrunner.record(model, ["0:output"], tmp_path / "run") as rec:
            for x, y in batches[:2]:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
                rec.step(loss)
            raise KeyboardInterrupt
    with pytest.raises(GradrunnerError, match="No space left on device"):
        session(range(2, 4) if resumed else range(2))
    monkeypatch.undo()
    assert not (tmp_path / "run" / "done.json").exists()
    log = (tmp_path / "run" / LOG_FILE).read_text()
    assert "could not be written" in log and "not marked complete" in log and "no step completed" not in log
    if resumed:  # the earlier session's two steps are still there for resume=True
        with gradrunner.record(model, ["0:output"], tmp_path / "run", resume=True) as rec:
            assert rec.step_index == 2


def test_an_oserror_of_the_users_own_code_in_the_block_goes_on_as_it_is(tmp_path: Path) -> None:
    """A `record()` block whose own code raises an OSError (a data file that is not there) ends by that error, as
    without gradrunner: it is not turned into "could not write the records", which did not happen; the completed
    steps' records are kept and the last word names the real error."""
    torch.manual_seed(0)
    model, batches = _model(), _batches(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    missing = tmp_path / "no" / "data.bin"
    with pytest.raises(FileNotFoundError) as info, gradrunner.record(model, ["0:output"], tmp_path / "run") as rec:
        for i, (x, y) in enumerate(batches):
            if i == 2:
                missing.read_bytes()  # the user's own read
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()  # noqa: E702
            rec.step(loss)
    assert not isinstance(info.value, GradrunnerError) and info.value.filename == str(missing)
    assert sorted(pd.read_parquet(tmp_path / "run" / "steps.parquet")["step"]) == [0, 1]
    text = (tmp_path / "run" / LOG_FILE).read_text()
    assert "ended by FileNotFoundError" in text and "could not write" not in text, text


def test_micro_step_numbers_the_backwards_of_a_step_of_several_and_is_null_in_a_step_of_one(tmp_path: Path) -> None:
    """README's Records table said `micro_step` is null "everywhere without accumulation"; a `record()` step of two
    backwards (two losses) numbers them 0 and 1, as the Python API section says: each row holds its backward's
    gradient (plain tensor hooks), the parameter's one row their sum, null; a step of one backward is null."""
    torch.manual_seed(0)
    model, x, y = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(5, 3), torch.randn(5, 2)
    seen: list[float] = []
    with gradrunner.record(model, ["0:output", "2:weight"], tmp_path / "run") as rec:
        for losses in (2, 1):
            out = model[0](x)
            out.register_hook(lambda g: seen.append(float(g.norm())))
            pred = model[2](model[1](out))
            nn.functional.mse_loss(pred, y).backward(retain_graph=losses == 2)
            if losses == 2:
                pred.abs().mean().backward()
            want = float(model[2].weight.grad.norm())
            rec.step()
            model.zero_grad(set_to_none=True)
            seen.append(want)
    df = load(tmp_path / "run")
    acts, params = df[df.tap == "0:output"], df[df.tap == "2:weight"]
    assert acts.micro_step.tolist()[:2] == [0, 1] and pd.isna(acts.micro_step.iloc[2])
    assert params.micro_step.isna().all()
    assert acts.norm.tolist() == pytest.approx([seen[0], seen[1], seen[3]], rel=1e-6)
    assert params.norm.tolist() == pytest.approx([seen[2], seen[4]], rel=1e-6)


def test_step_and_backward_outside_the_block_are_refused_before_anything_runs(tmp_path: Path) -> None:
    """`rec.step()` and `rec.backward(loss)` before the block and after it are one paragraph (the README did not say):
    the backward runs nothing (no `.grad`), and the dir keeps the block's records as they were."""
    model, (x, y) = _model(), _batches(1)[0]
    rec = gradrunner.record(model, ["0:output", "0:weight"], tmp_path / "run")
    outside = r"^rec\.(step|backward)\(\) was called outside the `with record\(\.\.\.\) as rec:` block"
    for entered in (False, True):
        if entered:
            with rec:
                nn.functional.mse_loss(model(x), y).backward()
                rec.step()
            model.zero_grad(set_to_none=True)
            kept = load(tmp_path / "run")
        with pytest.raises(GradrunnerError, match=outside):
            rec.backward(nn.functional.mse_loss(model(x), y))
        assert all(p.grad is None for p in model.parameters())
        with pytest.raises(GradrunnerError, match=outside):
            rec.step()
    got = load(tmp_path / "run")
    assert sorted(got["step"].unique()) == [0]
    _same(kept, got)
