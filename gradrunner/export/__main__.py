"""`python -m gradrunner.export <target> <dir>`: the command line of `gradrunner.export`."""

from gradrunner.export.jobs import main

if __name__ == "__main__":
    raise SystemExit(main())
