"""THE rule for URLs where gradrunner expects a local path (object storage: `s3://`, `gs://`, `memory://`, `file://`).

Contents:
    url_scheme(value)            -- the scheme of a URL (`"s3"`), or None for a local path
    local_path_of(value, what)   -- a local path for `value`: `file://` stripped, any other URL a GradrunnerError

gradrunner writes and reads local paths only. A run or sweep dir given as a URL is refused (Hydra would
make a local folder named `s3:/bucket/...`); `analysis.load` reads a `file://` URL as the local path it
names and refuses any other scheme. To use object storage, write locally and upload completed job dirs
(`done.json` present) yourself; download before `load()`. See docs/scale-out.md.

Example::

    url_scheme("s3://bucket/runs")          # 's3'
    url_scheme("multirun/2024-05-01")       # None
    local_path_of("file:///data/sweep", "load()")   # '/data/sweep'
"""

from __future__ import annotations

import re
import urllib.parse
import urllib.request

from gradrunner.errors import GradrunnerError

# RFC 3986's scheme, then "://": a Windows drive (`C:\\runs`) or a colon in a folder name is no URL.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def url_scheme(value: str) -> str | None:
    """The scheme of `value` when it is a URL (`scheme://...`), else None.

    Example::

        url_scheme("memory://b/r")   # 'memory'
    """
    match = _URL.match(value)
    return match.group(1).lower() if match else None


def local_path_of(value: str, what: str) -> str:
    """`value` as a local path: unchanged without a scheme, a `file://` URL's path, else a GradrunnerError.

    Example::

        local_path_of("file:///data/sweep", "load()")      # '/data/sweep'
        local_path_of("s3://bucket/sweep", "load()")       # GradrunnerError: ... URLs are not read ...
    """
    scheme = url_scheme(value)
    if scheme is None:
        return value
    if scheme == "file":
        parts = urllib.parse.urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            raise GradrunnerError(
                f"{what} was given {value!r}, a file:// URL on a remote host ({parts.netloc}); only local paths "
                "are read. Mount or copy the files and pass the local path (file:///path or /path)."
            )
        return urllib.request.url2pathname(parts.path)
    raise GradrunnerError(
        f"{what} was given {value!r}, a URL ({scheme}://); gradrunner reads and writes local paths only (a "
        "file:// URL is read as its local path), so URLs are not read. Download the run or sweep dir first "
        "(e.g. `aws s3 sync`, `gsutil rsync`, fsspec's `get(..., recursive=True)`) and pass the local path."
    )
