"""What a user meets first: rows of the report, read-only commands, provenance and `verify`, progress,
`runs` / `show`, key suggestions, plot files and their links."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.report import write_report
from _committed import committed_store

TINY = {"dataset": "digits", "model": "mlp", "clients": 6, "rounds": 2, "fraction": 0.5, "local_epochs": 1,
        "method": "fedavg", "engine": "sequential"}


def tiny(**kw):
    return resolve({**TINY, **{k.replace("__", "."): v for k, v in kw.items()}})


def _run(db, **kw):
    store = Store(db)
    res = Experiment(tiny(**kw), store).run()
    store.close()
    return res


# -- 1. rows of the report --------------------------------------------------------------------------
def test_runs_with_other_hyperparameters_are_separate_rows(tmp_path):
    db = str(tmp_path / "s.db")
    a = _run(db, lr=0.01)
    _run(db, lr=0.05)
    _run(db, lr=0.01, seed=1)
    _run(db, lr=0.01, seed=2, engine="vectorized", compile=False)   # execution-only keys still pool
    write_report(db, str(tmp_path / "rep"), plots=False)
    md = (tmp_path / "rep" / "results.md").read_text()
    assert "| fedavg (lr=0.01) | 3 |" in md, md
    assert "| fedavg (lr=0.05) | 1 |" in md, md
    assert "| fedavg | 2 |" not in md and "| fedavg | 4 |" not in md
    # name= relabels a finished run: same id, same results, new row label
    store = Store(db)
    before = dict(store.run(a.run_id))
    res = Experiment(tiny(lr=0.01, name="slow lr"), store).run()
    after = dict(store.run(a.run_id))
    assert res.run_id == a.run_id and after["final"] == before["final"] and after["name"] == "slow lr"
    assert len(store.runs()) == 4
    store.close()
    write_report(db, str(tmp_path / "rep2"), plots=False)
    md = (tmp_path / "rep2" / "results.md").read_text()
    assert "| slow lr | 1 |" in md and "| fedavg (lr=0.01) | 2 |" in md, md


def test_sweep_labels_stay_and_same_label_other_config_splits(tmp_path):
    from fedprism.report import collect

    db = str(tmp_path / "s.db")
    store = Store(db)
    for mu in (1.0, 0.1):
        Experiment(tiny(method="fedamp", fedamp__mu=mu, name="FedAMP"), store, sweep="sw").run()
    store.add_to_sweep("sw", Experiment(tiny(method="local", name="Local"), store).run().run_id, "Local")
    groups = collect(store, "sw")
    store.close()
    (labels,) = [set(v) for v in groups.values()]
    assert labels == {"FedAMP (mu=0.1)", "FedAMP (mu=1)", "Local"}


# -- 2. read-only commands -------------------------------------------------------------------------
def _digest(p: Path) -> tuple[str, int]:
    return hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns


def _rollback_journal_store(tmp_path) -> Path:
    """A small store in the committed files' journal mode (not WAL), as the snapshot script leaves them."""
    db = tmp_path / "small.db"
    _run(str(db))
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=DELETE")
    con.close()
    os.utime(db, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return db


def test_read_only_commands_change_no_byte(tmp_path, capsys):
    """Nor leave a file: also a store in WAL mode (as `fedprism run` leaves one), where a read-only
    connection creates -wal and -shm files it cannot remove itself."""
    dbs = [_rollback_journal_store(tmp_path)]
    (tmp_path / "wal").mkdir()
    dbs.append(tmp_path / "wal" / "w.db")
    _run(str(dbs[-1]))
    assert dbs[-1].read_bytes()[18:20] == b"\x02\x02"
    (tmp_path / "link").mkdir()                        # the same store through a symbolic link
    (tmp_path / "link" / "l.db").symlink_to(dbs[-1])
    assert main(["runs", "--db", str(tmp_path / "link" / "l.db")]) == 0
    assert sorted(p.name for p in (tmp_path / "wal").iterdir()) == ["w.db", "w.db.final"]
    COMMITTED = committed_store()                      # built from the committed dump
    if COMMITTED is not None:
        dbs.append(tmp_path / "committed.db")
        with open(COMMITTED, "rb") as fh:
            journal = fh.read(20)[18:20]                  # SQLite header: 1, 1 rollback journal; 2, 2 WAL
        if journal == b"\x01\x01":
            shutil.copy2(COMMITTED, dbs[-1])             # as committed, byte for byte
        else:                                            # a sweep writes to it now (WAL): its content as committed
            src = sqlite3.connect(f"file:{COMMITTED}?mode=ro", uri=True)
            dst = sqlite3.connect(dbs[-1])
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
            dst.close()
            src.close()
    for db in dbs:
        before, header = _digest(db), db.read_bytes()[18:20]
        beside = sorted(p.name for p in db.parent.glob(db.name + "*"))
        with Store(str(db), readonly=True) as st:
            run_id = st.runs()[0]["run_id"]
        assert main(["report", "--db", str(db), "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
        assert main(["export", "--db", str(db), "--out", str(tmp_path / "exp")]) == 0
        assert main(["runs", "--db", str(db)]) == 0
        assert main(["show", "--db", str(db), run_id]) == 0
        for wrong in (["show", "zzzz"], ["runs", "--sweep", "no-such"], ["runs", "--method", "no-such"]):
            assert main([wrong[0], "--db", str(db), *wrong[1:]]) == 2           # their error paths too
        assert _digest(db) == before, db
        assert db.read_bytes()[18:20] == header                      # a rollback-journal file stays one
        assert sorted(p.name for p in db.parent.glob(db.name + "*")) == beside       # no -wal / -shm left
        assert not any(n.endswith(("-wal", "-shm", "-journal")) for n in beside)
    capsys.readouterr()


@pytest.mark.parametrize("name", ["a#1.db", "q?x.db", "p%41.db", "sp ace.db"])
def test_a_store_whose_path_holds_uri_characters_opens_read_only_as_itself(tmp_path, name):
    """The read-only open goes through an SQLite URI: '#', '?' and '%' in the path are that file's name,
    not a fragment, a query or an escape (they used to open, and create, another file)."""
    import fedprism

    (tmp_path / "a").write_bytes(b"")                              # what an unescaped 'a#1.db' opened
    (tmp_path / "pA.db").write_bytes(b"")                          # ... and 'p%41.db'
    res = _run(str(tmp_path / name))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert [r["run_id"] for r in fedprism.results(str(tmp_path / name))] == [res.run_id]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "a").read_bytes() == b"" and (tmp_path / "pA.db").read_bytes() == b""


def test_numpy_values_configure_and_filter_as_the_python_values_they_hold(tmp_path):
    """np.int64 from a loop over np.arange, np.float32, np.bool_: the same config and run id as the
    Python values (np.int64 used to be refused as 'not an integer'); a choice given as 1 stays 1 (its own
    run id, as it always had); store filters and round numbers take numpy values; an unknown run id is
    an error."""
    import numpy as np

    import fedprism
    from fedprism.errors import FedPrismError
    from fedprism.experiment.store import UnknownFilter

    py = tiny(clients=6, lr=0.05, seed=0, data__pad32=True)
    np_cfg = tiny(clients=np.int64(6), lr=np.float64(0.05), seed=np.int32(0), data__pad32=np.True_)
    assert np_cfg.run_id == py.run_id and type(np_cfg["clients"]) is int and np_cfg["data.pad32"] is True
    assert tiny(clients=6, lr=0.05, seed=0, data__pad32=1).run_id != py.run_id
    db = str(tmp_path / "n.db")
    res = _run(db)
    assert [r["run_id"] for r in fedprism.results(db, seed=np.int64(0))] == [res.run_id]
    with pytest.raises(UnknownFilter, match="one value"):
        fedprism.results(db, method=["fedavg"])
    with Store(db, readonly=True) as st:
        last = st.client_rows(res.run_id)
        assert last and [dict(r) for r in st.client_rows(res.run_id, rnd=np.int64(last[0]["round"]))] == \
            [dict(r) for r in last]
        for call in (st.round_metrics, st.client_rows, st.records):
            with pytest.raises(FedPrismError, match="no run 'feedbeef'"):
                call("feedbeef")


def test_report_on_a_missing_store_is_one_line_and_creates_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cmd in (["report"], ["export"], ["runs"], ["show", "abc"]):
        assert main([*cmd, "--db", "typo.db"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fedprism: error:") and "typo.db" in err[0], err
        assert not (tmp_path / "typo.db").exists()


def test_unknown_reference_is_one_line_exit_2(tmp_path, capsys):
    db = _rollback_journal_store(tmp_path)
    assert main(["report", "--db", str(db), "--out", str(tmp_path / "r"), "--reference", "foo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown reference 'foo'" in err[0] and "fedprism-paper-fmnist" in err[0]


def test_no_plots_links_no_images(tmp_path):
    db = _rollback_journal_store(tmp_path)
    write_report(str(db), str(tmp_path / "r"), plots=False)
    md = (tmp_path / "r" / "results.md").read_text()
    assert "![" not in md and "plots/" not in md and not (tmp_path / "r" / "plots").exists()


def test_a_store_of_an_older_schema_is_migrated_on_write_only(tmp_path):
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE runs (run_id TEXT PRIMARY KEY, name TEXT, method TEXT, dataset TEXT, "
                      "seed INTEGER, config TEXT NOT NULL, code_version TEXT, status TEXT NOT NULL, rounds_done "
                      "INTEGER NOT NULL DEFAULT 0, final TEXT, created REAL, updated REAL, sweep TEXT);")
    con.close()
    cols = lambda: {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(runs)")}  # noqa: E731
    Store(db, readonly=True).close()
    assert "provenance" not in cols()
    Store(db).close()
    assert "provenance" in cols()


# -- 3. provenance, --fresh, verify -----------------------------------------------------------------
def test_a_run_records_what_produced_it(tmp_path):
    import numpy as np
    import torch

    from fedprism.algorithms.fedavg import FedAvg

    db = str(tmp_path / "p.db")
    res = _run(db, threads=1)
    assert res.run_id == tiny().run_id                             # threads= is not part of the run id
    prov = Store(db, readonly=True).provenance(res.run_id)
    src = Path(__import__("inspect").getsourcefile(FedAvg)).read_bytes()
    assert prov["code"]["method"]["sha256"] == hashlib.sha256(src).hexdigest()
    assert prov["code"]["model"]["class"].endswith("MLP") and len(prov["code"]["model"]["sha256"]) == 64
    assert len(prov["data"]) == 64
    ex = prov["execution"]
    assert ex["threads"] == 1 and ex["engine"] == "SequentialEngine" and ex["compile"] is False
    assert ex["cuda_graphs"] is False and ex["fuse_jobs"] is False
    assert _run(db, threads=1, cuda_graphs="false", fuse_jobs="false").run_id == res.run_id   # execution keys
    assert ex["torch"] == torch.__version__ and ex["numpy"] == np.__version__ and ex["cpu"]
    assert prov["version"]
    # the same data gives the same fingerprint; another partition seed gives another
    assert Store(db, readonly=True).provenance(_run(db, seed=0).run_id)["data"] == prov["data"]
    assert Store(db, readonly=True).provenance(_run(db, seed=1).run_id)["data"] != prov["data"]


def _tamper(db: str, run_id: str, path: tuple[str, ...], value) -> None:
    con = sqlite3.connect(db)
    prov = json.loads(con.execute("SELECT provenance FROM runs WHERE run_id=?", (run_id,)).fetchone()[0])
    d = prov
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), run_id))
    con.commit()
    con.close()


def test_other_code_or_data_never_reuses_the_stored_result(tmp_path, capsys):
    from fedprism.experiment.provenance import ProvenanceMismatch

    db = str(tmp_path / "p.db")
    res = _run(db)
    for path in (("code", "method", "sha256"), ("data",)):
        _tamper(db, res.run_id, path, "0" * 64)
        if path[0] == "code":                                   # other code: other text too
            _tamper(db, res.run_id, ("code", "method", "text"), "0" * 64)
        with pytest.raises(ProvenanceMismatch, match="--fresh"):
            Experiment(tiny(), Store(db)).run()
        args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]
        assert main(["run", "--db", db, "--quiet", *args]) == 2
        assert "stored from other code or data" in capsys.readouterr().err
        assert main(["run", "--db", db, "--quiet", "--fresh", *args]) == 0   # re-runs under the current code
        capsys.readouterr()
        store = Store(db, readonly=True)
        assert store.provenance(res.run_id)[path[0]] != "0" * 64 and len(store.round_metrics(res.run_id)) == 2
    # a run stored without provenance ("unknown") has nothing to compare: reused as before
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET provenance=NULL")
    con.commit()
    again = Experiment(tiny(), Store(db)).run()
    assert again.status == "finished" and again.final == json.loads(Store(db).run(res.run_id)["final"])


def test_fresh_drops_the_stored_rounds_and_runs_again(tmp_path, capsys):
    db = str(tmp_path / "f.db")
    res = _run(db)
    con = sqlite3.connect(db)
    con.execute("UPDATE rounds SET metrics='{\"marker\": 1}' WHERE run_id=?", (res.run_id,))
    con.commit()
    args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]
    capsys.readouterr()
    assert main(["run", "--db", db, "--quiet", *args]) == 0              # finished: not run again
    assert Store(db).round_metrics(res.run_id)[0].get("marker") == 1
    assert "(stored: not run again; --fresh runs it again)" in capsys.readouterr().out
    assert main(["run", "--db", db, "--quiet", "--fresh", *args]) == 0
    hist = Store(db).round_metrics(res.run_id)
    assert "marker" not in hist[0] and len(hist) == 2
    assert "not run again" not in capsys.readouterr().out


def test_fresh_keeps_a_run_that_cannot_start_or_that_another_process_runs(tmp_path, capsys, monkeypatch):
    """--fresh drops a stored run only once its replacement is built, and not while another process holds
    the run's lock: data that cannot load (the same run id: data.root is execution-only) and a run in
    progress elsewhere each leave every stored round in place."""
    from fedprism.errors import FedPrismError
    from fedprism.experiment import runner
    from fedprism.experiment.runlock import RunLock

    db = str(tmp_path / "k.db")
    res = _run(db)
    args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]

    def gone(cfg):
        raise FedPrismError("data.root /nowhere does not hold dataset 'digits'")

    with monkeypatch.context() as m:
        m.setattr(runner, "build_federation", gone)
        assert main(["run", "--db", db, "--quiet", "--fresh", *args]) == 2
    assert "does not hold" in capsys.readouterr().err
    assert len(Store(db, readonly=True).round_metrics(res.run_id)) == 2
    lock = RunLock(Store(db, readonly=True).ckpt_dir / f"{res.run_id}.lock")
    lock.acquire()                                   # as a process executing the run holds it
    try:
        assert main(["run", "--db", db, "--quiet", "--fresh", *args]) == 2
        assert "another process" in capsys.readouterr().err
        assert len(Store(db, readonly=True).round_metrics(res.run_id)) == 2
    finally:
        lock.release()
    assert main(["run", "--db", db, "--quiet", "--fresh", *args]) == 0       # free again: it runs again
    assert "--fresh: dropped" in capsys.readouterr().err


def test_verify_reproduces_and_names_the_first_difference(tmp_path, capsys):
    db = str(tmp_path / "v.db")
    res = _run(db, threads=1)
    assert main(["verify", "--db", db, res.run_id[:6], "--rounds", "2", "--quiet"]) == 0
    assert "reproduced" in capsys.readouterr().out
    con = sqlite3.connect(db)
    m = json.loads(con.execute("SELECT metrics FROM rounds WHERE run_id=? AND round=1", (res.run_id,)).fetchone()[0])
    m["train_loss"] += 1e-9
    con.execute("UPDATE rounds SET metrics=? WHERE run_id=? AND round=1", (json.dumps(m), res.run_id))
    con.commit()
    con.close()
    before = _digest(Path(db))
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS: round 2, metric train_loss" in out, out
    assert "note:" not in out                                  # the same machine and execution: no excuse
    assert _digest(Path(db)) == before
    # stored elsewhere: the difference comes with the execution facts that changed
    con = sqlite3.connect(db)
    prov = json.loads(con.execute("SELECT provenance FROM runs WHERE run_id=?", (res.run_id,)).fetchone()[0])
    prov["execution"]["cpu"], prov["execution"]["torch"] = "Another CPU", "0.0.1"
    con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), res.run_id))
    con.commit()
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "note: this re-run executed differently (cpu 'Another CPU' -> " in out, out
    assert f"torch '0.0.1' -> '{torch.__version__}'" in out and "engine" not in out.split("note:")[1]
    con.execute("UPDATE runs SET provenance=NULL WHERE run_id=?", (res.run_id,))
    con.commit()
    con.close()
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    assert "note: the stored run records no execution" in capsys.readouterr().out


