"""`scalars=DIR` as a callback of the round loop (experiment/scalars.py): the CSV files are byte for byte
those the store wrote when it held the writer (`Store.start_run` made it, `Store.truncate` cut it back,
`Store.write_round` appended to it), for a fresh run, a run killed after a round and resumed, a run whose
CSV write failed, and a re-scored run.

Two halves make the promise:
* the writer's bytes: `HEAD_FRESH` and `HEAD_RESUMED` were produced once by the store's own `Scalars`
  class before it moved (driven as the store drove it: made, cut back to -1, rounds appended; made again,
  cut back to the checkpoint's round, rounds appended), and the callback, driven through its hooks, must
  give them;
* the wiring: `HeadStore` is the store's hooks as they were, kept here as the reference, writing a second
  copy of the files into `<DIR>-head` from the very calls the run makes (so the timings agree too); every
  scenario compares the callback's files with that copy byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedprism.errors import ConfigError
from fedprism.experiment import build
from fedprism.experiment.callbacks import Callback, Loop, Round
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.scalars import Scalars
from fedprism.experiment.store import Store, StoreError

TINY = {"method": "fedavg", "dataset": "digits", "clients": 4, "rounds": 3, "fraction": 1.0, "local_epochs": 1,
        "model": "mlp", "device": "cpu", "engine": "sequential", "seed": 2, "eval_every": 2}
NAMES = ("rounds", "clients")


def cfg(**kw):
    return resolve({**TINY, **kw})


# -- 1. the writer's bytes ---------------------------------------------------------------------------------
ROUNDS = [
    (0, {"local_acc": 0.5, "train_s": 1.25, "accepted": 3, "flag": True, "nan": float("nan"),
         "inf": float("inf"), "none": None, "f32": np.float32(0.1), "f64": np.float64(1 / 3), "i64": np.int64(7),
         "text": "x,y", "big": 1e300, "neg": -0.0, "list": [1, 2], "a,comma": 2.5, "tiny": 5e-324},
     [(0, 0.5, 1.2, 0.25, 10, 0.4), (1, float("nan"), 0.1, None, 3, np.float32(0.2))]),
    (1, {"accepted": 2, "clients": 2, "bytes_up": 123456789012}, None),
    (2, {"local_acc": 0.75, "eval_s": 0.001}, [(3, 1.0, 0.0, 1.0, 4, 1.0)]),
]
RESUMED = [                                # the run resumed from its checkpoint of round 1: round 2 again, then 3
    (2, {"local_acc": 0.875, "eval_s": 0.002}, [(3, 0.5, 0.5, 0.5, 4, 0.5)]),
    (3, {"accepted": 1}, [(0, 0.0, float("inf"), 0.0, 10, 0.0)]),
]
# written by the store's `Scalars` before it moved out of experiment/store.py, from ROUNDS and RESUMED
HEAD_FRESH = (
    b'round,tag,value\n0,"a,comma",2.5\n0,accepted,3\n0,big,1e+300\n0,f32,0.10000000149011612\n'
    b'0,f64,0.3333333333333333\n0,i64,7\n0,local_acc,0.5\n0,neg,-0.0\n0,tiny,5e-324\n0,train_s,1.25\n'
    b'1,accepted,2\n1,bytes_up,123456789012\n1,clients,2\n2,eval_s,0.001\n2,local_acc,0.75\n',
    b'round,client,local_acc,local_loss,global_acc,n_test,local_f1\n0,0,0.5,1.2,0.25,10,0.4\n'
    b'0,1,,0.1,,3,0.20000000298023224\n2,3,1.0,0.0,1.0,4,1.0\n')
HEAD_RESUMED = (
    b'round,tag,value\n0,"a,comma",2.5\n0,accepted,3\n0,big,1e+300\n0,f32,0.10000000149011612\n'
    b'0,f64,0.3333333333333333\n0,i64,7\n0,local_acc,0.5\n0,neg,-0.0\n0,tiny,5e-324\n0,train_s,1.25\n'
    b'1,accepted,2\n1,bytes_up,123456789012\n1,clients,2\n2,eval_s,0.002\n2,local_acc,0.875\n3,accepted,1\n',
    b'round,client,local_acc,local_loss,global_acc,n_test,local_f1\n0,0,0.5,1.2,0.25,10,0.4\n'
    b'0,1,,0.1,,3,0.20000000298023224\n2,3,0.5,0.5,0.5,4,0.5\n3,0,0.0,,0.0,10,0.0\n')


def drive(sc: Scalars, start: int, rounds: list) -> tuple[bytes, bytes]:
    """The loop's calls: on_run_start at `start`, on_round_stored per round, on_finish; the files' bytes."""
    loop = Loop({}, start, start - 1 if start else None, 0.0, np.zeros(4, bool), None)
    sc.on_run_start(None, loop)
    for rnd, metrics, clients in rounds:
        sc.on_round_stored(None, Round(rnd, {}, None, metrics=metrics, client_rows=clients))
    sc.on_finish(None, loop, {})
    return sc.rounds.read_bytes(), sc.clients.read_bytes()


def test_the_callback_writes_the_bytes_the_store_wrote(tmp_path):
    (tmp_path / "r-rounds.csv").write_text("round,tag,value\n0,stale,1\n7,stale,2\n")   # a run before --fresh
    assert drive(Scalars(tmp_path, "r"), 0, ROUNDS) == HEAD_FRESH
    assert drive(Scalars(tmp_path, "r"), 2, RESUMED) == HEAD_RESUMED


def test_a_closed_callback_writes_nothing(tmp_path):
    sc = Scalars(tmp_path, "r")
    drive(sc, 0, ROUNDS[:1])
    with pytest.raises(RuntimeError, match="closed when the run finished"):
        sc.on_round_stored(None, Round(1, {}, None, metrics={"accepted": 1}))
    with pytest.raises(RuntimeError, match="closed"):
        sc.truncate(0)


# -- 2. the wiring: the store's hooks as they were, as the reference ---------------------------------------
def head_dir(folder) -> Path:
    return Path(f"{folder}-head")


class HeadStore(Store):
    """The store as it wrote `scalars=DIR` when it held the writer: `start_run` made it (before the run was
    locked), `truncate` cut it back with the store's rounds, `write_round` appended the round once it was
    in the store. Writes into `<DIR>-head`."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._head: dict[str, Scalars] = {}

    def start_run(self, run_id, config, sweep=None, provenance=None):
        sc = Scalars(head_dir(config["scalars"]), run_id) if config.get("scalars") else None
        row = super().start_run(run_id, config, sweep, provenance)
        if sc is not None:
            self._head[run_id] = sc
        return row

    def truncate(self, run_id, after_round):
        super().truncate(run_id, after_round)
        if run_id in self._head:
            self._head[run_id].truncate(after_round)

    def write_round(self, run_id, rnd, metrics, clients, records, wall_s):
        super().write_round(run_id, rnd, metrics, clients, records, wall_s)
        if run_id in self._head:
            self._head[run_id].write(rnd, metrics, clients)


