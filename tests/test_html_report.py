"""`fedprism report --html` in a real headless browser (Chromium): the page loads without console
errors, renders something (the screenshot is not blank), fetches nothing from outside, and its tables
hold the store's numbers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.report import write_report

TINY = {"dataset": "digits", "model": "mlp", "clients": 6, "rounds": 3, "fraction": 0.5, "local_epochs": 1,
        "engine": "sequential"}


def _chromium() -> str:
    """The Chromium binary; installed with apt-get when missing and this process may (root, apt-get)."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("FEDPRISM_NO_INSTALL"):
        pytest.skip("no chromium on PATH and FEDPRISM_NO_INSTALL is set")
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("no chromium on PATH, and this machine cannot install it (needs root and apt-get)")
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, capture_output=True,
                       timeout=900, env=env)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"no chromium on PATH and `apt-get install chromium` failed here ({e})")
    path = shutil.which("chromium")
    if not path:
        pytest.skip("`apt-get install chromium` ran but no chromium is on PATH")
    return path


def _browse(chromium: str, page: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                           "--v=0", "--hide-scrollbars", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


class _Tables(HTMLParser):
    """Every <table> as a list of rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("html")
    db = d / "r.db"
    store = Store(db)
    for method, label in (("fedavg", "FedAvg"), ("ifca", "IFCA")):
        Experiment(resolve({**TINY, "method": method, "name": label}), store, sweep="sw").run()
    store.close()
    write_report(str(db), str(d / "rep"), sweep="sw", html=True)
    return db, d / "rep" / "report.html"


def test_html_report_is_self_contained(report):
    _, page = report
    text = page.read_text()
    assert "<table>" in text and text.count("data:image/png;base64,") == 3     # accuracy, ECDF, IFCA clusters
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", text), "an external resource"
    assert "<script" not in text and "@import" not in text and "url(" not in text
    assert "Methods in this report" in text and "ifca" in text


def test_html_report_in_headless_chromium(report, tmp_path):
    db, page = report
    chromium = _chromium()
    shot = tmp_path / "shot.png"
    r = _browse(chromium, page, f"--screenshot={shot}", "--window-size=1280,2000")
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console                       # no console message at all (errors, failed loads)
    assert shot.exists(), r.stderr[-2000:]
    import matplotlib.image

    img = matplotlib.image.imread(shot)
    assert img.shape[0] >= 1000 and float(np.var(img[..., :3])) > 0.001          # not a blank page
    dom = _browse(chromium, page, "--dump-dom")
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    parser = _Tables()
    parser.feed(dom.stdout)
    detail = next(t for t in parser.tables if t and t[0][:3] == ["method", "seeds", "Glob Final"])
    store = Store(db, readonly=True)
    finals = {r["label"]: json.loads(r["final"]) for r in store.runs(sweep="sw")}
    store.close()
    rows = {row[0]: row for row in detail[1:]}
    assert set(rows) == set(finals)
    for label, f in finals.items():
        assert rows[label][1] == "1"
        assert rows[label][2] == f"{100 * f['global_acc']:.2f}" and rows[label][4] == f"{100 * f['local_acc']:.2f}"
