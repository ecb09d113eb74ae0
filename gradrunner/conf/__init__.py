"""gradrunner's Hydra configs, shipped as package data (`config_path="pkg://gradrunner.conf"`).

Importing this package (Hydra does, to read the YAML files) registers the schema that
`config.yaml` lists first in its defaults.
"""

from gradrunner.config.schema import register_configs

register_configs()
