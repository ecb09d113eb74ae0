"""`python -m gradrunner ...` and the `gradrunner` console script: `entry()` runs the app of `gradrunner.cli.app`.

`entry` adds what only a real process needs: Ctrl-C while Python is still importing, between jobs,
or after the run ended (its `atexit` callbacks) is one line on stderr and exit status 130, never a
`KeyboardInterrupt` traceback. Records are never open at those moments.
"""

import sys


def entry() -> None:
    """The program: `gradrunner.cli.app.main`, with Ctrl-C outside a run reported in one line."""
    try:
        from gradrunner.cli.app import main
        from gradrunner.run import signals
    except KeyboardInterrupt:
        print("gradrunner: interrupted while starting; nothing ran", file=sys.stderr, flush=True)
        sys.exit(130)
    try:
        main()
    except KeyboardInterrupt as e:  # outside any job (a job's own is reported by the app)
        signals.ignore_further_signals()
        print("gradrunner: interrupted", file=sys.stderr, flush=True)
        sys.exit(signals.exit_status(e))
    finally:  # what is left (atexit: the sweep manifest) is not worth a traceback
        signals.quiet_interrupts("interrupted while finishing; the records written are complete")


if __name__ == "__main__":
    entry()
