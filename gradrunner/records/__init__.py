"""The records layer: the Parquet schema and writers, and the books of a run dir.

Imports no torch and nothing of the capture layer, so a notebook reading records pays for neither.

| module | what it holds |
| --- | --- |
| `schema` | the Parquet schemas of `grads.parquet` and `steps.parquet`, and their column encodings |
| `writer` | `grads.parquet` / `steps.parquet`: streamed writers |
| `rundir` | a job's books: `done.json`, `failed.json`, resume decisions, which folders are jobs |

Example::

    from gradrunner.records.schema import GRADS_SCHEMA
    GRADS_SCHEMA.names
"""
