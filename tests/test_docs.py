"""The documentation names things that exist: every `fedprism.x.y` in a code span is an importable
module or attribute, a method's configuration key or an entry-point group, and every repository path in
a code span or a fenced code block (the commands) and every relative markdown link points at a file or
folder of the checkout. A rename in the code that leaves a document behind fails here. A file that left
the tree is named as "`bench/x.py` at commit abc1234": that commit must hold it (git), and the document
may then name it elsewhere too."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

from fedprism.algorithms.base import REGISTRY
from fedprism.plugins import GROUPS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "results").glob("*.md")),
        *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("src", "tests", "bench", "docs", "scripts", "sweeps", "results", "examples")
PATH = re.compile(r"\b(?:" + "|".join(TOP) + r")/[A-Za-z0-9_./*<>-]+")
#: paths the documents name as made by a run, not held by the checkout
NOT_IN_CHECKOUT = {"results/x.db", "results/mine.db", "results/fedprism.db.ckpt/", "results/fedprism.db.final/",
                   "results/fedprism.db",                      # built from the committed dump (`fedprism store load`)
                   "src/FILE"}                                 # the placeholder of scripts/mutate.py's usage
#: wrong on purpose: the README's example of a mistyped configuration key
MISTYPED = {"fedprism.kk"}
#: "`path` at commit <hash>": a file that left the tree, with the last commit that holds it
HISTORIC = re.compile(r"`(" + PATH.pattern + r")` at commit ([0-9a-f]{7,40})\b")
DOTTED = re.compile(r"(?<![/\w.-])fedprism(?:\.[A-Za-z_][A-Za-z0-9_]*)+")            # not inside a path


def resolves(name: str) -> bool:
    """`name` is a module, or a module's attribute path."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def config_key(name: str) -> bool:
    """`name` is `fedprism.<param>`, a parameter of the `fedprism` method (`fedprism.k`, ...)."""
    parts = name.split(".")
    return len(parts) == 2 and parts[1] in REGISTRY["fedprism"].params


def known(name: str) -> bool:
    return (name in GROUPS or name in MISTYPED or config_key(name) or resolves(name)
            or name.startswith("fedprism.db"))                 # the store's file name: `results/fedprism.db`


def _paths(text: str) -> list[str]:
    return [p for p in (m.rstrip(".,:;") for m in PATH.findall(text))
            if not any(ch in p for ch in "*<>") and p not in NOT_IN_CHECKOUT and not (ROOT / p).exists()]


def in_history(path: str, commit: str) -> bool:
    """`commit` of this repository holds `path`."""
    return subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True).returncode == 0


def problems(text: str, folder: Path) -> list[str]:
    """What a document's text (in `folder`, for its relative links) names that does not exist; a path it
    names "at commit <hash>" is checked against that commit instead."""
    historic = {p: c for p, c in HISTORIC.findall(" ".join(text.split()))}
    fences = r"^```.*?^```"
    prose = re.sub(fences, "", text, flags=re.S | re.M)
    inline = [" ".join(x.split()) for x in re.findall(r"`([^`]+)`", prose)]
    missing = [name for span in inline for name in DOTTED.findall(span) if not known(name)]
    missing += [p for span in inline for p in _paths(span)]
    missing += [p for block in re.findall(fences, text, flags=re.S | re.M) for p in _paths(block)]
    missing += [f"link {t}" for t in re.findall(r"\]\(([^)#\s]+)", text)
                if not t.startswith(("http://", "https://", "mailto:")) and not (folder / t).exists()]
    missing = [m for m in missing if m not in historic]
    missing += [f"{p} at commit {c}" for p, c in historic.items() if not in_history(p, c)]
    return sorted(set(missing))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_names_and_paths_exist(doc: Path):
    missing = problems(doc.read_text(), doc.parent)
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_check_sees_a_stale_name():
    """The check itself: a renamed function, a mistyped key, a missing file (in text, after a code span
    that wraps over two lines, and in a command), and a dead link are reported; what exists is not."""
    good = ("`fedprism.clustering.choose_k_silhouette`, `fedprism.k`, `fedprism.methods`, "
            "`src/fedprism/cli.py`, [x](docs/testing.md)\n```\npython bench/engine.py\n```\n")
    assert problems(good, ROOT) == []
    bad = ("`fedprism.clustering.choose_k_silhouettes`, `fedprism.kkk`, `fedprism.method`, `a wrapped\n"
           "span` then `src/fedprism/clis.py`, [x](docs/testin.md)\n```\npython bench/engin.py\n```\n")
    assert problems(bad, ROOT) == ["bench/engin.py", "fedprism.clustering.choose_k_silhouettes",
                                   "fedprism.kkk", "fedprism.method", "link docs/testin.md",
                                   "src/fedprism/clis.py"]


def test_a_file_that_left_the_tree_is_checked_against_its_commit():
    """"`bench/bf16.py` at commit b9ec7a1" (a script removed since) passes and lets the document name it
    again; a path that commit does not hold, or a removed path named without its commit, is reported."""
    good = "(script: `bench/bf16.py` at\ncommit b9ec7a1)\n```\npython bench/bf16.py\n```\n"
    assert problems(good, ROOT) == []
    assert problems("`bench/bf16.py`", ROOT) == ["bench/bf16.py"]
    assert problems("`bench/bf16x.py` at commit b9ec7a1", ROOT) == ["bench/bf16x.py at commit b9ec7a1"]
