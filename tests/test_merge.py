"""`fedprism merge`: the finished runs of another store arrive whole, once, and nothing else moves."""

from __future__ import annotations

import shutil

import pytest

from fedprism.cli import main
from fedprism.errors import FedPrismError
from fedprism.experiment.merge import merge
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import MissingStoreError, Store
from fedprism.experiment.sweep import dump_sweep, load_sweep, run_sweep

BASE = dict(dataset="digits", clients=6, rounds=3, local_epochs=1, model="mlp", engine="sequential", keep_final=False)
ROWS = [dict(label="FedAvg", method="fedavg"), dict(label="Local", method="local")]
SWEEP = dump_sweep("part", BASE, ROWS, {"seed": [0]})


def content(db) -> dict:
    """Every stored row of every run (row order aside), by table."""
    s = Store(db, readonly=True)
    try:
        out = {}
        for t in ("runs", "rounds", "client_metrics", "records", "sweep_runs"):
            rows = [tuple(r) for r in s.db.execute(f"SELECT * FROM {t}")]
            out[t] = sorted(rows, key=repr)
        return out
    finally:
        s.close()


@pytest.fixture
def part(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    run_sweep(str(f), str(tmp_path / "part.db"), progress=False)
    return f, tmp_path / "part.db"


def test_finished_runs_arrive_whole_and_once(tmp_path, part):
    f, src = part
    before = src.read_bytes()
    home = Store(tmp_path / "home.db")
    rep = merge(home, src)
    assert len(rep.copied) == 2 and not (rep.replaced or rep.present or rep.unfinished or rep.busy)
    home.close()
    assert content(tmp_path / "home.db") == content(src)        # every row, the sweep membership too
    assert src.read_bytes() == before                             # the other store is only read
    home = Store(tmp_path / "home.db")
    again = merge(home, src)                                      # a second merge changes nothing
    home.close()
    assert len(again.present) == 2 and not again.copied
    assert content(tmp_path / "home.db") == content(src)


def test_a_finished_copy_replaces_an_interrupted_one_and_a_running_one_is_left(tmp_path, part):
    f, src = part
    _, cfgs = load_sweep(f)
    home_db = tmp_path / "home.db"
    home = Store(home_db)
    for cfg in cfgs:                                              # both runs stopped after round 0 here
        Experiment(cfg, home, progress=False).run(stop_after=1)
    assert {r["status"] for r in home.runs()} == {"interrupted"}
    busy_id = cfgs[1].run_id
    other = Store(home_db)
    other.lock(busy_id)                                           # "a process running it here right now"
    try:
        rep = merge(home, src)
    finally:
        other.close()
    assert rep.replaced == [cfgs[0].run_id] and rep.busy == [busy_id]
    home.close()
    got, want = content(home_db), content(src)
    for t in ("rounds", "client_metrics", "records"):
        assert [r for r in got[t] if r[0] == cfgs[0].run_id] == [r for r in want[t] if r[0] == cfgs[0].run_id]
    for t in ("rounds", "client_metrics"):                        # the busy run keeps its one round
        assert len([r for r in got[t] if r[0] == busy_id]) < len([r for r in want[t] if r[0] == busy_id])
    status = {r[0]: r[7] for r in got["runs"]}
    assert status == {cfgs[0].run_id: "finished", busy_id: "interrupted"}
    assert not Store(home_db).checkpoint_path(cfgs[0].run_id).exists()


def test_unfinished_runs_stay_behind_and_bad_sources_change_nothing(tmp_path, part, capsys):
    f, src = part
    _, cfgs = load_sweep(f)
    half = tmp_path / "half.db"
    s = Store(half)
    Experiment(cfgs[0], s, progress=False).run(stop_after=1)
    s.close()
    home_db = tmp_path / "home.db"
    shutil.copy(src, home_db)
    Store(home_db).close()
    before = home_db.read_bytes()
    assert main(["merge", str(half), "--db", str(home_db)]) == 0
    assert "merged 0 finished run(s); 0 already finished here; 1 unfinished there, not merged" in capsys.readouterr().out
    home = Store(home_db)
    assert merge(home, half).unfinished == [cfgs[0].run_id]
    home.close()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 100)
    assert main(["merge", str(bad), "--db", str(home_db)]) == 2
    assert "bad.db is not a fedprism results store" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "absent.db"), "--db", str(home_db)]) == 2
    assert main(["merge", str(home_db), "--db", str(home_db)]) == 2
    assert "is the target store itself" in capsys.readouterr().err
    assert home_db.read_bytes() == before
    fresh = tmp_path / "fresh.db"                   # a bad or absent part does not create the destination
    assert main(["merge", str(bad), "--db", str(fresh)]) == 2
    assert main(["merge", str(src), str(tmp_path / "absent.db"), "--db", str(fresh)]) == 2
    assert "no results store to merge at" in capsys.readouterr().err and not fresh.exists()
    with pytest.raises(MissingStoreError):
        merge(Store(home_db), bad)


