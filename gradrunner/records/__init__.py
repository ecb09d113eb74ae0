"""The records layer: the Parquet schema and writers, and a run dir's state (read-only).

Imports no OmegaConf either: writing a run dir's books, its lock and resume decisions are `gradrunner.run.books`.

Imports no torch and nothing of the capture layer, so a notebook reading records pays for neither.

| module | what it holds |
| --- | --- |
| `schema` | the Parquet schemas of `grads.parquet` and `steps.parquet`, and their column encodings |
| `writer` | `grads.parquet` / `steps.parquet`: streamed writers, the files' metadata |
| `table_writer` | one Parquet table streamed to a temp file and committed atomically; a job's writers closed as one |
| `rundir` | a job dir's state, read-only: `done.json`, `failed.json`, verified reading, which folders are jobs |
| `atomic` | `write_atomically`: a small file whole or not at all |
| `locking` | `FileLock`: an exclusive `flock` naming its live holder (the exporters' lock on their target dir) |
| `columns` | column and file names, temp names, the host-side records of a step |

Example::

    from gradrunner.records.schema import GRADS_SCHEMA
    GRADS_SCHEMA.names
"""
