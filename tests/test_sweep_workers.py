"""`fedprism sweep --workers N`: the same runs and numbers as one worker, in parallel processes."""

from __future__ import annotations

import json

from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, run_sweep

SWEEP = dump_sweep("par", dict(dataset="digits", clients=6, rounds=2, local_epochs=1, model="mlp",
                                engine="sequential"),
                   [dict(label="FedAvg", method="fedavg"), dict(label="Local", method="local")], {"seed": [0, 1]})


def finals(db):
    return {r["run_id"]: (r["label"], json.loads(r["final"])["local_acc"]) for r in Store(db).runs(sweep="par")}


def test_two_workers_give_the_same_runs_as_one(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    run_sweep(str(f), str(tmp_path / "one.db"), progress=False, workers=1)
    run_sweep(str(f), str(tmp_path / "two.db"), progress=False, workers=2)
    one, two = finals(tmp_path / "one.db"), finals(tmp_path / "two.db")
    assert len(one) == 4 and one == two
    s = Store(tmp_path / "two.db")
    assert all(r["status"] == "finished" for r in s.runs())
    assert all(len(s.round_metrics(r["run_id"])) == 2 for r in s.runs())
    run_sweep(str(f), str(tmp_path / "two.db"), progress=False, workers=2)      # resumable: nothing to do
    assert finals(tmp_path / "two.db") == two
