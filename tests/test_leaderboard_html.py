"""`fedprism report --html --leaderboard`: the leaderboard (means, 95 % intervals, ranks, paired-test marks,
links to each cell's tuned configuration and budget) as a section of the one HTML report page, beside the
report's tables and the leaderboard's markdown and CSV (src/fedprism/report/leaderboard.py, html.py), on the
hand-made store of tests/test_leaderboard.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fedprism.cli import main

sys.path.insert(0, str(Path(__file__).parent))

from test_leaderboard import _store  # noqa: E402


def _rows(page: str, start: int) -> dict[str, list[str]]:
    """The leaderboard table after `start` in `page`: label -> its cells' HTML."""
    table = page[page.index("<table>", start):page.index("</table>", start)]
    out = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", table)[1:]:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr)
        out[cells[0]] = cells[1:]
    return out


def test_the_report_page_holds_the_leaderboard_beside_the_tables(tmp_path, capsys):
    db = tmp_path / "lb.db"
    _store(db)
    out, alone = tmp_path / "out", tmp_path / "alone"
    assert main(["report", "--html", "--leaderboard", "--sweep", "lb", "--db", str(db), "--out", str(out),
                 "--no-plots"]) == 0
    printed = capsys.readouterr().out.split()
    for name in ("results.md", "results.csv", "leaderboard.md", "leaderboard.csv", "leaderboard.html", "report.html"):
        assert str(out / name) in printed and (out / name).is_file()
    # the leaderboard's markdown and CSV are those `--leaderboard` alone writes, byte for byte
    assert main(["report", "--leaderboard", "--sweep", "lb", "--db", str(db), "--out", str(alone)]) == 0
    assert not (alone / "report.html").exists()
    for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.html"):
        assert (out / name).read_bytes() == (alone / name).read_bytes()
    page = (out / "report.html").read_text()
    # one page: the report's own tables first, then the leaderboard's section, then the notes on the methods
    body = (out / "results.md").read_text().splitlines()[0].lstrip("# ").strip()
    i_report, i_lb = page.index(f"<h1>{body}"), page.index('<h2 id="leaderboard">Leaderboard: lb</h2>')
    i_notes = page.index("<h2>Methods in this report</h2>")
    assert i_report < i_lb < i_notes and page.count('id="leaderboard"') == 1
    rows = _rows(page, i_lb)
    anchor = re.search(r'<a href="#(tuned-[a-z0-9-]+)">', rows["A"][0])[1]
    # A: the best (bold), mean 80.00 with a zero interval, rank 1, linked to its tuned configuration
    assert rows["A"] == [f'<a href="#{anchor}"><strong>80.00 ± 0.00 (1)</strong></a>']
    # B: mean (1.9/3 + 0.7)/2, the t interval, rank 2, p = 2/16 (not marked), no tuned configuration
    (b,) = rows["B"]
    assert b.startswith("66.67 ± ") and b.endswith("(2) p=0.125") and "<a" not in b and "▼" not in b
    # the link leads to the cell's chosen trial and budget, on this page
    section = page[page.index(f'<h4 id="{anchor}">'):i_notes]
    assert section.startswith(f'<h4 id="{anchor}">A, ')
    assert "trial #5 of study <code>lb</code> (run <code>0000000000000000</code>)" in section
    assert "<code>lr=0.05</code>" in section
    assert "12 trials (tpe sampler, median pruner): 9 complete, 3 pruned, 300 rounds trained" in section
    assert page.index("<h3>Tuned configurations</h3>") < page.index(f'<h4 id="{anchor}">')
    assert "<script" not in page and "http" not in page.split("<body>")[1]


def test_a_significant_cell_is_marked_on_the_page(tmp_path, monkeypatch):
    """With the sign-flip p-value forced to 0.01 the worse cell carries the ▼ mark on the report's page."""
    from fedprism.report import leaderboard as lb

    db = tmp_path / "lb.db"
    _store(db)
    monkeypatch.setattr(lb, "stratified_sign_flip", lambda blocks: (0.1, 0.01))
    assert main(["report", "--html", "--leaderboard", "--sweep", "lb", "--db", str(db), "--out",
                 str(tmp_path / "o"), "--no-plots"]) == 0
    page = (tmp_path / "o" / "report.html").read_text()
    (b,) = _rows(page, page.index('id="leaderboard"'))["B"]
    assert b.endswith("(2) p=0.01 ▼")


def test_the_leaderboard_on_the_page_needs_a_sweep_and_writes_nothing_without_one(tmp_path, capsys):
    db = tmp_path / "lb.db"
    _store(db)
    assert main(["report", "--html", "--leaderboard", "--db", str(db), "--out", str(tmp_path / "o"),
                 "--no-plots"]) != 0
    assert "the leaderboard needs --sweep NAME" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    from fedprism.report import write_report

    with pytest.raises(Exception, match="needs html=True"):
        write_report(str(db), str(tmp_path / "p"), sweep="lb", plots=False, leaderboard="local_acc")
    assert not (tmp_path / "p").exists()
