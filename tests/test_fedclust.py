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


def _six_clients(planted, **hp):
    """FedClust with clients 0-2 near +5 and 3-5 near -5 in parameter space (the update of a round)."""
    from fedprism.protocol import Update

    fed, _ = planted
    algo, _ = setup(fed, "fedclust", **hp)
    P = algo.ctx.spec.size
    params = torch.cat([torch.full((3, P), 5.0), torch.full((3, P), -5.0)])
    params += 0.01 * torch.randn(6, P, generator=torch.Generator().manual_seed(0))
    up = Update(np.arange(6), {"params": params}, torch.ones(6, dtype=torch.float64))
    return algo, algo.init_state(), up


def test_reclustering_keeps_the_members_previous_clusters(planted):
    # clients 0-2 were in cluster 1 and 3-5 in cluster 0, although model 0 lies next to 0-2: the matching
    # follows the members' previous clusters, not the nearest model
    algo, state, up = _six_clients(planted, k=2, every=1)
    P = algo.ctx.spec.size
    state["w_c"] = torch.stack([torch.full((P,), 5.0), torch.full((P,), -5.0)])
    state["assign"][:6] = torch.tensor([1, 1, 1, 0, 0, 0])
    rec = algo.aggregate(state, 0, up)
    assert rec["clusters"]["labels"].tolist() == [1, 1, 1, 0, 0, 0]


def test_a_newcomer_joins_the_nearest_cluster_that_has_members(planted):
    algo, state, up = _six_clients(planted, k=3, every=100)
    P = algo.ctx.spec.size
    state["assign"][:5] = torch.tensor([0, 0, 0, 1, 1])                 # client 5 is new; cluster 2 is empty
    state["w_c"] = torch.stack([torch.full((P,), 4.0), torch.full((P,), 0.0), torch.full((P,), -5.0)])
    rec = algo.aggregate(state, 1, up)
    assert rec["joined"]["clients"].tolist() == [5] and state["assign"][5].item() == 1


def test_cosine_features_ignore_the_scale_of_a_model(planted):
    fed, _ = planted
    x = torch.randn(3, setup(fed, "fedclust")[0].ctx.spec.size, generator=torch.Generator().manual_seed(1))
    cos, euc = setup(fed, "fedclust", metric="cosine")[0], setup(fed, "fedclust")[0]
    assert np.allclose(cos._features(3 * x), cos._features(x), atol=1e-12)
    assert not np.allclose(euc._features(3 * x), euc._features(x))