def test_verify_sets_a_key_added_since_the_run_was_stored_and_no_other(tmp_path, capsys):
    """A run stored before `pfpl.own_share` existed (its config lacks the key; it ran the `live` reading):
    verify with the current default differs, with `pfpl.own_share=live` it reproduces; a key the stored
    configuration holds is refused."""
    db = str(tmp_path / "o.db")
    res = _run(db, threads=1, method="pfpl", **{"pfpl.own_share": "live"})
    con = sqlite3.connect(db)
    cfg = json.loads(con.execute("SELECT config FROM runs WHERE run_id=?", (res.run_id,)).fetchone()[0])
    del cfg["pfpl.own_share"]
    con.execute("UPDATE runs SET config=? WHERE run_id=?", (json.dumps(cfg), res.run_id))
    con.commit()
    con.close()
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet", "pfpl.own_share=live"]) == 0
    assert "reproduced" in capsys.readouterr().out
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    assert "DIFFERS" in capsys.readouterr().out
    assert main(["verify", "--db", db, res.run_id, "--quiet", "lr=0.1"]) == 2
    assert "a key this run's stored configuration does not hold" in capsys.readouterr().err


# -- 4. progress, runs, show -----------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_redraws_on_a_terminal_and_prints_lines_in_a_log():
    from fedprism.experiment.progress import Progress

    clock, log = _Clock(), io.StringIO()
    p = Progress(100, True, "run", stream=log, tty=False, every_s=10, clock=clock)
    for r in range(1, 101):
        clock.t += 3.0                                                   # 3 s per round
        p.update(r, {"local_acc": 0.5} if r % 5 == 0 else None)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("run round 1/100") and lines[-1].startswith("run round 100/100")
    assert 25 <= len(lines) <= 30                                        # about one line per 10 s
    assert "local 0.500" in lines[-1]
    term = io.StringIO()
    p = Progress(3, True, "run", stream=term, tty=True, clock=clock)
    for r in (1, 2, 3):
        p.update(r, None)
    assert term.getvalue().count("\r") == 3 and term.getvalue().endswith("\n")


