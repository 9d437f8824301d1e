"""A re-clustering that finds fewer than K clusters keeps the run going (spectral clustering can)."""

from __future__ import annotations

import numpy as np
import torch

import fedprism.algorithms.fedprism as fp
from fedprism.clustering.hard import Clustering, cluster_means
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store


def two_clusters(features, k, method, seed=0, affinity="shifted"):
    """What SpectralClustering sometimes does: k requested, 2 non-empty clusters returned."""
    x = np.asarray(features, dtype=np.float64)
    labels = (np.arange(len(x)) % 2).astype(np.int64)
    return Clustering(labels=labels, centroids=cluster_means(x, labels), affinity=None,
                      info={"method": method, "k": k, "seed": seed, "k_found": 2})


def test_fewer_clusters_than_k_keeps_the_run_going(tmp_path, monkeypatch):
    monkeypatch.setattr(fp, "hard_cluster", two_clusters)
    c = resolve({"method": "fedprism", "dataset": "digits", "clients": 8, "rounds": 3, "fraction": 1.0,
                 "local_epochs": 1, "model": "mlp", "engine": "sequential", "fedprism.k": 4, "fedprism.m": 3,
                 "fedprism.every": 1, "fedprism.clustering": "covariance"})
    store = Store(tmp_path / "s.db")
    e = Experiment(c, store)
    res = e.run()
    assert res.status == "finished"
    short = store.records(c.run_id, "cluster_short")
    assert [r["round"] for r in short] == [0, 1, 2]
    assert short[0]["data"]["k_found"] == 2 and len(short[0]["data"]["unused_models"]) == 2
    W = e.state["W"].numpy()
    unused = short[-1]["data"]["unused_models"]
    assert np.allclose(W[:, unused], 0) and np.allclose(W.sum(1), 1)
    assert (W > 0).sum(1).max() == 2                          # m = 3 > 2 clusters found: rows use 2


def test_models_without_a_cluster_stay_bit_identical(monkeypatch, digits):
    from conftest import unequal_federation
    from fedprism.algorithms.fedprism import FedPrism
    from fedprism.engine.base import LocalConfig
    from fedprism.engine.sequential import SequentialEngine
    from fedprism.experiment.runner import Simulator, make_context
    from fedprism.models import build_model

    monkeypatch.setattr(fp, "hard_cluster", two_clusters)
    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    eng = SequentialEngine(fed, model, LocalConfig(epochs=1, batch_size=16, lr=0.05), 0, "cpu")
    cfg = resolve({"method": "fedprism", "dataset": "digits", "clients": fed.num_clients, "seed": 0})
    ctx = make_context(cfg, model, fed.n_train, fed.label_hist())
    ctx.spec = eng.spec
    sim = Simulator(FedPrism(ctx, k=4, m=3, every=1, clustering="covariance"), eng)
    everyone = np.arange(fed.num_clients)
    _, _, rec = sim.round(0, everyone)
    unused = rec["cluster_short"]["unused_models"]
    assert len(unused) == 2
    before = sim.state["w_c"][unused].clone()
    sim.round(1, everyone)
    assert torch.equal(sim.state["w_c"][unused], before)
    used = sorted(set(range(4)) - set(unused))
    assert not torch.equal(sim.state["w_c"][used], before[:len(used)])
