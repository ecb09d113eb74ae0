"""The run dir's lock (`run.books.RunLock`): a refused run names the live holder from a whole record, or says
honestly that it could not be read; one rule for the runner and `record()`."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from gradrunner.records.columns import LOCK_FILE
from gradrunner.records.locking import EXPORT_LOCK, FileLock
from gradrunner.run import books
from gradrunner.run.books import LiveRun, RunLock


def _refusal(directory: Path, run_id: str = "refused") -> str:
    with pytest.raises(LiveRun) as info, RunLock(directory, run_id):
        pass
    return str(info.value)


def test_a_run_refused_while_the_holder_writes_its_record_names_the_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder has its flock but has not written its record yet (paused there); a second run tries the lock
    then: it is refused naming the holder (not the previous owner, itself, or an empty record)."""
    with RunLock(tmp_path, "previous-owner"):  # the record a stale read would find, naming this very process
        pass
    paused, go, tried = threading.Event(), threading.Event(), threading.Event()
    write = books.write_owner

    def pausing_write(fd: int, owner: dict[str, Any]) -> None:
        if owner.get("run_id") == "holder":
            paused.set()
            go.wait()
        write(fd, owner)

    flock = fcntl.flock

    def noting_flock(fd: int, operation: int) -> None:  # the second run is about to wait for the holder
        if threading.current_thread().name == "second" and not operation & fcntl.LOCK_NB:
            tried.set()
        flock(fd, operation)

    monkeypatch.setattr(books, "write_owner", pausing_write)
    monkeypatch.setattr(fcntl, "flock", noting_flock)
    release, got = threading.Event(), []

    def holder() -> None:
        with RunLock(tmp_path, "holder"):
            release.wait()

    def second() -> None:
        try:
            got.append(_refusal(tmp_path))
        finally:
            tried.set()  # refused without waiting (or failed): the holder may go on

    first = threading.Thread(target=holder, name="holder")
    first.start()
    try:
        assert paused.wait(60)
        other = threading.Thread(target=second, name="second")
        other.start()
        assert tried.wait(60)
    finally:
        go.set()
        other.join(60)
        release.set()
        first.join(60)
    assert len(got) == 1 and "run id holder)" in got[0] and f"pid {os.getpid()}," in got[0], got


@pytest.mark.parametrize("record", [b"", b'{"host": "h', b"[]"])
def test_a_holder_whose_record_cannot_be_read_is_said_to_be_unknown_not_named_with_question_marks(
    tmp_path: Path, record: bytes
) -> None:
    with RunLock(tmp_path, "live"):
        (tmp_path / LOCK_FILE).write_bytes(record)  # a record the disk refused, or one being written by an old version
        message = _refusal(tmp_path)
    assert "could not be read, so it cannot be named" in message and "?" not in message
    assert "pid <pid>" not in message and message.startswith(f"the run dir {tmp_path} is in use by a live run (")


def test_a_run_that_holds_the_dir_but_does_not_run_there_is_the_one_a_refusal_names(tmp_path: Path) -> None:
    """A skipped or refused run puts the previous owner's record back (its `.hydra/`, its run id for live
    reads) but, while it still holds the lock, a refusal names it, not the previous owner."""
    with RunLock(tmp_path, "previous-owner"):
        pass
    with RunLock(tmp_path, "skipping") as lock:
        lock.leave_no_trace()
        message = _refusal(tmp_path)
    assert "run id skipping)" in message and "previous-owner" not in message
    with RunLock(tmp_path, "next") as lock:
        assert lock.previous.get("run_id") == "previous-owner" and "held_by" not in lock.previous


def test_a_dir_held_by_this_very_process_is_not_said_to_be_stopped_by_killing_it(tmp_path: Path) -> None:
    """An open session of the same process (an outer `with record(...)` into the same dir) holds the lock: the
    refusal says so, rather than telling the user to kill the process it runs in; another process's: kill it."""
    with RunLock(tmp_path, "outer"):
        message = _refusal(tmp_path)
    assert f"pid {os.getpid()}," in message and f"kill {os.getpid()}" not in message
    assert "this very process" in message and "record()'s run_dir" in message
    other = RunLock(tmp_path, "x")._refusal({"host": "elsewhere", "pid": 1, "started": "2020-01-01", "run_id": "r"})
    assert "stop it (kill 1 on elsewhere)" in other and "this very process" not in other


@pytest.mark.parametrize("kind", ["run dir", "export"])
def test_both_locks_go_on_unlocked_with_a_warning_on_a_filesystem_without_locks_and_lock_the_file_that_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """One loop takes both locks (`records.locking.take`): ENOLCK is "no locks here" (go on, said), and a lock file
    replaced between open and flock is let go and the one that is there is locked."""
    flock, calls = fcntl.flock, []
    path = tmp_path / (LOCK_FILE if kind == "run dir" else EXPORT_LOCK)
    path.write_text("{}")

    def no_locks(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_NB:
            calls.append(os.fstat(fd).st_ino)
            if len(calls) == 1:  # the first file is replaced under us: a run that removed it and made another
                path.unlink()
                path.write_text("{}")
                return flock(fd, operation)
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock: Any = RunLock(tmp_path, "r1") if kind == "run dir" else FileLock(path)
    with caplog.at_level("WARNING"), lock:
        assert json.loads(path.read_text())["pid"] == os.getpid()  # the record is in the file that is there
    assert len(calls) == 2 and calls[0] != calls[1] == path.stat().st_ino
    assert [r.getMessage() for r in caplog.records if "no file locks" in r.getMessage()] == [
        f"{path}: this filesystem has no file locks ({os.strerror(errno.ENOLCK)}); "
        + ("running without the run-dir lock, so nothing stops a second run into this dir" if kind == "run dir"
           else "going on without the lock, so nothing stops a second process writing here")  # fmt: skip
    ]
