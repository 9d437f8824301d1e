"""Fed-PRISM server (the Fed-PRISM technical report): equivalences, invariants and planted-federation recovery."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import planted_federation, same
from sklearn.metrics import adjusted_rand_score

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, Update
from fedprism.algorithms.fedprism import CLUSTERINGS, FedPrism, personalize, soft_cluster_step
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.errors import ConfigError
from fedprism.experiment.runner import Simulator, sample_clients
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten

LOCAL = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)


def setup(fed, method, seed=0, rounds=5, fraction=1.0, **hp):
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed, rounds, fraction)
    algo = REGISTRY[method](ctx, **hp)
    return algo, SequentialEngine(fed, model, LOCAL, seed)


def drive(algo, engine, rounds, fraction=1.0, seed=0, on_round=None):
    sim = Simulator(algo, engine)
    for t in range(rounds):
        clients = sample_clients(seed, t, algo.ctx.num_clients, fraction)
        plan, _, rec = sim.round(t, clients)
        if on_round:
            on_round(t, sim.state, plan, rec)
    return sim.state


def test_k1_m1_equals_uniform_fedavg(planted):
    fed, _ = planted
    a, e = setup(fed, "fedprism", k=1, m=1, alpha=0.3, every=2)
    b, e2 = setup(fed, "fedavg", weighting="uniform")
    sa = drive(a, e, 4, fraction=0.5)
    sb = drive(b, e2, 4, fraction=0.5)
    assert same(sa["w_g"], sb["w"]) and same(a.model_for(sa, np.arange(3))[0], sb["w"])
    assert not same(sb["w"], b.ctx.init)          # something was trained


def test_alpha_one_sends_the_global_model(planted):
    fed, _ = planted
    algo, eng = setup(fed, "fedprism", k=3, m=2, alpha=1.0)

    def check(t, state, plan, rec):
        assert torch.equal(plan.start, state_before["w_g"].expand_as(plan.start))

    sim = Simulator(algo, eng)
    for t in range(3):
        state_before = {"w_g": sim.state["w_g"].clone()}
        clients = np.arange(fed.num_clients)
        plan, _, _ = sim.round(t, clients)
        check(t, sim.state, plan, None)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_rows_sum_to_one_with_exactly_m_nonzeros(planted, m):
    fed, _ = planted
    algo, eng = setup(fed, "fedprism", k=3, m=m, every=1)
    state = drive(algo, eng, 2)
    W = state["W"][state["clustered"]]
    assert len(W) == fed.num_clients
    assert torch.allclose(W.sum(1), torch.ones(len(W), dtype=W.dtype))
    assert ((W > 0).sum(1) == m).all()


def test_unsampled_clients_keep_their_row_and_new_ones_are_uniform(planted):
    fed, _ = planted
    algo, eng = setup(fed, "fedprism", k=2, m=1, every=1)
    sim = Simulator(algo, eng)
    state = sim.state
    first = np.array([0, 1, 2, 6, 7, 8])
    sim.round(0, first)
    W0 = state["W"].clone()
    assert torch.allclose(W0[3], torch.full((2,), 0.5, dtype=W0.dtype))      # never clustered
    second = np.array([3, 4, 9, 10])
    sim.round(1, second)
    assert torch.equal(state["W"][first], W0[first])


def test_cluster_without_weight_is_bit_identical():
    w_c = torch.randn(3, 7)
    W_S = torch.tensor([[0.6, 0.4, 0.0], [0.3, 0.7, 0.0]], dtype=torch.float64)
    delta = torch.randn(2, 7)
    out = soft_cluster_step(w_c, W_S, delta)
    assert torch.equal(out[2], w_c[2])
    expect0 = w_c[0] + (0.6 * delta[0] + 0.3 * delta[1]) / 0.9
    assert torch.allclose(out[0], expect0, atol=1e-6)


def test_personalize_matches_the_formula():
    w_g, w_c = torch.randn(5), torch.randn(3, 5)
    W = torch.tensor([[0.2, 0.8, 0.0]], dtype=torch.float64)
    got = personalize(w_g, w_c, W, 0.25)[0]
    assert torch.allclose(got, 0.25 * w_g + 0.75 * (0.2 * w_c[0] + 0.8 * w_c[1]), atol=1e-6)


@pytest.mark.parametrize("method", CLUSTERINGS)
def test_planted_groups_recovered_and_identity_kept(digits, method):
    fed, truth = planted_federation(digits, clients_per_group=5, per_client=60)
    algo, eng = setup(fed, "fedprism", k=2, m=1, every=1, clustering=method, alpha=0.3)
    labels = []

    def on_round(t, state, plan, rec):
        assert "clusters" in rec, rec
        labels.append(np.asarray(rec["clusters"]["labels"]))

    drive(algo, eng, 4, on_round=on_round)
    for lab in labels:
        assert adjusted_rand_score(truth, lab) == 1.0
    # identity: the same group keeps the same cluster model after every re-clustering
    assert all(np.array_equal(lab, labels[0]) for lab in labels[1:])


def test_permuting_hard_labels_changes_nothing(monkeypatch, digits):
    """Hungarian matching makes the outcome independent of the clustering's arbitrary label order
    (from the second clustering on; at the first one all cluster models are identical)."""
    import fedprism.algorithms.fedprism as fp

    fed, truth = planted_federation(digits, clients_per_group=4, per_client=50)
    results = []
    real = fp.hard_cluster
    for flip in (False, True):

        calls = []

        def hc(*a, flip=flip, calls=calls, **k):
            c = real(*a, **k)
            calls.append(1)
            if flip and len(calls) > 1:
                c.labels = 1 - c.labels
                c.centroids = c.centroids[::-1].copy()
            return c

        monkeypatch.setattr(fp, "hard_cluster", hc)
        algo, eng = setup(fed, "fedprism", k=2, m=1, every=1)
        results.append(drive(algo, eng, 3))
    assert torch.equal(results[0]["W"], results[1]["W"])
    assert same(results[0]["w_c"], results[1]["w_c"], atol=0)


def test_too_few_clients_skips_reclustering(planted):
    fed, _ = planted
    algo, eng = setup(fed, "fedprism", k=3, m=1, every=1)
    sim = Simulator(algo, eng)
    state = sim.state
    _, _, rec = sim.round(0, np.array([0, 1]))
    assert rec["cluster_skipped"]["reason"] == "cannot form 3 clusters with method 'kmeans': only 2 points"
    assert rec["cluster_skipped"]["clients"].tolist() == [0, 1] and "clusters" not in rec
    assert torch.equal(state["W"], torch.full_like(state["W"], 1 / 3))


def test_empty_update_is_a_noop(planted):
    """The runner's server step (`aggregate_records`) leaves the state as it is for an empty update
    without calling `aggregate`."""
    from fedprism.experiment.runner import aggregate_records

    fed, _ = planted
    algo, _ = setup(fed, "fedprism", k=2, m=1)
    state = algo.init_state()
    before = {k: v.clone() for k, v in state.items()}
    empty = Update(np.zeros(0, int), {"params": torch.zeros(0, algo.ctx.spec.size)},
                   torch.zeros(0, dtype=torch.float64), sent={"params": torch.zeros(0, algo.ctx.spec.size)})
    assert aggregate_records(algo, state, 0, empty) == {}
    assert all(torch.equal(before[k], state[k]) for k in state)


@pytest.mark.parametrize("bad", [{"k": 0}, {"m": 3, "k": 2}, {"alpha": 1.5}, {"every": 0},
                                 {"clustering": "dbscan"}, {"m": 0}, {"alpha": "x"}])
def test_invalid_parameters_name_the_key(bad):
    with pytest.raises(ConfigError) as e:
        FedPrism.resolve(bad)
    key = "m" if "m" in bad and bad.get("m", 1) != 1 else next(iter(bad))
    assert f"fedprism.{key}" in str(e.value)


def test_reclustering_runs_when_t_mod_C_is_0(planted):
    fed, _ = planted
    algo, eng = setup(fed, "fedprism", k=2, m=1, every=3)
    rounds = []
    drive(algo, eng, 7, on_round=lambda t, state, plan, rec: rounds.append(t) if "clusters" in rec else None)
    assert rounds == [0, 3, 6]


def test_matching_uses_the_previous_assignment_once_there_is_one():
    """Two groups; group A (rows 0-2) sits next to cluster model 0 but was in cluster 1 before. With that
    previous assignment the matching keeps A in cluster 1 (overlap); with none (uniform rows) it puts A at
    the nearer model 0 (centroid distance)."""
    from fedprism.algorithms.fedprism import recluster

    jitter = np.array([[0.0, 0.1], [0.1, 0.0], [0.1, 0.1]])
    feats = np.vstack([[5.0, 0.0] + jitter, [0.0, 5.0] + jitter])
    models = np.array([[5.0, 0.0], [0.0, 5.0]])
    before = np.repeat([[0.0, 1.0], [1.0, 0.0]], 3, axis=0)
    _, labels, info = recluster(feats, before, models, 2, 1, "kmeans", seed=0)
    assert labels.tolist() == [1, 1, 1, 0, 0, 0] and info["matching"] == "overlap"
    _, labels, info = recluster(feats, np.full((6, 2), 0.5), models, 2, 1, "kmeans", seed=0)
    assert labels.tolist() == [0, 0, 0, 1, 1, 1] and info["matching"] == "centroid"


@pytest.mark.parametrize("clustering", ["covariance", "kmeans"])
def test_covariance_clusters_the_updates_and_the_others_the_models(planted, clustering):
    fed, _ = planted
    algo, _ = setup(fed, "fedprism", k=2, m=1, clustering=clustering)
    P = algo.ctx.spec.size
    g = torch.Generator().manual_seed(0)
    sent, params = torch.randn(4, P, generator=g), torch.randn(4, P, generator=g)
    up = Update(np.arange(4), {"params": params}, torch.ones(4, dtype=torch.float64), sent={"params": sent})
    _, feats = algo._cluster_features(algo.init_state(), up)
    want = (params - sent) if clustering == "covariance" else params
    assert np.array_equal(feats, want.double().numpy())


def test_a_cluster_nobody_trained_keeps_its_model_and_server_momentum(planted):
    fed, _ = planted
    algo, _ = setup(fed, "fedprism", k=3, m=1, every=100, server_opt="avgm")
    state = algo.init_state()
    state["W"][:] = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)        # every client in cluster 0
    state["W"][1::2] = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)     # ... or 1; none in 2
    P = algo.ctx.spec.size
    f64 = torch.float64
    state["opt"] = {"w_c": {"m": torch.ones(3, P, dtype=f64), "v": torch.zeros(3, P, dtype=f64)}}
    before_w2, before_m2 = state["w_c"][2].clone(), state["opt"]["w_c"]["m"][2].clone()
    sent = algo.model_for(state, np.arange(4))
    up = Update(np.arange(4), {"params": sent + 0.01}, torch.ones(4, dtype=f64), sent={"params": sent})
    algo.aggregate(state, 1, up)
    assert torch.equal(state["w_c"][2], before_w2) and torch.equal(state["opt"]["w_c"]["m"][2], before_m2)
    assert not torch.equal(state["w_c"][0], before_w2)                       # cluster 0 took its step
