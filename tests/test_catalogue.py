"""The sweep catalogue (issue 25): written as jobs end, safe under concurrent writers, and the shortcut it gives a re-run.

Unit tests of `records.catalogue` (concurrent writers in separate processes, a writer killed inside
its transaction, damage), then the real CLI: a completed sweep re-run composes and launches no job
(counted by wrapping Hydra's config loader; the CLI runs in-process, `conftest.python_m`), a new job of a re-run runs alone, an
edited config file disables the shortcut, the manifest and `load()` agree with the catalogue, and a
damaged catalogue is moved aside and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from catalogue_writers import damaged_then_written, killed_inside_a_transaction, writer
from conftest import check_ok, child_python, cli_env, python_m

from gradrunner.analysis import load
from gradrunner.cli.sweep_books import MANIFEST, _job_num, build_manifest
from gradrunner.records.catalogue import CATALOGUE, JobRow, read_jobs, record_job
from gradrunner.records.rundir import DONE

BASE = ["+experiment=mlp", "steps=1", "device=cpu"]


# --- the file ------------------------------------------------------------------------------------


def test_concurrent_writers_lose_no_row(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=writer, args=(str(tmp_path), w, 40, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    rows = read_jobs(tmp_path)
    assert rows is not None
    assert sorted(r.dir for r in rows) == sorted(f"{w}-{i}" for w in range(4) for i in range(40))
    assert all(r.run_id == f"{int(r.dir.split('-')[0]):02d}{int(r.dir.split('-')[1]):04d}" for r in rows)


def test_a_writer_killed_inside_its_transaction_loses_only_its_own_row(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=killed_inside_a_transaction, args=(str(tmp_path),))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 9
    record_job(tmp_path, JobRow(dir="after", num=2, overrides=["a=2"], status="failed", error="boom"))
    rows = read_jobs(tmp_path)
    assert rows is not None
    assert [(r.dir, r.status) for r in rows] == [("before", "completed"), ("after", "failed")]


@pytest.mark.parametrize("damage", [b"not a database at all" * 50, b""])
def test_a_damaged_catalogue_is_moved_aside_never_trusted(tmp_path: Path, damage: bytes,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    (tmp_path / CATALOGUE).write_bytes(damage)
    if damage:
        assert read_jobs(tmp_path) is None
        assert "damaged" in caplog.text
        assert not (tmp_path / CATALOGUE).exists()
        assert [p.read_bytes() for p in tmp_path.glob(f"{CATALOGUE}.damaged-*")] == [damage]
    record_job(tmp_path, JobRow(dir="0", num=0, overrides=["seed=0"], status="completed", run_id="x"))
    assert [r.run_id for r in read_jobs(tmp_path) or []] == ["x"]


def test_another_layout_version_is_damage(tmp_path: Path) -> None:
    con = sqlite3.connect(tmp_path / CATALOGUE)
    con.execute("create table jobs (dir text)")
    con.execute("pragma user_version = 99")
    con.commit()
    con.close()
    assert read_jobs(tmp_path) is None
    assert list(tmp_path.glob(f"{CATALOGUE}.damaged-*"))


# --- the CLI -------------------------------------------------------------------------------------

def run_counted(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """The CLI (`python -m gradrunner`, in this process: `conftest.python_m`), and how many job configs it
    composed: every call of Hydra's `load_sweep_config`, by the launching code and by its jobs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    original = ConfigLoaderImpl.load_sweep_config
    calls: list[int] = []

    def load_sweep_config(self: ConfigLoaderImpl, *a: Any, **k: Any) -> Any:
        calls.append(1)
        return original(self, *a, **k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConfigLoaderImpl, "load_sweep_config", load_sweep_config)
        result = python_m(tmp_path, "gradrunner", *args)
    return result, len(calls)


