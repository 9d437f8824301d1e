"""The documentation site (`mkdocs.yml`: the guides in docs/ and an API reference generated from the
docstrings) builds in strict mode: a broken link between pages, a link to a repository file that does
not exist, a missing page in the navigation or a docstring reference that no longer resolves fails
here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, cwd=config.parent, timeout=300)


def test_the_documentation_site_builds_in_strict_mode(tmp_path):
    r = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "algorithms" / "index.html").read_text()
    assert "client_update" in api and "aggregate" in api          # the reference is generated, not empty


def test_a_broken_link_fails_the_build(tmp_path):
    """The same hook and strictness on a two-page site: a link to a repository file that exists is
    kept as its path, one that does not exist fails the build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "src.py").write_text("x = 1\n")
    (docs / "index.md").write_text("# Home\n\n[the source](../src.py) and [the guide](guide.md)\n")
    (docs / "guide.md").write_text("# Guide\n")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(f"site_name: t\nhooks:\n  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}\n"
                   "nav:\n  - index.md\n  - guide.md\n")
    ok = build(cfg, tmp_path / "site")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "(<code>src.py</code>)" in (tmp_path / "site" / "index.html").read_text()
    (docs / "index.md").write_text("# Home\n\n[the source](../nope.py)\n")
    bad = build(cfg, tmp_path / "site")
    assert bad.returncode != 0 and "nope.py" in bad.stderr
    (docs / "index.md").write_text("# Home\n\n[the guide](gone.md)\n")
    assert build(cfg, tmp_path / "site").returncode != 0
