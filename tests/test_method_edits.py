"""The loop around a researcher's own method: after an edit, every entry point runs it again (`--fresh` on
`fedprism run RUN_ID`, on `fedprism sweep` with and without `--only`, `fedprism.run(fresh=True)`), a run
of other code that did not finish never blocks the fixed code, and the code fingerprint of a plugin
method covers the modules of its own project it imports (docs/reproducibility.md)."""

from __future__ import annotations

import importlib
import json
import sqlite3
import sys
import textwrap

import pytest

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.cli import main
from fedprism.experiment.config import resolve
from fedprism.experiment.provenance import ProvenanceMismatch, capture, helper_files, helpers_fingerprint
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep

TINY = {"dataset": "digits", "model": "mlp", "clients": 4, "rounds": 2, "fraction": 1.0, "local_epochs": 1,
        "method": "fedavg", "engine": "sequential"}
ARGS = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]


def _tamper_code(db, run_id: str) -> None:
    """Make a stored run read as stored from other code (its method's file and text hashes)."""
    con = sqlite3.connect(db)
    prov = json.loads(con.execute("SELECT provenance FROM runs WHERE run_id=?", (run_id,)).fetchone()[0])
    prov["code"]["method"].update(sha256="0" * 64, text="0" * 64)
    con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), run_id))
    con.commit()
    con.close()


def _mark(db, run_id: str) -> None:
    """A marker in the stored rounds: gone once the run ran again."""
    con = sqlite3.connect(db)
    con.execute("UPDATE rounds SET metrics='{\"marker\": 1}' WHERE run_id=?", (run_id,))
    con.commit()
    con.close()


def _marked(db, run_id: str) -> bool:
    with Store(db, readonly=True) as s:
        return any(h.get("marker") == 1 for h in s.round_metrics(run_id))


