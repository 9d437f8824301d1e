"""Start-up: what a command imports before it does anything (fedprism.experiment.lookup, bench/startup.py).

A finished stored run is answered from the store in a fresh process without importing torch, numpy or
any method, dataset, model or partition module; `import fedprism` imports no torch. The lookup memo that
makes this possible is written here in process (`Recorder(active=True)`: pytest has imported torch), and
read by fresh interpreters with the same environment, which is what `fedprism run` does after a run."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fedprism.experiment import lookup
from fedprism.experiment.config import parse_overrides, resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

ROOT = Path(__file__).resolve().parents[1]
ITEMS = ["method=fedavg", "dataset=digits", "clients=4", "rounds=1", "local_epochs=1", "engine=sequential"]
#: what a stored result must not import: the libraries that cost seconds, and every component module
HEAVY = ("torch", "numpy", "scipy", "sklearn", "pandas", "matplotlib", "flwr")
COMPONENTS = ("fedprism.algorithms", "fedprism.models", "fedprism.data.sets", "fedprism.data.partitions",
              "fedprism.engine", "fedprism.experiment.runner", "fedprism.kernels")

REPORT = ("import json, sys; "
          "heavy = sorted(m for m in {heavy!r} if m in sys.modules); "
          "parts = sorted(m for m in sys.modules if m.startswith({components!r})); "
          "print(json.dumps({{'heavy': heavy, 'components': parts}}))"
          ).format(heavy=HEAVY, components=COMPONENTS)


def fresh(code: str, *args: str, env: dict | None = None, cwd: Path | None = None,
          timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `code` and then REPORT in a new interpreter; returns the process and what REPORT found imported."""
    env = env or {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=cwd or os.getcwd())
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """`fedprism run ITEMS` in a fresh process, on a copy of the package: the run is trained, stored, and
    its lookup memo written (into a cache of this module's own). The copy keeps the code the memo is keyed
    by fixed while other work edits the tree (an edit is another key: the full path again)."""
    where = tmp_path_factory.mktemp("startup")
    shutil.copytree(ROOT / "src" / "fedprism", where / "src" / "fedprism",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(where / "src"), "FEDPRISM_CACHE": str(where / "cache")}
    db = where / "r.db"
    r = subprocess.run([sys.executable, "-m", "fedprism", "run", *ITEMS, "--db", str(db), "--json",
                        "--quiet"], capture_output=True, text=True, timeout=600, env=env, cwd=where)
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert first["reused"] is False and len(list((where / "cache" / "lookup").glob("*.json"))) == 1
    return where, env, db, first


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A store holding the finished run ITEMS ask for, and the lookup memo entry of that configuration,
    written in this process (the package's code pinned: the tree may change while the test runs)."""
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lookup, "code_hash", lambda root=None: "pinned")
    db = tmp_path / "r.db"
    raw = parse_overrides(ITEMS)
    cfg = resolve(raw)
    memo = lookup.Recorder(raw, cfg, active=True)
    store = Store(db)
    exp = Experiment(cfg, store)
    memo.watch(exp)
    res = exp.run()
    store.close()
    assert res.status == "finished" and memo.save(res)
    return db, raw, cfg, res


def test_import_fedprism_imports_no_torch():
    _, seen = fresh("import fedprism, fedprism.api\n"
                    "fedprism.RunResult, fedprism.Config, fedprism.Store, fedprism.__version__")
    assert seen == {"heavy": [], "components": []}


def test_stored_run_through_the_cli_imports_neither_torch_nor_a_method(first_run):
    where, env, db, first = first_run
    r, seen = fresh("import sys\nfrom fedprism.cli import main\n"
                    "assert main(['run', *sys.argv[2:], '--db', sys.argv[1], '--json']) == 0",
                    str(db), *ITEMS, env=env, cwd=where)
    assert seen == {"heavy": [], "components": []}, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-2])
    assert out == {**first, "reused": True}                  # what the full path printed, now stored


def test_stored_run_through_the_api_imports_neither_torch_nor_a_method(first_run):
    where, env, db, first = first_run
    r, seen = fresh("import sys, fedprism\n"
                    "r = fedprism.run(method='fedavg', dataset='digits', clients=4, rounds=1, "
                    "local_epochs=1, "
                    "engine='sequential', db=sys.argv[1])\n"
                    "print(r.run_id, r.reused, r.final['local_acc'], len(r.history))",
                    str(db), env=env, cwd=where)
    assert seen == {"heavy": [], "components": []}, r.stderr
    run_id, reused, acc, rounds = r.stdout.splitlines()[0].split()
    assert (run_id, reused, float(acc), int(rounds)) == (first["run_id"], "True", first["local_acc"], 1)


