"""The report: `python -m gradrunner.report <run or sweep dir>` writes PNGs and one self-contained HTML page.

Imports no torch (a test checks it in a fresh interpreter); matplotlib only when a figure is drawn.
It reads records through `gradrunner.analysis` and imports downward only:

| module | what it holds |
| --- | --- |
| `write` | the entry points (`write_report`, `try_report`, `main`) and a run's sections |
| `sweep` | a large sweep's sections, drawn across its runs |
| `sections` | sections a run and a sweep share: findings, strategies, optional columns, edits |
| `records` | what the report reads beyond `load`: light columns, the rows a figure draws |
| `page` | the page: sections, tables, figures embedded as PNG, the page written atomically |
| `plots`, `plots_optional`, `plots_training` | matplotlib figures drawn from the analysis helpers' DataFrames |
| `plots_edits` | a sweep over an edit's strength: its table (`edit_sweep`) and panel (`plot_edit_sweep`) |
| `plots_sweep` | a large sweep's figures: medians and bands over runs (`analysis.aggregate`) |

Example::

    from gradrunner.report import write_report
    write_report("multirun/2026-11-23/10-00-00")     # .../report.html
"""

from gradrunner.report.write import main, write_report

__all__ = ["main", "write_report"]
