"""Comments, docstrings and blank lines never count as a method's code, anywhere in its module, its class
body included, for a plugin (its own source folded into its fingerprint) and for a built-in method (its
file's text hash); every change of a token of code does. A plugin run stored before `tokens` existed is
compared as before and says why an edit inside its class reads as a change (docs/reproducibility.md,
"Comments inside a plugin's class")."""

from __future__ import annotations

import importlib.util
import json
import linecache
import sqlite3
import sys

import pytest

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.experiment.provenance import (BEFORE_TOKENS, ProvenanceMismatch, code_now, differences,
                                            source_fingerprint, source_text_sha256, with_text)

#: a plugin method as a newcomer writes it: comments at module level and inside the class
PLUGIN = '''"""A method of my own."""
import numpy as np

from fedprism.algorithms.fedavg import FedAvg


class MyNova(FedAvg):
    name = "{name}"

    def aggregate(self, state, rnd, update):
        tau_eff = (np.ones(2) * 3).sum()  # effective steps
        return super().aggregate(state, rnd, update)
'''

#: edits that change no token of code: (what, old text, new text)
NO_CODE = [
    ("a comment inside the class", "# effective steps", "# effective local steps"),
    ("a comment removed inside the class", "  # effective steps", ""),
    ("a method docstring added", "    def aggregate(self, state, rnd, update):\n",
     "    def aggregate(self, state, rnd, update):\n        \"\"\"Steps, then FedAvg.\"\"\"\n"),
    ("a class docstring and blank lines", "class MyNova(FedAvg):\n",
     "class MyNova(FedAvg):\n    \"\"\"Nova.\"\"\"\n\n\n    # the name it is registered under\n"),
    ("a module comment", "import numpy as np\n", "import numpy as np  # arrays\n"),
]

#: edits of code: each is other code
CODE = [
    ("a number", "* 3", "* 4"),
    ("a name", "tau_eff", "tau"),
    ("a string statement that is no docstring", "        return super()",
     "        \"not a docstring\"\n        return super()"),
]


def _load(path, module: str):
    """The module in `path`, imported again from its current text (no cached bytecode or lines)."""
    linecache.clearcache()
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """(write(text) -> the class as that text defines it, the file) for a plugin module in tmp_path."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "mynova_plugin.py"
    monkeypatch.delitem(sys.modules, "mynova_plugin", raising=False)

    def write(text: str):
        path.write_text(text)
        return _load(path, "mynova_plugin").MyNova

    return write, path


def _fp(cls) -> dict:
    return {"code": {"method": source_fingerprint(cls)}}


@pytest.mark.parametrize("what,old,new", NO_CODE, ids=[w for w, _, _ in NO_CODE])
def test_an_edit_of_comments_or_docstrings_in_a_plugin_is_the_same_code(plugin, what, old, new):
    write, _ = plugin
    text = PLUGIN.format(name="mynova")
    before = _fp(write(text))
    assert old in text
    after = _fp(write(text.replace(old, new)))
    assert before["code"]["method"]["sha256"] != after["code"]["method"]["sha256"]   # the file did change
    assert before["code"]["method"]["tokens"] == after["code"]["method"]["tokens"]
    assert differences(before, after) == []
    assert code_now(before) == "the same as stored"


@pytest.mark.parametrize("what,old,new", CODE, ids=[w for w, _, _ in CODE])
def test_an_edit_of_code_in_a_plugin_is_other_code(plugin, what, old, new):
    write, _ = plugin
    text = PLUGIN.format(name="mynova")
    before = _fp(write(text))
    after = _fp(write(text.replace(old, new)))
    (diff,) = differences(before, after)
    assert diff.startswith("method code (") and "mynova_plugin.py): stored " in diff
    assert BEFORE_TOKENS not in diff            # recorded with `tokens`: a real change, nothing to excuse
    assert code_now(before).startswith("differs (method code (")


def test_a_second_class_of_one_name_in_one_file_is_other_code(plugin):
    """The class's own source still counts apart from the file: two definitions under one name."""
    write, _ = plugin
    text = PLUGIN.format(name="mynova")
    first = _fp(write(text))
    twice = text + "\n\nclass MyNova(FedAvg):\n    name = \"mynova\"\n"
    assert differences(first, _fp(write(twice)))


