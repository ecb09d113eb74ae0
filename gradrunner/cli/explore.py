"""`python -m gradrunner.taps <the same overrides as a run>`: the taps the model offers, with shapes.

Builds the model and the data the config names, runs one forward pass on the first batch
(`gradrunner.capturing.explore.list_taps`, under the config's `train.autocast`, as a training step)
and prints every module path in forward order: class, calls, the shapes (or types) of its outputs,
inputs, parameters and forward() locals, each marked `-- no gradient: <why>` when a tap on it cannot
carry one; modules not called are marked. Then, for each glob of the config's `taps`, how many taps
it resolves to at each module depth (`*` and `?` match dots: `transformer.h.*` reaches every
submodule of every block), over the whole model, `--match` or not. Nothing is written (no output
dir, no records). `--format json` prints the same for scripts. A mistake on the command line (a
misspelled key, an unknown option) is refused as the runner refuses it: one paragraph, status 2.

Example::

    python -m gradrunner.taps +experiment=transformer
    python -m gradrunner.taps +experiment=gpt2 --format json | jq '.modules[].path'
    python -m gradrunner.taps +experiment=gpt2 --match 'transformer.h.0.*'    # only the paths the glob matches
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from gradrunner.config.overrides import group_mistake, misspelled_key
from gradrunner.errors import EXIT_USER_ERROR, GradrunnerError, one_paragraph
from gradrunner.run.hydra_adapter import mark_task_started, mistakes_as_one_paragraph, split_options

#: `--format` values.
FORMATS = ("text", "json")
#: Hydra settings that keep a listing from writing anything: no run dir contents, no log file, no callbacks.
_QUIET = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.run.dir=.",
          "~hydra.callbacks.gradrunner", "~hydra.callbacks.output_dir"]  # fmt: skip
_format = "text"
#: `--match GLOB`: only the module paths it matches are listed.
_match: str | None = None


#: What each option of ours takes, for the error when its value is missing.
_TAKES = {
    "--format": f"one of {', '.join(FORMATS)}, e.g. --format json",
    "--match": "a glob over module paths as model.named_modules() prints them, e.g. --match 'layers.0.*'",
}


def _pop_option(argv: list[str], option: str, default: str | None) -> tuple[str | None, list[str]]:
    """`--option X` / `--option=X` taken out of `argv` (Hydra does not know it); a bare `--option` is an error."""
    value, rest, i = default, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == option:
            if i + 1 == len(argv) or argv[i + 1].startswith("-"):
                raise GradrunnerError(f"{option} needs a value: {_TAKES[option]} (as {option} VALUE or {option}=VALUE).")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(f"{option}="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _pop_format(argv: list[str]) -> tuple[str, list[str]]:
    """`--format X` taken out of `argv`, checked."""
    fmt, rest = _pop_option(argv, "--format", "text")
    if fmt not in FORMATS:
        raise GradrunnerError(f"--format {fmt!r} is not allowed; allowed: {', '.join(FORMATS)}.")
    return fmt, rest


def listing(cfg: DictConfig) -> object:
    """The `TapListing` of the model `cfg` names, on its first batch (no records written).

    Example::

        print(listing(compose("config", overrides=["+experiment=mlp"])))
    """
    from gradrunner.capturing.explore import list_taps
    from gradrunner.capturing.taps import glob_reach
    from gradrunner.data import ForwardInputs
    from gradrunner.run.build import setup
    from gradrunner.run.guards import next_batch
    from gradrunner.run.numerics import autocast

    job = setup(cfg, check_taps=False)  # the model's taps are listed whatever the config's `taps` reach
    x, _ = next_batch(job.batches, 0, source=str(cfg.data._target_))
    args, kwargs = (x.args, x.kwargs) if isinstance(x, ForwardInputs) else ((), x) if isinstance(x, Mapping) else ((x,), {})
    try:
        with autocast(job.device, str(cfg.train.autocast)):  # as a training step's forward: the dtypes its taps hold
            found = list_taps(job.model, *args, **kwargs)
        found.reach = glob_reach(job.model, OmegaConf.to_container(cfg.taps, resolve=True))  # type: ignore[attr-defined,arg-type]
        return found
    except GradrunnerError:
        raise
    except Exception as e:
        raise GradrunnerError(
            f"the model's forward() raised {type(e).__name__}: {one_paragraph(e)} on the first batch; "
            "check that the data fits the model (data.* shapes), as a run would"
        ) from e


def main() -> None:
    """Entry point: take `--format` out of argv, keep Hydra from writing anything, run the app.

    Example::

        python -m gradrunner.taps +experiment=mlp --format json
    """
    global _format, _match
    try:
        _format, argv = _pop_format(sys.argv[1:])
        _match, argv = _pop_option(argv, "--match", None)
    except GradrunnerError as e:
        _refuse(str(e))
    if "-m" in argv or "--multirun" in argv:
        _refuse("-m/--multirun is not allowed; list one config's taps at a time.")
    mistake = misspelled_key(argv) or group_mistake(argv)  # the runner's checks: the same overrides as a run
    if mistake is not None and os.environ.get("HYDRA_FULL_ERROR") != "1":
        _refuse(mistake)
    helping = "--help" in argv or "-h" in argv
    overrides, options = split_options(argv)  # _QUIET joins the user's overrides, before any option of theirs
    sys.argv = [sys.argv[0], *(argv if helping else [*overrides, *_QUIET, *options])]
    try:
        if helping:  # Hydra's help says only what a run takes: say first what this command does and takes
            print(_usage(), flush=True)
        with mistakes_as_one_paragraph(_refuse):  # what Hydra finds while composing, as the runner reports it
            app()
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted (the listing's own print says so too)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _usage() -> str:
    """The head of `--help`: the command, its own options (`_TAKES`), and that the overrides are a run's."""
    options = "\n".join(f"  {option}: {takes}" for option, takes in _TAKES.items())
    return ("usage: python -m gradrunner.taps [--format text|json] [--match GLOB] [OVERRIDES...]\n"
            "Lists the taps the model of the config offers, from one forward pass on its first batch; writes nothing.\n"
            f"{options}\nOVERRIDES: the same as a run's (python -m gradrunner), below.\n")  # fmt: skip