def digests(root: Path) -> dict[str, str]:
    """Every file below the job dirs (hidden ones too), by path: what a re-run must leave byte-identical."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.parent != root}  # fmt: skip


def test_a_completed_sweep_rerun_composes_and_launches_nothing(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    first, composed = run_counted(tmp_path, "-m", *BASE, "seed=0,1,2", f"hydra.sweep.dir={sweep}")
    check_ok(first)
    assert composed >= 3  # each job's config, at least once
    rows = read_jobs(sweep)
    assert rows is not None and [(r.dir, r.num, r.status) for r in rows] == [(str(n), n, "completed") for n in range(3)]
    for row in rows:
        marker = json.loads((sweep / row.dir / DONE).read_text())
        assert (row.run_id, row.rows, row.files) == (marker["run_id"], sum(marker["rows"].values()), marker["files"])
        assert row.fingerprint is not None and row.fingerprint.startswith("sha256:")
    before = digests(sweep)

    again, composed = run_counted(tmp_path, "-m", *BASE, "seed=0,1,2", f"hydra.sweep.dir={sweep}")
    check_ok(again)
    assert composed == 0
    assert "Launching" not in again.stdout + again.stderr
    assert digests(sweep) == before
    manifest = json.loads((sweep / MANIFEST).read_text())
    assert manifest["counts"] == {"completed": 3, "failed": 0, "missing": 0}

    grown, composed = run_counted(tmp_path, "-m", *BASE, "seed=0,1,2,3", f"hydra.sweep.dir={sweep}")
    check_ok(grown)
    assert "#3 : " in grown.stdout + grown.stderr and "#0 : " not in grown.stdout + grown.stderr
    assert composed == 1  # job 3 only, by the up-front check: the job runs on that config (`config_composed_once`)
    assert {k: v for k, v in digests(sweep).items() if not k.startswith("3/")} == before
    assert [r.dir for r in read_jobs(sweep) or []] == ["0", "1", "2", "3"]


def test_an_edited_config_file_disables_the_shortcut_and_the_rerun_refuses(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    exp = conf / "mine.yaml"
    exp.write_text("# @package _global_\ndefaults:\n  - override /model: mlp\nsteps: 1\ndevice: cpu\n")
    sweep = tmp_path / "s"
    args = ["-m", "--config-dir", str(tmp_path / "conf"), "+experiment=mine", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    check_ok(run_counted(tmp_path, *args)[0])
    unchanged, composed = run_counted(tmp_path, *args)
    check_ok(unchanged)
    assert composed == 0
    before = digests(sweep)
    rows_before = read_jobs(sweep)

    exp.write_text(exp.read_text().replace("steps: 1", "steps: 2"))
    edited, composed = run_counted(tmp_path, *args)
    assert edited.returncode != 0
    assert composed >= 2  # no fingerprint match: every job composed and checked the slow way
    assert "steps: 1 -> 2" in edited.stderr
    assert digests(sweep) == before  # refused: the completed jobs' files untouched, no failed.json
    assert read_jobs(sweep) == rows_before
    manifest = json.loads((sweep / MANIFEST).read_text())
    assert manifest["counts"] == {"completed": 2, "failed": 0, "missing": 0}


def test_manifest_and_load_agree_with_the_catalogue_and_a_damaged_one_is_rebuilt(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    check_ok(run_counted(tmp_path, "-m", *BASE, "seed=0,1", "capture.strategy=hook,retain_grad",
                         f"hydra.sweep.dir={sweep}")[0])  # fmt: skip
    rows = read_jobs(sweep)
    assert rows is not None and len(rows) == 4
    df = load(sweep)
    by_run = df.groupby("run_id").size().to_dict()
    assert set(by_run) == {r.run_id for r in rows}
    for row in rows:
        marker = json.loads((sweep / row.dir / DONE).read_text())
        assert by_run[row.run_id] == marker["rows"]["grads.parquet"]
    for row in rows:  # the job number read off Hydra's text is the one its YAML holds
        hydra_yaml = yaml.safe_load((sweep / row.dir / ".hydra" / "hydra.yaml").read_text())
        assert _job_num(sweep / row.dir) == hydra_yaml["hydra"]["job"]["num"] == row.num
    view = build_manifest(sweep, [r.overrides for r in rows])
    scanned = build_manifest(sweep, None)
    assert [(j["dir"], j["status"], j["files"]) for j in view["jobs"]] == [
        (j["dir"], j["status"], j["files"]) for j in scanned["jobs"]]  # fmt: skip

    (sweep / CATALOGUE).write_bytes(b"\x00garbage" * 100)
    again, composed = run_counted(tmp_path, "-m", *BASE, "seed=0,1", "capture.strategy=hook,retain_grad",
                                  f"hydra.sweep.dir={sweep}")  # fmt: skip
    check_ok(again)
    assert "damaged" in again.stdout + again.stderr
    assert composed >= 4  # no catalogue to trust: composed, then skipped by each job's own check
    rebuilt = read_jobs(sweep)
    assert rebuilt is not None
    assert sorted((r.dir, r.run_id, r.status) for r in rebuilt) == sorted((r.dir, r.run_id, r.status) for r in rows)
    assert all(r.fingerprint == rows[0].fingerprint for r in rebuilt)  # each skipped job wrote its row again
    assert json.loads((sweep / MANIFEST).read_text())["counts"]["completed"] == 4


def test_a_failed_job_is_listed_failed_and_runs_again(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    result = run_counted(tmp_path, "-m", "+experiment=mlp", "steps=1", "device=cpu", "dtype=float16",
                         "optimizer.lr=0.01,1e6", f"hydra.sweep.dir={sweep}")[0]  # fmt: skip
    rows = {r.num: r for r in read_jobs(sweep) or []}
    if result.returncode == 0:  # the huge rate did not fail on this build: nothing to check here
        pytest.skip("optimizer.lr=1e6 did not fail the job on this torch build")
    assert rows[0].status == "completed" and rows[1].status == "failed" and rows[1].error
    again, composed = run_counted(tmp_path, "-m", "+experiment=mlp", "steps=1", "device=cpu", "dtype=float16",
                                  "optimizer.lr=0.01,1e6", f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert "#1 : " in again.stdout + again.stderr and "#0 : " not in again.stdout + again.stderr


def test_the_fingerprint_follows_the_config_files_and_refuses_the_environment(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from gradrunner.run.sweep_plan import _impure, config_fingerprint

    assert _impure(b"steps: ${oc.env:STEPS}\n")
    assert _impure(b"lr: ${my_resolver:3}\n")
    assert not _impure(b"lr: ${optimizer.base}\nx: ${oc.select:a.b,1}\nhydra:\n  run:\n    dir: ${now:%H}\n")
    (tmp_path / "experiment").mkdir()
    exp = tmp_path / "experiment" / "mine.yaml"
    exp.write_text("steps: 1\n")
    cfg = OmegaConf.create({"hydra": {"sweep": {"subdir": "${hydra.job.num}"}, "runtime": {"config_sources": [
        {"path": "gradrunner.conf", "schema": "pkg", "provider": "main"},
        {"path": str(tmp_path), "schema": "file", "provider": "command-line"}]}}})  # fmt: skip
    first = config_fingerprint(cfg)
    assert first is not None and first == config_fingerprint(cfg)
    exp.write_text("steps: 2\n")
    assert config_fingerprint(cfg) not in (None, first)
    exp.write_text("steps: ${oc.env:STEPS}\n")
    assert config_fingerprint(cfg) is None
    exp.write_text("steps: 2\n")
    cfg.hydra.sweep.subdir = "${seed}"
    assert config_fingerprint(cfg) not in (None, first)


def test_two_concurrent_launchers_with_parallel_jobs_lose_no_row(tmp_path: Path) -> None:
    sweep = tmp_path / "s"
    env = cli_env()
    procs = [subprocess.Popen(
        [child_python(), "-m", "gradrunner", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *BASE,
         f"seed={seeds}", f"hydra.sweep.dir={sweep}", f"hydra.sweep.subdir={name}${{hydra.job.num}}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) for name, seeds in (("a", "0,1,2,3"), ("b", "4,5,6,7"))]  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    rows = read_jobs(sweep)
    assert rows is not None
    assert sorted(r.dir for r in rows) == [f"{n}{i}" for n in "ab" for i in range(4)]
    for row in rows:
        marker = json.loads((sweep / row.dir / DONE).read_text())
        assert (row.status, row.run_id, row.overrides) == ("completed", marker["run_id"], marker["overrides"])
        assert f"seed={marker['config']['seed']}" in row.overrides


# --- the catalogue is a cache (issue 38 items 2 and 6) ----------------------------------------------


def _damage_files(sweep: Path, rng: random.Random) -> dict[str, str]:
    """Jobs 0-3's grads.parquet deleted, flipped, truncated and swapped for job 4's, at seeded points."""
    grads = [sweep / str(n) / "grads.parquet" for n in range(5)]
    grads[0].unlink()
    data = bytearray(grads[1].read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    grads[1].write_bytes(bytes(data))
    kept = rng.randrange(1, grads[2].stat().st_size)
    with open(grads[2], "r+b") as f:
        f.truncate(kept)
    shutil.copy2(grads[4], grads[3])  # size, mtime and all: only the footer digest tells it apart
    return {"0": "deleted", "1": f"bit flipped at byte {at}", "2": f"truncated to {kept} bytes", "3": "job 4's file"}


@pytest.mark.parametrize("seed", [3, 38])
def test_a_rerun_reruns_completed_jobs_whose_files_do_not_verify(tmp_path: Path, seed: int) -> None:
    """The catalogue is a cache: a listed job whose files were deleted, flipped, truncated or swapped runs again."""
    sweep = tmp_path / "s"
    args = ["-m", *BASE, "seed=0,1,2,3,4", f"hydra.sweep.dir={sweep}"]
    check_ok(run_counted(tmp_path, *args)[0])
    before = {r.dir: r.run_id for r in read_jobs(sweep) or []}
    intact = digests(sweep / "4")
    damage = _damage_files(sweep, random.Random(seed))

    again, composed = run_counted(tmp_path, *args)
    check_ok(again)
    assert "no longer are" in again.stderr + again.stdout
    after = {r.dir: r.run_id for r in read_jobs(sweep) or []}
    assert digests(sweep / "4") == intact and after["4"] == before["4"]  # the intact job: skipped, untouched
    df = load(sweep)  # every job verifies: nothing refused
    assert sorted(df.job.unique()) == [str(n) for n in range(5)]
    for job, what in damage.items():
        marker = json.loads((sweep / job / DONE).read_text())
        rows = df[df.job == job]
        if marker["run_id"] == before[job]:  # only a flip in bytes nothing reads can leave a job verified as it was
            assert what.startswith("bit flipped"), (job, what)
        assert set(rows.run_id) == {marker["run_id"]} and len(rows) == marker["rows"]["grads.parquet"], (job, what)
    assert composed <= 2 * 4  # the damaged jobs, each composed by the up-front check and the job (at most)


def _rename_column(sweep: Path) -> None:
    con = sqlite3.connect(sweep / CATALOGUE)
    con.execute("alter table jobs rename column files to filez")
    con.commit()
    con.close()


def test_a_catalogue_damaged_into_operational_errors_is_moved_aside_once_and_the_shortcut_returns(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "s"
    args = ["-m", *BASE, "seed=0,1,2", f"hydra.sweep.dir={sweep}"]
    check_ok(run_counted(tmp_path, *args)[0])
    _rename_column(sweep)  # every select and insert is now an OperationalError ("no such column")
    with sqlite3.connect(sweep / CATALOGUE) as con, pytest.raises(sqlite3.OperationalError):
        con.execute("select files from jobs").fetchall()

    again, composed = run_counted(tmp_path, *args)
    check_ok(again)
    output = again.stdout + again.stderr
    assert output.count("is damaged") == 1, output  # moved aside once, with one warning
    assert "could not write" not in output and "could not read" not in output
    assert len(list(sweep.glob(f"{CATALOGUE}.damaged-*"))) == 1
    assert composed >= 3  # nothing to trust: each job checked by itself, and each wrote its row anew

    third, composed = run_counted(tmp_path, *args)
    check_ok(third)
    assert composed == 0 and "is damaged" not in third.stdout + third.stderr  # the fast path is back


@pytest.mark.parametrize("seed", range(4))
def test_operational_damage_is_moved_aside_and_the_next_write_starts_anew(
    tmp_path: Path, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    for n in range(3):
        record_job(tmp_path, JobRow(dir=str(n), num=n, overrides=[f"seed={n}"], status="completed", run_id=f"r{n}"))
    rng = random.Random(seed)
    con = sqlite3.connect(tmp_path / CATALOGUE)
    column = rng.choice(["overrides", "status", "files", "fingerprint", "finished", "stamps"])
    how = rng.choice(["rename", "drop"])
    con.execute(f"alter table jobs rename column {column} to x_{column}" if how == "rename"
                else f"alter table jobs drop column {column}")  # fmt: skip
    con.commit()
    con.close()
    first = read_jobs(tmp_path) if seed % 2 else None
    if seed % 2 == 0:  # the first access a write: it moves the file aside and writes its row anew
        record_job(tmp_path, JobRow(dir="9", num=9, overrides=["seed=9"], status="completed", run_id="r9"))
    assert first is None
    assert caplog.text.count("is damaged") == 1 and column in caplog.text
    assert len(list(tmp_path.glob(f"{CATALOGUE}.damaged-*"))) == 1
    record_job(tmp_path, JobRow(dir="8", num=8, overrides=["seed=8"], status="completed", run_id="r8"))
    assert sorted(r.dir for r in read_jobs(tmp_path) or []) == (["8", "9"] if seed % 2 == 0 else ["8"])
    assert caplog.text.count("is damaged") == 1


def test_concurrent_writers_move_a_damaged_catalogue_aside_once(tmp_path: Path) -> None:
    record_job(tmp_path, JobRow(dir="0", num=0, overrides=["seed=0"], status="completed", run_id="r0"))
    _rename_column(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=damaged_then_written, args=(str(tmp_path), w, start)) for w in range(3)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    assert len(list(tmp_path.glob(f"{CATALOGUE}.damaged-*"))) == 1
    assert sorted(r.dir for r in read_jobs(tmp_path) or []) == ["w0", "w1", "w2"]


HOLDER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("begin exclusive")
print("held", flush=True)
sys.stdin.read()   # holds the lock until the test closes stdin
"""