def test_a_plugin_run_stored_before_tokens_is_compared_as_before(plugin):
    """A record without `tokens`: a comment outside the class keeps it (its `text`), one inside the class
    reads as a change and the difference says why; once a write command finds it unchanged it gains
    `tokens`, and from then on a comment inside the class keeps it too."""
    write, _ = plugin
    text = PLUGIN.format(name="mynova")
    new = _fp(write(text))
    old = json.loads(json.dumps(new))
    del old["code"]["method"]["tokens"]
    outside = _fp(write(text.replace("import numpy as np\n", "import numpy as np  # arrays\n")))
    assert differences(old, outside) == []
    inside = _fp(write(text.replace("# effective steps", "# effective local steps")))
    (diff,) = differences(old, inside)
    assert diff.endswith(f"({BEFORE_TOKENS})")
    assert with_text(old, outside) is None      # another file as written: nothing is added
    upgraded = with_text(old, new)
    assert upgraded["code"]["method"]["tokens"] == new["code"]["method"]["tokens"]
    assert {k: v for k, v in upgraded["code"]["method"].items() if k != "tokens"} == old["code"]["method"]
    assert differences(upgraded, inside) == []


def test_a_built_in_method_keeps_its_fingerprint_and_ignores_comments_in_its_class(tmp_path, monkeypatch):
    """A module of fedprism's own: the file's hashes alone (no `tokens`, the stored format of every
    committed run), and a comment or docstring inside the class changes only `sha256`."""
    from fedprism.algorithms.fedavg import FedAvg
    from fedprism.experiment.provenance import _file_hashes, _source_file

    real = source_fingerprint(FedAvg)
    assert set(real) == {"sha256", "text", "file", "class"}
    assert {k: real[k] for k in ("sha256", "text")} == _file_hashes(_source_file(FedAvg))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "builtin_like.py"
    name = "fedprism.algorithms._builtin_like_for_test"
    monkeypatch.delitem(sys.modules, name, raising=False)
    text = PLUGIN.format(name="builtin_like")
    path.write_text(text)
    before = {"code": {"method": source_fingerprint(_load(path, name).MyNova)}}
    assert "tokens" not in before["code"]["method"]
    for _, old, new in NO_CODE:
        path.write_text(text.replace(old, new))
        after = {"code": {"method": source_fingerprint(_load(path, name).MyNova)}}
        assert after["code"]["method"]["sha256"] != before["code"]["method"]["sha256"]
        assert differences(before, after) == [], old
    for _, old, new in CODE:
        path.write_text(text.replace(old, new))
        assert differences(before, {"code": {"method": source_fingerprint(_load(path, name).MyNova)}}), old


def test_indented_source_is_read_as_it_stands():
    """A class defined in a function comes indented from `inspect.getsource`."""
    a = "    class A:\n        x = 1  # one\n"
    b = "    class A:\n        \"\"\"Doc.\"\"\"\n\n        x = 1\n"
    assert source_text_sha256(a) is not None and source_text_sha256(a) == source_text_sha256(b)
    assert source_text_sha256(a) != source_text_sha256(a.replace("1", "2"))


def test_fedprism_run_reuses_a_plugin_run_after_a_comment_edit_in_its_class(plugin, tmp_path):
    """The newcomer's loop: a run, an edit of a comment and a docstring inside the class, the same call
    again returns the stored run; an edit of code is refused."""
    write, _ = plugin
    text = PLUGIN.format(name="mynova_e2e")
    cfg = {"dataset": "digits", "model": "mlp", "clients": 3, "rounds": 1, "fraction": 1.0, "local_epochs": 1,
           "method": "mynova_e2e", "engine": "sequential"}
    db = tmp_path / "r.db"
    try:
        fedprism.register(write(text))
        first = fedprism.run(cfg, db=db, progress=False)
        assert not first.reused
        fedprism.register(write(text.replace("# effective steps", "# effective local steps")
                                .replace("    def aggregate(self, state, rnd, update):\n",
                                         "    def aggregate(self, state, rnd, update):\n        \"\"\"Doc.\"\"\"\n")))
        again = fedprism.run(cfg, db=db, progress=False)
        assert again.reused and again.run_id == first.run_id
        con = sqlite3.connect(db)
        stored = json.loads(con.execute("SELECT provenance FROM runs").fetchone()[0])
        con.close()
        assert stored["code"]["method"]["tokens"]
        fedprism.register(write(text.replace("* 3", "* 4")))
        with pytest.raises(ProvenanceMismatch, match="method code"):
            fedprism.run(cfg, db=db, progress=False)
    finally:
        REGISTRY.unregister("mynova_e2e")
