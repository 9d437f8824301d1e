"""Crafted results stores and files planted beside them: nothing outside the store's own folders is
touched, every command ends in a result or one line, and stores of every schema version are read and
migrated (`fedprism.experiment.store`, `runlock`, `safefs`, `merge`, `clientstore`, `report.export`)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.experiment.config import resolve
from fedprism.experiment.merge import merge
from fedprism.experiment.runlock import RunLock, holder_gone
from fedprism.experiment.runner import Experiment
from fedprism.experiment.safefs import UnsafePath
from fedprism.experiment.store import SCHEMA_VERSION, Store, StoreError, schema_version

SMALL = dict(dataset="digits", clients=4, rounds=2, fraction=1.0, local_epochs=1, batch_size=32, lr=0.05,
             engine="sequential", method="fedavg", model="mlp", keep_final=False)
RUN = [f"{k}={v}" for k, v in SMALL.items()]
HEX = "0123456789abcdef"


def cfg(**kw):
    return resolve({**SMALL, **kw})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One store with a finished run (and its sweep membership), made once and copied by each test."""
    p = tmp_path_factory.mktemp("base") / "base.db"
    s = Store(p)
    Experiment(cfg(name="FedAvg"), s, progress=False, sweep="sw").run()
    s.close()
    return p


def copy_store(base: Path, to: Path) -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(base, to)
    return to


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict:
    """Every entry under `root` (not following links): its kind, mode, and content or link target;
    entries under `skip` (the store's own files and folders) left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if any(p == s or s in p.parents or p.name.startswith(s.name) and p.parent == s.parent for s in skip):
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                what = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                what = ("other", stat.S_IFMT(st.st_mode))
            out[str(p.relative_to(root))] = (*what, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return out


def one_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedprism: error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


# -- run ids that are paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_a_running_row_whose_id_is_a_path_opens_truncates_and_deletes_nothing(tmp_path, base, capsys, kind):
    """Opening a store for writing recovers stale `running` rows by taking each one's lock: the lock path
    was built from the stored id, so an id `/abs/victim` or `../../victim` opened, truncated, rewrote and
    deleted `victim.lock` anywhere. Ids that are no run id now name no file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.lock"
    victim.write_text("precious")
    db = copy_store(base, tmp_path / "store" / "s.db")
    rid = str(outside / "victim") if kind == "absolute" else "../../outside/victim"
    assert (db.parent / "s.db.ckpt" / f"{rid}.lock").resolve() == victim.resolve()   # where it pointed
    c = raw(db)
    c.execute("INSERT INTO runs (run_id, config, status, rounds_done) VALUES (?, '{}', 'running', 0)", (rid,))
    c.close()
    before = snapshot(tmp_path, skip=(db.parent,))
    Store(db).close()                                                           # recovers stale rows
    assert main(["runs", "--db", str(db)]) == 0
    assert main(["run", "--db", str(db), *RUN, "rounds=1", "--quiet"]) == 0
    assert main(["merge", str(copy_store(base, tmp_path / "part.db")), "--db", str(db)]) == 0
    assert victim.read_text() == "precious"
    assert snapshot(tmp_path, skip=(db.parent, tmp_path / "part.db")) == before
    assert raw(db).execute("SELECT status FROM runs WHERE run_id=?", (rid,)).fetchone() == ("running",)  # left
    with pytest.raises(StoreError, match="is not a run id"):
        Store(db).lock(rid)
    capsys.readouterr()


