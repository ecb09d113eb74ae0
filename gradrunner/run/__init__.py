"""The run layer: a job built from the composed config, the step loop, guards, DDP, the Hydra job.

May use every other layer; nothing below imports it.

| module | what it holds |
| --- | --- |
| `loop` | the job built from the config and the step loop: `train(cfg)` |
| `guards` | one-paragraph errors around the user's data, model, loss and the disk |
| `signals` | every signal handler of the runner: SIGTERM/SIGHUP as Ctrl-C, exit statuses, quiet exits |
| `resume` | the run dir's lock, refuse/skip/resume decisions, `done.json`/`failed.json` written, `.hydra/` restored |
| `hydra_adapter` | every use of Hydra's private APIs, and errors before the job as one paragraph |
| `distributed` | DDP inside a job under `torchrun` |
| `job` | one Hydra job: the run dir's books around `train` (`run(cfg)`) |

Example::

    from gradrunner.run.job import run
    run(cfg, out_dir="outputs/try")
"""
