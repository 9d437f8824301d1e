"""FedClust (the Fed-PRISM technical report's 2nd algorithm; Islam et al. 2024 variant)."""

from __future__ import annotations

import numpy as np
import torch
from conftest import planted_federation, same
from sklearn.metrics import adjusted_rand_score
from test_fedprism import drive, setup

from fedprism.algorithms.fedclust import threshold_clusters


def test_one_cluster_equals_fedavg(planted):
    fed, _ = planted
    a, e = setup(fed, "fedclust", k=1, every=2)
    b, e2 = setup(fed, "fedavg")
    sa, sb = drive(a, e, 4, fraction=0.5), drive(b, e2, 4, fraction=0.5)
    assert same(a.model_for(sa, np.arange(fed.num_clients)), sb["w"].expand(fed.num_clients, -1))


def test_periodic_recovers_planted_groups_and_keeps_identity(digits):
    fed, truth = planted_federation(digits, clients_per_group=5, per_client=60)
    algo, eng = setup(fed, "fedclust", k=2, every=1)
    seen = []
    drive(algo, eng, 3, on_round=lambda t, s, p, r: seen.append(np.asarray(r["clusters"]["labels"])))
    assert all(adjusted_rand_score(truth, lab) == 1.0 for lab in seen)
    assert all(np.array_equal(lab, seen[0]) for lab in seen)


def test_each_client_receives_its_cluster_model(digits):
    fed, truth = planted_federation(digits, clients_per_group=4, per_client=50)
    algo, eng = setup(fed, "fedclust", k=2, every=1)
    state = drive(algo, eng, 2)
    models = algo.model_for(state, np.arange(fed.num_clients))
    for c in range(fed.num_clients):
        assert torch.equal(models[c], state["w_c"][state["assign"][c]])
    assert not torch.equal(state["w_c"][0], state["w_c"][1])


def test_original_variant_one_shot_threshold_clustering(digits):
    fed, truth = planted_federation(digits, clients_per_group=4, per_client=60)
    algo, eng = setup(fed, "fedclust", variant="original", features="last_layer")
    recs = []
    state = drive(algo, eng, 3, fraction=0.5, on_round=lambda t, s, p, r: recs.append(r))
    assert "clusters" in recs[0] and all("clusters" not in r for r in recs[1:])   # one-shot
    assert adjusted_rand_score(truth, state["assign"].numpy()) == 1.0


def test_threshold_cut_at_largest_gap():
    p = np.concatenate([np.random.default_rng(0).normal(0, 0.01, (5, 3)),
                        np.random.default_rng(1).normal(5, 0.01, (4, 3))])
    labels, thr, heights = threshold_clusters(p)
    assert len(set(labels)) == 2 and adjusted_rand_score([0] * 5 + [1] * 4, labels) == 1.0
    assert heights.min() < thr < heights.max()
