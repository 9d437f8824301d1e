"""`fedprism store dump` / `load` (fedprism.experiment.archive): a results store as one file per run.

The round trip is row for row and bit for bit (every table, every rowid, every float), loading is
deterministic, a dump grows by what is added (one new run: one new run file and one changed membership
file, nothing else rewritten), the committed dump is the committed store's, and what cannot be trusted
or placed is refused with the file and the reason."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.experiment import archive
from fedprism.experiment.archive import ArchiveError, dump, load
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store, StoreError

ROOT = Path(__file__).resolve().parents[1]
TINY = {"dataset": "digits", "model": "mlp", "clients": 4, "rounds": 1, "fraction": 1.0, "local_epochs": 1,
        "method": "fedavg", "engine": "sequential"}
#: the last committed SQLite file of the results (git blob of results/fedprism.db before the dump replaced it)
LAST_DB_BLOB = "2a5d40c49438ccd2921dfb568682cbf58dece32e"


def _run(db: Path, sweep: str | None = None, label: str | None = None, **kw) -> str:
    store = Store(db)
    try:
        exp = Experiment(resolve({**TINY, **kw}), store, progress=False)
        exp.run()
        if sweep:
            store.add_to_sweep(sweep, exp.run_id, label)
        return exp.run_id
    finally:
        store.close()


def every_row(db: Path) -> dict:
    """Everything a store holds, as exact text: the schema, `user_version`, and every table's rows with
    their rowids, in rowid order and in SQLite's own scan order (`repr` tells 1 from 1.0, -0.0 from 0.0,
    and gives every bit of a float)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        out = {"user_version": con.execute("PRAGMA user_version").fetchone()[0],
               "schema": con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY rowid").fetchall()}
        for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall():
            out[t] = repr(con.execute(f'SELECT rowid, * FROM "{t}" ORDER BY rowid').fetchall())
            out[t + " (scan order)"] = repr(con.execute(f'SELECT rowid, * FROM "{t}"').fetchall())
        return out
    finally:
        con.close()


def _files(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file of a dump: bytes, mtime (ns) and inode (a rewritten file has a new inode: written by rename)."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    """A store with two real runs, sweeps whose names are no file names, and rows at the edges of what
    SQLite holds: -0.0, the smallest subnormal, the largest double, infinities, 0.1 + 0.2, 2**62, NULL, a
    blob, text beyond ASCII, rowids with gaps and out of key order, and a table that belongs to no run."""
    d = tmp_path_factory.mktemp("crafted")
    db = d / "c.db"
    a = _run(db, sweep="s1", label="A")
    b = _run(db, sweep="dir/../x", label="B é", seed=1)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("INSERT INTO sweep_runs VALUES ('.hidden', ?, NULL)", (a,))
    edge = [-0.0, 5e-324, 1.7976931348623157e308, float("inf"), float("-inf"), 0.1 + 0.2, 2 ** 62, None]
    for i, v in enumerate(edge):
        con.execute("INSERT INTO client_metrics VALUES (?, 7, ?, ?, ?, ?, ?, ?)",
                    (a, 100 + i, v, v, v, 3 if v is None else 2 ** 40, v))
    con.execute("INSERT INTO client_metrics (rowid, run_id, round, client, local_acc) VALUES (9000, ?, 6, 0, 1.0)", (b,))
    con.execute("INSERT INTO client_metrics (rowid, run_id, round, client, local_acc) VALUES (5000, ?, 8, 0, 1)", (b,))
    con.execute("INSERT INTO records VALUES (?, 3, 'note', NULL, ?, 0)", (a, "\u00e9\u2028\U0001f600 \"q\" \\"))
    con.execute("INSERT INTO records VALUES (?, 3, 'raw', 1, ?, 1)", (a, b"\x00\xffbytes"))
    con.execute("DELETE FROM rounds WHERE rowid = (SELECT min(rowid) FROM rounds)")
    con.execute("INSERT INTO rounds (rowid, run_id, round, metrics, wall_s) VALUES (77, ?, 99, '{}', -0.0)", (a,))
    con.execute("CREATE TABLE notes (k TEXT, v REAL)")
    con.execute("INSERT INTO notes VALUES ('pi', 3.141592653589793), ('none', NULL)")
    con.execute("PRAGMA user_version = 4")
    con.close()
    return db


def test_round_trip_is_row_for_row_and_bit_exact(crafted, tmp_path):
    before = crafted.read_bytes()
    rep = dump(crafted, tmp_path / "d")
    assert crafted.read_bytes() == before                                  # the store is only read
    assert sorted(rep.written) == sorted(["store.json", *(f"runs/{r}.json.gz" for r in _ids(crafted)),
                                          "sweeps/s1.json", "sweeps/dir%2F..%2Fx.json", "sweeps/%2Ehidden.json"])
    load(tmp_path / "d", tmp_path / "l.db")
    assert every_row(tmp_path / "l.db") == every_row(crafted)
    con = sqlite3.connect(tmp_path / "l.db")
    got = con.execute("SELECT local_acc, global_acc FROM client_metrics WHERE round = 7 ORDER BY client").fetchall()
    con.close()
    assert [str(x) for x, _ in got] == ["0.0", "5e-324", "1.7976931348623157e+308", "inf", "-inf",  # SQLite: no -0
                                        "0.30000000000000004", "4.611686018427388e+18", "None"]
    # deterministic: a second load is the same file, byte for byte; the loaded store dumps to the same files
    load(tmp_path / "d", tmp_path / "l2.db")
    assert (tmp_path / "l.db").read_bytes() == (tmp_path / "l2.db").read_bytes()
    dump(tmp_path / "l.db", tmp_path / "d2")
    assert {k: v[0] for k, v in _files(tmp_path / "d").items()} == {k: v[0] for k, v in _files(tmp_path / "d2").items()}


def _ids(db: Path) -> list[str]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY rowid")]
    finally:
        con.close()


def test_a_run_file_is_deterministic_text(crafted, tmp_path):
    """gzip with mtime 0 and no name; inside, the format, the run id and one table row per line in rowid
    order, the run id column left out; the same store dumps to the same bytes."""
    dump(crafted, tmp_path / "a")
    dump(crafted, tmp_path / "b")
    assert {k: v[0] for k, v in _files(tmp_path / "a").items()} == {k: v[0] for k, v in _files(tmp_path / "b").items()}
    rid = _ids(crafted)[0]
    raw = (tmp_path / "a" / "runs" / f"{rid}.json.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\0\0\0\0" and not raw[3] & 0x08   # mtime 0, no file name
    text = gzip.decompress(raw).decode("ascii")
    d = json.loads(text)
    assert d["format"] == "fedprism-run/1" and d["run_id"] == rid
    assert sorted(d["tables"]) == ["client_metrics", "records", "rounds", "runs"]
    cm = d["tables"]["client_metrics"]
    assert cm["columns"] == ["rowid", "round", "client", "local_acc", "local_loss", "global_acc", "n_test", "local_f1"]
    assert [r[0] for r in cm["rows"]] == sorted(r[0] for r in cm["rows"])
    assert text.count("\n") > len(cm["rows"])                               # one row a line
    assert '7,101,5e-324,5e-324,5e-324,1099511627776,5e-324]' in text and "Infinity" in text
    assert '{"blob":"AP9ieXRlcw=="}' in text


def test_adding_a_run_adds_one_file_and_changes_one_membership_file(crafted, tmp_path):
    db = tmp_path / "s.db"
    shutil.copy(crafted, db)
    out = tmp_path / "d"
    dump(db, out)
    before = _files(out)
    new = _run(db, sweep="s1", label="C", seed=5)
    rep = dump(db, out)
    after = _files(out)
    assert sorted(rep.written) == sorted([f"runs/{new}.json.gz", "sweeps/s1.json"]) and not rep.removed
    assert set(after) - set(before) == {f"runs/{new}.json.gz"} and set(before) <= set(after)
    changed = sorted(k for k in before if after[k][0] != before[k][0])
    assert changed == ["sweeps/s1.json"]
    assert all(after[k] == before[k] for k in before if k != "sweeps/s1.json")    # not even rewritten
    old, now = (json.loads(x[0])["tables"]["sweep_runs"]["rows"] for x in (before["sweeps/s1.json"],
                                                                            after["sweeps/s1.json"]))
    assert [r for r in now if r[1] != new] == old and [r[1:] for r in now if r[1] == new] == [[new, "C"]]
    # and back: a forgotten run's file goes, its membership line with it
    st = Store(db)
    st.forget(new)
    st.leave_sweep("s1", new)
    st.close()
    rep = dump(db, out)
    assert rep.removed == [f"runs/{new}.json.gz"] and rep.written == ["sweeps/s1.json"]
    assert {k: v[0] for k, v in _files(out).items()} == {k: v[0] for k, v in before.items()}


def test_dump_reads_a_store_being_written_without_changing_it(tmp_path):
    """A store in WAL mode (as a run leaves it, or while a sweep writes to it): its bytes, its mtime and the
    files beside it stay as they were."""
    db = tmp_path / "w.db"
    _run(db, sweep="s", label="A")
    assert db.read_bytes()[18:20] == b"\x02\x02"
    beside = sorted(p.name for p in tmp_path.iterdir())
    before, mtime = db.read_bytes(), db.stat().st_mtime_ns
    dump(db, tmp_path / "out")
    assert db.read_bytes() == before and db.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(beside + ["out"])


def test_load_leaves_an_existing_store_alone(crafted, tmp_path):
    out = tmp_path / "d"
    dump(crafted, out)
    same = tmp_path / "same.db"
    shutil.copy(crafted, same)
    mtime = same.stat().st_mtime_ns
    rep = load(out, same)                                  # already holds these rows: nothing written
    assert not rep.written and same.stat().st_mtime_ns == mtime and "already holds" in rep.summary()
    other = tmp_path / "other.db"                          # one row fewer than the dump holds
    shutil.copy(crafted, other)
    con = sqlite3.connect(other, isolation_level=None)
    con.execute("DELETE FROM client_metrics WHERE rowid = 9000")
    con.close()
    before = other.read_bytes()
    with pytest.raises(ArchiveError, match=r"other\.db exists and differs from the dump \(1 run\(s\) with other rows "
                                           rf"\(e\.g\. {_ids(crafted)[1]}\)\); nothing was written"):
        load(out, other)
    assert other.read_bytes() == before
    fresh = tmp_path / "fresh.db"                          # another store altogether: its schema differs
    _run(fresh, sweep="s1", label="A")
    with pytest.raises(ArchiveError, match=r"fresh\.db exists and differs from the dump \(its schema"):
        load(out, fresh)


def _copy_dump(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_run(folder: Path, rid: str, edit) -> None:
    p = folder / "runs" / f"{rid}.json.gz"
    d = json.loads(gzip.decompress(p.read_bytes()))
    edit(d)
    p.write_bytes(gzip.compress(json.dumps(d).encode("ascii"), mtime=0))


def test_load_checks_each_run_id_against_its_configuration(crafted, tmp_path):
    """As `fedprism merge` does: a result filed under an id that is not its configuration's hash is refused
    (the whole dump, nothing written); so is a store holding one, by `dump`."""
    good = tmp_path / "d"
    dump(crafted, good)
    rid = _ids(crafted)[0]
    forged = _copy_dump(good, tmp_path / "forged")

    def more_rounds(d):
        row = d["tables"]["runs"]["rows"][0]
        cols = d["tables"]["runs"]["columns"]
        cfg = json.loads(row[cols.index("config")])
        row[cols.index("config")] = json.dumps({**cfg, "rounds": 50})
    _rewrite_run(forged, rid, more_rounds)
    with pytest.raises(ArchiveError, match=rf"1 run\(s\) of the dump are refused, nothing was loaded: {rid}: its id "
                                           r"is not the hash of its configuration \(that is [0-9a-f]{16}"):
        load(forged, tmp_path / "f.db")
    assert not (tmp_path / "f.db").exists() and not list(tmp_path.glob(".f.db*"))
    db = tmp_path / "forged.db"
    shutil.copy(crafted, db)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("UPDATE runs SET config = json_set(config, '$.rounds', 50) WHERE run_id = ?", (rid,))
    con.close()
    with pytest.raises(ArchiveError, match=rf"1 run\(s\) of .*forged\.db are not filed under the hash of their "
                                           rf"configuration; nothing was written .*{rid}: its id is not the hash"):
        dump(db, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, match", [
    ("stray", r"runs/notes\.txt: not a run file"),
    ("renamed", r"holds run '[0-9a-f]{16}', not the run its name says"),
    ("format", r"store\.json: format 'fedprism-store-dump/9'; this fedprism reads 'fedprism-store-dump/1'"),
    ("columns", r"table rounds: columns .*; store\.json says"),
    ("short row", r"table rounds: a row without exactly 4 values"),
    ("rowid twice", r"table client_metrics has a rowid that is not an integer, or one used twice"),
    ("no meta", r"holds no dump \(store\.json is missing\)"),
    ("bad sweep name", r"sweeps/s1\.json: holds sweep 's2', whose file is s2\.json"),
])
def test_a_damaged_dump_is_refused_naming_the_file(crafted, tmp_path, case, match):
    folder = tmp_path / "d"
    dump(crafted, folder)
    a, b = _ids(crafted)
    if case == "stray":
        (folder / "runs" / "notes.txt").write_text("x")
    elif case == "renamed":
        (folder / "runs" / f"{a}.json.gz").rename(folder / "runs" / f"{'0' * 16}.json.gz")
    elif case == "format":
        meta = json.loads((folder / "store.json").read_text())
        (folder / "store.json").write_text(json.dumps({**meta, "format": "fedprism-store-dump/9"}))
    elif case == "columns":
        _rewrite_run(folder, a, lambda d: d["tables"]["rounds"]["columns"].reverse())
    elif case == "short row":
        _rewrite_run(folder, a, lambda d: d["tables"]["rounds"]["rows"][0].pop())
    elif case == "rowid twice":
        first = lambda d: d["tables"]["client_metrics"]["rows"][0]   # noqa: E731
        _rewrite_run(folder, a, lambda d: first(d).__setitem__(0, 1))
        _rewrite_run(folder, b, lambda d: first(d).__setitem__(0, 1))
    elif case == "no meta":
        (folder / "store.json").unlink()
    elif case == "bad sweep name":
        p = folder / "sweeps" / "s1.json"
        p.write_text(p.read_text().replace('"sweep":"s1"', '"sweep":"s2"'))
    with pytest.raises(ArchiveError, match=match):
        load(folder, tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists()


def test_dump_refuses_rows_it_cannot_place(crafted, tmp_path):
    db = tmp_path / "o.db"
    shutil.copy(crafted, db)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("INSERT INTO rounds VALUES ('feedfacefeedface', 0, '{}', 1.0)")
    con.close()
    with pytest.raises(ArchiveError, match=r"1 row\(s\) of rounds belong to no stored run \(e\.g\. run id "
                                           r"'feedfacefeedface'\)"):
        dump(db, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("DELETE FROM rounds WHERE run_id = 'feedfacefeedface'")
    con.execute("UPDATE runs SET run_id = '../../etc' WHERE rowid = (SELECT min(rowid) FROM runs)")
    con.close()
    with pytest.raises(ArchiveError, match=r"run\(s\) whose id is no run id"):
        dump(db, tmp_path / "out")


def test_cache_key_follows_the_dump(crafted, tmp_path):
    a = tmp_path / "a"
    dump(crafted, a)
    b = _copy_dump(a, tmp_path / "b")
    assert archive.key(a) == archive.key(b)
    p = b / "sweeps" / "s1.json"
    p.write_text(p.read_text().replace('"A"', '"Z"'))                # same size, other bytes
    assert archive.key(a) != archive.key(b)


def test_cli_store_commands_and_the_missing_store_beside_a_dump(crafted, tmp_path, capsys):
    """`fedprism store dump|load`; a read-only command on the store a dump would build says how to build it,
    and a command that writes does not start an empty store there."""
    folder = tmp_path / "results"
    assert main(["store", "dump", "--db", str(crafted), "--out", str(folder)]) == 0
    assert "2 run(s), 3 sweep(s)" in capsys.readouterr().out
    missing = folder / "fedprism.db"
    for argv in (["runs", "--db", str(missing)], ["show", "--db", str(missing), "abc"],
                 ["report", "--db", str(missing), "--out", str(tmp_path / "rep")]):
        assert main(argv) == 2
        assert f"`fedprism store load {folder}/ --db {missing}`" in capsys.readouterr().err
    assert main(["run", "--db", str(missing), "--quiet", *(f"{k}={v}" for k, v in TINY.items())]) == 2
    assert "build the store from it first" in capsys.readouterr().err and not missing.exists()
    assert main(["store", "load", str(folder), "--db", str(missing)]) == 0
    assert "built from the dump, 2 run(s)" in capsys.readouterr().out
    assert every_row(missing) == every_row(crafted)
    assert main(["store", "load", str(folder), "--db", str(missing)]) == 0
    assert "already holds this dump" in capsys.readouterr().out
    assert main(["runs", "--db", str(missing)]) == 0


# -- the committed results ---------------------------------------------------------------------------------
def _last_committed_db(tmp_path: Path) -> Path | None:
    """The SQLite file git held before the dump, from the repository's history (None in a shallow clone)."""
    try:
        data = subprocess.run(["git", "cat-file", "blob", LAST_DB_BLOB], cwd=ROOT, capture_output=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if not data.startswith(b"SQLite format 3\0"):
        return None
    p = tmp_path / "last.db"
    p.write_bytes(data)
    return p


@pytest.mark.slow
def test_the_committed_store_built_from_its_dump_is_the_last_committed_file_row_for_row(committed_db, tmp_path):
    """The binary store git held before the dump: every row of it is in the store built from the dump, at
    its rowid (runs added since have later rowids), with the same schema."""
    last = _last_committed_db(tmp_path)
    if last is None:
        pytest.skip("the last committed results/fedprism.db is not in this clone's history")
    now, then = every_row(committed_db), every_row(last)
    assert now["schema"] == then["schema"]
    con = sqlite3.connect(f"file:{committed_db}?mode=ro", uri=True)
    old = sqlite3.connect(f"file:{last}?mode=ro", uri=True)
    try:
        for (t,) in old.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall():
            rows = old.execute(f'SELECT rowid, * FROM "{t}" ORDER BY rowid').fetchall()
            here = {r[0]: r for r in con.execute(f'SELECT rowid, * FROM "{t}" ORDER BY rowid').fetchall()}
            assert all(repr(here.get(r[0])) == repr(r) for r in rows), t
    finally:
        con.close()
        old.close()


@pytest.mark.slow
def test_one_run_added_to_the_committed_store_changes_two_files_of_its_dump(committed_db, tmp_path):
    """The committed dump is what `fedprism store dump` makes of the committed store (none of its files is
    written again), at the current schema version (opening the store for writing changes nothing); then one
    run added to it, in one sweep, writes exactly its run file and that sweep's membership file, every
    other file left as it was."""
    db = tmp_path / "c.db"
    shutil.copy(committed_db, db)
    out = tmp_path / "results"
    out.mkdir()
    for name in ("store.json", "runs", "sweeps"):
        src = ROOT / "results" / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, out / name)
    committed = _files(out)
    rep = dump(db, out)
    assert rep.written == [] and rep.removed == [] and rep.unchanged == len(committed) > 300
    assert _files(out) == committed
    assert json.loads(committed["store.json"][0])["user_version"] == 4
    Store(db).close()                                     # already at the schema version: nothing to stamp
    assert dump(db, out).written == []
    before = _files(out)
    new = _run(db, sweep="fedprism_gate", label="tiny")
    rep = dump(db, out)
    after = _files(out)
    assert sorted(rep.written) == [f"runs/{new}.json.gz", "sweeps/fedprism_gate.json"] and not rep.removed
    assert set(after) == set(before) | {f"runs/{new}.json.gz"}
    assert [k for k in before if after[k] != before[k]] == ["sweeps/fedprism_gate.json"]
    size = sum(len(v[0]) for v in after.values())
    assert size < committed_db.stat().st_size / 3, size          # 8.2 MB of dump for a 36.7 MB SQLite file
