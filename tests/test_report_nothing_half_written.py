"""A report that fails half-way leaves nothing new in the dir (every section is built before a file is written);
into a read-only dir it is one paragraph naming the dir, exit 2, the real error not masked by the cleanup's."""

from __future__ import annotations

import base64
import errno
import re
from pathlib import Path

import pytest
import torch
from conftest import recorded
from torch import nn

pytest.importorskip("matplotlib", reason="matplotlib is the optional extra gradrunner[report]")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return recorded(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), ["*:output", "*:weight"], tmp_path / "run")


def _report_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("report", ".report")))


def test_a_report_that_fails_half_way_writes_nothing(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradrunner.report import plots, write_report

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a figure that cannot be drawn")

    monkeypatch.setattr(plots, "plot_norms", broken)  # after the loss and flow figures were made
    with pytest.raises(RuntimeError, match="cannot be drawn"):
        write_report(run)
    assert _report_files(run) == []
    monkeypatch.undo()
    page = write_report(run).read_text(encoding="utf-8")  # and whole when it works: the PNGs are the page's
    embedded = [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    pngs = sorted(run.glob("report-*.png"))
    assert len(pngs) == len(embedded) >= 3
    assert sorted(p.read_bytes() for p in pngs) == sorted(embedded)


def test_a_read_only_dir_is_one_paragraph_naming_it(
    run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradrunner.report import write as report

    def read_only(*args: object, **kwargs: object) -> None:  # what a read-only file system says, to unlink too
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_bytes", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradrunner.report: error: ") and err.count("\n") == 1
    assert str(run) in err and "Read-only file system" in err and "Traceback" not in err
    monkeypatch.undo()
    assert _report_files(run) == []
