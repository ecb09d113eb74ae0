"""Write a whole file or none: the one helper every small file of a run dir is written with.

Example::

    write_atomically(run_dir / "report.html", page)          # str (UTF-8) or bytes

The data goes to a hidden temp name beside the target (`columns.temp_name`: ignored by pyarrow and
DuckDB), is closed, and the temp file is renamed over the target; on any failure (a full disk, a
read-only dir, Ctrl-C) the temp file is removed and the target is as it was. A reader sees the old
file or the new one, never a truncated one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

from gradrunner.records.columns import temp_name


def write_atomically(path: Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write `data` to `path` through a temp file and a rename; on failure no temp file and `path` untouched."""
    path = Path(path)
    temp = path.with_name(temp_name(path.name, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))
    try:
        temp.write_bytes(data.encode(encoding) if isinstance(data, str) else data)
        os.replace(temp, path)
    except BaseException:
        # never leave a temp file behind (a full disk); on a read-only file system unlink fails too (EROFS, even
        # for a file that is not there): the error to raise is the write's, not the cleanup's
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        raise
    return path
