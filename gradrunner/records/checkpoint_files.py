"""A job dir's mid-run checkpoint (`.checkpoint/`) on disk: its names, its manifest, and how each file is verified.

Contents:
    CHECKPOINT_DIR, MANIFEST        -- the hidden folder, and `checkpoint.json`: the commit point of a checkpoint
    file_digest(path)               -- SHA-256 of a whole file, read in blocks
    write_manifest(folder, body)    -- `checkpoint.json` written atomically, carrying the SHA-256 of its own body
    read_manifest(directory)        -- a job dir's manifest if it verifies, and why one that is there does not
    segment_problem(path, entry)    -- why a records segment is not the file the manifest recorded, or None

A checkpoint is used only when every file verifies, as `analysis.load` verifies finished records:
the manifest its own digest, the state file and every segment their SHA-256 (any flipped bit, a
truncation or a file swapped in from another run changes it); a segment that does not match is
named with why (unreadable, rows of another run, another row count, other bytes). Segments are
then read with page checksums on. What a checkpoint holds, saving and restoring it:
`gradrunner.run.checkpoint`; the run-dir rules around it: `gradrunner.run.books`.

Example::

    manifest, problem = read_manifest(job_dir)   # (None, None) without a checkpoint
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from gradrunner.records.atomic import write_atomically

#: The checkpoint folder inside a job dir (hidden: pyarrow and DuckDB globs skip it).
CHECKPOINT_DIR = ".checkpoint"
#: The checkpoint's manifest, written last: a checkpoint is the one it describes.
MANIFEST = "checkpoint.json"
#: The manifest's format; an older checkpoint (a bare `state.pt`, no digests) cannot be verified.
FORMAT = 2
#: What a checkpoint written before manifests existed left (it cannot be verified).
LEGACY_STATE = "state.pt"


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of the whole file at `path`.

    Example::

        file_digest(job_dir / ".checkpoint" / "grads-000000010.parquet")   # '9f86d081...'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(folder: Path, body: dict[str, Any]) -> Path:
    """Write `folder/checkpoint.json` atomically: `body` and the SHA-256 of its canonical JSON (`sha256`).

    Example::

        write_manifest(job_dir / ".checkpoint", {"format": 2, "step": 10, ...})
    """
    data = {**body, "format": FORMAT}
    data["sha256"] = _body_digest(data)
    return write_atomically(folder / MANIFEST, json.dumps(data, indent=1) + "\n")


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest of the checkpoint in `directory` (a job dir) if it verifies; else None and why.

    Example::

        read_manifest(job_dir)     # ({"step": 10, ...}, None), or (None, None) without a checkpoint

    (None, None): no checkpoint (none written yet, or only the open segment of a run killed before
    its first checkpoint). (None, why): a manifest that does not verify, or a checkpoint of an older
    gradrunner that has none.
    """
    folder = directory / CHECKPOINT_DIR
    path = folder / MANIFEST
    if not path.is_file():
        if (folder / LEGACY_STATE).is_file():
            return None, (f"it was written by an earlier gradrunner, without the digests that let it be verified "
                          f"({LEGACY_STATE}, no {MANIFEST})")  # fmt: skip
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{MANIFEST} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    if not isinstance(data, dict) or not isinstance(data.get("sha256"), str):
        return None, f"{MANIFEST} is not a checkpoint manifest gradrunner wrote"
    digest = data.pop("sha256")
    if _body_digest(data) != digest:
        return None, f"{MANIFEST} does not match its own digest (its bytes changed after it was written)"
    if data.get("format") != FORMAT:
        return None, f"{MANIFEST} has format {data.get('format')!r}; this gradrunner reads format {FORMAT}"
    return data, None


def segment_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """Why the segment at `path` is not the file `entry` (its manifest entry) recorded, or None when it is.

    Example::

        segment_problem(folder / "grads-000000010.parquet", manifest["segments"][0])   # None

    `entry` holds the file's `sha256`, `rows` and `run_id`. A file whose digest differs is refused,
    the message saying what differs where it can tell: unreadable, rows of another run, another row
    count; else "its bytes changed" (a flipped bit the Parquet reader would not notice).
    """
    name = path.name
    if not path.is_file():
        return f"{name} is missing"
    try:
        if file_digest(path) == entry.get("sha256"):
            return None
    except OSError as e:
        return f"{name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    run_id = entry.get("run_id")
    try:
        f = pq.ParquetFile(path, page_checksum_verification=True)
        rows = f.metadata.num_rows
        ids = {str(v) for v in pc.unique(f.read(columns=["run_id"]).column("run_id")).to_pylist()}
    except Exception as e:  # ArrowInvalid, OSError, ...: a damaged footer or page
        return f"{name} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    if ids - {run_id}:
        return f"{name} holds rows of run(s) {', '.join(sorted(ids - {run_id}))}, not of run {run_id} ({MANIFEST})"
    if rows != entry.get("rows"):
        return f"{name} has {rows} rows where {MANIFEST} recorded {entry.get('rows')}"
    return f"{name} is not the file {MANIFEST} recorded (its bytes changed after the checkpoint was written)"