def test_a_held_lock_costs_one_bounded_wait_and_names_its_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gradrunner.records import catalogue

    record_job(tmp_path, JobRow(dir="0", num=0, overrides=["seed=0"], status="completed", run_id="r0"))
    monkeypatch.setattr(catalogue, "LOCK_WAIT_S", 1.0)
    waits: list[float] = []
    connect = sqlite3.connect
    monkeypatch.setattr(catalogue.sqlite3, "connect", lambda *a, **k: waits.append(k["timeout"]) or connect(*a, **k))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / CATALOGUE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert read_jobs(tmp_path) is None  # the job dirs are read instead
        assert f"pid {holder.pid}" in caplog.text and "locked by" in caplog.text
        with pytest.raises(catalogue.CatalogueBusy, match=f"pid {holder.pid}"):
            record_job(tmp_path, JobRow(dir="1", num=1, overrides=["seed=1"], status="failed", error="x"))
        assert read_jobs(tmp_path) is None
        assert waits == [1.0, 0.0, 0.0]  # one bounded wait, then no more waiting while it is held
        assert not list(tmp_path.glob(f"{CATALOGUE}.damaged-*"))  # a held lock is not damage
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    assert [r.dir for r in read_jobs(tmp_path) or []] == ["0"]  # released: the try without waiting succeeds
    read_jobs(tmp_path)
    assert waits[-2:] == [0.0, 1.0]  # and the access after it waits again as usual