def test_lookup_answers_what_the_full_path_answers(stored, monkeypatch):
    db, raw, cfg, res = stored
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    found = lookup.stored_result(raw, db)
    assert found is not None
    got_cfg, got = found
    with Store(db) as store:
        full = Experiment(resolve(raw), store).run()
    assert full.reused and got.reused
    assert (got.run_id, got.status, got.final) == (full.run_id, full.status, full.final)
    assert got.history == full.history
    assert got_cfg.run_id == cfg.run_id and got_cfg.train_id == cfg.train_id and got_cfg.values == cfg.values


def test_lookup_leaves_every_doubt_to_the_full_path(stored, monkeypatch, tmp_path):
    db, raw, cfg, _ = stored
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    assert lookup.stored_result(raw, db) is not None
    assert lookup.stored_result({**raw, "seed": 1}, db) is None              # no entry for that configuration
    assert lookup.stored_result(raw, tmp_path / "absent.db") is None          # no store: none is created
    assert not (tmp_path / "absent.db").exists()
    monkeypatch.setattr(lookup, "pristine", lambda: False)                    # torch imported: full path
    assert lookup.stored_result(raw, db) is None
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    # stored by other code: the full path raises ProvenanceMismatch, the lookup never answers
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT provenance FROM runs WHERE run_id=?", (cfg.run_id,)).fetchone()
        prov = json.loads(row[0])
        prov["code"]["method"].update(sha256="0" * 64, text="1" * 64)
        con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), cfg.run_id))
    assert lookup.stored_result(raw, db) is None


def test_lookup_checks_the_recorded_dataset_files(stored, monkeypatch, tmp_path):
    db, raw, _, _ = stored
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    path = lookup._path(lookup.key(raw))
    entry = json.loads(path.read_text())
    assert entry["files"] == []                                               # digits: no files
    folder = tmp_path / "data"                           # the folder the copy was read from, and its file
    folder.mkdir()
    data = folder / "train.bin"
    data.write_bytes(b"12345")
    entry["files"] = [[str(folder), lookup._stat(folder)], [str(data), lookup._stat(data)]]
    path.write_text(json.dumps(entry))
    assert lookup.stored_result(raw, db) is not None
    data.write_bytes(b"123456")                                               # another size: another copy
    assert lookup.stored_result(raw, db) is None
    entry["files"][1] = [str(data), lookup._stat(data)]
    path.write_text(json.dumps(entry))
    assert lookup.stored_result(raw, db) is not None
    (folder / "other.bin").write_bytes(b"")                  # the folder changed: another copy may be read
    assert lookup.stored_result(raw, db) is None
    entry["files"][0] = [str(folder), lookup._stat(folder)]
    path.write_text(json.dumps(entry))
    assert lookup.stored_result(raw, db) is not None
    path.write_text("{not json")                                              # a damaged entry is no entry
    assert lookup.stored_result(raw, db) is None
    for part, value in (("files", [[1]]), ("files", "x"), ("declared", {"k": [1]}), ("values", []),
                        ("provenance", "x"), ("auto", 3)):                    # nor is one of another shape
        path.write_text(json.dumps({**entry, part: value}))
        assert lookup.stored_result(raw, db) is None, part


def test_memo_key_follows_what_the_entry_depends_on(monkeypatch, tmp_path):
    raw = parse_overrides(ITEMS)
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(lookup, "code_hash", lambda root=None: "pinned")
    k = lookup.key(raw)
    assert k == lookup.key(dict(raw)) and len(k) == 64
    assert lookup.key({**raw, "clients": 5}) != k
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path))                        # other dataset folders
    assert lookup.key(raw) != k
    monkeypatch.delenv("FEDPRISM_DATA")
    assert lookup.key(raw) == k
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "fused_0.so").write_bytes(b"")                    # kernels built since
    assert lookup.key(raw) != k
    monkeypatch.chdir(tmp_path)                                               # a relative data.root moves
    k2 = lookup.key(raw)
    assert k2 != k
    monkeypatch.setattr(lookup, "code_hash", lambda root=None: "edited")
    assert lookup.key(raw) != k2                                              # fedprism's code changed
    import datetime

    assert lookup.key({**raw, "name": datetime.date(2024, 1, 1)}) is None     # not JSON: never remembered