# -- `fedprism run --fresh RUN_ID` -------------------------------------------------------------------------
def test_run_fresh_takes_a_stored_run_id(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    assert main(["run", "--db", db, "--quiet", "--json", *ARGS]) == 0
    run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    _tamper_code(db, run_id)
    _mark(db, run_id)
    assert main(["run", "--db", db, "--quiet", *ARGS]) == 2                 # other code: refused ...
    err = capsys.readouterr().err
    assert "stored from other code or data" in err
    assert f"`fedprism run --fresh {run_id} --db {db}` re-runs it" in err    # ... naming the command that works
    assert main(["run", "--db", db, "--quiet", "--fresh", run_id[:8], "threads=1"]) == 0   # a prefix; execution key
    assert "--fresh: dropped" in capsys.readouterr().err
    assert not _marked(db, run_id)
    with Store(db, readonly=True) as s:
        assert s.provenance(run_id)["code"]["method"]["sha256"] != "0" * 64
        assert [r["run_id"] for r in s.runs()] == [run_id]
    # a key of its own configuration would make another run; an id the store does not hold is named
    assert main(["run", "--db", db, "--quiet", "--fresh", run_id, "rounds=3"]) == 2
    assert "config key 'rounds' = 3 is not valid" in capsys.readouterr().err
    assert main(["run", "--db", db, "--quiet", "--fresh", "ffffffff"]) == 2
    assert "no run 'ffffffff'" in capsys.readouterr().err


# -- `fedprism sweep --fresh` ------------------------------------------------------------------------------
def test_sweep_fresh_runs_again_every_row_or_those_of_only(tmp_path, capsys):
    f = tmp_path / "s.toml"
    base = {k: v for k, v in TINY.items() if k != "method"}
    f.write_text(dump_sweep("edits", base, [dict(label="A", method="fedavg"),
                                            dict(label="B", method="fedavg", lr=0.05)]))
    db = str(tmp_path / "s.db")
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0
    with Store(db, readonly=True) as s:
        ids = {r["label"]: r["run_id"] for r in s.runs(sweep="edits")}
    _tamper_code(db, ids["A"])
    for run_id in ids.values():
        _mark(db, run_id)
    capsys.readouterr()
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 2             # A refused, B skipped
    err = capsys.readouterr().err
    assert f"`fedprism sweep {f} --fresh --only A --db {db}` re-runs it" in err
    assert "fedprism run --fresh" not in err                               # not the advice of another command
    assert main(["sweep", str(f), "--db", db, "--quiet", "--fresh", "--only", "A"]) == 0
    assert "[1/1] A seed=0: --fresh: dropped" in capsys.readouterr().err
    assert not _marked(db, ids["A"]) and _marked(db, ids["B"])             # only the selected row ran again
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0             # now current: both skipped
    assert "0 ran, 2 already finished" in capsys.readouterr().err
    assert main(["sweep", str(f), "--db", db, "--quiet", "--fresh"]) == 0  # every row
    assert "2 ran, 0 already finished" in capsys.readouterr().err
    assert not _marked(db, ids["B"])


# -- a run of other code that did not finish -----------------------------------------------------------------
@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_an_unfinished_run_of_other_code_is_replaced_with_a_note(tmp_path, capsys, status):
    db = str(tmp_path / "u.db")
    cfg = resolve(TINY)
    with Store(db) as s:
        assert Experiment(cfg, s).run(stop_after=1).status == "interrupted"
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET status=? WHERE run_id=?", (status, cfg.run_id))
    con.commit()
    con.close()
    _tamper_code(db, cfg.run_id)
    with pytest.warns(UserWarning) as caught:
        assert main(["run", "--db", db, "--quiet", *ARGS]) == 0             # not blocked: replaced
    notes = [str(w.message) for w in caught if "replaced" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0]                        # one line
    assert notes[0].startswith(f"run {cfg.run_id} was stored {status} after 1 round(s) from other code")
    with Store(db, readonly=True) as s:
        assert s.run(cfg.run_id)["status"] == "finished" and len(s.round_metrics(cfg.run_id)) == 2
        assert s.provenance(cfg.run_id)["code"]["method"]["sha256"] != "0" * 64


# -- a plugin package: helper modules in the fingerprint, fedprism.run(fresh=True) ----------------------------
def _write(path, text: str) -> None:
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def loopkit(tmp_path, monkeypatch):
    """A plugin package written to tmp_path: its method imports a helper module, which imports another
    (`loopkit.shrink` -> `loopkit.consts`), whose constant changes the method's numbers."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)                  # an edit is read again on reload
    pkg = tmp_path / "plugins" / "loopkit"
    pkg.mkdir(parents=True)
    _write(pkg / "__init__.py", "")
    _write(pkg / "consts.py", "SCALE = 1.0\n")
    _write(pkg / "shrink.py", """\
        from loopkit import consts


        def factor():
            return consts.SCALE
        """)
    _write(pkg / "method.py", """\
        from fedprism.algorithms.fedavg import FedAvg
        from loopkit.shrink import factor


        class Shrunk(FedAvg):
            name = "shrunk"

            def aggregate(self, state, rnd, update):
                out = super().aggregate(state, rnd, update)
                state["w"] = state["w"] * factor()
                return out
        """)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    importlib.invalidate_caches()
    mod = importlib.import_module("loopkit.method")
    fedprism.register(mod.Shrunk)
    yield pkg
    REGISTRY.pop("shrunk", None)
    for name in [m for m in sys.modules if m == "loopkit" or m.startswith("loopkit.")]:
        del sys.modules[name]


def test_an_edit_of_a_helper_module_that_changes_numbers_is_caught(loopkit, tmp_path):
    db = tmp_path / "h.db"
    cfg = {**TINY, "method": "shrunk"}
    first = fedprism.run(cfg, db=db)
    fp = Store(db, readonly=True).provenance(first.run_id)["code"]["method_helpers"]
    assert fp["modules"] == ["loopkit", "loopkit.consts", "loopkit.shrink"]          # transitively
    # comments and docstrings only: the same code, the stored run is returned
    _write(loopkit / "consts.py", '"""The scale of the model."""\n\n# one, for now\nSCALE = 1.0  # unchanged\n')
    assert fedprism.run(cfg, db=db).reused
    # another number in the helper of the helper: other code, refused with the advice that works here
    _write(loopkit / "consts.py", "SCALE = 0.5\n")
    with pytest.raises(ProvenanceMismatch) as e:
        fedprism.run(cfg, db=db)
    msg = str(e.value)
    assert "method_helpers code (" in msg and "loopkit/consts.py" in msg
    assert "fedprism.run(..., db=" in msg and "fresh=True)` re-runs it" in msg
    assert "registered in this process only" in msg and "fedprism run --fresh" not in msg
    importlib.reload(sys.modules["loopkit.consts"])
    again = fedprism.run(cfg, db=db, fresh=True)
    assert not again.reused and again.run_id == first.run_id
    assert again.final["global_acc"] != first.final["global_acc"]                    # the edit changed numbers
    assert fedprism.run(cfg, db=db).reused                                           # current again


def test_which_modules_a_method_fingerprints(tmp_path, monkeypatch):
    """A method of a top-level module: the modules in its folder and below (a sibling file, a sibling
    package), not fedprism, not installed packages, not the standard library; fedprism's own methods have
    none, so their fingerprints are those of the runs stored before helpers were covered."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    d = tmp_path / "flat"
    (d / "nested").mkdir(parents=True)
    _write(d / "solo_plugin.py", """\
        import json
        import numpy as np
        import fedprism
        import solo_util


        def later():
            from nested import deep                 # deferred imports are read too
            return deep


        class Solo:
            pass
        """)
    _write(d / "solo_util.py", "X = 1\n")
    _write(d / "nested" / "__init__.py", "")
    _write(d / "nested" / "deep.py", "Y = 2\n")
    monkeypatch.syspath_prepend(str(d))
    importlib.invalidate_caches()
    mod = importlib.import_module("solo_plugin")
    try:
        fp = helpers_fingerprint(mod.Solo)
        assert fp["modules"] == ["nested", "nested.deep", "solo_util"]
        assert {n for n, _ in helper_files("solo_plugin", d / "solo_plugin.py")} == set(fp["modules"])
        before = fp["sha256"], fp["text"]
        _write(d / "nested" / "deep.py", "# a comment\nY = 2\n")
        after = helpers_fingerprint(mod.Solo)
        assert after["sha256"] != before[0] and after["text"] == before[1]   # text: comments do not count
        _write(d / "nested" / "deep.py", "Y = 3\n")
        assert helpers_fingerprint(mod.Solo)["text"] != before[1]
    finally:
        for name in ("solo_plugin", "solo_util", "nested", "nested.deep"):
            sys.modules.pop(name, None)
    from fedprism.algorithms.fedavg import FedAvg
    from fedprism.algorithms.fedprox import FedProx

    assert helpers_fingerprint(FedAvg) is None and helpers_fingerprint(FedProx) is None


def test_a_built_in_methods_provenance_keeps_its_keys(tmp_path):
    """No `method_helpers` key for a built-in method: a new run's code fingerprints are what they were."""
    with Store(tmp_path / "b.db") as s:
        prov = capture(Experiment(resolve(TINY), s))
    assert set(prov["code"]) == {"method", "method_bases", "model"}
