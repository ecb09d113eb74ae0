"""Gradients where training already happens: thin adapters from a framework's events to `gradrunner.record`.

| module | what it offers |
| --- | --- |
| `lightning` | `GradientCapture`, a Lightning callback (`gradrunner[lightning]`) |
| `hf` | `GradientCaptureCallback`, a `transformers.TrainerCallback` (`gradrunner[hf]`) |

Each opens one `gradrunner.run.recording.Recorder` (the runner's step engine) and lets the framework's
own backward run unchanged: the capture reads the gradients around it, from the framework's sanctioned
events; nothing of the framework or of torch is patched, nothing of capture or records is done twice.
The modules import their framework only when imported themselves.
"""
