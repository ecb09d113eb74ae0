"""An exclusive lock on a file, held while a process writes somewhere, naming its holder to whoever is refused.

Example::

    try:
        with FileLock(out / EXPORT_LOCK):      # the exporters' lock on their target dir
            ...                                # write; no other process holding this lock writes here meanwhile
    except Held as e:
        print(e.owner.get("pid"))              # the live holder (its record; {} if it could not be read)

One mechanism for this lock and the run dir's (`gradrunner.run.books.RunLock`), `take`: an `fcntl.flock` that the kernel drops when
its process dies (SIGKILL included), so a killed holder never blocks the next one; the file stays (removing
it would race with a process about to lock it), and a process that locked a file someone removed meanwhile
locks the one that is there (inode check). On a filesystem without locks it goes on unlocked, with a warning.
The holder's record (host, pid, start time) is written over the previous one in one write, padded, then cut
to length: never truncated first, so a refused process does not read an empty record (`write_owner`,
`read_owner`: the run dir's lock writes and reads its record with them too).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The lock file an exporter holds in the dir it writes (hidden; no reader of the targets reads it).
EXPORT_LOCK = ".gradrunner-export.lock"
#: `flock` errors meaning "this filesystem has no locks" (go on unlocked), not "held".
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class Held(Exception):
    """The lock is held by a live process: `owner` is its record (host, pid, started; {} if it could not be read)."""

    def __init__(self, path: Path, owner: dict[str, Any]) -> None:
        super().__init__(f"{path} is held by pid {owner.get('pid', '?')} on {owner.get('host', '?')}")
        self.path = path
        self.owner = owner


class FileLock:
    """An exclusive, non-blocking `flock` on `path` (created, with its parent dirs), held inside a `with`.

    Example::

        with FileLock(Path("tb/.gradrunner-export.lock"), run_id="3f2a"):   # Held if a live process holds it
            ...

    Entering writes this process's record (host, pid, start time, and `extra`) into the file; leaving
    releases the lock and keeps the file.
    """

    def __init__(self, path: Path, **extra: Any) -> None:
        self.path = Path(path)
        self.extra = extra
        self._fd: int | None = None

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, _ = take(self.path, "going on without the lock, so nothing stops a second process writing here")
        self._fd = fd
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        write_owner(fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": started, **self.extra})
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def take(path: Path, unlocked: str) -> tuple[int, bool]:
    """Open and `flock` the lock file at `path`, the one that is there (it may be removed or replaced meanwhile:
    inode check): (its fd, whether this call created the file). `Held`, with the holder's record, if a live
    process holds it. On a filesystem without locks: a warning ending in `unlocked`, and the fd, not locked.

    Example::

        fd, created = take(Path("out/.gradrunner.lock"), "going on unlocked")   # Held if another process holds it
    """
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = read_owner(fd)
            os.close(fd)
            raise Held(path, owner) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            log.warning("%s: this filesystem has no file locks (%s); %s", path, os.strerror(e.errno or 0), unlocked)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, created
        os.close(fd)


def write_owner(fd: int, owner: dict[str, Any]) -> None:
    """One pwrite of the whole record (padded with blanks over a longer old one, which JSON ignores), then the
    file cut to it: a reader never sees it empty. A record the disk refuses is emptied: never a stale one."""
    data = json.dumps(owner).encode()
    try:
        os.pwrite(fd, data.ljust(os.fstat(fd).st_size, b" "), 0)
        os.ftruncate(fd, len(data))
    except OSError:
        with contextlib.suppress(OSError):  # the record only serves messages: a full disk must not stop the lock
            os.ftruncate(fd, 0)


def read_owner(fd: int) -> dict[str, Any]:
    """The lock file's record of its holder, read whole (a run's holds its `.hydra/`: past one read); {} if it
    does not read."""
    chunks: list[bytes] = []
    try:
        while chunk := os.pread(fd, 1 << 16, sum(map(len, chunks))):
            chunks.append(chunk)
        data = json.loads(b"".join(chunks) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