# -- files planted beside a store ---------------------------------------------------------------------------
def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_never_followed(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep me")
    lock = tmp_path / "s.db.ckpt" / f"{HEX}.lock"
    lock.parent.mkdir()
    lock.symlink_to(target)
    with pytest.raises(UnsafePath, match="symbolic link"):
        RunLock(lock).acquire()
    assert target.read_text() == "keep me" and lock.is_symlink()
    lock.unlink()
    os.mkfifo(lock)
    done = []
    t = threading.Thread(target=lambda: done.append(holder_gone(lock)), daemon=True)   # a FIFO hung `runs`
    t.start()
    t.join(10)
    assert done == [False]
    with pytest.raises(UnsafePath, match="not a regular file"):
        RunLock(lock).acquire()


def test_a_fifo_lock_does_not_hang_fedprism_runs(tmp_path, base, capsys):
    db = copy_store(base, tmp_path / "s.db")
    rid = raw(db).execute("SELECT run_id FROM runs").fetchone()[0]
    raw(db).execute("UPDATE runs SET status='running'")
    (tmp_path / "s.db.ckpt").mkdir()
    os.mkfifo(tmp_path / "s.db.ckpt" / f"{rid}.lock")
    rc = []
    t = threading.Thread(target=lambda: rc.append(main(["runs", "--db", str(db)])), daemon=True)
    t.start()
    t.join(20)
    assert rc == [0], "fedprism runs hung on a FIFO lock file"
    assert "running" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_sqlite_files_beside_a_store_that_are_links_are_refused(tmp_path, base, capsys, suffix):
    db = copy_store(base, tmp_path / "s.db")
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"precious")
    Path(f"{db}{suffix}").symlink_to(decoy)
    before = db.read_bytes()
    assert main(["runs", "--db", str(db)]) == 2
    one_line(capsys, f"s.db{suffix} is a symbolic link")
    assert main(["run", "--db", str(db), *RUN, "seed=3", "--quiet"]) == 2
    one_line(capsys, f"s.db{suffix} is a symbolic link")
    assert decoy.read_bytes() == b"precious" and db.read_bytes() == before


