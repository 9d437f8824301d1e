"""The results store under contention and faults: one process per run, keyed rows, one-line errors."""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.experiment import checkpoint
from fedprism.experiment.config import resolve
from fedprism.experiment.runlock import RunBusyError, RunLock
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store, StoreError

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             engine="sequential", method="fedavg")
X = "0123456789abcdef"                         # a run id's form (16 hex digits) for runs made by hand
RUN = ["dataset=digits", "method=fedavg", "clients=6", "rounds=3", "fraction=0.5", "local_epochs=1",
       "engine=sequential", "batch_size=16", "lr=0.05"]


def cfg(**kw):
    return resolve({**SMALL, **kw})


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedprism: error: ") and "\n" not in err, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


# -- one process per run ----------------------------------------------------------------------------------
def test_a_run_held_by_another_process_is_refused_and_left_alone(tmp_path, capsys):
    c = cfg()
    s = Store(tmp_path / "l.db")
    Experiment(c, s).run(stop_after=1)
    assert s.run(c.run_id)["status"] == "interrupted"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid %d' % os.getpid()); print('ready', flush=True); "
        "time.sleep(60)"), str(s.ckpt_dir / f"{c.run_id}.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RunBusyError, match="running in another process"):
            Experiment(c, s).run()
        assert s.run(c.run_id)["status"] == "interrupted"          # not touched
        assert main(["run", "--db", str(tmp_path / "l.db"), *RUN, "--quiet"]) == 2
        one_line_error(capsys, c.run_id, "running in another process", f"pid {holder.pid}")
    finally:
        holder.send_signal(signal.SIGKILL)          # a holder that dies: its lock is taken over
        holder.wait()
    res = Experiment(c, s).run()
    assert res.status == "finished" and res.resumed_from == 0
    assert not s.ckpt_dir.exists()


def test_stale_running_row_without_a_lock_holder_becomes_interrupted(tmp_path):
    c = cfg()
    s = Store(tmp_path / "s.db")
    Experiment(c, s).run(stop_after=1)
    s.db.execute("UPDATE runs SET status='running' WHERE run_id=?", (c.run_id,))   # as after kill -9
    s.close()
    assert Store(tmp_path / "s.db").run(c.run_id)["status"] == "interrupted"


def test_lock_file_race_with_a_release_is_retried(tmp_path):
    a, b = RunLock(tmp_path / "x.lock"), RunLock(tmp_path / "x.lock")
    a.acquire()
    with pytest.raises(RunBusyError):
        b.acquire()
    a.release()
    assert not (tmp_path / "x.lock").exists()
    b.acquire()
    assert b.held and (tmp_path / "x.lock").read_text().startswith(f"pid {os.getpid()}")
    b.release()


def test_processes_creating_one_store_at_the_same_instant_all_open_it(tmp_path):
    # Two connections that both read a new file and then both ask to switch it to WAL deadlock;
    # SQLite answers one of them SQLITE_BUSY at once, without its busy handler. Four processes open
    # twenty fresh stores, each at an agreed instant: every open must succeed.
    n, start = 20, time.time() + 4.0
    code = ("import sys, time\nfrom fedprism.experiment.store import Store\n"
            "d, t0 = sys.argv[1], float(sys.argv[2])\n"
            "for i in range(int(sys.argv[3])):\n"
            "    while time.time() < t0 + 0.25 * i: pass\n"
            "    Store(f'{d}/s{i}.db', timeout=10).close()\n")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(start), str(n)], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errs = [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
    assert all(rc == 0 for rc, _ in errs), [e.strip().splitlines()[-1] for rc, e in errs if rc]


def test_two_processes_start_the_same_run_at_once(tmp_path):
    db = tmp_path / "race.db"
    args = ["run", "--db", str(db), "dataset=digits", "method=fedprism", "clients=10", "rounds=30",
            "fraction=0.5", "local_epochs=1", "engine=sequential", "model=mlp", "fedprism.k=2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    code = "import sys; from fedprism.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(o[0] for o in outs)
    assert codes == [0, 2], outs
    loser = next(o for o in outs if o[0] == 2)
    assert loser[2].strip().count("\n") == 0 and "running in another process" in loser[2], outs
    s = Store(db)
    (run,) = s.runs()
    assert run["status"] == "finished" and run["rounds_done"] == 30
    rid = run["run_id"]
    n = lambda q: s.db.execute(q, (rid,)).fetchone()[0]  # noqa: E731
    assert n("SELECT COUNT(*) FROM client_metrics WHERE run_id=?") == 300          # 10 clients x 30 rounds
    assert n("SELECT COUNT(*) FROM rounds WHERE run_id=?") == 30
    assert n("SELECT COUNT(*) FROM records WHERE run_id=?") == \
        n("SELECT COUNT(*) FROM (SELECT DISTINCT round, kind, client, data FROM records WHERE run_id=?)")
    assert not s.ckpt_dir.exists()


# -- keys and migration -------------------------------------------------------------------------------
def test_writing_a_round_twice_replaces_it(tmp_path):
    s = Store(tmp_path / "k.db")
    s.start_run(X, {"method": "fedavg", "dataset": "digits", "seed": 0})
    for _ in range(2):
        s.write_round(X, 0, {"a": 1}, [(0, 0.5, 1.0, 0.4, 10, 0.3)], [("r", 1, {"v": 1}), ("r", 2, {"v": 2})], 0.1)
    assert [(r["client"], r["data"]) for r in s.records(X)] == [(1, {"v": 1}), (2, {"v": 2})]
    with pytest.raises(sqlite3.IntegrityError):
        s.db.execute("INSERT INTO records (run_id, round, kind, client, data, seq) VALUES ('0123456789abcdef', 0, 'r', 1, '{}', 0)")


def test_truncating_drops_every_later_row_and_the_round_count(tmp_path):
    # what a resume from round 2's checkpoint does to rounds 3-4 written after it: gone from every table, and
    # the run counts 3 rounds (0-2) until it writes round 3 again
    s = Store(tmp_path / "k.db")
    s.start_run(X, {"method": "fedavg", "dataset": "digits", "seed": 0})
    for rnd in range(5):
        s.write_round(X, rnd, {"a": rnd}, [(0, 0.5, 1.0, 0.4, 10, 0.3)], [("r", 1, {"v": rnd})], 0.1)
    s.truncate(X, 2)
    assert [h["round"] for h in s.round_metrics(X)] == [0, 1, 2]
    client_rounds = s.db.execute("SELECT DISTINCT round FROM client_metrics ORDER BY round").fetchall()
    assert [r[0] for r in client_rounds] == [0, 1, 2]
    assert [r["round"] for r in s.records(X)] == [0, 1, 2]
    assert s.run(X)["rounds_done"] == 3


def test_truncating_or_forgetting_an_unknown_run_is_an_error_and_changes_nothing(tmp_path):
    """A mistyped run id (the library API: `Store.truncate`, `Store.forget`) says which id and which store,
    instead of silently doing nothing; the runs the store holds keep every row."""
    from fedprism.errors import FedPrismError
    s = Store(tmp_path / "k.db")
    s.start_run(X, {"method": "fedavg", "dataset": "digits", "seed": 0})
    for rnd in range(3):
        s.write_round(X, rnd, {"a": rnd}, [(0, 0.5, 1.0, 0.4, 10, 0.3)], [("r", 1, {"v": rnd})], 0.1)
    for call in (lambda: s.truncate("y", 0), lambda: s.forget("y"), lambda: s.forget("")):
        with pytest.raises(FedPrismError, match=r"no run '.*' in .*k\.db"):
            call()
    assert [h["round"] for h in s.round_metrics(X)] == [0, 1, 2] and s.run(X)["rounds_done"] == 3
    s.forget(X)
    assert s.run(X) is None
    assert s.db.execute("SELECT COUNT(*) FROM rounds WHERE run_id='0123456789abcdef'").fetchone()[0] == 0


OLD_SCHEMA = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, name TEXT, method TEXT, dataset TEXT, seed INTEGER,
    config TEXT NOT NULL, code_version TEXT, status TEXT NOT NULL, rounds_done INTEGER NOT NULL DEFAULT 0,
    final TEXT, created REAL, updated REAL, sweep TEXT);
CREATE TABLE records (run_id TEXT NOT NULL, round INTEGER NOT NULL, kind TEXT NOT NULL, client INTEGER, data TEXT);
CREATE INDEX records_run ON records (run_id, kind, round);
"""


def test_an_old_store_is_migrated_on_write_open(tmp_path):
    p = tmp_path / "old.db"
    db = sqlite3.connect(p)
    db.executescript(OLD_SCHEMA)
    db.executemany("INSERT INTO records VALUES (?,?,?,?,?)",
                   [("r", 0, "a", 1, '{"i":0}'), ("r", 1, "a", None, '{"i":1}'), ("r", 0, "b", 2, '{"i":2}'),
                    ("q", 0, "a", 1, '{"i":3}')])
    db.commit()
    db.close()
    s = Store(p)
    assert [r["data"]["i"] for r in s.records("r")] == [0, 2, 1]      # old order within each round kept
    assert [r["data"]["i"] for r in s.records("q")] == [3]
    cols = [r[1] for r in s.db.execute("PRAGMA table_info(records)")]
    assert "seq" in cols
    assert s.db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name='records_run'").fetchone()[0] == 1
    s.close()
    Store(p).close()                                                     # idempotent


# -- faults: one line, exit 2, never left 'running' --------------------------------------------------
def test_a_corrupt_store_is_a_one_line_error(tmp_path, capsys):
    db = tmp_path / "bad.db"
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a fedprism results store"):
        Store(db)
    assert main(["run", "--db", str(db), *RUN, "--quiet"]) == 2
    one_line_error(capsys, str(db), "corrupt")


def _readonly_connect(real):
    def connect(path, *a, **kw):                     # the kernel refusing writes (tests run as root)
        return real(f"file:{path}?mode=ro", *a, uri=True, **kw)
    return connect


def test_a_read_only_store_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    db = tmp_path / "ro.db"
    Store(db).close()
    monkeypatch.setattr("fedprism.experiment.store.sqlite3.connect", _readonly_connect(sqlite3.connect))
    assert main(["run", "--db", str(db), *RUN, "--quiet"]) == 2
    one_line_error(capsys, str(db), "read-only")


def test_a_store_locked_by_another_writer_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    db = tmp_path / "busy.db"
    Store(db).close()
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    monkeypatch.setenv("FEDPRISM_DB_TIMEOUT", "0.2")
    t0 = time.time()
    assert main(["run", "--db", str(db), *RUN, "--quiet"]) == 2
    assert time.time() - t0 < 5
    one_line_error(capsys, str(db), "locked by another writer")
    other.execute("ROLLBACK")
    assert Store(db).runs() == []


class _FullDisk:
    """A connection whose round inserts fail as SQLite does on a full disk."""

    def __init__(self, db):
        object.__setattr__(self, "_db", db)

    def __setattr__(self, name, value):
        setattr(self._db, name, value)

    def execute(self, sql, *a):
        if sql.startswith("INSERT OR REPLACE INTO rounds"):
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *a)

    def __getattr__(self, name):
        return getattr(self._db, name)


def test_a_full_disk_under_sqlite_is_a_one_line_error_and_the_run_is_failed(tmp_path, capsys, monkeypatch):
    db = tmp_path / "full.db"
    real = sqlite3.connect
    monkeypatch.setattr("fedprism.experiment.store.sqlite3.connect", lambda *a, **kw: _FullDisk(real(*a, **kw)))
    assert main(["run", "--db", str(db), *RUN, "--quiet"]) == 2
    one_line_error(capsys, str(db), "database or disk is full")
    monkeypatch.undo()
    s = Store(db)
    (run,) = s.runs()
    assert run["status"] == "failed"
    assert not (s.ckpt_dir / f"{run['run_id']}.lock").exists()


def test_a_full_disk_for_the_checkpoint_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    db = tmp_path / "fullck.db"

    def enospc(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save", enospc)
    assert main(["run", "--db", str(db), *RUN, "--quiet"]) == 2
    one_line_error(capsys, "No space left on device", "checkpoint")
    monkeypatch.undo()
    (run,) = Store(db).runs()
    assert run["status"] == "failed"


def test_a_sweep_skips_runs_held_by_another_process(tmp_path, capsys):
    from fedprism.experiment.sweep import load_sweep, run_sweep
    f = tmp_path / "s.toml"
    f.write_text('name = "par"\n[base]\ndataset = "digits"\nclients = 6\nrounds = 2\nlocal_epochs = 1\n'
                 'engine = "sequential"\n[[runs]]\nlabel = "A"\nmethod = "fedavg"\n[[runs]]\nlabel = "B"\n'
                 'method = "local"\n')
    _, (a, b) = load_sweep(f)
    db = tmp_path / "par.db"
    Store(db).close()
    held = RunLock(Path(str(db) + ".ckpt") / f"{a.run_id}.lock")
    held.path.parent.mkdir(exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('ready', flush=True); time.sleep(60)"), str(held.path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert run_sweep(str(f), str(db), progress=False) == 0
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert "skipped, run" in err and "1 running in other processes" in err
    s = Store(db)
    assert s.run(a.run_id) is None and s.run(b.run_id)["status"] == "finished"


class _SignalAfterBegin(_FullDisk):
    """A connection on which Ctrl-C lands the moment `BEGIN IMMEDIATE` returns, once two rounds are written:
    a SIGINT that arrives while SQLite waits for another writer's lock (two sweep workers) is raised there,
    before the caller's `try`."""

    rounds = 0

    def execute(self, sql, *a):
        out = self._db.execute(sql, *a)
        _SignalAfterBegin.rounds += sql.startswith("INSERT OR REPLACE INTO rounds")
        if sql == "BEGIN IMMEDIATE" and _SignalAfterBegin.rounds == 2:
            _SignalAfterBegin.rounds += 1                                # once
            raise KeyboardInterrupt
        return out


def test_ctrl_c_as_a_write_begins_leaves_the_run_interrupted_and_resumable(tmp_path, monkeypatch):
    db = tmp_path / "sig.db"
    _SignalAfterBegin.rounds = 0                          # counted over every connection the run opens
    real = sqlite3.connect
    monkeypatch.setattr("fedprism.experiment.store.sqlite3.connect",
                        lambda *a, **kw: _SignalAfterBegin(real(*a, **kw)))
    with pytest.raises(KeyboardInterrupt):
        Experiment(cfg(), Store(db)).run()
    monkeypatch.undo()
    raw = sqlite3.connect(f"file:{db}?mode=ro", uri=True)      # what the run wrote, before any recovery
    assert raw.execute("SELECT status, rounds_done FROM runs").fetchall() == [("interrupted", 2)]
    raw.close()
    res = Experiment(cfg(), Store(db)).run()
    assert (res.status, res.resumed_from) == ("finished", 1)


def test_a_damaged_kept_final_state_is_dropped_and_a_read_only_store_leaves_it(tmp_path):
    """A kept final state that fails its checksum is no source for re-scoring: a writable store deletes it,
    a read-only one (`scripts/routing_study.py`, `scripts/fedsoft_scoring.py`) only declines it."""
    db = tmp_path / "kf.db"
    Experiment(cfg(), Store(db)).run()
    train_id = cfg().train_id
    kept = Store(db).final_dir / f"{train_id}{checkpoint.SUFFIX}"
    assert Store(db, readonly=True).load_final(train_id) is not None
    damaged = kept.read_bytes()[:-10]
    kept.write_bytes(damaged)
    assert Store(db, readonly=True).load_final(train_id) is None
    assert kept.read_bytes() == damaged                             # a read-only store writes nothing
    assert Store(db).load_final(train_id) is None and not kept.exists()


def test_writing_to_a_run_the_store_does_not_hold_is_an_error_that_keeps_nothing(tmp_path):
    """A round or an end written for a run whose row is gone (never started, or dropped by another
    process while it ran) used to be stored as rows of no run, silently; now it is refused, rolled back."""
    from fedprism.experiment.store import StoreError

    s = Store(tmp_path / "g.db")
    with pytest.raises(StoreError, match="run gone is not in it .*round 1 not written"):
        s.write_round("gone", 0, {"a": 1}, [(0, 0.5, 1.0, 0.4, 10, 0.3)], [("r", 1, {"v": 1})], 0.1)
    with pytest.raises(StoreError, match=r"run gone is not in it .*its end \(finished\) not written"):
        s.finish("gone", {"local_acc": 0.5})
    for table in ("rounds", "client_metrics", "records", "runs"):
        assert s.db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 0, table