def files(folder: Path, run_id: str) -> dict[str, bytes]:
    return {n: (folder / f"{run_id}-{n}.csv").read_bytes() for n in NAMES}


def same_as_head(folder: Path, run_id: str) -> dict[str, bytes]:
    got = files(folder, run_id)
    assert got == files(head_dir(folder), run_id)
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{run_id}-{n}.csv" for n in NAMES)
    return got


def tags(b: bytes) -> list[tuple[str, str]]:
    return [tuple(ln.split(",")[:2]) for ln in b.decode().splitlines()[1:]]


def test_a_fresh_run_writes_what_the_store_wrote(tmp_path):
    sc, c = tmp_path / "sc", cfg(scalars=str(tmp_path / "sc"))
    for d in (sc, head_dir(sc)):                    # files of an earlier attempt: a fresh run starts them again
        d.mkdir()
        (d / f"{c.run_id}-rounds.csv").write_text("round,tag,value\n0,old,1\n5,old,2\n")
    with HeadStore(tmp_path / "s.db") as s:
        res = Experiment(c, s, progress=False).run()
    got = same_as_head(sc, c.run_id)
    assert [r for r, _ in tags(got["rounds"])].count("0") > 3 and ("0", "old") not in tags(got["rounds"])
    assert {r for r, _ in tags(got["clients"])} == {"1", "2"}          # eval_every=2 and the last round
    assert len(res.history) == 3