def test_a_lock_that_fails_after_its_flock_keeps_no_lock_in_the_process(tmp_path, monkeypatch):
    lock = tmp_path / "c" / f"{HEX}.lock"

    def full(fd, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("fedprism.experiment.runlock.os.ftruncate", full)
    with pytest.raises(OSError, match="No space"):
        RunLock(lock).acquire()
    monkeypatch.undo()
    fd = os.open(lock, os.O_RDWR)                  # another open file: its flock conflicts with a leaked one
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_folders_beside_a_store_are_owner_only_under_umask_0(tmp_path):
    old = os.umask(0)
    try:
        s = Store(tmp_path / "s.db")
        Experiment(cfg(rounds=2, keep_final=True), s, progress=False).run(stop_after=1)
        ckpt_mode = stat.S_IMODE(os.lstat(s.ckpt_dir).st_mode)
        Experiment(cfg(rounds=2, keep_final=True), s, progress=False).run()
        final_mode = stat.S_IMODE(os.lstat(s.final_dir).st_mode)
        s.close()
    finally:
        os.umask(old)
    assert ckpt_mode == 0o700 and final_mode == 0o700
    from fedprism.experiment.safefs import private_dir

    old = os.umask(0o277)                           # a umask that takes the owner's own write bit: 0700 still
    try:
        odd = private_dir(tmp_path / "odd.db.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(odd.stat().st_mode) == 0o700
    wide = tmp_path / "w.db.ckpt"                   # a folder an older version made with umask 000: narrowed
    wide.mkdir()
    os.chmod(wide, 0o777)
    s = Store(tmp_path / "w.db")
    s.lock(HEX)
    assert stat.S_IMODE(os.lstat(wide).st_mode) == 0o755
    s.close()


def test_a_ckpt_folder_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "s.db.ckpt").symlink_to(elsewhere)
    s = Store(tmp_path / "s.db")
    with pytest.raises(StoreError, match="symbolic link"):
        s.lock(HEX)
    assert list(elsewhere.iterdir()) == []
    s.close()


def test_mmap_row_files_never_go_through_a_planted_link(tmp_path):
    """`state.storage=mmap` row folder `<db>.ckpt/<run_id>.rows` planted as a link to another folder: the
    run's row files used to be written into the link's target."""
    c = cfg(method="local", **{"state.storage": "mmap"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.rows").write_bytes(b"precious")
    s = Store(tmp_path / "s.db")
    s.ckpt_dir.mkdir(mode=0o700)
    s.rows_dir(c.run_id).symlink_to(elsewhere)
    res = Experiment(c, s, progress=False).run()
    s.close()
    assert res.status == "finished"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["w.rows"] and (elsewhere / "w.rows").read_bytes() == b"precious"


def test_row_files_to_resume_from_that_are_links_are_refused(tmp_path):
    from fedprism.experiment.clientstore import MmapStore, StoreMismatch
    from fedprism.protocol import ClientState

    import torch

    from types import SimpleNamespace

    class Ctx:
        num_clients, num_classes, feature_dim, spec = 3, 10, 4, SimpleNamespace(size=5)
    decls = {"w": ClientState(shape=(2,), init="zeros")}
    st = MmapStore(decls, Ctx(), tmp_path / "rows")
    st.write(torch.arange(1).numpy(), {"w": torch.ones(1, 2)})
    snap = st.snapshot()
    st.commit()
    target = tmp_path / "target"
    target.write_bytes(bytes(24))
    (tmp_path / "rows" / "w.rows").unlink()
    (tmp_path / "rows" / "w.rows").symlink_to(target)
    fresh = MmapStore(decls, Ctx(), tmp_path / "rows")
    with pytest.raises(StoreMismatch, match="not a regular file"):
        fresh.restore(snap)
    assert target.read_bytes() == bytes(24)


def test_orphan_checkpoint_temporaries_go_when_the_run_is_locked(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    s = Store(tmp_path / "s.db")
    s.ckpt_dir.mkdir(mode=0o700)
    mine = [s.ckpt_dir / f"{HEX}.ckpt.a1b2.tmp", s.ckpt_dir / f"{HEX}.ckpt.c3d4.tmp"]
    mine[0].write_bytes(b"half a checkpoint")          # what kill -9 during a save leaves
    mine[1].symlink_to(target)
    other = s.ckpt_dir / "fedcba9876543210.ckpt.e5f6.tmp"   # another run's: it may be writing it now
    other.write_bytes(b"x")
    s.lock(HEX)
    assert not any(os.path.lexists(p) for p in mine) and other.exists() and target.read_text() == "keep"
    s.close()


def test_a_checkpoint_that_is_a_link_is_discarded_unread(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"not a checkpoint, and not yours")
    c = cfg()
    s = Store(tmp_path / "s.db")
    Experiment(c, s, progress=False).run(stop_after=1)
    s.checkpoint_path(c.run_id).unlink()
    s.checkpoint_path(c.run_id).symlink_to(target)
    res = Experiment(c, s, progress=False).run()
    assert res.status == "finished"
    why = [r["data"] for r in s.records(c.run_id, "checkpoint_discarded")]
    assert why and "not a regular file" in why[0]["reason"]
    assert target.read_bytes() == b"not a checkpoint, and not yours"
    s.close()


def test_a_damaged_row_of_the_run_asked_for_is_one_line_and_never_reused(tmp_path, base, capsys):
    db = copy_store(base, tmp_path / "s.db")
    raw(db).execute("UPDATE runs SET final='{\"local_acc\": 0.9'")                 # torn: not JSON
    assert main(["run", "--db", str(db), *RUN, "name=FedAvg", "--quiet"]) == 2
    one_line(capsys, cfg().run_id, "is stored damaged", f"`fedprism merge {db} --db NEW.db` copies")
    assert main(["runs", "--db", str(db)]) == 0
    err = capsys.readouterr().err
    assert "1 stored row(s) are not well formed" in err


# -- merge of part stores -------------------------------------------------------------------------------
def test_merge_refuses_a_run_whose_id_is_not_its_configs_hash(tmp_path, base, capsys):
    part = copy_store(base, tmp_path / "part.db")
    real = cfg(rounds=3)                            # a configuration nobody ran yet
    c = raw(part)
    row = c.execute("SELECT * FROM runs").fetchone()
    cols = [d[1] for d in c.execute("PRAGMA table_info(runs)")]
    fake = dict(zip(cols, row), run_id=real.run_id, final=json.dumps({"local_acc": 0.99, "global_acc": 0.99}))
    c.execute(f"INSERT INTO runs ({', '.join(fake)}) VALUES ({', '.join('?' * len(fake))})", list(fake.values()))
    c.execute("INSERT INTO runs (run_id, config, status, rounds_done) VALUES (NULL, '{}', 'finished', 0)")
    c.close()
    home = Store(tmp_path / "home.db")
    rep = merge(home, part)
    assert len(rep.copied) == 1 and real.run_id not in rep.copied
    assert dict(rep.refused)[real.run_id].startswith("its id is not the hash of its configuration")
    assert any("no run id" in r for r, _ in rep.refused)                 # counted as refused, not as merged
    assert home.run(real.run_id) is None
    home.close()
    assert main(["merge", str(part), "--db", str(tmp_path / "home2.db")]) == 0
    out = capsys.readouterr().out
    assert "merged 1 finished run(s)" in out and "2 refused" in out and real.run_id in out


def test_merge_refuses_rows_that_are_not_well_formed_and_reads_stay_whole(tmp_path, base, capsys):
    part = copy_store(base, tmp_path / "part.db")
    rid = raw(part).execute("SELECT run_id FROM runs").fetchone()[0]
    raw(part).execute("UPDATE rounds SET metrics='{\"global_acc\": ' WHERE round=0")      # torn JSON
    home = tmp_path / "home.db"
    s = Store(home)
    rep = merge(s, part)
    s.close()
    assert rep.refused == [(rid, "1 row(s) of rounds that are not well formed (JSON that is not JSON, values of "
                                 "the wrong type)")] and not rep.copied
    for argv in (["runs"], ["show", rid[:6]], ["report", "--out", str(tmp_path / "r"), "--no-plots"],
                 ["export", "--out", str(tmp_path / "e")]):
        assert main([*argv, "--db", str(part)]) in (0, 2), argv                      # no traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_merge_copies_plain_final_state_files_only(tmp_path, capsys):
    part = tmp_path / "part.db"
    s = Store(part)
    c = cfg(keep_final=True)
    Experiment(c, s, progress=False).run()
    s.close()
    final = tmp_path / "part.db.final" / f"{c.train_id}.ckpt"
    assert final.is_file()
    secret = tmp_path / "secret"
    secret.write_text("not yours")
    final.unlink()
    final.symlink_to(secret)
    rows = tmp_path / "part.db.final" / f"{c.train_id}.rows"
    rows.mkdir()
    (rows / "w.rows").symlink_to(secret)
    home = Store(tmp_path / "home.db")
    rep = merge(home, part)
    home.close()
    assert rep.copied == [c.run_id] and rep.finals == 0
    assert not os.path.lexists(tmp_path / "home.db.final" / final.name)
    assert not os.path.lexists(tmp_path / "home.db.final" / rows.name)
    final.unlink()                                   # a plain file is copied, into an owner-only folder
    final.write_bytes(b"state")
    rows.joinpath("w.rows").unlink()
    rows.joinpath("w.rows").write_bytes(b"rows")
    home = Store(tmp_path / "home3.db")
    assert merge(home, part).finals == 2
    home.close()
    got = tmp_path / "home3.db.final"
    assert (got / final.name).read_bytes() == b"state" and (got / rows.name / "w.rows").read_bytes() == b"rows"
    assert stat.S_IMODE(got.stat().st_mode) == 0o700


# -- schema versions ----------------------------------------------------------------------------------------
#: the schemas of earlier versions, as `git log -p -- src/fedprism/experiment/store.py` shows them
V1 = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, name TEXT, method TEXT, dataset TEXT, seed INTEGER,
    config TEXT NOT NULL, code_version TEXT, status TEXT NOT NULL,
    rounds_done INTEGER NOT NULL DEFAULT 0, final TEXT, created REAL, updated REAL, sweep TEXT
);
CREATE TABLE rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, metrics TEXT NOT NULL, wall_s REAL,
    PRIMARY KEY (run_id, round)
);
CREATE TABLE client_metrics (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, client INTEGER NOT NULL,
    local_acc REAL, local_loss REAL, global_acc REAL, n_test INTEGER, local_f1 REAL,
    PRIMARY KEY (run_id, round, client)
);
CREATE TABLE records (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, kind TEXT NOT NULL, client INTEGER, data TEXT
);
CREATE INDEX records_run ON records (run_id, kind, round);
"""
SWEEP_RUNS = "CREATE TABLE sweep_runs (sweep TEXT NOT NULL, run_id TEXT NOT NULL, label TEXT, PRIMARY KEY (sweep, run_id));"
SCHEMAS = {1: V1, 2: V1 + SWEEP_RUNS, 3: V1 + SWEEP_RUNS + "ALTER TABLE runs ADD COLUMN provenance TEXT;"}


def old_store(current: Path, to: Path, version: int) -> Path:
    """The rows of store `current` in a file of schema `version` (1-3), as that version wrote them."""
    db = sqlite3.connect(to)
    db.executescript(SCHEMAS[version])
    db.execute("ATTACH ? AS cur", (str(current),))
    for t in ("runs", "rounds", "client_metrics", "records", "sweep_runs"):
        cols = [r[1] for r in db.execute(f"PRAGMA main.table_info({t})")]
        if cols:
            db.execute(f"INSERT INTO main.{t} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM cur.{t}"
                       + (" ORDER BY round, seq" if t == "records" else ""))
    db.commit()
    db.execute("DETACH cur")
    db.close()
    return to


def rows_of(db: Path) -> dict:
    s = Store(db, readonly=True)
    try:
        return {t: sorted((tuple(r) for r in s.db.execute(f"SELECT * FROM {t}")), key=repr)
                for t in ("rounds", "client_metrics")} | {
            "runs": sorted((r["run_id"], r["config"], r["final"], r["status"]) for r in s.runs()),
            "records": [(r["round"], r["kind"], r["client"], r["data"]) for r in s.records(s.runs()[0]["run_id"])]}
    finally:
        s.close()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_every_earlier_schema_is_read_merged_and_migrated(tmp_path, base, capsys, version):
    old = old_store(base, tmp_path / f"v{version}.db", version)
    assert schema_version(raw(old)) == version
    before = old.read_bytes()
    rid = raw(old).execute("SELECT run_id FROM runs").fetchone()[0]
    for argv in (["runs"], ["runs", "--json"], ["show", rid[:8]], ["export", "--out", str(tmp_path / "e")],
                 ["report", "--out", str(tmp_path / "r"), "--no-plots"]):
        assert main([*argv, "--db", str(old)]) == 0, (argv, capsys.readouterr().err)
    if version >= 2:
        assert main(["runs", "--sweep", "sw", "--db", str(old)]) == 0
    assert old.read_bytes() == before                              # read-only: not migrated, not touched
    want = rows_of(base)
    want_records = want.pop("records")
    got = rows_of(old)
    assert got.pop("records") == want_records                      # numbered in their stored order
    if version < 3:                                                # no provenance column: NULL there
        assert got["runs"] == want["runs"]
    assert got == want
    home = tmp_path / "home.db"                                    # merged whole into a current store
    s = Store(home)
    rep = merge(s, old)
    s.close()
    assert rep.copied == [rid] and rows_of(home) | {"records": want_records} == rows_of(base) | {
        "records": want_records}
    s = Store(old)                                                 # opened for writing: migrated
    assert schema_version(s.db) == SCHEMA_VERSION == 4
    assert s.db.execute("PRAGMA user_version").fetchone()[0] == 4             # written into the file
    assert "seq" in [r[1] for r in s.db.execute("PRAGMA table_info(records)")]
    assert [r["data"] for r in s.records(rid)] == [json.loads(d) for *_, d in want_records]
    s.close()
    assert rows_of(old) == rows_of(base)


def test_a_store_of_a_newer_schema_is_refused_before_anything_is_written(tmp_path, base, capsys):
    for how in ("version", "column"):
        db = copy_store(base, tmp_path / how / "n.db")
        c = raw(db)
        if how == "version":
            c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        else:
            c.execute("ALTER TABLE rounds ADD COLUMN shard INTEGER NOT NULL DEFAULT 0")   # fillable: fine
            c.execute("CREATE TABLE r2 AS SELECT * FROM rounds")
            c.execute("DROP TABLE rounds")
            c.execute("CREATE TABLE rounds (run_id TEXT NOT NULL, round INTEGER NOT NULL, metrics TEXT NOT NULL,"
                      " wall_s REAL, shard INTEGER NOT NULL, PRIMARY KEY (run_id, round))")
            c.execute("INSERT INTO rounds SELECT * FROM r2")
            c.execute("DROP TABLE r2")
        c.close()
        before = db.read_bytes()
        assert main(["run", "--db", str(db), *RUN, "seed=5", "--quiet"]) == 2
        one_line(capsys, "nothing was written", "newer fedprism")
        assert db.read_bytes() == before and not (db.parent / "n.db.ckpt").exists()
        assert main(["runs", "--db", str(db)]) == 0                 # still readable
        capsys.readouterr()


def test_a_store_in_a_folder_this_user_cannot_write_is_read(tmp_path, base, capsys):
    """A store in WAL mode needs its `-shm` file, which SQLite cannot create in a folder this user may not
    write: read-only commands said it 'is not a fedprism results store'. (Root writes any folder: there
    the folder is made immutable, which root cannot write either.)"""
    folder = tmp_path / "ro"
    db = copy_store(base, folder / "s.db")
    Store(db).close()                                              # WAL mode, log folded in
    c = raw(db)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c.close()
    assert sorted(p.name for p in folder.iterdir()) == ["s.db"]
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without immutable folders")
        undo = ["chattr", "-i", str(folder)]
    else:
        os.chmod(folder, 0o555)
        undo = ["chmod", "755", str(folder)]
    try:
        assert main(["runs", "--db", str(db), "--json"]) == 0, capsys.readouterr().err
        assert [d["label"] for d in json.loads(capsys.readouterr().out)] == ["FedAvg"]
        assert main(["export", "--db", str(db), "--out", str(tmp_path / "e")]) == 0
    finally:
        subprocess.run(undo, check=True)
    assert sorted(p.name for p in folder.iterdir()) == ["s.db"]
    wal = folder / "s.db-wal"                      # writes not folded in: readable only by writing, so said
    wal.write_bytes(b"x" * 100)
    subprocess.run(undo[:1] + ["+i" if undo[0] == "chattr" else "555", str(folder)], check=True)
    try:
        assert main(["runs", "--db", str(db)]) == 2
        one_line(capsys, "holds writes not yet folded into it")
    finally:
        subprocess.run(undo, check=True)


# -- export -------------------------------------------------------------------------------------------------
def test_export_streams_a_large_store(tmp_path, base):
    """The CSV export holds a few rows at a time, not the store: 40 000 round rows (about 9 MB of JSON)
    exported in well under a megabyte of Python memory (the rows as lists took tens of MB)."""
    db = copy_store(base, tmp_path / "big.db")
    rid = raw(db).execute("SELECT run_id FROM runs").fetchone()[0]
    c = raw(db)
    metrics = json.dumps({f"m{i}": 0.123456789 for i in range(12)})
    c.execute("BEGIN")
    c.executemany("INSERT INTO rounds VALUES (?,?,?,?)", ((rid, r, metrics, 0.5) for r in range(2, 40002)))
    c.execute("COMMIT")
    c.close()
    from fedprism.report.export import export

    tracemalloc.start()
    try:
        paths = export(str(db), str(tmp_path / "out"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    lines = (tmp_path / "out" / "rounds.csv").read_text().splitlines()
    assert len(lines) == 1 + 40002 and lines[0].startswith("run_id,round,wall_s,") and len(paths) == 5
    assert peak < 2_000_000, peak


# -- fuzzing ------------------------------------------------------------------------------------------------
IDS = [HEX, "fedcba9876543210", "", None, 7, "../../decoy/x", "/ABS/decoy/x", "A" * 16, "0123456789abcde\n",
       "é" * 16, "%_", "0123456789ABCDEF"]
JSONS = ['{}', '{"a": 1}', '[1, 2]', '{', '', 'null', '"s"', '{"local_acc": "high", "global_acc": [1]}',
         '[' * 3000 + ']' * 3000, '{"a": NaN}', None, 3, b"\x00{}", '{"rounds": 2, "seed": 0}',
         '{"method": "nope", "dataset": "digits", "partition": "iid", "seed": 0, "clients": 4, "rounds": 2}',
         '{"method": "fedavg", "dataset": "digits", "partition": "iid", "seed": 0, "clients": 4, "rounds": 2,'
         ' "local_acc": "x", "name": 5}']
STATUSES = ["running", "finished", "interrupted", "failed", "bogus", None, 1]


def craft(rng: random.Random, base: Path, db: Path, decoy: Path) -> object:
    """A store of random rows, ids, JSON, schema version and files beside it (links into `decoy`); returns
    the id of its first row."""
    version = rng.choice([1, 2, 3, 4, 4, 4, 4, 4, 5, 99])
    db.parent.mkdir(parents=True, exist_ok=True)
    if version in (1, 2, 3):
        old_store(base, db, version)
    else:
        copy_store(base, db)
    c = raw(db)
    if version > 4:
        c.execute(f"PRAGMA user_version = {version}")
    ids = [x.replace("/ABS", str(decoy.parent)) if isinstance(x, str) else x for x in IDS]
    ids += [cfg().run_id, cfg(rounds=1).run_id] * 2      # the stored run's and the one `run` below runs
    pick = lambda xs: rng.choice(xs)  # noqa: E731
    for _ in range(rng.randint(1, 6)):
        table = pick(["runs", "runs", "rounds", "client_metrics", "records", "sweep_runs"])
        try:
            if table == "runs":
                c.execute("INSERT OR REPLACE INTO runs (run_id, name, method, dataset, seed, config, status, "
                          "rounds_done, final, created, sweep) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                          (pick(ids), pick(["x", None, 3]), pick(["fedavg", "nope", None]), "digits",
                           pick([0, "0", None]), pick([j for j in JSONS if j is not None]), pick(STATUSES),
                           pick([0, 2, "two"]), pick(JSONS), pick([1.0, "t", None]), pick(["sw", None])))
            elif table == "rounds":
                c.execute("INSERT OR REPLACE INTO rounds VALUES (?,?,?,?)",
                          (pick(ids), pick([0, 1, "r"]), pick([j for j in JSONS if j is not None]), pick([0.1, "w"])))
            elif table == "client_metrics":
                c.execute("INSERT OR REPLACE INTO client_metrics VALUES (?,?,?,?,?,?,?,?)",
                          (pick(ids), pick([0, 1, "r"]), pick([0, 9]), pick([0.5, "a", None]), 0.1, 0.2,
                           pick([10, "n"]), None))
            elif table == "records":
                cols = [r[1] for r in c.execute("PRAGMA table_info(records)")]
                vals = (pick(ids), pick([0, "r"]), pick(["clusters", "alpha", 5]), pick([0, None, "c"]),
                        pick(JSONS)) + ((rng.randint(0, 5),) if "seq" in cols else ())
                c.execute(f"INSERT OR REPLACE INTO records VALUES ({', '.join('?' * len(vals))})", vals)
            elif version >= 2:
                c.execute("INSERT OR REPLACE INTO sweep_runs VALUES (?,?,?)", (pick(["sw", "x"]), pick(ids),
                                                                            pick(["L", None, 4])))
        except sqlite3.Error:
            pass
    rid = c.execute("SELECT run_id FROM runs LIMIT 1").fetchone()[0]
    c.close()
    ckpt = db.with_name(db.name + ".ckpt")
    final = db.with_name(db.name + ".final")
    if rng.random() < 0.15:
        Path(f"{db}{rng.choice(['-wal', '-shm', '-journal'])}").symlink_to(decoy / "x")
    if rng.random() < 0.5:
        ckpt.mkdir(exist_ok=True)
        for name in (f"{rid}.lock", f"{HEX}.lock", f"{rid}.ckpt", f"{rid}.rows"):
            if rng.random() < 0.5:
                (ckpt / name).symlink_to(decoy / "x.lock" if rng.random() < 0.5 else decoy)
    if rng.random() < 0.5:
        final.mkdir(exist_ok=True)
        tid = cfg().train_id
        for name in (f"{tid}.ckpt", f"{tid}.rows", f"{HEX}.ckpt"):
            if rng.random() < 0.5:
                (final / name).symlink_to(decoy / "x.lock" if rng.random() < 0.5 else decoy)
    return rid


@pytest.mark.parametrize("seed", range(30))
def test_crafted_stores_end_in_results_or_one_line_and_touch_nothing_outside(tmp_path, base, capsys, seed):
    rng = random.Random(seed)
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "x.lock").write_text("precious")
    (decoy / "x").write_text("precious")
    db = tmp_path / "store" / "s.db"
    first = craft(rng, base, db, decoy)
    target = tmp_path / "target" / "t.db"
    own = (db.parent, target.parent, tmp_path / "out")
    before = snapshot(tmp_path, skip=own)
    prefix = rng.choice([HEX[:6], first, "zz"])
    prefix = prefix if isinstance(prefix, str) and prefix and "\x00" not in prefix else "zz"
    commands = [["runs"], ["runs", "--json"], ["runs", "--sweep", "sw"], ["show", prefix],
                ["report", "--out", str(tmp_path / "out" / "r"), "--no-plots"],
                ["export", "--out", str(tmp_path / "out" / "e")],
                ["merge", str(db), "--db", str(target)]]
    if seed % 3 == 0:                                # the commands that train: a third of the cases
        from fedprism.experiment.sweep import dump_sweep

        sweep = tmp_path / "out" / "sw.toml"
        sweep.parent.mkdir(exist_ok=True)
        sweep.write_text(dump_sweep("sw", {**SMALL, "rounds": 1}, [dict(label="FedAvg", method="fedavg")],
                                    {"seed": [rng.choice([0, 1])]}))
        commands += [["run", *RUN, "rounds=1"], ["verify", cfg().run_id[:8], "--rounds", "1"], ["sweep", str(sweep)]]
    for argv in commands:
        argv = argv if "--db" in argv else [*argv, "--db", str(db)]
        if argv[0] in ("run", "verify", "sweep"):
            argv.append("--quiet")
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc in (0, 1, 2) and "Traceback" not in err, (argv, rc, err)
        if rc == 2:
            assert err.strip().splitlines()[-1].startswith("fedprism: error: "), (argv, err)
    assert (decoy / "x.lock").read_text() == "precious" and (decoy / "x").read_text() == "precious"
    assert snapshot(tmp_path, skip=own) == before
