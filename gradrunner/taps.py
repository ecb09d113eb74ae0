"""`python -m gradrunner.taps <the same overrides as a run>`: the tap explorer, in `gradrunner.cli.explore`.

Example::

    python -m gradrunner.taps +experiment=transformer
"""

if __name__ == "__main__":
    from gradrunner.cli.explore import main

    main()