def test_a_run_killed_after_a_round_resumes_to_what_the_store_wrote(tmp_path):
    """Killed (SIGKILL) once round 1 is stored and its CSV rows written, before its checkpoint: the resumed
    run restarts at round 1, so the files are cut back to round 0 and round 1 is written once."""
    sc, db, c = tmp_path / "sc", tmp_path / "s.db", cfg(scalars=str(tmp_path / "sc"))
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_scalars_callback import HeadStore, cfg
        from fedprism.experiment.runner import Experiment
        from fedprism.experiment.store import Store

        def save_checkpoint(self, run_id, payload, *a, **k):
            if payload["round"] == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, run_id, payload, *a, **k)

        real, Store.save_checkpoint = Store.save_checkpoint, save_checkpoint
        Experiment(cfg(scalars={str(sc)!r}), HeadStore({str(db)!r}), progress=False).run()
        """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    killed = files(sc, c.run_id)
    assert ("1", "accepted") in tags(killed["rounds"]) and files(head_dir(sc), c.run_id) == killed
    with HeadStore(db) as s:
        res = Experiment(c, s, progress=False).run()
    assert res.status == "finished" and res.resumed_from == 0
    got = same_as_head(sc, c.run_id)
    assert tags(got["rounds"]).count(("1", "accepted")) == 1
    assert [r for r, _ in tags(got["rounds"])] == sorted(r for r, _ in tags(got["rounds"]))


def test_an_interrupted_run_resumes_to_what_the_store_wrote(tmp_path):
    sc, db, c = tmp_path / "sc", tmp_path / "s.db", cfg(scalars=str(tmp_path / "sc"), eval_every=1)
    with HeadStore(db) as s:
        assert Experiment(c, s, progress=False).run(stop_after=2).status == "interrupted"
    assert {r for r, _ in tags(same_as_head(sc, c.run_id)["rounds"])} == {"0", "1"}
    with HeadStore(db) as s:
        assert Experiment(c, s, progress=False).run().resumed_from == 1
    assert {r for r, _ in tags(same_as_head(sc, c.run_id)["clients"])} == {"0", "1", "2"}


def test_a_round_whose_rows_could_not_be_written_is_not_checkpointed(tmp_path, monkeypatch):
    """`Scalars` runs before `Checkpoint`: the failed round is redone on resume and its rows written once
    (with the checkpoint first, the resumed run would start after it and its rows would be missing)."""
    sc, db, c = tmp_path / "sc", tmp_path / "s.db", cfg(scalars=str(tmp_path / "sc"))
    real = Scalars.write

    def write(self, rnd, metrics, clients):
        if rnd == 1 and self.dir == sc:                 # the callback's files (not HeadStore's copy)
            raise StoreError(f"scalars file {self.rounds}: No space left on device (writing round 1)")
        real(self, rnd, metrics, clients)

    with HeadStore(db) as s:
        with monkeypatch.context() as m:
            m.setattr(Scalars, "write", write)
            with pytest.raises(StoreError, match="writing round 1"):
                Experiment(c, s, progress=False).run()
        assert s.run(c.run_id)["status"] == "failed" and s.run(c.run_id)["rounds_done"] == 2
        res = Experiment(c, s, progress=False).run()
    assert res.resumed_from == 0
    got = same_as_head(sc, c.run_id)
    assert tags(got["rounds"]).count(("1", "accepted")) == 1


def test_a_rescored_run_writes_what_the_store_wrote(tmp_path):
    sc, db = tmp_path / "sc", tmp_path / "s.db"
    trained, c = cfg(keep_final=True), cfg(keep_final=True, scalars=str(sc), **{"eval.finetune": 1})
    assert trained.train_id == c.train_id and trained.run_id != c.run_id
    with HeadStore(db) as s:
        Experiment(trained, s, progress=False).run()
        for d in (sc, head_dir(sc)):                # an earlier attempt of the re-scored run: started again
            d.mkdir()
            (d / f"{c.run_id}-clients.csv").write_text("round,client,local_acc,local_loss,global_acc,n_test,"
                                                       "local_f1\n0,0,1,1,1,1,1\n")
        res = Experiment(c, s, progress=False).run()
    assert res.final["rescored_from"] == trained.run_id
    got = same_as_head(sc, c.run_id)
    assert {r for r, _ in tags(got["rounds"]) + tags(got["clients"])} == {"2"}   # the kept state's round
    assert ("2", "local_acc@ft") in tags(got["rounds"]) and ("2", "train_s") in tags(got["rounds"])


class AddsAMetric(Experiment):
    """A subclass's own callback, after the built-in ones, adds a metric at the end of each round."""

    def callbacks(self):
        class Mine(Callback):
            def on_round_end(self, exp, rnd):
                rnd.metrics["mine"] = 100.0 + rnd.index

        return [*super().callbacks(), Mine()]