def test_json_run_keeps_stdout_to_one_object_and_reports_progress_on_stderr(tmp_path, capsys):
    args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]
    assert main(["run", "--db", str(tmp_path / "j.db"), "--json", *args]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["run_id"] and len(out.strip().splitlines()) == 1
    assert "round 2/2" in err and "\r" not in err                       # not a terminal: plain lines


def test_runs_lists_and_show_prints_config_provenance_and_rounds(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    a = _run(db, name="first")
    b = _run(db, method="local")
    store = Store(db)
    store.add_to_sweep("sw", b.run_id, "Only local")
    store.close()
    assert main(["runs", "--db", db]) == 0
    out = capsys.readouterr().out
    assert a.run_id in out and b.run_id in out and "first" in out and "finished" in out and "2/2" in out
    assert main(["runs", "--db", db, "--method", "fedavg"]) == 0
    out = capsys.readouterr().out
    assert a.run_id in out and b.run_id not in out
    assert main(["runs", "--db", db, "--method", "fedavgg"]) == 2           # a misspelt method: not "no runs"
    assert "no method 'fedavgg' (did you mean fedavg?); methods of stored runs: fedavg, local" in \
        capsys.readouterr().err
    assert main(["runs", "--db", db, "--method", "ifca"]) == 0              # a method with no runs here
    assert "no runs match" in capsys.readouterr().err
    assert main(["runs", "--db", db, "--sweep", "sw", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["run_id"] == b.run_id and row["label"] == "Only local"
    assert row["local_acc"] == b.final["local_acc"] and row["rounds_done"] == row["rounds"] == 2   # numbers
    assert main(["show", "--db", db, a.run_id[:5]]) == 0
    out = capsys.readouterr().out
    for text in ("Configuration:", "lr", "Provenance:", "code.method", "execution.threads", "Rounds:",
                 "train_loss"):
        assert text in out, text
    assert "code now: the same as stored; data not checked here" in out
    _tamper(db, a.run_id, ("code", "method", "sha256"), "0" * 64)             # a comment edit: the same text
    assert main(["show", "--db", db, a.run_id]) == 0
    assert "code now: the same as stored" in capsys.readouterr().out
    _tamper(db, a.run_id, ("code", "method", "text"), "0" * 64)
    assert main(["show", "--db", db, a.run_id]) == 0
    assert "code now: differs (method code (fedprism/algorithms/fedavg.py): stored 000000000000" in \
        capsys.readouterr().out
    _tamper(db, a.run_id, ("code", "method", "class"), "fedprism.algorithms.gone.Gone")
    assert main(["show", "--db", db, a.run_id]) == 0 and "code now: cannot tell" in capsys.readouterr().out


def test_a_mistyped_sweep_is_an_error_that_names_the_sweeps_and_writes_nothing(tmp_path, capsys):
    """`runs --sweep` and `report --sweep` with a name no sweep of the store has: exit 2, the nearest name
    and the store's sweeps, and no report written (it used to be an empty table and an empty report)."""
    db = str(tmp_path / "s.db")
    run = _run(db)
    store = Store(db)
    store.add_to_sweep("paper_fmnist_dir01", run.run_id, "FedAvg")
    store.close()
    for cmd in (["runs", "--db", db, "--sweep", "paper_fmnist_dir1"],
                ["report", "--db", db, "--sweep", "paper_fmnist_dir1", "--out", str(tmp_path / "rep")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "no sweep 'paper_fmnist_dir1'" in err and "did you mean paper_fmnist_dir01?" in err, err
    assert not (tmp_path / "rep").exists()
    assert main(["runs", "--db", db, "--sweep", "paper_fmnist_dir01"]) == 0
    assert run.run_id in capsys.readouterr().out


# -- 5. unknown keys --------------------------------------------------------------------------------
@pytest.mark.parametrize("key,meant", [("rouds", "rounds"), ("fedprism.kk", "fedprism.k"),
                                       ("fedprsim.k", "fedprism.k"), ("partition.alpah", "partition.alpha"),
                                       ("local_epoch", "local_epochs")])
def test_unknown_key_suggests_the_nearest(key, meant):
    with pytest.raises(ConfigError, match=f"did you mean {meant}\\?"):
        resolve({"method": "fedprism", key: 3})


@pytest.mark.parametrize("key,value,says", [
    ("lr", float("nan"), "is not valid: a finite number > 0$"),
    ("fedprism.alpha", float("inf"), "is not valid: a finite number; a number in"),
    ("rounds", float("-inf"), "is not valid: a finite number; an integer >= 1$")])
def test_a_non_finite_value_is_named_once(key, value, says):
    """"finite" is said once, also where the parameter's own rule says it ("a finite number > 0")."""
    with pytest.raises(ConfigError) as e:
        resolve({"method": "fedprism", key: value})
    assert e.match(says) and str(e.value).count("finite") == 1, str(e.value)


def test_python_config_takes_method_keys_nested_as_in_a_toml_table():
    """`fedprism.config(method="fedprism", fedprism={"k": 3})` reads like a TOML table; it used to fail with
    "config key 'fedprism' = {'k': 3} is not valid: a fedprism parameter, but method=fedprism"."""
    import fedprism

    c = fedprism.config(method="fedprism", fedprism={"k": 3}, partition={"name": "dirichlet", "alpha": 0.2})
    assert c["fedprism.k"] == 3 and c["partition"] == "dirichlet" and c["partition.alpha"] == 0.2
    assert fedprism.config({"method": "fedprism", "fedprism": {"k": 4}})["fedprism.k"] == 4
    assert c.run_id == fedprism.config(method="fedprism", fedprism__k=3, partition="dirichlet",
                                       partition__alpha=0.2).run_id
    with pytest.raises(ConfigError, match=r"'fedprism.k' = 0 .*>= 1"):
        fedprism.config(method="fedprism", fedprism={"k": 0})


def test_results_filters_name_their_column_or_are_refused(tmp_path):
    """`fedprism.results(db, methd=...)` used to raise sqlite's "no such column"; a filter key now has to be
    a column of the runs table (it is put into the SQL as a name), else an error lists the columns."""
    import fedprism
    from fedprism.experiment.store import UnknownFilter

    db = str(tmp_path / "f.db")
    run = _run(db)
    assert [r["run_id"] for r in fedprism.results(db, method="fedavg", status="finished")] == [run.run_id]
    with pytest.raises(UnknownFilter, match=r"'methd'.*did you mean method\?.*columns: run_id"):
        fedprism.results(db, methd="fedavg")
    with pytest.raises(UnknownFilter):
        fedprism.results(db, **{"1=1 OR method": "x"})


def test_parquet_export_without_its_libraries_writes_nothing(tmp_path, monkeypatch):
    """Without pandas / pyarrow the parquet export is an error naming what to install, raised before the
    output folder is made (it used to leave an empty folder behind); CSV needs neither."""
    import importlib.util

    from fedprism.errors import FedPrismError
    from fedprism.report.export import export

    db = str(tmp_path / "e.db")
    _run(db)
    real = importlib.util.find_spec
    gone = ("pandas", "pyarrow", "fastparquet")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    with pytest.raises(FedPrismError, match="pip install pandas pyarrow"):
        export(db, str(tmp_path / "pq"), "parquet")
    assert not (tmp_path / "pq").exists()
    names = sorted(p.name for p in export(db, str(tmp_path / "csv"), "csv"))
    assert names == ["client_metrics.csv", "records.csv", "rounds.csv", "runs.csv", "sweep_runs.csv"]


def test_a_resumed_run_says_after_which_round_as_people_count(tmp_path, capsys):
    """Rounds are 0-based in the store and 1-based where a person reads them: a run stopped after its
    first round resumes "after round 1"."""
    db = str(tmp_path / "r.db")
    store = Store(db)
    Experiment(tiny(rounds=3), store).run(stop_after=1)
    store.close()
    args = [f"{k}={v}" for k, v in {**TINY, "rounds": 3}.items()]
    assert main(["run", *args, "--db", db]) == 0
    assert "-> finished, resumed after round 1" in capsys.readouterr().out


def test_a_rescored_run_says_so_in_text_json_and_show(tmp_path, capsys):
    """A run that differs from a finished one only in an evaluation-only key is scored from that run's kept
    final state: `run` says so instead of looking like a 0-second training, `--json` names the source
    run, and `show` explains why the run holds only its last round."""
    db = str(tmp_path / "r.db")
    base = [f"{k}={v}" for k, v in {**TINY, "method": "fedprism_dual", "fedprism_dual.k": 2,
                                     "fraction": 1.0}.items()]
    assert main(["run", *base, "--db", db, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert "rescored_from" not in first
    assert main(["run", *base, "fedprism_dual.inference_temperature=2", "--db", db]) == 0
    out = capsys.readouterr().out
    assert f"-> finished, re-scored from run {first['run_id']}'s kept final state (no training)" in out
    assert main(["run", *base, "fedprism_dual.inference_temperature=2", "--db", db, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["rescored_from"] == first["run_id"] and again["reused"]
    assert main(["show", again["run_id"], "--db", db]) == 0
    assert f"re-scored from run {first['run_id']}'s kept final state" in capsys.readouterr().out


def test_every_exported_table_has_rows_as_wide_as_its_header(tmp_path):
    """Every CSV table's rows have its header's columns, and `records.csv` names each (its `seq` too): a
    method that writes records (clusters, assignments) exported and read back field by field."""
    import csv

    from fedprism.report.export import export

    db = str(tmp_path / "e.db")
    _run(db, method="fedprism", fedprism__k=2, fedprism__every=1)
    export(db, str(tmp_path / "out"))
    for p in sorted((tmp_path / "out").glob("*.csv")):
        header, *rows = list(csv.reader(open(p)))
        assert (p.name == "sweep_runs.csv" or rows) and all(len(r) == len(header) for r in rows), p.name
    header, *rows = list(csv.reader(open(tmp_path / "out" / "records.csv")))
    assert header == ["run_id", "round", "seq", "kind", "client", "data"]
    store = Store(db, readonly=True)
    stored = store.db.execute("SELECT run_id, round, seq, kind, data FROM records ORDER BY rowid").fetchall()
    store.close()
    assert [(r[0], int(r[1]), int(r[2]), r[3], r[5]) for r in rows] == [tuple(s) for s in stored]


def test_export_carries_every_sweep_a_run_belongs_to(tmp_path):
    """`runs.csv` has the sweep that first ran a run; `sweep_runs.csv` every sweep holding it (its label)."""
    import csv

    from fedprism.report.export import export

    db = str(tmp_path / "e.db")
    store = Store(db)
    res = Experiment(tiny(), store, sweep="first").run()
    store.add_to_sweep("second", res.run_id, "baseline avg")
    first = store.runs(sweep="first")[0]["label"]           # as `fedprism runs --sweep first` shows it
    store.close()
    export(db, str(tmp_path / "out"))
    rows = list(csv.reader(open(tmp_path / "out" / "sweep_runs.csv")))
    assert rows[0] == ["sweep", "run_id", "label"]
    assert sorted(rows[1:]) == [["first", res.run_id, first or ""], ["second", res.run_id, "baseline avg"]]


def test_export_of_selected_runs_and_sweeps(tmp_path, capsys):
    """`fedprism export --run/--sweep`: only the selected runs' rows in every table; a run selected through
    a sweep carries that sweep's membership only, one named by id all of them; an unknown name writes
    nothing."""
    import csv

    from fedprism.cli import main

    db = str(tmp_path / "e.db")
    store = Store(db)
    a = Experiment(tiny(seed=0), store, sweep="first").run().run_id
    b = Experiment(tiny(seed=1), store, sweep="other").run().run_id
    store.add_to_sweep("second", a, "again")
    store.close()

    def table(out, name):
        return list(csv.DictReader(open(tmp_path / out / f"{name}.csv")))

    assert main(["export", "--db", db, "--out", str(tmp_path / "all")]) == 0
    assert {r["run_id"] for r in table("all", "rounds")} == {a, b}
    assert main(["export", "--db", db, "--out", str(tmp_path / "sw"), "--sweep", "second"]) == 0
    for name in ("runs", "rounds", "client_metrics"):
        assert {r["run_id"] for r in table("sw", name)} == {a}, name
    assert {r["run_id"] for r in table("sw", "records")} <= {a}        # (FedAvg may write no record)
    assert [(r["sweep"], r["run_id"]) for r in table("sw", "sweep_runs")] == [("second", a)]
    assert main(["export", "--db", db, "--out", str(tmp_path / "id"), "--run", a[:6],
                 "--sweep", "other"]) == 0
    assert {r["run_id"] for r in table("id", "runs")} == {a, b}
    assert sorted((r["sweep"], r["run_id"]) for r in table("id", "sweep_runs")) == \
        sorted([("first", a), ("second", a), ("other", b)])
    capsys.readouterr()
    assert main(["export", "--db", db, "--out", str(tmp_path / "no"), "--sweep", "secnd"]) == 2
    assert "has no sweep secnd" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_a_damaged_store_page_and_a_file_in_a_folder_s_place_are_one_line_errors(tmp_path, capsys,
                                                                                  monkeypatch):
    """A damaged page that the open's probe does not touch, and `--out` naming a file: exit 2 with one
    line, no traceback. `threads` has an upper bound (torch crashed with 100000)."""
    import sqlite3

    from fedprism.cli import main

    db = str(tmp_path / "d.db")
    _run(db)
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    assert main(["export", "--db", db, "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedprism: error:") and "afile" in err and len(err.splitlines()) == 1

    def damaged(*a, **k):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(Store, "runs", damaged)
    assert main(["runs", "--db", db]) == 2
    err = capsys.readouterr().err
    assert f"{db} is damaged (database disk image is malformed)" in err and ".recover" in err
    for tables in (["people (name TEXT)"], ["runs (x INTEGER)", "users (name TEXT)"]):
        other = tmp_path / f"other{len(tables)}.db"      # another program's SQLite file is not written to
        con = sqlite3.connect(other)
        for t in tables:
            con.execute(f"CREATE TABLE {t}")
        con.commit()
        con.close()
        before = other.read_bytes()
        assert main(["run", "method=fedavg", "dataset=digits", "clients=4", "rounds=1",
                     "--db", str(other)]) == 2
        assert "not a fedprism results store" in capsys.readouterr().err and other.read_bytes() == before
    from fedprism.experiment.federation import build_federation
    for key in ("data.train_subset", "data.test_subset"):         # more rows than the split holds: refused
        with pytest.raises(ConfigError, match=key.replace(".", r"\.") + r".*<= the \d+ samples of digits"):
            build_federation(resolve({**TINY, key: 100000}))
    with pytest.raises(ConfigError, match=r"'threads' = 100000 .*\[0, 256\]"):
        resolve({**TINY, "threads": 100000})


def test_runs_marks_a_killed_run_without_writing(tmp_path, capsys):
    """A row left `running` by a killed process shows as interrupted* in `fedprism runs` (no lock file, or
    a lock file naming a dead process of this host); a live holder keeps it `running`; nothing is written."""
    import socket
    import subprocess
    import sys

    from fedprism.cli import main

    db = tmp_path / "k.db"
    rid = _run(str(db)).run_id
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET status='running' WHERE run_id=?", (rid,))
    con.commit()
    con.close()
    before = _digest(db)
    lock = Path(f"{db}.ckpt") / f"{rid}.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for holder, shown in ((None, "interrupted*"), (f"pid {dead} on {socket.gethostname()}", "interrupted*"),
                          (f"pid {os.getpid()} on {socket.gethostname()}", "running"),
                          (f"pid {dead} on another-host", "running")):
        if holder is not None:
            lock.parent.mkdir(exist_ok=True)
            lock.write_text(holder)
        capsys.readouterr()
        assert main(["runs", "--db", str(db)]) == 0
        out, err = capsys.readouterr()
        assert f" {shown} " in out, (holder, out)
        assert ("no process runs it" in err) == (shown == "interrupted*")
        assert main(["runs", "--db", str(db), "--json"]) == 0
        rec = json.loads(capsys.readouterr().out)[0]
        assert rec["status"] == "running" and rec.get("process_gone", False) == (shown == "interrupted*")
    assert _digest(db) == before


def test_a_run_id_prefix_of_sql_wildcards_or_nothing_matches_no_run(tmp_path):
    from fedprism.errors import FedPrismError

    db = str(tmp_path / "p.db")
    rid = _run(db).run_id
    with Store(db, readonly=True) as st:
        assert st.find(rid[:5])["run_id"] == rid
        for prefix in ("%", "_", "", f"{rid[:3]}%"):
            with pytest.raises(FedPrismError, match="no run"):
                st.find(prefix)


def test_a_method_s_array_of_tables_and_pad32_on_tabular_data_name_what_to_write():
    with pytest.raises(ConfigError, match=r"'fedavg' = .*a \[fedavg\] table .*\[\[fedavg\]\] is an array"):
        resolve({**TINY, "method": "fedavg", "fedavg": [{"mu": 1}]})
    from fedprism.experiment.federation import build_federation
    with pytest.raises(ConfigError, match=r"'data\.pad32' = True"):
        build_federation(resolve({**TINY, "dataset": "synthetic", "data.pad32": True}))


def test_a_numbered_cuda_device_says_how_to_pick_a_gpu():
    """`device=cuda:1` is not a value the engines take; the error says how to run on GPU N instead."""
    with pytest.raises(ConfigError, match=r"'device' = 'cuda:1'.*cpu, cuda; .*CUDA_VISIBLE_DEVICES=N"):
        resolve({"method": "fedavg", "device": "cuda:1"})


# -- 7. plots ---------------------------------------------------------------------------------------
def test_plots_are_named_by_content_styled_apart_and_linked_with_captions(tmp_path):
    from fedprism.report import FONT_PT, _plt, styles

    db = str(tmp_path / "c.db")
    store = Store(db)
    for m in ("fedavg", "ifca"):
        Experiment(tiny(method=m, name=m.upper(), rounds=3), store, sweep="sw").run()
    store.close()
    paths = write_report(db, str(tmp_path / "rep"), sweep="sw")
    names = sorted(p.name for p in paths if p.suffix == ".png")
    setting = "digits-dirichlet-alpha0.1--N6-T3"
    assert names == [f"accuracy_{setting}.png", f"clusters_ifca_IFCA_{setting}_seed0.png", f"ecdf_{setting}.png"]
    md = (tmp_path / "rep" / "results.md").read_text()
    for n in names:
        link = next(line for line in md.splitlines() if f"(plots/{n})" in line)
        caption = md.split(link, 1)[1].lstrip("\n").splitlines()[0]
        assert link.startswith("![") and caption.startswith("*") and len(caption) > 30, (n, caption)
    st = styles(12)
    assert len({(s["color"], str(s["ls"])) for s in st}) == 12
    assert len({s["color"] for s in styles(10)}) == 10 and len({str(s["ls"]) for s in styles(4)}) == 4
    plt = _plt()
    assert min(plt.rcParams[k] for k in ("font.size", "legend.fontsize", "xtick.labelsize")) >= FONT_PT >= 9


def test_cluster_plot_uses_one_discrete_colour_per_cluster(tmp_path, monkeypatch):
    import matplotlib.axes

    from fedprism.report import plot_clusters

    db = str(tmp_path / "c.db")
    store = Store(db)
    res = Experiment(tiny(method="ifca", rounds=3), store).run()
    seen = {}
    orig = matplotlib.axes.Axes.imshow

    def spy(self, *a, **kw):
        seen["cmap"] = kw.get("cmap")
        return orig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", spy)
    run = {"run_id": res.run_id, "config": json.loads(store.run(res.run_id)["config"])}
    paths = plot_clusters(store, run, tmp_path, label="IFCA")
    assert sorted(q.suffix for q in paths) == [".pdf", ".png"]        # the same figure in both formats
    k = run["config"]["ifca.k"]
    from matplotlib.colors import ListedColormap
    assert isinstance(seen["cmap"], ListedColormap) and seen["cmap"].N == k
    assert all(q.stat().st_size > 1000 for q in paths)


def test_a_sweep_does_not_skip_a_run_stored_from_other_code(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text('name = "s"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 2\nfraction = 0.5\n'
                 'local_epochs = 1\nengine = "sequential"\n[[runs]]\nlabel = "A"\nmethod = "fedavg"\n')
    db = str(tmp_path / "s.db")
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0            # same code: skipped
    assert "finished earlier, skipped" in capsys.readouterr().err
    (run_id,) = [r["run_id"] for r in Store(db).runs()]
    _tamper(db, run_id, ("code", "model", "sha256"), "1" * 64)
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0            # only the file: the same text
    assert "finished earlier, skipped" in capsys.readouterr().err
    _tamper(db, run_id, ("code", "model", "text"), "1" * 64)
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "stored from other code or data" in err and "model code" in err and "finished earlier" not in err
    # a run added to the file still runs; the stale one is reported, neither re-used nor re-run
    f.write_text(f.read_text() + '[[runs]]\nlabel = "B"\nmethod = "local"\n')
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "1 ran, 0 already finished, 1 stored from other code or data" in err
    runs = {r["method"]: r for r in Store(db).runs()}
    assert runs["local"]["status"] == "finished" and runs["fedavg"]["run_id"] == run_id
    assert json.loads(Store(db).run(run_id)["provenance"])["code"]["model"]["sha256"] == "1" * 64


def test_a_resumed_sweep_fingerprints_each_data_setting_once(tmp_path, capsys, monkeypatch):
    """Skipping a finished run checks its data fingerprint; runs that share a data setting share one
    hash of the arrays (per sweep), and a run whose stored data differs is still caught."""
    from fedprism.experiment import provenance

    f = tmp_path / "s.toml"
    f.write_text('name = "s"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 1\n'
                 'fraction = 0.5\nlocal_epochs = 1\nengine = "sequential"\npartition = "dirichlet"\n'
                 + "".join(f'[[runs]]\nlabel = "{m} {a}"\nmethod = "{m}"\n"partition.alpha" = {a}\n'
                           for a in (0.5, 5.0) for m in ("fedavg", "local", "fedprox")))
    db = str(tmp_path / "s.db")
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0
    hashed = []
    real = provenance.data_fingerprint
    monkeypatch.setattr(provenance, "data_fingerprint", lambda fed: hashed.append(1) or real(fed))
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 0
    assert capsys.readouterr().err.count("finished earlier, skipped") == 6 and len(hashed) == 2
    (run_id,) = [r["run_id"] for r in Store(db).runs() if r["name"] == "local 5.0"]
    _tamper(db, run_id, ("data",), "0" * 64)
    assert main(["sweep", str(f), "--db", db, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("finished earlier, skipped") == 5 and "local 5.0 seed=0: not run" in err


def test_scalars_are_written_per_round_and_client_as_csv(tmp_path):
    import csv

    db = str(tmp_path / "s.db")
    res = _run(db, scalars=str(tmp_path / "sc"), eval_every=1)
    assert res.run_id == tiny().run_id                                   # scalars= is execution-only
    rounds = list(csv.DictReader(open(tmp_path / "sc" / f"{res.run_id}-rounds.csv")))
    stored = Store(db, readonly=True).round_metrics(res.run_id)
    for h in stored:
        got = {r["tag"]: float(r["value"]) for r in rounds if int(r["round"]) == h["round"]}
        assert got["local_acc"] == h["local_acc"] and got["train_loss"] == h["train_loss"]
    clients = list(csv.DictReader(open(tmp_path / "sc" / f"{res.run_id}-clients.csv")))
    assert len(clients) == 2 * 6 and {c["client"] for c in clients} == {str(i) for i in range(6)}


def test_a_row_keeps_its_name_across_settings(tmp_path):
    """lr tells two FedAvg rows apart at alpha=0.1; the alpha=0.5 column's only FedAvg row is named the same."""
    from fedprism.report import collect

    db = str(tmp_path / "s.db")
    _run(db, lr=0.01)
    _run(db, lr=0.05)
    _run(db, lr=0.01, partition__alpha=0.5)
    store = Store(db, readonly=True)
    groups = collect(store)
    store.close()
    assert sorted(sorted(v) for v in groups.values()) == [["fedavg (lr=0.01)"], ["fedavg (lr=0.01)", "fedavg (lr=0.05)"]]


def test_key_value_items_may_follow_options(tmp_path, capsys):
    db = str(tmp_path / "k.db")
    res = _run(db, threads=1)
    assert main(["verify", "--db", db, res.run_id, "--rounds", "1", "--quiet", "engine=sequential",
                 "compile=false"]) == 0
    assert "engine=sequential compile=False" in capsys.readouterr().out
    assert main(["verify", "--db", db, res.run_id, "--quiet", "lr=0.5"]) == 2         # not execution-only
    assert "execution-only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["runs", "--db", db, "rounds=2"])                                    # `runs` takes no items


def test_a_run_refused_for_its_data_leaves_no_store_behind(tmp_path, capsys, monkeypatch):
    """An impossible partition is refused after the store is opened: a store this command created is removed
    again (nothing else was in it), an existing store keeps its runs."""
    monkeypatch.chdir(tmp_path)
    bad = ["run", "dataset=digits", "clients=5000", "--db", "new.db"]
    assert main(bad) == 2
    assert "allow at most" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    db = _rollback_journal_store(tmp_path)
    runs = lambda: sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute(  # noqa: E731
        "SELECT run_id, status, rounds_done FROM runs").fetchall()
    before = runs()
    assert main([*bad[:-1], str(db)]) == 2
    assert db.exists() and runs() == before and len(before) == 1


def test_a_missing_store_names_the_stores_that_are_there(tmp_path, monkeypatch, capsys):
    """`fedprism runs` in the checkout reads ./fedprism-results.db by default, while the shipped sweeps write
    results/fedprism.db: the error names the stores it sees (not every `.db` file), and creates nothing."""
    monkeypatch.chdir(tmp_path)
    assert main(["runs"]) == 2
    assert capsys.readouterr().err.strip().endswith("(check --db or $FEDPRISM_DB)")
    (tmp_path / "results").mkdir()
    Store(tmp_path / "results" / "fedprism.db").close()
    (tmp_path / "notes.db").write_text("not a database")      # .db files that are no SQLite file are not named
    (tmp_path / "results" / "empty.db").touch()
    (tmp_path / "folder.db").mkdir()
    os.mkfifo(tmp_path / "pipe.db")                           # never opened: reading it would wait forever
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["runs", "--sweep", "x"]) == 2
    assert "stores here: results/fedprism.db)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_report_names_the_unfinished_runs_it_leaves_out(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    _run(db)
    store = Store(db)
    half = Experiment(tiny(seed=1), store).run(stop_after=1)
    store.close()
    assert half.status == "interrupted"
    assert main(["report", "--db", db, "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert f"1 unfinished run(s) left out of the report: {half.run_id[:8]} (interrupted)" in err
    _run(db, seed=1)                                                  # finished now: nothing to say
    assert main(["report", "--db", db, "--out", str(tmp_path / "rep2"), "--no-plots"]) == 0
    assert "left out" not in capsys.readouterr().err


@contextlib.contextmanager
def _plugin_model(tmp_path, monkeypatch, module: str, source: str):
    """A model registered from `tmp_path/<module>.py` (written from `source`); yields the config of a tiny
    FedAvg run on it and a store path, and unregisters it afterwards."""
    import importlib
    import sys

    import fedprism
    from fedprism import plugins

    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.register_model(f"{module}_model", importlib.import_module(module).build)
    try:
        yield (fedprism.config(method="fedavg", model=f"{module}_model", clients=4, rounds=1, local_epochs=1),
               tmp_path / "p.db")
    finally:
        plugins.MODELS.pop(f"{module}_model", None)
        sys.modules.pop(module, None)


def test_a_registered_model_is_fingerprinted_by_its_builder(tmp_path, monkeypatch):
    """A builder that returns `nn.Sequential` was fingerprinted by torch's container file, so editing the
    builder reused the stored run. Now its own file is the model's code, and an edit is other code."""
    import fedprism
    from fedprism.experiment.provenance import ProvenanceMismatch

    body = ("import torch\n\ndef build(shape, k):\n    return torch.nn.Sequential(torch.nn.Flatten(), "
            "torch.nn.Linear(64, k))\n")
    with _plugin_model(tmp_path, monkeypatch, "seq_plugin", body) as (cfg, db):
        res = fedprism.run(cfg, db=db)
        code = Store(str(db), readonly=True).provenance(res.run_id)["code"]["model"]
        assert code["file"].endswith("seq_plugin.py") and code["class"] == "seq_plugin.build"
        import inspect
        import sys

        file_sha = hashlib.sha256((tmp_path / "seq_plugin.py").read_bytes()).hexdigest()   # + its own code
        own = hashlib.sha256(inspect.getsource(sys.modules["seq_plugin"].build).encode()).hexdigest()
        assert code["sha256"] == hashlib.sha256(f"{file_sha}:{own}".encode()).hexdigest()
        (tmp_path / "seq_plugin.py").write_text(body + "X = 1\n")
        with pytest.raises(ProvenanceMismatch, match="model"):
            fedprism.run(cfg, db=db)


def test_text_hash_ignores_comments_docstrings_and_blank_lines_only(tmp_path):
    from fedprism.experiment.provenance import text_sha256

    def h(src: str) -> str:
        (tmp_path / "m.py").write_text(src)
        return text_sha256(tmp_path / "m.py")

    base = h('"""Module."""\n\nclass A:\n    """A."""\n\n    def f(self, x):\n        return x + 1  # one\n')
    same = ['"""Module, reworded\n\nover lines."""\n\nclass A:\n    def f(self, x):\n\n'
            '        # a comment\n        return x + 1\n',
            'class A:\n    """A."""\n    def f(self, x):\n        """f."""\n        return x + 1\n',
            '"""Module."""\nclass A:\n    """A."""\n    def f(self, x):\n        "s"; return x + 1\n']
    other = ['"""Module."""\nclass A:\n    """A."""\n    def f(self, x):\n        return x + 2\n',
             '"""Module."""\nclass A:\n    """A."""\n    def f(self, y):\n        return y + 1\n',
             '"""Module."""\nclass A:\n    """A."""\n    def f(self, x):\n        return x + 1\n'
             '"not a docstring"\n',
             '"""Module."""; X = 1\nclass A:\n    """A."""\n    def f(self, x):\n        return x + 1\n',
             '"""Module."""\nclass A:\n    """A."""\n    def f(self, x):\n        y = "doc"\n'
             '        return x + 1\n']
    assert all(h(s) == base for s in same)
    assert len({base, *(h(s) for s in other)}) == 1 + len(other)
    assert h("def f(:\n") is None


def test_a_comment_or_docstring_edit_keeps_the_stored_run_and_old_runs_gain_the_text_hash(tmp_path,
                                                                                       monkeypatch):
    import fedprism
    from fedprism.experiment.provenance import ProvenanceMismatch

    body = ('"""A plugin model."""\nimport torch\n\ndef build(shape, k):\n    return torch.nn.Sequential('
            'torch.nn.Flatten(), torch.nn.Linear(64, k))\n')
    with _plugin_model(tmp_path, monkeypatch, "doc_plugin", body) as (cfg, db):
        res = fedprism.run(cfg, db=db)
        code = Store(str(db), readonly=True).provenance(res.run_id)["code"]["model"]
        _tamper(str(db), res.run_id, ("code", "model"), {k: v for k, v in code.items() if k != "text"})
        assert fedprism.run(cfg, db=db).run_id == res.run_id     # same file: reused, and the text recorded
        assert Store(str(db), readonly=True).provenance(res.run_id)["code"]["model"] == code
        (tmp_path / "doc_plugin.py").write_text(body.replace("A plugin model.", "A plugin model, reworded.")
                                               + "# a comment\n")
        again = fedprism.run(cfg, db=db)
        assert again.run_id == res.run_id and again.final == res.final
        (tmp_path / "doc_plugin.py").write_text(body.replace("(64, k)", "(64, k, bias=False)"))
        with pytest.raises(ProvenanceMismatch, match="model"):
            fedprism.run(cfg, db=db)


def test_mutate_script_says_whether_a_test_guards_a_line():
    """scripts/mutate.py: a mutation the selected test catches is KILLED (exit 0), one it cannot see
    SURVIVED (exit 1), one that does not apply exits 2; the working tree is never changed."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    soft = root / "src/fedprism/clustering/soft.py"
    before = soft.read_bytes()

    def mutate(old, new, *tests):
        done = subprocess.run([sys.executable, "scripts/mutate.py", "fedprism/clustering/soft.py", old, new,
                               *tests], cwd=root, capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr

    select = ("tests/test_clustering.py", "-k", "soft_assign_rows")
    argsort = 'np.argsort({}sim, axis=1, kind="stable")'
    rc, out = mutate(argsort.format("-"), argsort.format(""), *select)
    assert rc == 0 and out.startswith("KILLED") and "test_soft_assign_rows_and_sparsity" in out
    rc, out = mutate("    m = int(m)\n", "    m = int(m) + 0\n", *select)
    assert rc == 1 and out.startswith("SURVIVED")
    rc, out = mutate("no such text", "x", *select)
    assert rc == 2 and "occurs 0 times" in out
    assert soft.read_bytes() == before


def test_a_methods_base_classes_in_other_files_are_part_of_its_code(tmp_path, monkeypatch, capsys):
    """A method that inherits its behaviour from a class in another module (FedPer from `partial.py`,
    FedProx from `fedavg.py`) was fingerprinted by its own file only, so an edit of the base class reused
    runs it had changed. The base files are now a fingerprint of their own (`method_bases`): a comment
    there keeps the run, a code token is other code, and a run stored without it is still reused."""
    import importlib
    import sys

    import fedprism
    from fedprism.algorithms.base import REGISTRY
    from fedprism.experiment.provenance import ProvenanceMismatch, bases_fingerprint, code_now

    assert bases_fingerprint(REGISTRY["fedper"])["file"].endswith("fedprism/algorithms/partial.py")
    assert bases_fingerprint(REGISTRY["fedprox"])["file"].endswith("fedprism/algorithms/fedavg.py")
    assert bases_fingerprint(REGISTRY["fedavg"]) is None            # only the interface above it
    base_src = ("from fedprism.algorithms.fedavg import FedAvg\n\n\nclass Mine(FedAvg):\n"
                "    def aggregate(self, state, rnd, update):\n"
                "        return super().aggregate(state, rnd, update)\n")
    (tmp_path / "my_base.py").write_text(base_src)
    (tmp_path / "my_method.py").write_text(         # a helper base in its own file, and Python's abc.ABC
        "import abc\nfrom my_base import Mine\nfrom fedprism.algorithms.base import register\n\n\n"
        "class Helper(Mine, abc.ABC):\n    pass\n\n\n@register\nclass Child(Helper):\n    name = 'child'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("my_method")
        fp = bases_fingerprint(REGISTRY["child"])
        assert fp["file"].split(" + ") == [(tmp_path / "my_base.py").resolve().as_posix(),
                                           "fedprism/algorithms/fedavg.py"]
        cfg = fedprism.config(method="child", clients=4, rounds=1, local_epochs=1)
        db = tmp_path / "p.db"
        res = fedprism.run(cfg, db=db)
        prov = Store(str(db), readonly=True).provenance(res.run_id)
        assert prov["code"]["method_bases"] == fp and code_now(prov) == "the same as stored"
        (tmp_path / "my_base.py").write_text(base_src + "# a comment\n")
        assert fedprism.run(cfg, db=db).final == res.final                  # a comment: the same code
        (tmp_path / "my_base.py").write_text(base_src.replace("return super()", "out = super()") +
                                             "        return out\n")
        assert code_now(prov).startswith("differs (method_bases code (")
        with pytest.raises(ProvenanceMismatch, match="method_bases code .*my_base.py"):
            fedprism.run(cfg, db=db)
        before = {k: v for k, v in prov["code"].items() if k != "method_bases"}
        _tamper(str(db), res.run_id, ("code",), before)
        assert fedprism.run(cfg, db=db).final == res.final                  # recorded before: not compared
    finally:
        REGISTRY.pop("child", None)
        for m in ("my_method", "my_base"):
            sys.modules.pop(m, None)


def test_verify_compares_per_client_rows_and_records_too(tmp_path, capsys):
    """Beyond the round metrics: a stored client's accuracy or a stored record (Fed-PRISM's clusters) that
    today's code does not reproduce is named, round and client or record kind; the store is not written."""
    db = str(tmp_path / "v.db")
    res = _run(db, threads=1, method="fedprism", fedprism__k=2, fedprism__every=1)
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 0
    capsys.readouterr()
    con = sqlite3.connect(db)
    kinds = [k for (k,) in con.execute("SELECT DISTINCT kind FROM records WHERE run_id=? AND round=1",
                                       (res.run_id,))]
    assert kinds, "a Fed-PRISM round records its clustering"
    seq, data = con.execute("SELECT seq, data FROM records WHERE run_id=? AND round=1 AND kind=? "
                            "ORDER BY seq", (res.run_id, kinds[0])).fetchone()
    con.execute("UPDATE records SET data=? WHERE run_id=? AND round=1 AND seq=?",
                (json.dumps({"forged": True, "was": json.loads(data) if data else None}), res.run_id, seq))
    con.commit()
    before = _digest(Path(db))
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    assert f"DIFFERS: round 2, record '{kinds[0]}' differs" in capsys.readouterr().out
    assert _digest(Path(db)) == before
    first = con.execute("SELECT MIN(client) FROM client_metrics WHERE run_id=? AND round=1",
                        (res.run_id,)).fetchone()[0]
    con.execute("UPDATE client_metrics SET local_acc = local_acc + 0.5 "
                "WHERE run_id=? AND round=1 AND client=?", (res.run_id, first))
    con.commit()
    con.close()
    assert main(["verify", "--db", db, res.run_id, "--rounds", "2", "--quiet"]) == 1
    assert f"DIFFERS: round 2, client {first}, local_acc" in capsys.readouterr().out
