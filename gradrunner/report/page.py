"""The report's page: HTML helpers (sections, tables, escaping), figures embedded as PNG, the page written atomically.

Contents:
    REPORT_NAME, DPI, INSTALL_HINT              -- the page's file name, the PNGs' resolution, the extra to install
    import_plots() -> module                   -- `report.plots`, or GradrunnerError with the install hint
    html_section(title, body) / html_table(df) -> str   -- an <h2> with its anchor; a table (scrolling, folded when long)
    figure_section(out_dir, name, title, fig, note)    -- `report-<name>.png` saved, a section embedding the same bytes
    FigureWriter                                -- `figure_section`'s signature (the sections draw through the one given)
    held_figures()                              -- inside it `figure_section` holds its PNGs for `write_page` instead
    write_page(out_dir, grads, sections, answer, figures) -> Path  -- the PNGs, then `report.html`, each atomically

Used by `write` (the entry points, a run's sections), `sections` and `sweep`; it imports
none of them, so each imports it without a cycle. The page loads nothing and runs no script.

Example::

    body = html_section("Runs", html_table(runs)) + figure_section(out_dir, "loss", "Loss over the steps", fig)
    write_page(out_dir, grads, [body], answer="Loss 0.9 → 0.1 over 3 steps.")   # out_dir/report.html
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import pandas as pd

from gradrunner import __version__
from gradrunner.errors import GradrunnerError
from gradrunner.records.atomic import write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The page's file name, written next to the records (the run dir, or the sweep dir).
REPORT_NAME = "report.html"
INSTALL_HINT = "pip install 'gradrunner[report]'"
#: The PNGs' resolution: a page (`plots.PAGE_INCHES`) is 1600 x 1100 px.
DPI = 100

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { padding: 0.2em 0.6em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f4f4f4; } img { max-width: 100%; } code { background: #f4f4f4; padding: 0 0.2em; }
.findings li { margin: 0.2em 0; } .ok { color: #2a7; } .wide { overflow-x: auto; max-width: 100%; }
.headline { font-size: 1.1em; } .answer { font-size: 1.2em; font-weight: 600; } .bad { color: #fff; background: #c33; } h3 { font-size: 1em; margin-bottom: 0.2em; }
td:first-child, td code { word-break: break-all; }
summary { cursor: pointer; color: #555; }
"""


class FigureWriter(Protocol):
    """`figure_section`'s signature: the section builders draw through the writer they are given (`write` passes its own)."""

    def __call__(self, out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str: ...


def import_plots() -> ModuleType:
    """`gradrunner.report.plots` (matplotlib), or one GradrunnerError paragraph with the install hint."""
    try:
        from gradrunner.report import plots
    except ImportError as e:
        if not (e.name or "").startswith("matplotlib"):
            raise
        message = f"the report draws its figures with matplotlib, which is not installed: {INSTALL_HINT}"
        raise GradrunnerError(message) from None
    return plots


def _anchor(title: str) -> str:
    return "-".join(title.lower().replace("?", "").split())


def html_section(title: str, body: str) -> str:
    """`body` under an <h2> titled `title`, with an anchor the page's contents link to."""
    return f'<h2 id="{_anchor(title)}">{html.escape(title)}</h2>\n{body}'


def html_table(df: pd.DataFrame, fold_above: int = 40) -> str:
    """The table as HTML, scrolling sideways if wide, folded (<details>) when it has many rows."""
    df = df.apply(lambda c: c.astype("float64") if str(c.dtype) == "Int64" else c)  # <NA> shown as ""
    table = df.to_html(index=False, border=0, na_rep="", float_format=lambda x: f"{x:.4g}")
    table = f'<div class="wide">{table}</div>'
    if len(df) > fold_above:
        return f"<details><summary>{len(df)} rows</summary>{table}</details>"
    return table


#: The PNGs `figure_section` holds inside `held_figures()` (None outside: it writes each at once).
_HELD: ContextVar[dict[Path, bytes] | None] = ContextVar("gradrunner_report_held_figures", default=None)


@contextmanager
def held_figures() -> Iterator[dict[Path, bytes]]:
    """Inside it `figure_section` writes nothing: its PNGs are held in the dict yielded, for `write_page` to write
    once every section is built (a report that fails half-way leaves no PNG of its own behind).

    Example::

        with held_figures() as figures:
            body = figure_section(out_dir, "loss", "Loss over the steps", fig)    # nothing written yet
            write_page(out_dir, grads, [body], figures=figures)                    # the PNG, then the page
    """
    held: dict[Path, bytes] = {}
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


def figure_section(out_dir: Path, name: str, title: str, fig: Figure, note: str = "") -> str:
    """Save `fig`, at most a page (`plots.PAGE_INCHES` at `DPI`), as `report-<name>.png` (held for `write_page`
    inside `held_figures()`); a section embedding the same PNG bytes."""
    buffer = io.BytesIO()
    plots = import_plots()
    plots.plain_ticks(plots.fit_page(fig)).savefig(buffer, format="png", dpi=DPI)
    held = _HELD.get()
    if held is None:
        write_atomically(out_dir / f"report-{name}.png", buffer.getvalue())
    else:
        held[out_dir / f"report-{name}.png"] = buffer.getvalue()
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    body = f'<img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'
    return html_section(title, f"<p>{html.escape(note)}</p>\n{body}" if note else body)


def write_page(
    out_dir: Path, grads: pd.DataFrame, sections: list[str], answer: str = "", figures: Mapping[Path, bytes] | None = None
) -> Path:
    """Write the `figures` (PNG bytes by path, `held_figures`), then `REPORT_NAME` in `out_dir`, each atomically
    (a reader never sees half a file), once the page is built; return its path. An OSError writing them (a
    read-only dir, a full disk) is a GradrunnerError naming the dir."""
    page = out_dir / REPORT_NAME
    text = _page(out_dir, grads, sections, answer)
    try:
        for path, png in (figures or {}).items():
            write_atomically(path, png)
        write_atomically(page, text)
    except OSError as e:  # a read-only dir, a full disk: the user's to fix, one paragraph
        raise GradrunnerError(
            f"cannot write the report into {out_dir}: {e.strerror or e} ({type(e).__name__}, errno {e.errno}). "
            "The records are untouched; copy the run dir somewhere writable and write the report there."
        ) from e
    return page


def _page(out_dir: Path, grads: pd.DataFrame, sections: list[str], answer: str = "") -> str:
    experiments = ", ".join(sorted(grads["experiment"].astype(str).unique()))
    titles = [s[s.index(">") + 1 : s.index("</h2>")] for s in sections]
    nav = " · ".join(f'<a href="#{_anchor(html.unescape(t))}">{t}</a>' for t in titles)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>gradrunner report: {html.escape(experiments)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>gradrunner report: {html.escape(experiments)}</h1>
<p class="answer">{answer}</p>
<p>Records in <code>{html.escape(str(out_dir.resolve()))}</code>, written by gradrunner {__version__}.</p>
<nav>{nav}</nav>
{chr(10).join(sections)}
</body>
</html>
"""
