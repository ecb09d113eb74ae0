"""The records layer: the Parquet schema and writers, and the books of a run dir.

Imports no torch and nothing of the capture layer, so a notebook reading records pays for neither.

| module | what it holds |
| --- | --- |
| `writer` | `grads.parquet` / `steps.parquet`: schema and streamed writers |
| `rundir` | a job's books: `done.json`, `failed.json`, resume decisions, which folders are jobs |

Example::

    from gradrunner.records.writer import GRADS_SCHEMA
    GRADS_SCHEMA.names
"""
