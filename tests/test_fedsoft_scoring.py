"""scripts/fedsoft_scoring.py rebuilds a FedSoft run from its kept final state: its own-model column is the
stored accuracy, and with one cluster model every other column scores that model, as the run's own
evaluation of the cluster model did."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fedsoft_scoring", ROOT / "scripts" / "fedsoft_scoring.py")
fedsoft_scoring = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fedsoft_scoring)


def sweep(tmp_path, k: int):
    f = tmp_path / f"s{k}.toml"
    f.write_text(dump_sweep("fs", dict(dataset="digits", clients=8, rounds=10, local_epochs=2, model="mlp",
                                       lr=0.1, fraction=1.0, partition="dirichlet", engine="sequential",
                                       **{"partition.alpha": 0.1}),
                            [dict(label="FedSoft", method="fedsoft", **{"fedsoft.k": k})]))
    db = tmp_path / f"s{k}.db"
    run_sweep(str(f), str(db), progress=False)
    (run,) = Store(db).runs(sweep="fs")
    last = Store(db).round_metrics(run["run_id"])[-1]
    return db, run, last


@pytest.fixture(scope="module")
def one_cluster(tmp_path_factory):
    """A finished FedSoft run with one cluster model (read, never written, by the tests that take it)."""
    return sweep(tmp_path_factory.mktemp("one"), 1)


def test_one_cluster_model_is_every_column_but_the_personal_one(one_cluster):
    db, run, last = one_cluster
    res = fedsoft_scoring.score(str(db), run["run_id"])
    assert res["own"] == res["stored own"] == json.loads(run["final"])["local_acc_weighted"]
    assert res["top u_k"] == res["top now"] == res["mix"]
    assert res["top shared"] == pytest.approx(last["cluster0_model_acc"], abs=1e-12)
    assert res["own"] != res["top u_k"]            # w_k and c_1 are different models


def test_the_shared_column_is_the_stored_cluster_model_of_each_clients_highest_weight(tmp_path, capsys):
    """Every client is sampled every round, so the last round's importance record holds each client's final
    u_k; the run scored each cluster model on the shared test set itself (`cluster{s}_model_acc`)."""
    db, run, last = sweep(tmp_path, 3)
    res = fedsoft_scoring.score(str(db), run["run_id"])
    (u,) = [r["data"]["u"] for r in Store(db).records(run["run_id"])
            if r["kind"] == "fedsoft_importance" and r["round"] == 9]
    top = [max(range(3), key=lambda s: (row[s], -s)) for row in u]
    assert len(u) == 8 and len(set(top)) > 1                       # the clients prefer different models
    assert res["top shared"] == pytest.approx(sum(last[f"cluster{s}_model_acc"] for s in top) / 8, abs=1e-12)
    assert fedsoft_scoring.main(["--db", str(db), "--sweep", "fs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith(f"| {run['run_id']} | FedSoft | {100 * res['own']:.2f} |")


def test_a_kept_state_that_is_not_the_runs_is_refused(one_cluster, monkeypatch):
    db, run, _ = one_cluster
    real = fedsoft_scoring.score
    monkeypatch.setattr(fedsoft_scoring, "score", lambda d, r: {**real(d, r), "own": 0.0})
    with pytest.raises(SystemExit, match="not the stored"):
        fedsoft_scoring.main(["--db", str(db), "--sweep", "fs"])


def test_a_missing_store_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^fedsoft_scoring: error: no results store at .*nope\.db"):
        fedsoft_scoring.main(["--db", str(tmp_path / "nope.db"), "--sweep", "fs"])
    assert not (tmp_path / "nope.db").exists()
