"""`python -m gradrunner ...`: the same app as the `gradrunner` console script (see `gradrunner.cli`)."""

from gradrunner.cli import main

if __name__ == "__main__":
    main()
