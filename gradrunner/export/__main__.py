"""`python -m gradrunner.export <target> <dir>`: the command line of `gradrunner.export.command`."""

from gradrunner.export.command import main

if __name__ == "__main__":
    raise SystemExit(main())
