"""FedAMP's kernel width: recorded self-attention each round, and `sigma_update=every_round`."""

from __future__ import annotations

from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

BASE = dict(method="fedamp", dataset="digits", clients=6, rounds=4, fraction=1.0, local_epochs=1, lr=0.1,
            model="mlp", engine="sequential", seed=2)


def test_self_attention_is_recorded_and_sigma_can_follow_the_models(tmp_path):
    store = Store(tmp_path / "a.db")
    once = resolve(BASE)
    Experiment(once, store).run()
    sig = store.records(once.run_id, "fedamp")
    att = store.records(once.run_id, "fedamp_attention")
    assert len(sig) == 1 and [r["round"] for r in att] == [1, 2, 3]          # round 0: sigma not known yet
    assert all(0 <= r["data"]["self_weight_min"] <= r["data"]["self_weight_mean"] <= 1 for r in att)
    assert len({r["data"]["sigma"] for r in att}) == 1
    every = resolve({**BASE, "fedamp.sigma_update": "every_round"})
    assert every.run_id != once.run_id and resolve(BASE).run_id == once.run_id
    Experiment(every, store).run()
    sig2 = store.records(every.run_id, "fedamp")
    assert [r["round"] for r in sig2] == [0, 1, 2, 3] and len({r["data"]["sigma"] for r in sig2}) == 4
    assert sig2[0]["data"]["sigma"] == sig[0]["data"]["sigma"]                # same first estimate
