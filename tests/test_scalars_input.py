"""`scalars=DIR` as input: a location that cannot hold the CSV files is refused before the run starts,
a resume rewrites damaged CSV files, and a run that raises after it started is never left `running`."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.scalars import Scalars
from fedprism.experiment.store import Store

TINY = {"dataset": "digits", "model": "mlp", "clients": 6, "rounds": 2, "fraction": 0.5, "local_epochs": 1,
        "method": "fedavg", "engine": "sequential", "eval_every": 1}
TIMINGS = ("train_s", "eval_s")              # the only values of two runs of one config that differ


def tiny(**kw):
    return resolve({**TINY, **kw})


def left_behind(db: Path, run_id: str) -> tuple[str | None, bool]:
    """(the run's status, or None when it has no row; whether its lock file is still there)."""
    status = None
    if db.exists():
        store = Store(db, readonly=True)
        row = store.run(run_id)
        store.close()
        status = row["status"] if row is not None else None
    return status, (Path(f"{db}.ckpt") / f"{run_id}.lock").exists()


# -- 1. a location that cannot hold the files ------------------------------------------------------------
@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_scalars_that_cannot_be_a_folder_is_refused_naming_the_key_and_leaves_no_run(tmp_path, capsys, where):
    """It used to print `[Errno 17] File exists: 'afile'` (no key) and leave a `running` row of 0 rounds
    and a stale lock file."""
    (tmp_path / "afile").write_text("mine\n")
    db, target = tmp_path / "s.db", str(tmp_path / where)
    items = [f"{k}={v}" for k, v in {**TINY, "rounds": 1}.items()]
    assert main(["run", "--db", str(db), "--quiet", *items, f"scalars={target}"]) == 2
    (err,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fedprism: error")]
    assert "'scalars'" in err and repr(target) in err and "folder" in err and "is a file" in err, err
    assert left_behind(db, tiny().run_id) == (None, False)
    assert not db.exists()                                 # nor an empty store that this command created
    assert (tmp_path / "afile").read_text() == "mine\n"                    # the file is left as it was


def test_a_bad_scalars_folder_on_resume_leaves_the_run_as_it_was(tmp_path):
    db = tmp_path / "s.db"
    (tmp_path / "afile").write_text("")
    with Store(db) as s:
        assert Experiment(tiny(), s, progress=False).run(stop_after=1).status == "interrupted"
    with Store(db) as s:
        with pytest.raises(ConfigError) as e:
            Experiment(tiny(scalars=str(tmp_path / "afile")), s, progress=False).run()
        assert e.value.key == "scalars" and e.value.value == str(tmp_path / "afile")
        assert left_behind(db, tiny().run_id) == ("interrupted", False)      # checked while the store is open
    with Store(db) as s:                                                       # and it still resumes
        res = Experiment(tiny(), s, progress=False).run()
    assert res.status == "finished" and res.resumed_from == 0


def test_scalars_refuses_a_file_without_touching_it(tmp_path):
    (tmp_path / "afile").write_text("x")
    for where in ("afile", "afile/sub"):
        with pytest.raises(ConfigError, match="'scalars'.*is a file, not a folder"):
            Scalars(tmp_path / where, "r")
    assert (tmp_path / "afile").read_text() == "x"


# -- 2. damaged CSV files on resume ----------------------------------------------------------------------
def rows(path: Path) -> list[list[str]]:
    return list(csv.reader(path.read_text().splitlines()))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full")
    with Store(folder / "s.db") as s:
        res = Experiment(tiny(scalars=str(folder / "sc")), s, progress=False).run()
    return folder / "sc", res.run_id


def same_files(got: Path, want: Path, run_id: str) -> None:
    for name in ("rounds", "clients"):
        a, b = rows(got / f"{run_id}-{name}.csv"), rows(want / f"{run_id}-{name}.csv")
        assert [r[:2] for r in a] == [r[:2] for r in b], name         # one row per round and tag (or client)
        assert [r for r in a if r[1] not in TIMINGS] == [r for r in b if r[1] not in TIMINGS], name


DAMAGE = {
    "junk line": lambda p: p.write_text(p.read_text() + "garbage line\n"),
    "torn row of a later round": lambda p: p.write_text(p.read_text() + "1,local_acc,0.5\n1,train_lo"),
    "not UTF-8, a bad value": lambda p: p.write_bytes(p.read_bytes() + b"\xff\xfe,x\n0,local_acc,nan?\n"),
    "a row twice": lambda p: p.write_text(p.read_text() + p.read_text().splitlines()[1] + "\n"),
    "header torn": lambda p: p.write_text("rou\n" + p.read_text().split("\n", 1)[1]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_resume_drops_damaged_scalars_lines(tmp_path, uninterrupted, damage):
    """`Scalars.truncate` used to raise `ValueError: invalid literal for int()` (IndexError for an empty
    file) and leave the run `running` with its lock."""
    want, run_id = uninterrupted
    db, sc = tmp_path / "s.db", tmp_path / "sc"
    with Store(db) as s:
        assert Experiment(tiny(scalars=str(sc)), s, progress=False).run(stop_after=1).status == "interrupted"
    for name in ("rounds", "clients"):
        DAMAGE[damage](sc / f"{run_id}-{name}.csv")
    with Store(db) as s:
        res = Experiment(tiny(scalars=str(sc)), s, progress=False).run()
    assert res.status == "finished" and res.resumed_from == 0
    same_files(sc, want, run_id)
    assert sorted(p.name for p in sc.iterdir()) == [f"{run_id}-{n}.csv" for n in ("clients", "rounds")]


def test_truncate_keeps_the_header_and_the_well_formed_rows_of_the_kept_rounds(tmp_path):
    sc = Scalars(tmp_path, "r")
    sc.rounds.write_text("round,tag,value\n0,a,1\n0,b,2\ngarbage line\n1,a,3\r\n0,b,5\n2,a,4\n-1,a,1\n0,,1\n"
                         "0,c,x\n0,d,1,2\n0,e,nan\n0,f,inf\n1,q")
    sc.clients.write_text("round,client,local_acc,local_loss,global_acc,n_test,local_f1\n"
                          "0,1,0.5,1.0,,3,0.4\n0,x,0.5,1.0,0.5,3,0.4\n0,2,0.5\n1,1,0.5,1.0,0.5,3,0.4\n")
    sc.truncate(1)
    assert sc.rounds.read_text() == "round,tag,value\n0,a,1\n0,b,2\n1,a,3\n"
    assert sc.clients.read_text().splitlines()[1:] == ["0,1,0.5,1.0,,3,0.4", "1,1,0.5,1.0,0.5,3,0.4"]
    sc.truncate(-1)
    assert sc.rounds.read_text() == "round,tag,value\n"
    sc.rounds.write_text("")                                    # emptied: the next start writes the header
    assert Scalars(tmp_path, "r").rounds.read_text() == "round,tag,value\n"


# -- 3. whatever raises after the run started ------------------------------------------------------------
def _fail(*a, **k):
    raise RuntimeError("injected")


@pytest.mark.parametrize("where", ["evaluator", "save_final"])
def test_a_run_that_raises_after_it_started_is_failed_unlocked_and_resumes(tmp_path, monkeypatch, where):
    """`evaluator` is built before the first round, `save_final` runs after the last: both used to be
    outside the `try` that marks a run `failed`, so the run stayed `running` with its lock file."""
    db, c = tmp_path / "s.db", tiny()
    with Store(db) as s:
        with monkeypatch.context() as m:
            m.setattr(Experiment if where == "evaluator" else Store, where, _fail)
            with pytest.raises(RuntimeError, match="injected"):
                Experiment(c, s, progress=False).run()
        assert left_behind(db, c.run_id) == ("failed", False)
        res = Experiment(c, s, progress=False).run()                   # same process, same store
    assert res.status == "finished" and len(res.history) == 2
    assert res.resumed_from == (None if where == "evaluator" else 1)  # nothing lost: the rounds were kept


def test_a_refused_provenance_releases_the_lock_it_took(tmp_path):
    from fedprism.experiment.provenance import ProvenanceMismatch

    db, c = tmp_path / "s.db", tiny()
    with Store(db) as s:
        Experiment(c, s, progress=False).run(stop_after=1)
        prov = Experiment(c, s, progress=False).provenance()
        with pytest.raises(ProvenanceMismatch):
            s.start_run(c.run_id, c.values, provenance={**prov, "data": "0" * 64})
        assert left_behind(db, c.run_id) == ("interrupted", False)