def test_a_catalogue_of_the_layout_before_stamps_is_read_and_upgraded_in_place(tmp_path: Path) -> None:
    con = sqlite3.connect(tmp_path / CATALOGUE)
    con.execute("create table jobs (dir text primary key, num integer, overrides text not null, status text not null, "
                "run_id text, rows integer, files text not null, error text, fingerprint text, finished text)")  # fmt: skip
    con.execute("""insert into jobs values ('0', 0, '["seed=0"]', 'completed', 'r0', 22, '["grads.parquet"]', """
                "null, 'sha256:x', null)")  # fmt: skip
    con.execute("pragma user_version = 1")
    con.commit()
    con.close()
    (old,) = read_jobs(tmp_path) or []
    assert (old.dir, old.run_id, old.stamps) == ("0", "r0", None)
    record_job(tmp_path, JobRow(dir="1", num=1, overrides=["seed=1"], status="completed", run_id="r1",
                                stamps={"grads.parquet": "10:20"}))  # fmt: skip
    assert [(r.dir, r.stamps) for r in read_jobs(tmp_path) or []] == [("0", None), ("1", {"grads.parquet": "10:20"})]
    assert not list(tmp_path.glob(f"{CATALOGUE}.damaged-*"))
    with sqlite3.connect(tmp_path / CATALOGUE) as con:
        assert con.execute("pragma user_version").fetchone()[0] == 2