def test_code_hash_covers_every_file_of_the_package(tmp_path):
    pkg = tmp_path / "fedprism"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "__pycache__" / "a.cpython.pyc").write_bytes(b"ignored")
    first = lookup.code_hash(pkg)
    assert lookup.code_hash(pkg) == first
    (pkg / "sub" / "__pycache__" / "a.cpython.pyc").write_bytes(b"other")    # compiled files: not the code
    assert lookup.code_hash(pkg) == first
    (pkg / "sub" / "a.py").write_text("x = 2\n")
    assert lookup.code_hash(pkg) != first
    (pkg / "sub" / "a.py").write_text("x = 1\n")
    assert lookup.code_hash(pkg) == first
    (pkg / "kernel.cpp").write_text("")                                       # a new file of any kind
    assert lookup.code_hash(pkg) != first
    assert lookup.code_hash() != first and len(lookup.code_hash()) == 64       # the installed package


def test_recorder_writes_only_what_reads_back_to_the_same_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(lookup, "code_hash", lambda root=None: "pinned")
    raw = parse_overrides([*ITEMS, "method=fedprox"])
    cfg = resolve(raw)
    rec = lookup.Recorder(raw, cfg, active=False)                             # a process that had torch
    assert rec.key is None and not rec.save(type("R", (), {"status": "finished"})())
    rec = lookup.Recorder(raw, cfg, active=True)
    rec.provenance = {"version": "x", "code": {}, "data": None}
    assert not rec.save(type("R", (), {"status": "interrupted"})())           # only a finished run
    assert rec.save(type("R", (), {"status": "finished"})())
    entry = json.loads(lookup._path(rec.key).read_text())
    back = lookup.config_of(entry)
    assert (back.run_id, back.train_id) == (cfg.run_id, cfg.train_id)
    assert entry["ids"][0] == cfg.run_id and back.values == cfg.values


def test_recorder_refuses_an_entry_that_reads_back_to_other_ids(tmp_path, monkeypatch):
    """Declarations that would not give the training id back (here: every parameter read as evaluation-only,
    so `weighting` leaves the training identity while the run id stays) are never written."""
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(lookup, "code_hash", lambda root=None: "pinned")
    raw = parse_overrides(ITEMS)
    rec = lookup.Recorder(raw, resolve(raw), active=True)
    rec.provenance = {"version": "x", "code": {}, "data": None}
    real = lookup._declared
    monkeypatch.setattr(lookup, "_declared", lambda entry: {k: type(p)(p.default, "", new=p.new, eval_only=True)
                                                            for k, p in real(entry).items()})
    assert not rec.save(type("R", (), {"status": "finished"})())
    assert not lookup._path(rec.key).exists()


def _edit_entry(raw: dict, **values) -> None:
    path = lookup._path(lookup.key(raw))
    entry = json.loads(path.read_text())
    entry["values"].update(values)
    entry["auto"] = sorted(k for k, v in values.items() if k.endswith(".kernels"))
    path.write_text(json.dumps(entry))


def test_lookup_takes_the_stored_pytorch_kernels_run_for_auto(stored, monkeypatch):
    """An entry whose `auto` kernels resolved to the fused ones finds the stored run with PyTorch's kernels,
    as `prefer_stored` makes the full path do (docs/reproducibility.md)."""
    db, raw, cfg, _ = stored
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    _edit_entry(raw, **{"train.kernels": "fused"})
    found = lookup.stored_result(raw, db)
    assert found is not None and found[1].run_id == cfg.run_id and found[0]["train.kernels"] == "aten"


def test_lookup_leaves_a_signed_run_to_the_full_path(stored, monkeypatch):
    """`checkpoint.key`: the full path reads the key file even for a stored run (and refuses one it cannot
    read), so the lookup does not answer."""
    db, raw, _, _ = stored
    monkeypatch.setattr(lookup, "pristine", lambda: True)
    _edit_entry(raw, **{"checkpoint.key": "/nonexistent/key"})
    assert lookup.stored_result(raw, db) is None


