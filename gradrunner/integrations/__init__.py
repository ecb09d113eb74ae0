"""Gradients where training already happens: thin adapters from a framework's events to `gradrunner.record`.

| module | what it offers |
| --- | --- |
| `lightning` | `GradientCapture`, a Lightning callback (`gradrunner[lightning]`) |
| `hf` | `GradientCaptureCallback`, a `transformers.TrainerCallback` (`gradrunner[hf]`) |

Each opens one `gradrunner.run.recording.Recorder` (the runner's capture session and writers) and
routes the framework's own backward call through it; nothing of capture or records is done twice.
The modules import their framework only when imported themselves.
"""
