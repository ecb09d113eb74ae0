"""The config layer: what a run may be told, checked before anything runs.

Imports nothing itself, so `gradrunner.config.choices` costs no OmegaConf (the capture layer uses it).

| module | what it holds |
| --- | --- |
| `schema` | the config dataclasses registered in Hydra's ConfigStore, and `validate(cfg)` for their values |
| `choices` | the allowed values of settings that more than one layer checks (torch-free, OmegaConf-free) |
| `edits` | what an `edits` entry may say: `parse_edits(entries)` (torch-free) |
| `overrides` | command-line overrides checked against the schema before Hydra composes the config |

The YAML config groups live beside it in `gradrunner/conf/` (`pkg://gradrunner.conf`).

Example::

    from gradrunner.config.schema import validate
    validate(cfg)
"""
