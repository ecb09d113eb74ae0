"""The run layer: a job built from the composed config, the step loop, guards, DDP, the Hydra job.

May use every other layer; nothing below imports it.

| module | what it holds |
| --- | --- |
| `build` | model, data, loss, optimizer and scheduler built from the config (`setup(cfg)`) |
| `preflight` | what only the built job can tell, checked before step 0: the schedule through the run, the eval data, the weights file |
| `loop` | the step loop: `train(cfg)`, `train_step` |
| `engine` | the step engine the runner, `record()` and the callbacks drive: capture, writers, a step's rows |
| `numerics` | autocast, the total gradient norm, clipping |
| `progress` | the console's progress bar or log lines |
| `schedules` | LambdaLR multipliers of the scheduler configs |
| `guards` | one-paragraph errors around the user's data, model, loss and the disk |
| `signals` | every signal handler of the runner: SIGTERM/SIGHUP as Ctrl-C, exit statuses, quiet exits |
| `books` | a run dir's books: the lock, refuse/skip/resume decisions, `done.json`/`failed.json` written, `.hydra/` restored |
| `checkpoint` | mid-run checkpoints and resume from the last one |
| `recording` | `gradrunner.record(...)`: the run dir's books around the step engine, in any training loop |
| `watch` | warnings during a run: records that will be huge, a loss or gradients stuck at zero, taps without gradient (the summary at the end: `analysis.health`) |
| `hydra_adapter` | every use of Hydra's private APIs, and errors before the job as one paragraph |
| `distributed` | DDP inside a job under `torchrun` |
| `job` | one Hydra job: the run dir's books around `train` (`run(cfg)`) |
| `sweep_plan` | which jobs of a re-run sweep are complete, from the catalogue |

Example::

    from gradrunner.run.job import run
    run(cfg, out_dir="outputs/try")
"""