def test_digits_split_from_the_cache_is_the_computed_split_bit_for_bit(tmp_path):
    """The training path's start-up: digits' split comes from the decoded-array cache after its first
    computation (no scikit-learn import), as the very arrays scikit-learn gives."""
    import warnings

    import torch

    from fedprism.data.datasets import load_dataset
    from fedprism.data.sets import digits

    computed = load_dataset("digits", cache_dir=False, seed=2)
    assert not (tmp_path / "decoded").exists()
    first = load_dataset("digits", cache_dir=tmp_path, seed=2)                # computed, then cached
    files = list((tmp_path / "decoded").glob("digits-split-2-0.25-*.npz"))
    assert len(files) == 1
    cached = load_dataset("digits", cache_dir=tmp_path, seed=2)               # read from the cache
    for ds in (first, cached):
        for k in ("x_train", "y_train", "x_test", "y_test"):
            a, b = getattr(computed, k), getattr(ds, k)
            assert a.dtype == b.dtype and torch.equal(a, b), k
    assert load_dataset("digits", cache_dir=tmp_path, seed=3).y_test.tolist() != computed.y_test.tolist()
    raw = digits.split(2, 0.25, tmp_path)
    files[0].write_bytes(files[0].read_bytes()[:-40])                         # damaged: warned, computed again
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = digits.split(2, 0.25, tmp_path)
    assert any("ignoring corrupt dataset cache" in str(w.message) for w in seen)
    assert all((getattr(raw, k) == getattr(again, k)).all() for k in ("x_train", "y_train", "x_test", "y_test"))


def test_listing_the_datasets_imports_no_torch():
    """`fedprism datasets` reads the datasets' declarations: no tensor is made, so neither torch nor any
    method, model or engine module is imported (numpy is: the declarations' modules use it)."""
    r, seen = fresh("import sys\nfrom fedprism.cli import main\nassert main(['datasets']) == 0")
    assert "digits" in r.stdout and "fmnist" in r.stdout
    assert [m for m in seen["heavy"] if m != "numpy"] == [], seen
    assert [m for m in seen["components"] if not m.startswith("fedprism.data.")] == [], seen


def test_exporting_a_store_imports_no_torch(stored, tmp_path):
    """`fedprism export` copies the store's tables: no method's code, no torch, no matplotlib."""
    db = stored[0]
    r, seen = fresh("import sys\nfrom fedprism.cli import main\n"
                    "assert main(['export', '--db', sys.argv[1], '--out', sys.argv[2]]) == 0",
                    str(db), str(tmp_path / "csv"))
    assert any((tmp_path / "csv").iterdir())
    assert [m for m in seen["heavy"] if m != "numpy"] == [] and seen["components"] == [], seen


def test_listing_a_stored_method_s_runs_imports_no_torch(stored):
    """`fedprism runs --method NAME` for a method the store holds runs of needs no method's code; an unknown
    name is still refused with the registry's did-you-mean (which imports the methods)."""
    db = stored[0]
    r, seen = fresh("import sys\nfrom fedprism.cli import main\n"
                    "assert main(['runs', '--db', sys.argv[1], '--method', 'fedavg']) == 0", str(db))
    assert "finished" in r.stdout and seen == {"heavy": [], "components": []}, seen
    r, seen = fresh("import sys\nfrom fedprism.cli import main\n"
                    "assert main(['runs', '--db', sys.argv[1], '--method', 'fedavgg']) == 2", str(db))
    assert "did you mean fedavg?" in r.stderr


def test_the_memo_keeps_a_bounded_number_of_entries(tmp_path, monkeypatch):
    """Every edit of fedprism is another key; past MAX_ENTRIES the least recently written tenth goes."""
    monkeypatch.setattr(lookup, "MAX_ENTRIES", 10)
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    for i in range(10):
        assert lookup._write(f"{i:064x}", "{}")
        os.utime(lookup._path(f"{i:064x}"), ns=(i * 10**9, i * 10**9))      # written in the order of i
    assert len(list(lookup.memo_dir().glob("*.json"))) == 10
    assert lookup._write("f" * 64, "{}")                                     # the 11th: 9 stay
    left = sorted(p.stem for p in lookup.memo_dir().glob("*.json"))
    assert len(left) == 9 and "f" * 64 in left and f"{0:064x}" not in left and f"{1:064x}" not in left