def _refuse(message: str) -> NoReturn:
    """A user mistake: one paragraph on stderr, exit status 2."""
    print(f"gradrunner.taps: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


@hydra.main(version_base="1.3", config_path="pkg://gradrunner.conf", config_name="config")
def app(cfg: DictConfig) -> None:
    """Print the listing of `cfg`'s model; a user mistake is one paragraph and exit status 2."""
    from omegaconf.errors import OmegaConfBaseException

    mark_task_started()  # from here on an error is the listing's, not the command line's (`mistakes_as_one_paragraph`)

    try:
        result = listing(cfg)
    except (GradrunnerError, OmegaConfBaseException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"gradrunner.taps: error: {one_paragraph(e)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    reach = _reach(result)  # over the whole model: `--match` narrows the listing, not what the config's globs reach
    if _match is not None:
        result = result.matching(_match)  # type: ignore[attr-defined]
        if not result.modules:
            print(f"gradrunner.taps: error: --match {_match!r} matches no module path of {result.model}; "
                  "it is a glob over paths as model.named_modules() prints them, e.g. --match 'layers.0.*'",
                  file=sys.stderr, flush=True)  # fmt: skip
            sys.exit(EXIT_USER_ERROR)
    text = json.dumps(_with_reach(result, reach), indent=1) if _format == "json" else _text(result, reach)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _reach(result: object) -> list[Any]:
    return list(getattr(result, "reach", []))


def _text(result: object, reach: list[Any] | None = None) -> str:
    """The listing, then how far each glob of the config's `taps` reached (taps per module depth; `reach`: the
    listing's own)."""
    lines = [f"  {r}" for r in (_reach(result) if reach is None else reach)]
    return str(result) + (("\n\nThe config's globs (taps=...):\n" + "\n".join(lines)) if lines else "")


def _with_reach(result: object, reach: list[Any] | None = None) -> dict[str, Any]:
    """`result.to_dict()` with `globs`: per glob its taps by depth, a path at each depth, and why it is refused (None:
    it resolves to taps), what the text says of it."""
    out: dict[str, Any] = result.to_dict()  # type: ignore[attr-defined]
    out["globs"] = [{"spec": r.spec, "taps": r.taps, "by_depth": {str(d): n for d, (n, _) in sorted(r.by_depth.items())},
                     "first_path": {str(d): path for d, (_, path) in sorted(r.by_depth.items())}, "refused": r.refused}
                    for r in (_reach(result) if reach is None else reach)]  # fmt: skip
    return out


if __name__ == "__main__":
    main()