def test_a_store_with_any_one_page_overwritten_is_refused_as_corrupt(tmp_path, part):
    """Every page of a source store, overwritten in turn: the merge refuses it as corrupt (SQLite's own
    error, or the quick_check run before anything is read) and the target keeps its bytes."""
    _, src = part
    home_db = tmp_path / "home.db"
    Store(home_db).close()
    before = home_db.read_bytes()
    pages = src.stat().st_size // 4096
    found = []
    for page in range(1, pages):                    # page 0 holds the header: "not a database"
        damaged = tmp_path / f"damaged{page}.db"
        shutil.copy(src, damaged)
        with open(damaged, "r+b") as fh:
            fh.seek(4096 * page)
            fh.write(b"\xff" * 4096)
        with pytest.raises(MissingStoreError, match=f"damaged{page}.db is corrupt") as e:
            merge(Store(home_db), damaged)
        found.append(str(e.value))
    assert home_db.read_bytes() == before
    assert any("integrity check" in m and "nothing was merged" in m for m in found)   # quick_check's finds
    assert any("malformed" in m for m in found)                                       # SQLite's own


def test_dry_run_writes_nothing(tmp_path, part, capsys):
    f, src = part
    import sqlite3

    home_db = tmp_path / "home.db"
    Store(home_db).close()
    c = sqlite3.connect(home_db)
    c.execute("PRAGMA journal_mode=DELETE")                      # as committed stores are (no -wal to read)
    c.close()
    before = home_db.read_bytes()
    assert main(["merge", str(src), "--db", str(home_db), "--dry-run"]) == 0
    assert "would merge 2 finished run(s)" in capsys.readouterr().out
    assert home_db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("home.db*")) == ["home.db"]


def test_a_selection_brings_only_its_runs_and_membership(tmp_path, part, capsys):
    f, src = part
    _, cfgs = load_sweep(f)
    fedavg, local = (c.run_id for c in cfgs)
    other = tmp_path / "other.toml"                  # the Local run belongs to a second sweep too
    other.write_text(dump_sweep("other", BASE, ROWS[1:], {"seed": [0]}))
    run_sweep(str(other), str(src), progress=False)
    assert Store(src, readonly=True).sweeps() == ["other", "part"]
    before = src.read_bytes()

    home_db = tmp_path / "home.db"
    assert main(["merge", str(src), "--db", str(home_db), "--sweep", "other"]) == 0
    assert "merged 1 finished run(s)" in capsys.readouterr().out
    with Store(home_db, readonly=True) as home:
        assert [r["run_id"] for r in home.runs()] == [local]
        assert home.sweeps() == ["other"]                          # not "part", by either column
        assert home.runs(sweep="part") == []
    assert main(["merge", str(src), "--db", str(home_db), "--run", fedavg[:8]]) == 0
    with Store(home_db, readonly=True) as home:
        assert sorted(r["run_id"] for r in home.runs()) == sorted([fedavg, local])
        assert [r["run_id"] for r in home.runs(sweep="part")] == [fedavg]   # all its membership came
    assert src.read_bytes() == before

    fresh = tmp_path / "fresh.db"                      # a name no store has: an error, nothing written
    assert main(["merge", str(src), "--db", str(fresh), "--sweep", "nosuch"]) == 2
    assert "has sweep nosuch; nothing was merged" in capsys.readouterr().err and not fresh.exists()
    assert main(["merge", str(src), "--db", str(fresh), "--run", "ffffffff"]) == 2
    assert not fresh.exists()
    with pytest.raises(FedPrismError, match="has no ffff"):
        merge(Store(fresh), src, runs=["ffff"])
    assert content(fresh)["runs"] == []
    empty = tmp_path / "empty.db"                      # spread over two stores: each merges what it has
    Store(empty).close()
    assert main(["merge", str(empty), str(src), "--db", str(tmp_path / "both.db"), "--run", local]) == 0
    with Store(tmp_path / "both.db", readonly=True) as both:
        assert [r["run_id"] for r in both.runs()] == [local]


def test_a_selection_brings_only_its_final_states(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(dump_sweep("part", {**BASE, "keep_final": True}, ROWS, {"seed": [0]}))
    src = tmp_path / "part.db"
    run_sweep(str(f), str(src), progress=False)
    _, cfgs = load_sweep(f)
    with Store(src, readonly=True) as s:
        assert sorted(p.name.split(".")[0] for p in s.final_dir.iterdir()) == sorted(c.train_id for c in cfgs)
    home = Store(tmp_path / "home.db")
    assert merge(home, src, runs=[cfgs[1].run_id]).finals == 1
    assert [p.name.split(".")[0] for p in home.final_dir.iterdir()] == [cfgs[1].train_id]
    home.close()
