"""End-to-end on the real Fashion-MNIST (slow; CI runs them with -m slow)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import planted_federation

from fedprism.errors import DataError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fmnist():
    from fedprism.data.datasets import load_dataset
    try:
        return load_dataset("fmnist", pad32=True)
    except DataError as e:
        pytest.skip(f"Fashion-MNIST not installed: {e}")


BASE = dict(dataset="fmnist", model="lenet5", partition="dirichlet", clients=100, fraction=0.1,
            batch_size=32, lr=0.01, momentum=0.9, **{"partition.alpha": 0.1})


def test_fedavg_passes_70_and_local_passes_85(tmp_path, fmnist):
    store = Store(tmp_path / "e2e.db")
    fedavg = Experiment(resolve({**BASE, "method": "fedavg", "rounds": 40, "local_epochs": 2,
                                 "eval_every": 10}), store).run()
    assert fedavg.final["global_acc"] >= 0.70, fedavg.final
    local = Experiment(resolve({**BASE, "method": "local", "rounds": 40, "local_epochs": 5, "eval_every": 40,
                                "eval.global": False}), store).run()
    assert local.final["local_acc"] >= 0.85, local.final


def test_fedprism_beats_fedavg_on_two_planted_label_groups(tmp_path, fmnist):
    """Pathological split into two planted label groups: Fed-PRISM's local accuracy >= FedAvg's + 5."""
    fed, truth = planted_federation(fmnist, clients_per_group=6, per_client=300, seed=0)
    common = dict(dataset="fmnist", clients=12, rounds=12, fraction=0.5, local_epochs=1, batch_size=32,
                  lr=0.01, momentum=0.9, eval_every=12, engine="sequential")
    store = Store(tmp_path / "planted.db")
    prism = Experiment(resolve({**common, "method": "fedprism", "fedprism.k": 2, "fedprism.m": 1,
                                "fedprism.every": 2, "fedprism.alpha": 0.3}), store, fed=fed).run()
    avg = Experiment(resolve({**common, "method": "fedavg"}), store, fed=fed).run()
    assert prism.final["local_acc"] >= avg.final["local_acc"] + 0.05, (prism.final, avg.final)
    labels = store.records(prism.run_id, "clusters")[-1]["data"]
    lab = np.full(12, -1)
    lab[np.asarray(labels["clients"])] = labels["labels"]
    seen = lab >= 0
    from sklearn.metrics import adjusted_rand_score
    assert adjusted_rand_score(truth[seen], lab[seen]) == 1.0