def test_the_rows_are_the_stored_round_with_every_callbacks_metrics(tmp_path):
    """The files get what the store got: a metric that a later callback adds before the round is stored."""
    sc, c = tmp_path / "sc", cfg(scalars=str(tmp_path / "sc"))
    with HeadStore(tmp_path / "s.db") as s:
        AddsAMetric(c, s, progress=False).run()
    got = same_as_head(sc, c.run_id)
    assert [ln for ln in got["rounds"].decode().splitlines() if ",mine," in ln] == ["0,mine,100.0", "1,mine,101.0",
                                                                                   "2,mine,102.0"]


# -- 3. the composition root ------------------------------------------------------------------------------
def test_the_composition_root_registers_scalars_before_the_checkpoint(tmp_path):
    with Store(tmp_path / "s.db") as s:
        e = Experiment(cfg(scalars=str(tmp_path / "sc"), **{"eval.clients": 2}), s, progress=False)
        assert [type(cb).__name__ for cb in e.callbacks()] == ["EvalSampling", "Scalars", "Checkpoint",
                                                               "ProgressBar"]
        assert [type(cb).__name__ for cb in build.rescore_callbacks(e)] == ["Scalars"]
        plain = Experiment(cfg(), s, progress=False)
        assert "Scalars" not in [type(cb).__name__ for cb in plain.callbacks()]
        assert build.rescore_callbacks(plain) == []


def test_a_bad_folder_for_a_rescored_run_is_refused_before_it_is_stored(tmp_path):
    db = tmp_path / "s.db"
    (tmp_path / "afile").write_text("x")
    c = cfg(keep_final=True, scalars=str(tmp_path / "afile"), **{"eval.finetune": 1})
    with Store(db) as s:
        Experiment(cfg(keep_final=True), s, progress=False).run()
        with pytest.raises(ConfigError, match="'scalars'.*is a file, not a folder"):
            Experiment(c, s, progress=False).run()
        assert s.run(c.run_id) is None and not s.lock_path(c.run_id).exists()
    assert (tmp_path / "afile").read_text() == "x"


def test_the_store_holds_no_csv_writer():
    import fedprism.experiment.store as store

    assert not hasattr(store, "Scalars") and "csv" not in vars(store)
