"""The tables of a report page, read back as numbers: `tables_after(page, title)` (test_report_panels, test_noise_scale).

Example::

    ratios = tables_after(Path("sweep/report.html").read_text(), "Update-to-weight ratio")
"""

from __future__ import annotations

from html.parser import HTMLParser

import pandas as pd


class Tables(HTMLParser):
    """The first <table> after a heading, as rows of cell texts (the standard library's parser: no lxml)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None
        self.done = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.done:
            return
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None and not self.done:
            self.rows[-1].append("".join(self.cell).strip())
            self.cell = None
        elif tag == "table":
            self.done = True

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def tables_after(page: str, title: str) -> pd.DataFrame:
    """The first table of the section titled `title`, numbers parsed."""
    start = page.index(f">{title}</h2>")
    end = page.find("<h2", start)
    parser = Tables()
    parser.feed(page[start : end if end > 0 else None])
    header, *body = parser.rows
    df = pd.DataFrame(body, columns=header)
    for c in df.columns:
        try:
            df[c] = pd.to_numeric(df[c])
        except ValueError:  # text: a tap name, a bin label
            pass
    return df
