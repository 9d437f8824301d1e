"""The documentation names things that exist: every `fedprism.x.y` in a code span is an importable
module or attribute, a method's configuration key or an entry-point group, and every repository path in
a code span or a fenced code block (the commands) and every relative markdown link points at a file or
folder of the checkout. A rename in the code that leaves a document behind fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from fedprism.algorithms.base import REGISTRY
from fedprism.plugins import GROUPS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "results" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("src", "tests", "bench", "docs", "scripts", "sweeps", "results", "examples")
PATH = re.compile(r"\b(?:" + "|".join(TOP) + r")/[A-Za-z0-9_./*<>-]+")
#: paths the documents name as made by a run, not held by the checkout
NOT_IN_CHECKOUT = {"results/x.db", "results/mine.db", "results/fedprism.db.ckpt/",
                   "src/FILE"}                                 # the placeholder of scripts/mutate.py's usage
#: wrong on purpose: the README's example of a mistyped configuration key
MISTYPED = {"fedprism.kk"}
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


def spans(path: Path) -> list[str]:
    """The inline code spans (which may wrap over lines) outside fenced code blocks."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return [" ".join(x.split()) for x in re.findall(r"`([^`]+)`", text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_names_and_paths_exist(doc: Path):
    missing = []
    for span in spans(doc):
        for name in DOTTED.findall(span):
            if not known(name):
                missing.append(name)
        for p in PATH.findall(span):
            p = p.rstrip(".,:;")
            if not any(ch in p for ch in "*<>") and p not in NOT_IN_CHECKOUT and not (ROOT / p).exists():
                missing.append(p)
    for block in re.findall(r"^```.*?^```", doc.read_text(), flags=re.S | re.M):   # commands in code blocks
        for p in PATH.findall(block):
            p = p.rstrip(".,:;")
            if not any(ch in p for ch in "*<>") and p not in NOT_IN_CHECKOUT and not (ROOT / p).exists():
                missing.append(p)
    for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {sorted(set(missing))}"


def test_the_check_sees_a_stale_name(tmp_path):
    """The checks themselves: a renamed function, a missing file and a dead link are all reported."""
    assert resolves("fedprism.clustering.choose_k_silhouette")
    assert not resolves("fedprism.clustering.choose_k_silhouettes")
    assert not resolves("fedprism.no_such_module")
    assert config_key("fedprism.k") and not config_key("fedprism.kk")
    assert known("fedprism.methods") and not known("fedprism.method")
