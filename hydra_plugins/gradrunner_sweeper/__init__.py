"""gradrunner's Hydra sweeper (`hydra/sweeper=gradrunner`, the default in gradrunner's config); see `gradrunner_sweeper.py`."""
